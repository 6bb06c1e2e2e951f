"""Stage execution: GPipe and 1F1B schedules over send/recv, one stage per rank.

A schedule is data: a list of actions `("F", mb)` / `("B", mb)` per stage, in the order the
stage runs them, taken from the simulator's `planner.schedule` so that what runs is what was
predicted. `StageRunner.run` executes one iteration's actions.

Transfers between stages: activations go forward, gradients of the activations go backward.
Sends are asynchronous (`isend`, waited at the end of the iteration) and receives block, so the
schedules cannot deadlock. Over gloo, CUDA tensors are staged through host memory (gloo has no
CUDA send/recv); two CUDA stages talk over NCCL, one communicator per direction. The first exchange on a link
carries a small header (count, dtypes, shapes, requires_grad), cached afterwards: shapes are
fixed after the first iteration because every microbatch has the same size.

Recompute (plan.recompute): the stage's forward runs under non-reentrant activation
checkpointing, so only its inputs are kept per in-flight microbatch and the forward runs again
inside backward — the stage-level recompute the simulator and memory model assume.

Precision (plan.precision): the stage's forward and the loss run under
planner.precision.autocast(device type, precision), backward outside it; under bf16 the
activations and their gradients cross stage boundaries as bf16, and the gradients land in the
fp32 parameters.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from planner.precision import autocast

Action = tuple[str, int]   # ("F", microbatch) or ("B", microbatch)

# dtype codes of the header; only these dtypes cross a stage boundary
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8]


def stage_actions(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """This stage's action order: exactly the simulator's schedule (planner.schedule)."""
    from planner.schedule import make_schedule
    return [(a.kind, a.microbatch) for a in make_schedule(schedule, n_stages, n_micro)[stage]]


# --- point-to-point ---------------------------------------------------------------------------
@dataclass
class Link:
    """One direction-agnostic pipeline link between this rank and a peer rank."""
    peer: int                          # global rank of the peer stage
    send_group: Any                    # process group for this rank -> peer
    recv_group: Any                    # process group for peer -> this rank
    device: torch.device               # where tensors live on this rank
    host_staged: bool                  # gloo with a CUDA device: copy through host memory
    headers: dict[str, list] = field(default_factory=dict)   # direction -> [(dtype, shape, rg)]
    pending: list = field(default_factory=list)              # outstanding isend works

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return (t.cpu() if self.host_staged else t).contiguous()

    def send(self, key: str, tensors: list[torch.Tensor]) -> None:
        if key not in self.headers:
            meta = [len(tensors)]
            for t in tensors:
                meta += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            hdr = torch.tensor(meta, dtype=torch.int64)
            n = torch.tensor([hdr.numel()], dtype=torch.int64)
            for x in (n, hdr):
                self.pending.append(dist.isend(self._hdr(x), self.peer, group=self.send_group))
            self.headers[key] = [(t.dtype, tuple(t.shape), t.requires_grad) for t in tensors]
        for t in tensors:
            self.pending.append(dist.isend(self._wire(t), self.peer, group=self.send_group))

    def _hdr(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.host_staged or self.device.type == "cpu" else x.to(self.device)

    def recv(self, key: str) -> list[torch.Tensor]:
        if key not in self.headers:
            n = self._hdr(torch.zeros(1, dtype=torch.int64))
            dist.recv(n, self.peer, group=self.recv_group)
            hdr = self._hdr(torch.zeros(int(n.item()), dtype=torch.int64))
            dist.recv(hdr, self.peer, group=self.recv_group)
            meta, i, spec = hdr.tolist(), 1, []
            for _ in range(meta[0]):
                dtype, rg, nd = _DTYPES[meta[i]], bool(meta[i + 1]), meta[i + 2]
                spec.append((dtype, tuple(meta[i + 3:i + 3 + nd]), rg))
                i += 3 + nd
            self.headers[key] = spec
        out = []
        wire_dev = torch.device("cpu") if self.host_staged else self.device
        for dtype, shape, rg in self.headers[key]:
            buf = torch.empty(shape, dtype=dtype, device=wire_dev)
            dist.recv(buf, self.peer, group=self.recv_group)
            out.append(buf.to(self.device) if self.host_staged else buf)
        return out

    def drain(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending.clear()


# --- one stage --------------------------------------------------------------------------------
class StageRunner:
    """Runs one stage's actions for an iteration and keeps what backward needs.

    `scale` is this replica's share of the global batch divided by its microbatches
    (b_r / G / m): each microbatch's mean loss is multiplied by it before backward, so the
    gradients summed over microbatches and (by the all-reduce) over replicas equal the gradient of
    the mean loss over the global batch.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, loss_fn: Callable,
                 prev: Link | None, next: Link | None, scale: float,
                 busy: Callable[[], Any], recompute: bool = False, precision: str = "fp32"):
        self.module, self.device, self.loss_fn = module, device, loss_fn
        self.recompute = recompute  # keep only the stage input; rerun forward in backward
        self.precision = precision  # forward and loss under planner.precision.autocast
        self.prev, self.next, self.scale = prev, next, scale
        self.busy = busy            # BusyTimer.timer: (name, kind, busy=True) -> context manager
        self.saved_tracker = None   # measure.SavedTracker, used while `track` is True
        self.track = False

    def run(self, actions: list[Action], inputs: list[tuple] | None,
            targets: list[Any] | None) -> torch.Tensor | None:
        """Execute the actions; return the weighted loss sum (last stage) or None."""
        saved: dict[int, tuple[list, list]] = {}
        losses: dict[int, torch.Tensor] = {}
        for kind, mb in actions:
            if kind == "F":
                self._forward(mb, inputs, targets, saved, losses)
            else:
                self._backward(mb, saved, losses)
        with self.busy("send wait", "transfer", busy=False):
            for link in (self.prev, self.next):
                if link is not None:
                    link.drain()
        if self.next is None:
            return sum(l.detach() for l in losses.values())
        return None

    def _forward(self, mb, inputs, targets, saved, losses) -> None:
        if self.prev is None:
            args = [a.to(self.device, non_blocking=True) for a in inputs[mb]]
        else:
            with self.busy(f"recv act {mb}", "transfer", busy=False):
                args = self.prev.recv("act")
            args = [a.requires_grad_(rg) if a.is_floating_point() else a
                    for a, (_, _, rg) in zip(args, self.prev.headers["act"])]
        track = self.saved_tracker if self.track else None
        with self.busy(f"F{mb}", "forward"), (track.hooks(mb) if track else contextlib.nullcontext()), \
                autocast(self.device.type, self.precision):
            if track is not None and self.recompute:   # checkpoint keeps just the stage input
                track.add_bytes(mb, sum(a.numel() * a.element_size() for a in args))
            if self.recompute:
                out = checkpoint(self.module, *args, use_reentrant=False)
            else:
                out = self.module(*args)
            if self.next is None:
                target = targets[mb].to(self.device, non_blocking=True)
                losses[mb] = self.loss_fn(out[0], target) * self.scale
        if self.next is not None:
            self.next.send("act", list(out))
            saved[mb] = (args, [o for o in out if o.requires_grad])
        else:
            saved[mb] = (args, [])

    def _backward(self, mb, saved, losses) -> None:
        args, outs = saved.pop(mb)
        if self.next is None:
            with self.busy(f"B{mb}", "backward"):
                losses[mb].backward()
        else:
            with self.busy(f"recv grad {mb}", "transfer", busy=False):
                grads = self.next.recv("grad")
            with self.busy(f"B{mb}", "backward"):
                if outs:
                    torch.autograd.backward(outs, grads)
        if self.track:
            self.saved_tracker.release(mb)
        if self.prev is not None:
            need = [a for a in args if a.requires_grad]
            self.prev.send("grad", [a.grad if a.grad is not None else torch.zeros_like(a)
                                    for a in need])


class WholeModel(torch.nn.Module):
    """The whole model as one stage (a one-stage replica needs no partition): returns (output,)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return (self.model(*inputs),)

    def named_parameters(self, *args, **kwargs):  # keep the original model's names
        return self.model.named_parameters(*args, **kwargs)
