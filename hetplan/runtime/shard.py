"""Sharded data parallel (plan `shard`, ZeRO): the N replicas of a stage each keep an equal
1/N slice of every parameter tensor's optimizer state (stage 1), gradient (stage 2) and the
parameter itself (stage 3).

`ShardedStep`: rank k steps elements [k·c, (k+1)·c) of every tensor (c = ceil(numel / N)) through
views into the parameters, then one all-gather a step gives every replica the whole update;
exact for element-wise optimizers (hetplan.planner.files.optimizer_spec.ELEMENTWISE).
`GradScatter` (stage 2): the final gradients (the last microbatch's backward) are reduce-scattered
with SUM (the losses are already weighted by the shares) a bucket at a time into this rank's
slices, and the whole gradients freed: no more than a bucket's whole gradients are held.
`ParamShards` (stage 3): each unit (a gradient bucket of the stage's layers) is all-gathered
before its layers run, forward and backward, the next one prefetched, and freed after them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class ShardedStep:
    """ZeRO stage 1 over `group`'s N ranks: rank k steps elements [k·c, (k+1)·c) of every
    parameter tensor (c = ceil(numel / N), the last slices shorter or empty), through views that
    share the parameters' storage; `gather()` all-gathers every rank's slices (one collective)."""

    def __init__(self, params: list[torch.nn.Parameter], group, own: bool = False):
        """`own` (stage 3): the slices are copies, not views (the parameters' storage is freed
        between uses), and `gather` is ParamShards' a unit at a time."""
        self.params, self.group, self.own = params, group, own
        self.scattered: list[torch.Tensor | None] | None = None   # GradScatter's slices, by tensor
        self.n, self.k = dist.get_world_size(group), dist.get_rank(group)
        self.chunk = [-(-p.numel() // self.n) for p in params]
        self.spans = [(min(self.k * c, p.numel()), min((self.k + 1) * c, p.numel()))
                      for p, c in zip(params, self.chunk)]
        self.mine = [i for i, (a, b) in enumerate(self.spans) if b > a]
        # leaves (no autograd history) sharing the parameters' storage: the optimizer's params
        self.slices = [params[i].detach().view(-1)[slice(*self.spans[i])] for i in self.mine]
        if own:
            self.slices = [t.clone() for t in self.slices]
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
    """ZeRO stages 2 and 3 for `step` (a ShardedStep): a hook on every parameter takes its final
    gradient into a bucket; a bucket of `bucket_bytes` or more (the plan's sync.bucket_bytes),
    or with `units` (stage 3) a unit all of whose gradients are in, and the last at `finish()`,
    is reduce-scattered with SUM (the losses already carry the shares) in one collective: every
    tensor's N slices laid out as N rows, each rank receiving its row (on gloo an all-reduce of
    the rows, each rank keeping its own: gloo's reduce-scatter is slower than its all-reduce).
    The whole gradients are freed then. The final gradients are the last backward's
    (`before_backward`, the runner's call before each backward or W pass); earlier microbatches
    accumulate whole gradients as usual. Every rank's hooks fire in the same order, so the
    buckets match. `on_unit(u)` is called once per backward when unit u's gradients are in."""

    def __init__(self, step: ShardedStep, bucket_bytes: float, units: list[list[int]] | None = None,
                 on_unit=None, shards=None):
        self.step, self.bucket_bytes, self.final = step, bucket_bytes, False
        step.scattered = [None] * len(step.params)
        self.pending: list[int] = []
        self.pending_bytes = 0
        self.units, self.on_unit, self.shards = units, on_unit, shards   # shards: ZeRO-3's ParamShards
        self.unit_of = {i: u for u, idx in enumerate(units or ()) for i in idx}
        self.arrived: dict[int, list[int]] = {}       # unit -> its parameters whose gradient is in
        self.gloo = dist.get_backend(step.group) == "gloo"
        self.peak = 0                   # the most gradient bytes held at once (slices, whole, bucket)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(step.params)]

    def before_backward(self, last_mb: int):
        """The runner's `before_backward`: the backward of `last_mb` makes the final gradients."""
        def enter(mb: int) -> None:
            for u in sorted(self.arrived):      # units an earlier backward left incomplete (unused)
                self.arrived.pop(u)
                if self.on_unit is not None:
                    self.on_unit(u)
            self.final = mb == last_mb
        return enter

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if self.units is not None:
                u = self.unit_of[i]
                got = self.arrived.setdefault(u, [])
                got.append(i)
                if len(got) == len(self.units[u]):
                    self._unit_done(u)
                return
            if not self.final:
                return
            self.pending.append(i)
            self.pending_bytes += p.grad.numel() * p.grad.element_size()
            if self.pending_bytes >= self.bucket_bytes:
                self.flush()
        return hook

    def _unit_done(self, u: int) -> None:
        got = self.arrived.pop(u)
        if self.final:
            self.pending = got
            self.flush()
        if self.on_unit is not None:
            self.on_unit(u)

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
        whole = sum(p.grad.numel() * p.grad.element_size() for p in st.params if p.grad is not None)
        self.peak = max(self.peak, self.held_bytes() + whole + (rows.numel() + mine.numel()) * rows.element_size())
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
        """The units whose gradients did not all come (parameters unused this iteration), in
        unit order on every rank; then the last bucket."""
        for u in sorted(self.arrived):
            self._unit_done(u)
        self.flush()
        if self.shards is not None:
            self.shards.release_all()

    def held_bytes(self) -> int:
        """The gradient slices this rank keeps."""
        return sum(t.numel() * t.element_size() for t in self.step.scattered if t is not None)

    def peak_bytes(self) -> int:
        """The most gradient bytes held at once: the slices so far, the whole gradients (a
        bucket's, and earlier microbatches' not yet scattered), a bucket's rows and the received
        row."""
        return max(self.peak, self.held_bytes())

    def param_peak_bytes(self) -> int | None:
        """ZeRO-3: the most parameter bytes held at once (ParamShards); else None (all of them)."""
        return None if self.shards is None else self.shards.peak_bytes()


class _Saved:
    """What autograd keeps of a ZeRO-3 parameter (or a view of it) saved for backward."""
    __slots__ = ("unit", "t")

    def __init__(self, unit: int, t: torch.Tensor):
        self.unit, self.t = unit, t


class ParamShards:
    """ZeRO stage 3 over `step` (a ShardedStep with `own` slices): the parameters' storage is
    freed except while a unit (a list of parameter indices, in forward order) is in use.
    `gather(u)` all-gathers unit u from every rank's slices into its parameters and starts the
    next unit's gather (the one before it in backward); `release(u)` frees them. The stage's graph
    calls both around the unit's layers (`wire`); in backward, the saved-tensor hooks (`pack`,
    `unpack`) gather a unit again when autograd first needs one of its parameters, and the
    gradient hook (GradScatter's `on_unit`) releases it once its gradients are in."""

    def __init__(self, step: ShardedStep, units: list[list[int]]):
        self.step, self.units, self.n = step, units, step.n
        params = step.params
        storages = set()
        for p in params:
            st = p.untyped_storage()
            if p.storage_offset() or st.nbytes() != p.numel() * p.element_size() or st.data_ptr() in storages:
                raise ValueError("shard.stage 3 needs every parameter in a storage of its own; "
                                 f"a parameter of shape {tuple(p.shape)} shares or views one")
            storages.add(st.data_ptr())
        self.order = list(range(len(units)))          # forward order (set by `wire`)
        self.bytes = [sum(params[i].numel() * params[i].element_size() for i in idx) for idx in units]
        self.resident: dict[int, list[int]] = {}      # unit -> its parameters' storage pointers
        self.ptrs: dict[int, int] = {}                # storage pointer -> unit, while resident
        self.inflight: dict[int, tuple] = {}          # unit -> (work, received) of a started gather
        self.held = sum(t.numel() * t.element_size() for t in step.slices)   # slices, then resident units
        self.peak = self.held
        self.pinned = False                           # inside `whole`
        for u in range(len(units)):
            self._free(u)

    def _free(self, u: int) -> None:
        for i in self.units[u]:
            self.step.params[i].untyped_storage().resize_(0)

    def _start(self, u: int) -> None:
        if u in self.resident or u in self.inflight:
            return
        st = self.step
        send = torch.cat([self._mine(i) for i in self.units[u]])
        got = [torch.empty_like(send) for _ in range(self.n)]
        work = dist.all_gather(got, send, group=st.group, async_op=True)
        self.inflight[u] = (work, got)
        self._count(sum(t.numel() * t.element_size() for t in got))

    def _mine(self, i: int) -> torch.Tensor:
        """Parameter i's slice on this rank, padded to its chunk."""
        st, c = self.step, self.step.chunk[i]
        a, b = st.spans[i]
        out = torch.zeros(c, dtype=st.params[i].dtype, device=st.params[i].device)
        if b > a:
            out[:b - a].copy_(st.slices[st.mine.index(i)])
        return out

    def _count(self, extra: int) -> None:
        self.peak = max(self.peak, self.held + extra + sum(
            t.numel() * t.element_size() for _, got in self.inflight.values() for t in got))

    @contextlib.contextmanager
    def whole(self):
        """Every parameter whole while inside (evaluation, saving): every unit gathered, in unit
        order on every rank of the group, and none freed until the end."""
        for u in range(len(self.units)):
            self.gather(u)
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False
            self.release_all()

    @torch.no_grad()
    def gather(self, u: int, backward: bool = False) -> None:
        if self.pinned:
            return
        if u not in self.resident:
            self._start(u)
            work, got = self.inflight.pop(u)
            work.wait()
            st, at, ptrs = self.step, 0, []
            for i in self.units[u]:
                p, c = st.params[i], st.chunk[i]
                p.untyped_storage().resize_(p.numel() * p.element_size())
                flat = p.view(-1)
                for r, buf in enumerate(got):
                    a, b = min(r * c, p.numel()), min((r + 1) * c, p.numel())
                    if b > a:
                        flat[a:b].copy_(buf[at:at + b - a])
                at += c
                ptrs.append(p.untyped_storage().data_ptr())
            self.resident[u] = ptrs
            self.ptrs.update(dict.fromkeys(ptrs, u))
            self.held += self.bytes[u]
            self._count(0)
        k = self.order.index(u) + (-1 if backward else 1)
        if 0 <= k < len(self.order):
            self._start(self.order[k])

    def release(self, u: int) -> None:
        if self.pinned:
            return
        ptrs = self.resident.pop(u, None)
        if ptrs is None:
            return
        for ptr in ptrs:
            self.ptrs.pop(ptr, None)
        self._free(u)
        self.held -= self.bytes[u]

    def release_all(self) -> None:
        for u in list(self.inflight):
            self.inflight.pop(u)[0].wait()
        for u in list(self.resident):
            self.release(u)

    def pack(self, t: torch.Tensor):
        """A handle for a resident parameter's storage (a parameter or a view of one), else None."""
        try:
            u = self.ptrs.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        return None if u is None else _Saved(u, t)

    def unpack(self, x):
        if isinstance(x, _Saved):
            self.gather(x.unit, backward=True)
            return x.t
        return x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t) or t, self.unpack)

    def peak_bytes(self) -> int:
        """The most parameter bytes held at once: the slices, the resident units and the
        gathers under way."""
        return self.peak


class _Call(torch.nn.Module):
    """A graph node that calls fn(arg) (ParamShards.gather / release) and returns nothing."""

    def __init__(self, fn, arg: int):
        super().__init__()
        self.fn, self.arg = fn, arg

    def forward(self) -> None:
        self.fn(self.arg)


def wire(stage, shards: ParamShards, unit_of: dict[int, int]) -> None:
    """Insert into `stage`'s graph (a hetplan.planner.workload.partition.StageModule) a gather of
    each unit before the first node of the layers that use its parameters and a release after
    their last node; `unit_of`: id(parameter) -> unit. Sets the shards' forward order."""
    from torch import fx
    from hetplan.planner.workload.partition import resolve_attr
    nodes = list(stage.graph.nodes)
    at = {n: k for k, n in enumerate(nodes)}
    layer = stage.node_layer
    layers_of: dict[int, set[int]] = {}
    for n in nodes:
        if n.op != "get_attr":
            continue
        u = unit_of.get(id(resolve_attr(stage, stage, n.target)))
        if u is not None:
            layers_of.setdefault(u, set()).update(layer[x.name] for x in n.users if x.name in layer)
    span = {}
    for u, ls in layers_of.items():
        mine = [at[n] for n in nodes if layer.get(n.name) in ls]
        span[u] = (min(mine), max(mine))
    g: fx.Graph = stage.graph
    for u, (a, b) in span.items():
        for name, fn, before, pos in ((f"_zero3_gather_{u}", shards.gather, True, a),
                                      (f"_zero3_release_{u}", shards.release, False, b)):
            stage.add_submodule(name, _Call(fn, u))
            ctx = g.inserting_before(nodes[pos]) if before else g.inserting_after(nodes[pos])
            with ctx:
                g.call_module(name)
    g.lint()
    stage.recompile()
    shards.order = sorted(span, key=lambda u: span[u]) + [u for u in range(len(shards.units)) if u not in span]


def check_runs(plan, file: str) -> None:
    """InputError unless the runtime runs the plan's sharding: one-device stages that are not
    interleaved, each stage's replicas on one device kind."""
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
