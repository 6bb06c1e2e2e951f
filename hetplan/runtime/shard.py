"""Sharded data parallel (plan `shard`, ZeRO): the N replicas of a stage each keep an equal
1/N slice of every parameter tensor's optimizer state (stage 1) and gradient (stage 2).

`ShardedStep`: rank k steps elements [k·c, (k+1)·c) of every tensor (c = ceil(numel / N)) through
views into the parameters, then one all-gather a step gives every replica the whole update;
exact for element-wise optimizers (hetplan.planner.files.optimizer_spec.ELEMENTWISE).
`GradScatter` (stage 2): the final gradients (the last microbatch's backward) are reduce-scattered
with SUM (the losses are already weighted by the shares) a bucket at a time into this rank's
slices, and the whole gradients freed: no more than a bucket's whole gradients are held.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ShardedStep:
    """ZeRO stage 1 over `group`'s N ranks: rank k steps elements [k·c, (k+1)·c) of every
    parameter tensor (c = ceil(numel / N), the last slices shorter or empty), through views that
    share the parameters' storage; `gather()` all-gathers every rank's slices (one collective)."""

    def __init__(self, params: list[torch.nn.Parameter], group):
        self.params, self.group = params, group
        self.scattered: list[torch.Tensor | None] | None = None   # GradScatter's slices, by tensor
        self.n, self.k = dist.get_world_size(group), dist.get_rank(group)
        self.chunk = [-(-p.numel() // self.n) for p in params]
        self.spans = [(min(self.k * c, p.numel()), min((self.k + 1) * c, p.numel()))
                      for p, c in zip(params, self.chunk)]
        self.mine = [i for i, (a, b) in enumerate(self.spans) if b > a]
        # leaves (no autograd history) sharing the parameters' storage: the optimizer's params
        self.slices = [params[i].detach().view(-1)[slice(*self.spans[i])] for i in self.mine]
        self.send = torch.empty(sum(self.chunk), dtype=params[0].dtype if params else torch.float32,
                                device=params[0].device if params else "cpu")

    def take_grads(self) -> None:
        """Each slice's gradient: the same elements of its parameter's (synced) gradient, or
        the reduce-scattered slice (GradScatter)."""
        for s, i in zip(self.slices, self.mine):
            if self.scattered is not None:
                s.grad = self.scattered[i]
                continue
            g = self.params[i].grad
            s.grad = None if g is None else g.view(-1)[slice(*self.spans[i])]

    @torch.no_grad()
    def gather(self) -> None:
        at = 0
        for p, c, (a, b) in zip(self.params, self.chunk, self.spans):
            self.send[at:at + b - a].copy_(p.view(-1)[a:b])
            at += c
        recv = [torch.empty_like(self.send) for _ in range(self.n)]
        dist.all_gather(recv, self.send, group=self.group)
        for r, buf in enumerate(recv):
            if r == self.k:
                continue
            at = 0
            for p, c in zip(self.params, self.chunk):
                a, b = min(r * c, p.numel()), min((r + 1) * c, p.numel())
                p.view(-1)[a:b].copy_(buf[at:at + b - a])
                at += c


class GradScatter:
    """ZeRO stage 2 for `step` (a ShardedStep): a hook on every parameter takes its final
    gradient into a bucket; a bucket of `bucket_bytes` or more (the plan's sync.bucket_bytes),
    and the last at `finish()`, is reduce-scattered with SUM (the losses already carry the
    shares) in one collective: every tensor's N slices laid out as N rows, each rank receiving
    its row (on gloo an all-reduce of the rows, each rank keeping its own: gloo's reduce-scatter
    is slower than its all-reduce). The whole gradients are freed then. `final` is set by the runner's forward of the
    microbatch whose backward comes last (hetplan.planner.cost.grad_sync.sync_microbatch);
    earlier microbatches accumulate whole gradients as usual. Every rank's hooks fire in the
    same order, so the buckets match."""

    def __init__(self, step: ShardedStep, bucket_bytes: int):
        self.step, self.bucket_bytes, self.final = step, bucket_bytes, False
        step.scattered = [None] * len(step.params)
        self.pending: list[int] = []
        self.pending_bytes = 0
        self.gloo = dist.get_backend(step.group) == "gloo"
        self.peak = 0                   # the most gradient bytes held at once (slices, whole, bucket)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(step.params)]

    def forward_context(self, sync_mb: int):
        import contextlib

        def enter(mb: int):
            self.final = mb == sync_mb
            return contextlib.nullcontext()
        return enter

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self.final or p.grad is None:
                return
            self.pending.append(i)
            self.pending_bytes += p.grad.numel() * p.grad.element_size()
            if self.pending_bytes >= self.bucket_bytes:
                self.flush()
        return hook

    @torch.no_grad()
    def flush(self) -> None:
        if not self.pending:
            return
        st, idx = self.step, self.pending
        grads = [st.params[i].grad for i in idx]
        width = sum(st.chunk[i] for i in idx)
        rows = torch.empty(st.n, width, dtype=grads[0].dtype, device=grads[0].device)
        col = 0
        for i, g in zip(idx, grads):
            c, n = st.chunk[i], g.numel()
            flat = g.view(-1)
            full = n // c if c else 0                 # rows filled whole; then one partial, then padding
            if full:
                rows[:full, col:col + c].copy_(flat[:full * c].view(full, c))
            if full < st.n:
                rest = n - full * c
                rows[full, col:col + rest].copy_(flat[full * c:])
                rows[full, col + rest:col + c].zero_()
                rows[full + 1:, col:col + c].zero_()
            col += c
        if self.gloo:      # gloo's reduce-scatter is slower than its all-reduce (docs/tuning.md)
            dist.all_reduce(rows, group=st.group)
            mine = rows[st.k].clone()         # not a view: the rows are freed with the bucket
        else:
            mine = torch.empty(width, dtype=rows.dtype, device=rows.device)
            dist.reduce_scatter_tensor(mine, rows.view(-1), group=st.group)
        self.peak = max(self.peak, self.held_bytes() + self.pending_bytes
                        + (rows.numel() + mine.numel()) * rows.element_size())
        col = 0
        for i in idx:
            a, b = st.spans[i]
            st.scattered[i] = mine[col:col + b - a] if b > a else None
            st.params[i].grad = None
            col += st.chunk[i]
        self.pending, self.pending_bytes = [], 0

    def begin(self) -> None:          # GradSync's interface
        self.final = False

    def finish(self) -> None:
        self.flush()

    def held_bytes(self) -> int:
        """The gradient slices this rank keeps."""
        return sum(t.numel() * t.element_size() for t in self.step.scattered if t is not None)

    def peak_bytes(self) -> int:
        """The most gradient bytes held at once: the slices so far, a bucket's whole gradients and
        its rows, and the received row."""
        return max(self.peak, self.held_bytes())


def check_runs(plan, file: str) -> None:
    """InputError unless the runtime runs the plan's sharding: stage 1 of one-device stages that
    are not interleaved, each stage's replicas on one device kind; stage 2 of one-stage replicas whose schedule ends with the backward of the
    microbatch it reduce-scatters, without clipping."""
    from hetplan.planner.files.io import InputError
    from hetplan.planner.hardware.topology import parse_device_name
    for j in range(len(plan.replicas[0].stages) if plan.shard else 0):
        kinds = {parse_device_name(r.stages[j].device)[1] for r in plan.replicas}
        if len(kinds) > 1:    # its collectives run on one backend, over tensors of one kind
            raise InputError(f"{file}: shard.stage: stage {j}'s replicas are on {' and '.join(sorted(kinds))} "
                             "devices; sharding runs over devices of one kind in this version")
    if plan.shard and plan.schedule == "interleaved-1f1b":
        raise InputError(f"{file}: schedule: expected a schedule other than \"interleaved-1f1b\" with "
                         f"shard.stage {plan.shard} in this version")
    if plan.shard != 2:
        return
    if any(len(r.stages) > 1 for r in plan.replicas):
        raise InputError(f"{file}: shard.stage: 2 runs with one-stage replicas (data parallel) in this "
                         "version; expected 1 beside pipelines")
    if plan.optimizer.clip_grad_norm is not None:
        raise InputError(f"{file}: optimizer.clip_grad_norm: expected none with shard.stage 2 in this version "
                         "(each replica holds a slice of the gradients)")
    from hetplan.planner.cost.grad_sync import sync_microbatch
    from hetplan.planner.files.schedule import make_schedule
    for i, r in enumerate(plan.replicas):
        if sync_microbatch([(a.kind, a.microbatch) for a in make_schedule(plan.schedule, 1, r.microbatches)[0]]) is None:
            raise InputError(f"{file}: schedule: {plan.schedule!r} with replicas[{i}].microbatches "
                             f"{r.microbatches} ends with no microbatch to reduce-scatter; expected 1f1b")
