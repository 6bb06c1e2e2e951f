"""Stage execution: GPipe and 1F1B schedules over send/recv, one stage per rank.

A schedule is data: a list of actions `("F", mb)` / `("B", mb)` per stage, in the order the
stage runs them, taken from the simulator's `hetplan.planner.sim.schedule` so that what runs is what was
predicted. `StageRunner.run` executes one iteration's actions. Zero-bubble schedules split a
backward into `("I", mb)`, the inputs' gradient, sent back at once, and `("W", mb)`, the
weights' gradient, later (hetplan.planner.workload.split_backward); a microbatch's activations are held until its W.

Transfers between stages: activations go forward, gradients of the activations go backward.
Sends are asynchronous (`isend`, waited at the end of the iteration) and receives block, so the
schedules cannot deadlock. Over gloo, CUDA tensors are staged through pinned host memory
(gloo has no CUDA send/recv; see `PeerLink`); two CUDA stages talk over NCCL, one communicator per
direction. The first exchange on a link
carries a small header (count, dtypes, shapes, requires_grad), cached afterwards: shapes are
fixed after the first iteration because every microbatch has the same size.

Recompute (plan.recompute): the stage's forward runs under non-reentrant activation
checkpointing, so only its inputs are kept per in-flight microbatch and the forward runs again
inside backward — the stage-level recompute the simulator and memory model assume.

Activation offload (a stage's offload_activations): the forward runs under
hetplan.runtime.offload.ActivationOffload's hooks, so what it saves for backward waits in host memory.

Precision (plan.precision): the stage's forward and the loss run under
hetplan.planner.workload.precision.autocast(device type, precision), backward outside it; under bf16 the
activations and their gradients cross stage boundaries as bf16, and the gradients land in the
fp32 parameters.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from hetplan.planner.hardware.device import TorchDevice
from hetplan.planner.workload.inputs import to_device
from hetplan.planner.sim.schedule import POSTED_AHEAD
from hetplan.planner.workload.precision import autocast
from hetplan.planner.workload.split_backward import input_pass

Step = tuple[str, int]   # ("F" | "B" | "I" | "W", microbatch): a schedule Action of this stage

# dtype codes of the header; only these dtypes cross a stage boundary
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8]


def stage_actions(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[Step]:
    """This stage's action order: exactly the simulator's schedule (hetplan.planner.sim.schedule)."""
    from hetplan.planner.sim.schedule import make_schedule
    return [(a.kind, a.microbatch) for a in make_schedule(schedule, n_stages, n_micro)[stage]]


# --- point-to-point ---------------------------------------------------------------------------
@dataclass
class PeerLink:
    """One direction-agnostic pipeline link between this rank and a peer rank.

    Host staging (gloo beside an accelerator): a tensor to send is copied into a pinned host
    buffer on a side stream (non-blocking), and its isend is issued once the copy is done
    (`flush`), so the copy overlaps the next compute; sends leave in program order (gloo matches
    messages by order), and every rank flushes before it blocks in a receive, so no rank waits for
    a message that sits in another's queue. Received tensors land in pinned buffers and move
    to the device with a non-blocking copy on the compute stream.
    """
    peer: int                          # global rank of the peer stage
    send_group: Any                    # process group for this rank -> peer
    recv_group: Any                    # process group for peer -> this rank
    device: TorchDevice                # where tensors live on this rank
    host_staged: bool                  # gloo with an accelerator: copy through host memory
    headers: dict[str, list] = field(default_factory=dict)   # direction -> [(dtype, shape, rg)]
    pending: list = field(default_factory=list)              # outstanding isend works
    staged: list = field(default_factory=list)               # [(event | None, host tensors, sources)]
    copy_stream: Any = None
    posted: list = field(default_factory=list)               # receives posted ahead: [(works, buffers)]

    def send(self, key: str, tensors: list[torch.Tensor]) -> None:
        if key not in self.headers:
            meta = [len(tensors)]
            for t in tensors:
                meta += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            hdr = torch.tensor(meta, dtype=torch.int64)
            n = torch.tensor([hdr.numel()], dtype=torch.int64)
            self._queue(None, [self._hdr(n), self._hdr(hdr)], [])
            self.headers[key] = [(t.dtype, tuple(t.shape), t.requires_grad) for t in tensors]
        if not self.host_staged:
            self._queue(None, [t.detach().contiguous() for t in tensors], [])
            return
        if self.copy_stream is None:
            self.copy_stream = self.device.new_stream()
        self.copy_stream.wait_stream(self.device.current_stream())   # the tensors are computed
        with self.device.stream(self.copy_stream):
            hosts = [self.device.host_buffer(t.shape, t.dtype) for t in tensors]
            for h, t in zip(hosts, tensors):
                h.copy_(t.detach(), non_blocking=True)
            done = self.device.event()
            done.record(self.copy_stream)
        # the sources stay referenced until sent: their memory is not reused while copied
        self._queue(done, hosts, tensors)

    def _queue(self, event, tensors: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        self.staged.append((event, tensors, sources))
        self.flush(block=False)

    def flush(self, block: bool = True) -> None:
        """isend the queued tensors in order: all of them (block), or those whose copy is done."""
        while self.staged:
            event, tensors, _ = self.staged[0]
            if event is not None:
                if not block and not event.query():
                    return
                event.synchronize()
            self.staged.pop(0)
            for t in tensors:
                self.pending.append(dist.isend(t, self.peer, group=self.send_group))

    def _hdr(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.host_staged or not self.device.native else x.to(self.device.device)

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
        if not self.posted:
            self.post(key)
        works, bufs = self.posted.pop(0)
        for w in works:
            w.wait()
        if self.host_staged:
            return [b.to(self.device.device, non_blocking=True) for b in bufs]
        return bufs

    def post(self, key: str) -> None:
        """Post the next receive of `key` now (irecv into fresh buffers; its header must be
        known): the message lands while this rank computes, and `recv` only waits for it.
        A link receives one kind of message, so posted receives match the peer's sends in order."""
        bufs = [self.device.host_buffer(shape, dtype) if self.host_staged
                else torch.empty(shape, dtype=dtype, device=self.device.device)
                for dtype, shape, _ in self.headers[key]]
        self.posted.append(([dist.irecv(b, self.peer, group=self.recv_group) for b in bufs], bufs))

    def drain(self) -> None:
        self.flush(block=True)
        for w in self.pending:
            w.wait()
        self.pending.clear()


@dataclass
class FanLink:
    """A pipeline link beside a tensor-split stage (hetplan.runtime.tensor): receives from the
    neighbouring stage's first rank (every rank of a split stage receives the boundary tensors
    and holds its outputs), and sends to every rank of the neighbouring stage, or to none: a
    split stage's first rank sends for it. Same interface as PeerLink."""
    first: PeerLink                    # the neighbouring stage's first rank
    others: list[PeerLink]             # its other ranks (sent to when `sending`)
    sending: bool

    @property
    def headers(self) -> dict[str, list]:
        return self.first.headers

    @property
    def posted(self) -> list:
        return self.first.posted

    def _links(self) -> list[PeerLink]:
        return [self.first, *self.others]

    def send(self, key: str, tensors: list[torch.Tensor]) -> None:
        if self.sending:
            for link in self._links():
                link.send(key, tensors)

    def recv(self, key: str) -> list[torch.Tensor]:
        return self.first.recv(key)

    def post(self, key: str) -> None:
        self.first.post(key)

    def flush(self, block: bool = True) -> None:
        for link in self._links():
            link.flush(block)

    def drain(self) -> None:
        for link in self._links():
            link.drain()


# --- one stage --------------------------------------------------------------------------------
class StageRunner:
    """Runs one stage's actions for an iteration and keeps what backward needs.

    `scale` is this replica's share of the global batch divided by its microbatches
    (b_r / G / m): each microbatch's mean loss is multiplied by it before backward, so the
    gradients summed over microbatches and (by the all-reduce) over replicas equal the gradient of
    the mean loss over the global batch.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, loss_fn: Callable,
                 prev: PeerLink | None, next: PeerLink | None, scale: float,
                 busy: Callable[[], Any], recompute: bool = False, precision: str = "fp32"):
        self.module, self.device, self.loss_fn = module, device, loss_fn
        self.recompute = recompute  # keep only the stage input; rerun forward in backward
        self.precision = precision  # forward and loss under hetplan.planner.workload.precision.autocast
        self.prev, self.next, self.scale = prev, next, scale
        self.busy = busy            # BusyTimer.timer: (name, kind, busy=True) -> context manager
        self.saved_tracker = None   # instruments.SavedTracker, used while `track` is True
        self.track = False
        self.offload = None         # hetplan.runtime.offload.ActivationOffload (offload_activations)
        self.forward_context = lambda mb: contextlib.nullcontext()   # hetplan.runtime.ddp: no_sync()
        self.before_backward = lambda mb: None   # hetplan.runtime.shard.GradScatter: the last microbatch's
        self.params_saved = None    # hetplan.runtime.shard.ParamShards: what autograd saves of the parameters
        self.weight_passes: dict[int, Any] = {}   # split backward: microbatch -> its W still to run
        # runs of `run` to come, this one included: the next run's first receives are posted once
        # this run's last ones are taken (the builder sets it to the iterations to train)
        self.runs_left = 1
        self._later = {"act": 0, "grad": 0}

    def run(self, actions: list[Step], inputs: list[tuple] | None,
            targets: list[Any] | None) -> torch.Tensor | None:
        """Execute the actions; return the weighted loss sum (last stage) or None."""
        saved: dict[int, tuple[list, list]] = {}
        losses: dict[int, torch.Tensor] = {}
        # receives still to come this iteration: an activation per F (not on the first stage),
        # a gradient per B or I (not on the last); and in the runs after this one
        self._left = {"act": sum(k == "F" for k, _ in actions) if self.prev else 0,
                      "grad": sum(k in "BI" for k, _ in actions) if self.next else 0}
        self.runs_left = max(self.runs_left - 1, 0)
        self._later = {k: n * self.runs_left for k, n in self._left.items()}
        for kind, mb in actions:
            self._flush(block=False)   # sends whose host copy finished during the last action
            self._post_ahead()
            if kind == "F":
                self._forward(mb, inputs, targets, saved, losses)
            elif kind == "I":
                self._backward_input(mb, saved, losses)
            elif kind == "W":
                self._backward_weight(mb)
            else:
                self._backward(mb, saved, losses)
        with self.busy("send wait", "transfer", busy=False):
            for link in (self.prev, self.next):
                if link is not None:
                    link.drain()
        if self.next is None:
            return sum(l.detach() for l in losses.values())
        return None

    def _post_ahead(self) -> None:
        """Keep the next POSTED_AHEAD receives of each link posted (once its header is known), so
        a message arrives during the compute before it is needed, also the second of two receives
        in a row (a message moves only once its receive is posted); once this iteration's last
        are taken, the next iteration's first, so that the sender learns of them while it still
        waits in this one (gloo's loop thread, at the lowest priority, reads the receiver's
        notice only when its worker's core is idle: a send issued before it has read it leaves at
        the worker's next wait); never more than the runs to come receive (a receive left posted
        would outlive the run). The simulator's rule: hetplan.planner.sim.schedule.receives."""
        for link, key in ((self.prev, "act"), (self.next, "grad")):
            if link is not None and key in link.headers:
                while len(link.posted) < min(POSTED_AHEAD, self._left[key] + self._later[key]):
                    link.post(key)

    def _recv(self, link: PeerLink, key: str) -> list[torch.Tensor]:
        self._flush()
        self._left[key] -= 1
        return link.recv(key)

    def _flush(self, block: bool = True) -> None:
        """Issue queued sends on both links; before blocking in a receive, all of them
        (a peer may be waiting for one of them before it sends what this rank waits for)."""
        for link in (self.prev, self.next):
            if link is not None:
                link.flush(block)

    def _forward(self, mb, inputs, targets, saved, losses) -> None:
        kwargs = {}
        if self.prev is None:              # (args, kwargs) of the model or the first stage
            args, kwargs = to_device(inputs[mb], self.device)
            args = list(args)
        else:
            with self.busy(f"recv act {mb}", "transfer", busy=False):
                args = self._recv(self.prev, "act")
            args = [a.requires_grad_(rg) if a.is_floating_point() else a
                    for a, (_, _, rg) in zip(args, self.prev.headers["act"])]
        track = self.saved_tracker if self.track else None
        with self.busy(f"F{mb}", "forward"), self._saved_hooks(track, mb), \
                (self.offload.hooks() if self.offload else contextlib.nullcontext()), \
                autocast(self.device.type, self.precision), self.forward_context(mb):
            if track is not None and self.recompute:   # checkpoint keeps just the stage input
                track.add_bytes(mb, sum(a.numel() * a.element_size()
                                        for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)))
            if self.recompute:
                out = checkpoint(self.module, *args, use_reentrant=False, **kwargs)
            else:
                out = self.module(*args, **kwargs)
            if self.next is None:
                target = targets[mb].to(self.device, non_blocking=True)
                losses[mb] = self.loss_fn(out[0], target) * self.scale
        if self.next is not None:
            self.next.send("act", list(out))
            saved[mb] = (args, [o for o in out if o.requires_grad])
        else:
            saved[mb] = (args, [])

    def _saved_hooks(self, track, mb: int):
        """What autograd saves in a forward: counted (`track`), the parameters' kept as handles
        (ZeRO-3), activations offloaded (validated: not with ZeRO-3)."""
        if track is not None:
            return track.hooks(mb, self.params_saved)
        if self.params_saved is not None:
            return self.params_saved.hooks()
        return contextlib.nullcontext()

    def _backward(self, mb, saved, losses) -> None:
        args, outs = saved.pop(mb)
        self.before_backward(mb)
        if self.next is None:
            with self.busy(f"B{mb}", "backward"):
                losses[mb].backward()
        else:
            with self.busy(f"recv grad {mb}", "transfer", busy=False):
                grads = self._recv(self.next, "grad")
            with self.busy(f"B{mb}", "backward"):
                if outs:
                    torch.autograd.backward(outs, grads)
        if self.track:
            self.saved_tracker.release(mb)
        if self.prev is not None:
            need = [a for a in args if a.requires_grad]
            self.prev.send("grad", [a.grad if a.grad is not None else torch.zeros_like(a)
                                    for a in need])

    def _backward_input(self, mb, saved, losses) -> None:
        """I pass: the gradient of the stage's inputs, sent back now; the W pass is kept."""
        args, outs = saved.pop(mb)
        grads = None
        if self.next is None:
            outs = [losses[mb]]
        else:
            with self.busy(f"recv grad {mb}", "transfer", busy=False):
                grads = self._recv(self.next, "grad")
        need = [a for a in args if a.requires_grad] if self.prev is not None else []
        with self.busy(f"I{mb}", "backward"):
            got, self.weight_passes[mb] = input_pass(outs, grads, need, list(self.module.parameters()))
        if self.prev is not None:
            self.prev.send("grad", [g if g is not None else torch.zeros_like(a) for a, g in zip(need, got)])

    def _backward_weight(self, mb) -> None:
        """W pass: the weights' gradients of microbatch mb; its activations are freed after it."""
        self.before_backward(mb)
        with self.busy(f"W{mb}", "backward"):
            self.weight_passes.pop(mb).run()
        if self.track:
            self.saved_tracker.release(mb)


class WholeModel(torch.nn.Module):
    """The whole model as one stage (a one-stage replica needs no partition): returns (output,)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return (self.model(*args, **kwargs),)

    def named_parameters(self, *args, **kwargs):  # keep the original model's names
        return self.model.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.model.named_buffers(*args, **kwargs)
