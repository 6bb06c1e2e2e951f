"""PipeDream and PipeDream-2BW (plan field sync.mode): one pipeline that keeps running across
iterations, each stage updating its own weights (hetplan.planner.workload.weight_versions).

The stream: over a run of N iterations of m microbatches, every stage runs the 1F1B order of
N·m microbatches (microbatch k = iteration k // m, its slice q = k % m) without a flush between
iterations. Iteration i of a stage is its actions up to and including the backward of
microbatch (i+1)·m - 1: its first iteration holds the warm-up (p - 1 - s forwards of
microbatches ahead), its last the cool-down, every other one m forwards and m backwards, of
which stage s's first p - 1 - s forwards are of the next iteration's microbatches (stage 0
reads iteration i+1's batch during iteration i). The loss recorded for iteration i is the mean
of its microbatches' losses, as the last stage computed them (with the weights of their
forwards); the parameters saved are the live ones.

Transfers are those of hetplan.runtime.pipeline (the same links and messages); at the end of iteration
i a stage waits only for the sends it issued before iteration i (the peer takes them by the end
of its own iteration i), so it never waits for a peer still behind in the stream, and the
sent tensors are released an iteration later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.planner.workload.inputs import slice_inputs
from hetplan.planner.workload.weight_versions import WeightVersions
from hetplan.runtime.pipeline import Step, StageRunner, WholeModel, stage_actions


def stream_iterations(n_stages: int, stage: int, microbatches: int, iterations: int) -> list[list[Step]]:
    """This stage's 1F1B actions over iterations·m microbatches, cut after each iteration's last
    backward."""
    out: list[list[Step]] = [[]]
    for kind, k in stage_actions("1f1b", stage, n_stages, microbatches * iterations):
        out[-1].append((kind, k))
        if kind == "B" and (k + 1) % microbatches == 0:
            out.append([])
    out.pop()                       # the empty one after the last backward
    return out


class Stashed(torch.nn.Module):
    """The stage module called with the weights `weights` (a version of WeightVersions) in place
    of its parameters (torch.func.functional_call)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.whole = isinstance(module, WholeModel)   # its parameters carry the model's names
        self.inner = module.model if self.whole else module
        self.weights: dict[str, torch.Tensor] = {}

    def forward(self, *args, **kwargs):
        out = torch.func.functional_call(self.inner, self.weights, args, kwargs)
        return (out,) if self.whole else out


class PipeDreamRunner(StageRunner):
    """A StageRunner whose `run` executes the stream's next iteration: forwards with the
    version WeightVersions hands out, each backward followed by its update rule; what backward
    needs is kept across iterations."""

    def __init__(self, *args, versions: WeightVersions, iterations: list[list[Step]], **kwargs):
        super().__init__(*args, **kwargs)
        self.versions, self.iterations = versions, iterations
        self.done = 0
        self.saved: dict[int, tuple[list, list]] = {}
        self.older = [0, 0]          # per link (prev, next): sends issued before this iteration

    def run(self, actions, inputs, targets) -> torch.Tensor | None:
        acts = self.iterations[self.done]
        self.done += 1
        losses: dict[int, torch.Tensor] = {}
        self._left = {"act": sum(k == "F" for k, _ in acts) if self.prev else 0,
                      "grad": sum(k == "B" for k, _ in acts) if self.next else 0}
        for kind, mb in acts:
            self._flush(block=False)
            self._post_ahead()
            if kind == "F":
                self.module.weights = self.versions.for_forward(mb)
                if self.track:                         # a stashed version is not an activation
                    self.saved_tracker.param_ptrs.update(
                        w.untyped_storage().data_ptr() for w in self.module.weights.values())
                self._forward(mb, inputs, targets, self.saved, losses)
            else:
                self._backward(mb, self.saved, losses)
                with self.busy(f"update {mb}", "optimizer"):
                    self.versions.after_backward(mb)
        self._flush()
        with self.busy("send wait", "transfer", busy=False):
            for j, link in enumerate((self.prev, self.next)):
                if link is None:
                    continue
                if self.done == len(self.iterations):
                    link.drain()
                    continue
                # the previous iteration's sends: the peer receives them by the end of its
                # iteration i, which needs nothing this stage sends later (gloo reports a send
                # complete only when waited for, so they are waited for, not polled)
                for w in link.pending[:self.older[j]]:
                    w.wait()
                del link.pending[:self.older[j]]
                self.older[j] = len(link.pending)
        if self.next is None:
            return sum(l.detach() for l in losses.values())
        return None


@dataclass
class StreamData:
    """Which microbatches a stage reads in iteration i: its forwards' inputs (first stage) and
    targets (last stage), keyed by the stream's microbatch index."""
    workload: object
    microbatches: int
    micro: int                      # samples per microbatch
    first: bool
    last: bool
    iterations: int

    def batches(self, global_batch: int, i: int, call_args) -> tuple[dict | None, dict | None]:
        if not (self.first or self.last):
            return None, None
        ins: dict = {}
        tgts: dict = {}
        # the first stage also runs forwards of the next iteration's microbatches
        for j in range(i, min(i + (2 if self.first else 1), self.iterations)):
            x, y = self.workload.make_batch(global_batch, j)
            for q in range(self.microbatches):
                a, b = q * self.micro, (q + 1) * self.micro
                k = j * self.microbatches + q
                if self.first:
                    ins[k] = call_args(slice_inputs(x, a, b))
                if self.last:
                    tgts[k] = slice_inputs(y, a, b)
        return (ins if self.first else None), (tgts if self.last else None)


__all__ = ["stream_iterations", "Stashed", "PipeDreamRunner", "StreamData"]
