"""Interleaved 1F1B on one rank: several virtual stages, run in the device's schedule order.

Device r of a p-device pipeline holds the virtual stages r, r + p, ... (hetplan.planner.files.plan checks
the layout); it runs the actions `hetplan.planner.sim.schedule.make_schedule` gives its row, each on the
stage module the action names. Consecutive stages are always on different ranks, so every
stage boundary is a message over the existing `hetplan.runtime.pipeline.PeerLink` to the previous or the
next device (one link per peer; with p = 2 both are the same rank). Keys name the receiving
stage (`act3`, `grad2`), so each key's header and shapes stay fixed.

Message order: a link delivers messages in the order the peer sent them, and a peer sends in its
own schedule order, which differs from the order this rank needs them. So each rank knows every
peer's send sequence (from the same schedule) and receives in that order, keeping early arrivals
until their action comes: waiting for a message means first taking those the peer sent before
it, which are already on their way. Sends are asynchronous and every link is flushed before a
blocking receive, as in StageRunner, so the schedule cannot deadlock.

Not supported here (refused by the plan's validation): offloaded activations; plain data
parallel on DDP does not apply (several stages per rank).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from hetplan.planner.sim.schedule import POSTED_AHEAD, Action, make_schedule
from hetplan.planner.workload.inputs import to_device
from hetplan.planner.workload.precision import autocast
from hetplan.runtime.pipeline import PeerLink

Message = tuple[str, int, int]   # ("act" | "grad", receiving stage, microbatch)


def device_actions(schedule: str, n_stages: int, n_micro: int, devices: int, row: int) -> list[Action]:
    """Device `row`'s actions: exactly the simulator's schedule (hetplan.planner.sim.schedule)."""
    return make_schedule(schedule, n_stages, n_micro, devices)[row]


def sent_messages(actions: list[Action], n_stages: int) -> list[Message]:
    """The messages a device sends, in its order: F of stage s sends the activation to s + 1
    (not from the last stage), B of stage s the input's gradient to s - 1 (not from stage 0)."""
    out = []
    for a in actions:
        if a.kind == "F" and a.stage < n_stages - 1:
            out.append(("act", a.stage + 1, a.microbatch))
        elif a.kind == "B" and a.stage > 0:
            out.append(("grad", a.stage - 1, a.microbatch))
    return out


class VirtualStages(torch.nn.Module):
    """A rank's stage modules as one module whose parameters and buffers keep the original
    model's names (a parameter shared by two of them, a tied weight, listed once)."""

    def __init__(self, stages: dict[int, torch.nn.Module]):
        super().__init__()
        self.by_stage = dict(stages)
        self.parts = torch.nn.ModuleList(stages.values())

    def _once(self, method: str, *args, **kwargs):
        """(name, tensor) of every stage's `method`, each tensor once (a tied weight)."""
        seen = set()
        for m in self.by_stage.values():
            for n, t in getattr(m, method)(*args, **kwargs):
                if id(t) not in seen:
                    seen.add(id(t))
                    yield n, t

    def named_parameters(self, *args, **kwargs):
        return self._once("named_parameters", *args, **kwargs)

    def flat_inputs(self, inputs):
        """The model inputs' leaves as stage 0 takes them (the rank holding stage 0)."""
        return self.by_stage[0].flat_inputs(inputs)

    def named_buffers(self, *args, **kwargs):
        return self._once("named_buffers", *args, **kwargs)


class InterleavedRunner:
    """Runs one device's interleaved actions for an iteration (StageRunner's contract: `run`
    returns the weighted loss sum on the rank holding the last stage, else None)."""

    def __init__(self, stages: dict[int, torch.nn.Module], n_stages: int, device: torch.device,
                 loss_fn: Callable, links: dict[int, PeerLink], rank_of_stage: list[int],
                 peer_sends: dict[int, list[Message]], scale: float, busy: Callable[[], Any],
                 recompute: bool = False, precision: str = "fp32"):
        self.stages, self.n_stages, self.device, self.loss_fn = stages, n_stages, device, loss_fn
        self.links, self.rank_of_stage, self.scale, self.busy = links, rank_of_stage, scale, busy
        self.peer_sends = peer_sends   # peer rank -> the messages it sends this rank, in its order
        self.recompute, self.precision = recompute, precision
        self.saved_tracker = None      # instruments.SavedTracker (keys: (stage, microbatch))
        self.track = False
        self.offload = None            # not supported with interleaving (plan validation)

    # --- messages ---------------------------------------------------------------------------
    def _recv(self, msg: Message) -> list[torch.Tensor]:
        peer = self.rank_of_stage[msg[1] - 1 if msg[0] == "act" else msg[1] + 1]
        link, seq = self.links[peer], self.peer_sends[peer]
        self._flush()
        while msg not in self._inbox:
            kind, stage, mb = seq[self._pos[peer]]
            self._pos[peer] += 1
            self._inbox[(kind, stage, mb)] = link.recv(f"{kind}{stage}")
        return self._inbox.pop(msg)

    def _post_ahead(self) -> None:
        """Keep each link's next POSTED_AHEAD expected receives posted, in the peer's send order,
        as far as their headers are known (they land while this rank computes)."""
        for peer, seq in self.peer_sends.items():
            link = self.links[peer]
            while len(link.posted) < POSTED_AHEAD and (k := self._pos[peer] + len(link.posted)) < len(seq):
                key = f"{seq[k][0]}{seq[k][1]}"
                if key not in link.headers:
                    break
                link.post(key)

    def _send(self, kind: str, stage: int, tensors: list[torch.Tensor]) -> None:
        self.links[self.rank_of_stage[stage]].send(f"{kind}{stage}", tensors)

    def _flush(self, block: bool = True) -> None:
        for link in self.links.values():
            link.flush(block)

    # --- one iteration ----------------------------------------------------------------------
    def run(self, actions: list[Action], inputs: list[tuple] | None,
            targets: list[Any] | None) -> torch.Tensor | None:
        self._inbox: dict[Message, list[torch.Tensor]] = {}
        self._pos = dict.fromkeys(self.peer_sends, 0)
        saved: dict[tuple[int, int], tuple[list, list]] = {}
        losses: dict[int, torch.Tensor] = {}
        for a in actions:
            self._flush(block=False)
            self._post_ahead()
            if a.kind == "F":
                self._forward(a.stage, a.microbatch, inputs, targets, saved, losses)
            else:
                self._backward(a.stage, a.microbatch, saved, losses)
        with self.busy("send wait", "transfer", busy=False):
            for link in self.links.values():
                link.drain()
        if self.n_stages - 1 in self.stages:
            return sum(l.detach() for l in losses.values())
        return None

    def _forward(self, s: int, mb: int, inputs, targets, saved, losses) -> None:
        kwargs = {}
        if s == 0:
            args, kwargs = to_device(inputs[mb], self.device)
            args = list(args)
        else:
            with self.busy(f"recv act {s}.{mb}", "transfer", busy=False):
                args = self._recv(("act", s, mb))
            headers = self.links[self.rank_of_stage[s - 1]].headers[f"act{s}"]
            args = [x.requires_grad_(rg) if x.is_floating_point() else x for x, (_, _, rg) in zip(args, headers)]
        track = self.saved_tracker if self.track else None
        module = self.stages[s]
        with self.busy(f"F{s}.{mb}", "forward"), (track.hooks((s, mb)) if track else contextlib.nullcontext()), \
                autocast(self.device.type, self.precision):
            if track is not None and self.recompute:   # checkpoint keeps just the stage input
                track.add_bytes((s, mb), sum(x.numel() * x.element_size()
                                             for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)))
            out = (checkpoint(module, *args, use_reentrant=False, **kwargs) if self.recompute
                   else module(*args, **kwargs))
            if s == self.n_stages - 1:
                losses[mb] = self.loss_fn(out[0], targets[mb].to(self.device, non_blocking=True)) * self.scale
        if s < self.n_stages - 1:
            self._send("act", s + 1, list(out))
            saved[(s, mb)] = (args, [o for o in out if o.requires_grad])
        else:
            saved[(s, mb)] = (args, [])

    def _backward(self, s: int, mb: int, saved, losses) -> None:
        args, outs = saved.pop((s, mb))
        if s == self.n_stages - 1:
            with self.busy(f"B{s}.{mb}", "backward"):
                losses[mb].backward()
        else:
            with self.busy(f"recv grad {s}.{mb}", "transfer", busy=False):
                grads = self._recv(("grad", s, mb))
            with self.busy(f"B{s}.{mb}", "backward"):
                if outs:
                    torch.autograd.backward(outs, grads)
        if self.track:
            self.saved_tracker.release((s, mb))
        if s > 0:
            need = [x for x in args if x.requires_grad]
            self._send("grad", s - 1, [x.grad if x.grad is not None else torch.zeros_like(x) for x in need])


__all__ = ["InterleavedRunner", "VirtualStages", "device_actions", "sent_messages"]
