"""Sharded data parallel (plan `shard`, ZeRO): the N replicas of a stage share its optimizer
state (stage 1), gradients (stage 2) and parameters (stage 3) in equal parts, whatever the
batch shares.

`ShardedStep` (stages 1, 2): rank k steps elements [k·c, (k+1)·c) of every tensor
(c = ceil(numel / N)) through views into the parameters, then one all-gather a step gives every
replica the whole update; exact for element-wise optimizers
(hetplan.planner.files.optimizer_spec.ELEMENTWISE).
`GradScatter` (stage 2): the final gradients (the last backward's) are reduce-scattered with SUM
(the losses already carry the shares) a bucket at a time into this rank's slices, the whole
gradients freed.
`ParamShards` (stage 3, FSDP's flat parameters): each unit (a gradient bucket) is one flat
buffer, rank k keeping chunk k; it is all-gathered before its layers run, forward and backward,
the next one prefetched, and freed after them; its gradient reduce-scattered as stage 2's.
Checkpoints hold whole tensors (`whole`, `split`). A group of a CPU and a GPU (`staged`) runs
every collective through host memory.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

# torch 2.13 names them *_single (the *_tensor names warn); torch 2.11 has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def launch_scatter(rows: torch.Tensor, group, staged: bool):
    """Start a SUM reduce-scatter of `rows` (N rows, row k rank k's): (work, what `my_row`
    reads). On gloo an all-reduce of the rows (gloo's reduce-scatter is slower than its
    all-reduce: docs/tuning.md), through host memory where `staged`."""
    if dist.get_backend(group) == "gloo":
        on = rows.cpu() if staged else rows
        return dist.all_reduce(on, group=group, async_op=True), on
    out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
    return reduce_scatter_single(out, rows.reshape(-1), group=group, async_op=True), out


def my_row(work, out: torch.Tensor, k: int, device) -> torch.Tensor:
    """Wait for `launch_scatter`'s work; rank k's row, a tensor of its own on `device`."""
    work.wait()
    return (out[k] if out.dim() == 2 else out).to(device, copy=True)


class ShardedStep:
    """ZeRO stage 1 over `group`'s N ranks: rank k steps elements [k·c, (k+1)·c) of every
    parameter tensor (c = ceil(numel / N), the last slices shorter or empty), through views that
    share the parameters' storage; `gather()` all-gathers every rank's slices (one collective)."""

    own = False         # StageOptimizer: `gather` after the step (ZeRO-3's ParamShards: as units run)

    def __init__(self, params: list[torch.nn.Parameter], group, staged: bool = False):
        """`staged`: the group runs on gloo beside CUDA tensors (a CPU and a GPU sharding a
        stage): every collective goes through host memory (hetplan.runtime.sync.Groups.host_staged)."""
        self.params, self.group, self.staged = params, group, staged
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
        # the gather's copies, each a list for one foreach copy: this rank's slices into `send`,
        # and every other rank's (at its offset in the gathered rows) into the parameters
        offs = [0] + list(itertools.accumulate(self.chunk))[:-1]
        self.send_views = [self.send[offs[i]:offs[i] + self.spans[i][1] - self.spans[i][0]] for i in self.mine]
        self.into, self.from_at = [], []
        for r in range(self.n):
            for i, (p, c) in enumerate(zip(params, self.chunk)):
                a, b = min(r * c, p.numel()), min((r + 1) * c, p.numel())
                if r != self.k and b > a:
                    self.into.append(p.detach().view(-1)[a:b])
                    self.from_at.append((r * len(self.send) + offs[i], b - a))

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
    def whole(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Every parameter's whole tensor (its shape, on the host) of something kept in slices:
        `parts[j]` this rank's of parameter `mine[j]` (None: nothing); one all-gather,
        collective over the group (a checkpoint's optimizer state)."""
        dtype = next((t.dtype for t in parts if t is not None), torch.float32)
        send, at = torch.zeros(sum(self.chunk), dtype=dtype), 0
        own = dict(zip(self.mine, parts))
        for i, (c, (a, b)) in enumerate(zip(self.chunk, self.spans)):
            if own.get(i) is not None:
                send[at:at + b - a].copy_(own[i].reshape(-1))
            at += c
        send = send if self.staged else send.to(self.send.device)
        got = torch.empty(self.n * send.numel(), dtype=send.dtype, device=send.device)
        all_gather_single(got, send, group=self.group)
        rows, out, at = got.view(self.n, -1).cpu(), [], 0
        for p, c in zip(self.params, self.chunk):
            out.append(rows[:, at:at + c].reshape(-1)[:p.numel()].view(p.shape).clone())
            at += c
        return out

    def split(self, wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        """`whole`'s inverse: this rank's slices from whole tensors by parameter."""
        return [wholes[i].reshape(-1)[slice(*self.spans[i])] for i in self.mine]

    @torch.no_grad()
    def gather(self) -> None:
        if self.mine:
            torch._foreach_copy_(self.send_views, self.slices)
        send = self.send.cpu() if self.staged else self.send
        got = torch.empty(self.n * send.numel(), dtype=send.dtype, device=send.device)
        all_gather_single(got, send, group=self.group)
        if self.into:
            got = got.to(self.send.device)
            torch._foreach_copy_(self.into, [got[a:a + n] for a, n in self.from_at])


class GradScatter:
    """ZeRO stage 2 for `step` (a ShardedStep): a hook on every parameter takes its final
    gradient into its bucket (`buckets`: lists of parameter indices, the plan's gradient buckets,
    as the simulator's and ZeRO-3's units; coarse sync: one); a bucket all of whose gradients
    are in, and any left at `finish()` (parameters unused this iteration) in bucket order, is
    reduce-scattered with SUM (the losses already carry the shares) in one collective: every
    tensor's N slices laid out as N rows, each rank receiving its row (on gloo an all-reduce of
    the rows, each rank keeping its own: gloo's reduce-scatter is slower than its all-reduce).
    The whole gradients are freed then. The final gradients are the last backward's
    (`before_backward`, the runner's call before each backward or W pass); earlier microbatches
    accumulate whole gradients as usual. Every rank's hooks fire in the same order, so the
    buckets are launched in the same order."""

    def __init__(self, step: ShardedStep, buckets: list[list[int]]):
        self.step, self.buckets, self.final = step, buckets, False
        step.scattered = [None] * len(step.params)
        self.bucket_of = {i: b for b, idx in enumerate(buckets) for i in idx}
        self.arrived: dict[int, list[int]] = {}   # bucket -> the indices whose final gradient is in
        self.flying: list[tuple] = []   # (work, indices, rows or row, device) of a bucket launched
        self.whole_bytes, self.counted = 0, set()   # whole gradients' bytes held in the last backward, for the peak
        self.peak = 0                   # the most gradient bytes held at once (slices, whole, bucket)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(step.params)]

    def before_backward(self, last_mb: int):
        """The runner's `before_backward`: the backward of `last_mb` makes the final gradients."""
        def enter(mb: int) -> None:
            self.final = mb == last_mb
            if self.final:   # the whole gradients the earlier backwards accumulated
                self.counted = {i for i, p in enumerate(self.step.params) if p.grad is not None}
                self.whole_bytes = sum(self._bytes(i) for i in self.counted)
        return enter

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self.final or p.grad is None:
                return
            if i not in self.counted:
                self.whole_bytes += self._bytes(i)
            b = self.bucket_of[i]
            got = self.arrived.setdefault(b, [])
            got.append(i)
            if len(got) == len(self.buckets[b]):
                self.flush(b)
        return hook

    def _bytes(self, i: int) -> int:
        g = self.step.params[i].grad
        return 0 if g is None else g.numel() * g.element_size()

    @torch.no_grad()
    def flush(self, b: int) -> None:
        """Reduce-scatter bucket b's arrived gradients (launched, not waited for; the bucket
        before it is finished first)."""
        st, idx = self.step, self.arrived.pop(b, [])
        if not idx:
            return
        parts = []
        for i in idx:                     # each gradient as N rows of its chunk, padded
            flat, c = st.params[i].grad.reshape(-1), st.chunk[i]
            pad = st.n * c - flat.numel()
            parts.append((torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(st.n, c))
        rows = torch.cat(parts, dim=1)
        self.whole_bytes -= sum(self._bytes(i) for i in idx)
        for i in idx:                     # the whole gradients are in the rows now
            st.params[i].grad = None
        # launched, not waited for: backward goes on (a blocking collective per bucket made each
        # rank wait for the other's backward to reach it, bucket after bucket); at most one
        # bucket's rows are in flight
        work, out = launch_scatter(rows, st.group, st.staged)
        flying = sum(t.numel() * t.element_size() for _, _, t, _ in self.flying)
        self.peak = max(self.peak, self.held_bytes() + self.whole_bytes + flying + 2 * rows.numel() * rows.element_size())
        self._land()
        self.flying.append((work, idx, out, rows.device))

    def _land(self) -> None:
        """Wait for the bucket in flight and keep this rank's row of it."""
        st = self.step
        for work, idx, out, device in self.flying:
            mine = my_row(work, out, st.k, device)
            col = 0
            for i in idx:
                a, b = st.spans[i]
                st.scattered[i] = mine[col:col + b - a] if b > a else None
                col += st.chunk[i]
        self.flying = []

    def begin(self) -> None:          # GradSync's interface
        self.final = False

    def finish(self) -> None:
        for b in sorted(self.arrived):
            self.flush(b)
        self._land()

    def held_bytes(self) -> int:
        """The gradient slices this rank keeps."""
        return sum(t.numel() * t.element_size() for t in self.step.scattered if t is not None)

    def peak_bytes(self) -> int:
        """The most gradient bytes held at once: the slices so far, the whole gradients (a
        bucket's, and earlier microbatches' not yet scattered), a bucket's rows and the received
        row."""
        return max(self.peak, self.held_bytes())

    def param_peak_bytes(self) -> None:
        """All of the parameters (ZeRO-3's ParamShards: fewer)."""
        return None


class _Saved:
    """What autograd keeps of a ZeRO-3 parameter (or a view of it) saved for backward."""
    __slots__ = ("unit", "t")

    def __init__(self, unit: int, t: torch.Tensor):
        self.unit, self.t = unit, t


class ParamShards:
    """ZeRO stage 3 over `group`'s N ranks, the sync and the sharded state of a stage (FSDP's
    flat parameters): each unit (a list of parameter indices, one dtype; a gradient bucket)
    is one flat buffer the unit's parameters are views of, its storage freed except while the
    unit is in use; rank k keeps chunk k of it (`slices[u]`, 1/N of the unit, the last padded),
    which the optimizer steps. `gather(u)` regrows the buffer and all-gathers every rank's chunk
    straight into it, then starts the next unit's gather (the one before it in backward);
    `release(u)` frees it. The stage's graph calls both around the unit's layers (`wire`); in
    backward the saved-tensor hooks (`pack`, `unpack`) gather a unit again when autograd first
    needs one of its parameters; a unit all of whose gradients are in is released and, in the
    last backward (`before_backward`), its flat gradient reduce-scattered with SUM (on gloo an
    all-reduce, each rank keeping its chunk) into `scattered[u]`."""

    own = True          # StageOptimizer: the parameters are gathered a unit at a time, not after the step

    def __init__(self, params: list[torch.nn.Parameter], group, units: list[list[int]], staged: bool = False):
        """`staged`: as ShardedStep's (each gather lands in host memory, then is copied in)."""
        self.params, self.group, self.units, self.staged = params, group, units, staged
        self.n, self.k = dist.get_world_size(group), dist.get_rank(group)
        self.flat, self.slices, self.offsets, self.chunk = [], [], [], []
        for idx in units:
            ps = [params[i] for i in idx]
            if len({(p.dtype, p.device) for p in ps}) > 1:
                raise ValueError("shard.stage 3 needs the parameters of a gradient bucket in one dtype on one "
                                 f"device; got {sorted({str(p.dtype) for p in ps})}")
            total = sum(p.numel() for p in ps)
            c = -(-total // self.n)
            flat = torch.zeros(c * self.n, dtype=ps[0].dtype, device=ps[0].device)
            offs, at = [], 0
            with torch.no_grad():
                for p in ps:
                    flat[at:at + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[at:at + p.numel()].view(p.shape)
                    offs.append(at)
                    at += p.numel()
            self.flat.append(flat)
            self.offsets.append(offs)
            self.chunk.append(c)
            self.slices.append(flat[self.k * c:(self.k + 1) * c].clone())
        self.bytes = [f.numel() * f.element_size() for f in self.flat]
        self.order = list(range(len(units)))          # forward order (set by `wire`)
        self.resident: dict[int, int] = {}            # unit -> its buffer's storage pointer
        self.ptrs: dict[int, int] = {}                # storage pointer -> unit, while resident
        self.inflight: dict[int, tuple] = {}          # unit -> (work, host buffer or None) of a started gather
        self.scattered: list[torch.Tensor | None] = [None] * len(units)
        self.flying: list[tuple] = []                 # (work, unit, flat or chunk) of a launched scatter
        self.arrived: dict[int, int] = {}             # unit -> how many of its gradients are in
        self.unit_of = {i: u for u, idx in enumerate(units) for i in idx}
        self.final, self.pinned = False, False        # the last backward; inside `unsharded`
        self.held = sum(t.numel() * t.element_size() for t in self.slices)   # slices, then resident units
        self.peak = self.held
        self.grad_peak = 0
        self.with_grad: set[int] = set()              # parameters holding a whole gradient, and their bytes
        self.whole_bytes = 0
        for u in range(len(units)):
            self.flat[u].untyped_storage().resize_(0)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    # --- parameters ------------------------------------------------------------------------
    def _start(self, u: int) -> None:
        if u in self.resident or u in self.inflight:
            return
        f = self.flat[u]
        f.untyped_storage().resize_(self.bytes[u])
        into = torch.empty(f.numel(), dtype=f.dtype) if self.staged else None
        work = all_gather_single(f if into is None else into, self.slices[u].cpu() if self.staged else self.slices[u],
                                 group=self.group, async_op=True)
        self.inflight[u] = (work, into)
        self.held += self.bytes[u]
        self.peak = max(self.peak, self.held)

    @torch.no_grad()
    def gather(self, u: int, backward: bool = False) -> None:
        if self.pinned:
            return
        if u not in self.resident:
            self._start(u)
            self._land(u)
            ptr = self.flat[u].untyped_storage().data_ptr()
            self.resident[u] = ptr
            self.ptrs[ptr] = u
        k = self.order.index(u) + (-1 if backward else 1)
        if 0 <= k < len(self.order):
            self._start(self.order[k])

    def release(self, u: int) -> None:
        if self.pinned or u not in self.resident:
            return
        self.ptrs.pop(self.resident.pop(u), None)
        self.flat[u].untyped_storage().resize_(0)
        self.held -= self.bytes[u]

    def _land(self, u: int) -> None:
        work, into = self.inflight.pop(u)
        work.wait()
        if into is not None:
            self.flat[u].copy_(into)

    def release_all(self) -> None:
        for u in list(self.inflight):
            self._land(u)
            self.resident[u] = self.flat[u].untyped_storage().data_ptr()
        for u in list(self.resident):
            self.release(u)

    @contextlib.contextmanager
    def unsharded(self):
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

    def pack(self, t: torch.Tensor):
        """A handle for a resident unit's storage (a parameter or a view of one), else None."""
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

    # --- gradients (GradSync's interface) ---------------------------------------------------
    def before_backward(self, last_mb: int):
        """The runner's `before_backward`: the backward of `last_mb` makes the final gradients."""
        def enter(mb: int) -> None:
            for u in sorted(self.arrived):      # units an earlier backward left incomplete (unused)
                self._unit_done(u, scatter=False)
            self.final = mb == last_mb
        return enter

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if i not in self.with_grad:
                self.with_grad.add(i)
                self.whole_bytes += p.grad.numel() * p.grad.element_size()
            u = self.unit_of[i]
            self.arrived[u] = self.arrived.get(u, 0) + 1
            if self.arrived[u] == len(self.units[u]):
                self._unit_done(u, self.final)
        return hook

    @torch.no_grad()
    def _unit_done(self, u: int, scatter: bool) -> None:
        self.arrived.pop(u, None)
        if scatter:
            ps = [self.params[i] for i in self.units[u]]
            pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps]
            pad = self.chunk[u] * self.n - sum(p.numel() for p in ps)
            flat = torch.cat(pieces + [ps[0].new_zeros(pad)] if pad else pieces)
            for i, p in zip(self.units[u], ps):   # the whole gradients are in the flat buffer now
                if i in self.with_grad:
                    self.with_grad.discard(i)
                    self.whole_bytes -= p.grad.numel() * p.grad.element_size()
                p.grad = None
            # launched, not waited for (as GradScatter's buckets): one unit in flight
            work, out = launch_scatter(flat.view(self.n, -1), self.group, self.staged)
            flying = sum(t.numel() * t.element_size() for _, _, t in self.flying)
            self.grad_peak = max(self.grad_peak, self.grad_bytes() + self.whole_bytes + flying
                                 + (flat.numel() + self.slices[u].numel()) * flat.element_size())
            self._land_grads()
            self.flying.append((work, u, out))
        self.release(u)

    def _land_grads(self) -> None:
        """Wait for the unit in flight and keep this rank's chunk of its gradient."""
        for work, u, out in self.flying:
            self.scattered[u] = my_row(work, out, self.k, self.slices[u].device)
        self.flying = []

    def begin(self) -> None:
        self.final = False
        self.with_grad, self.whole_bytes = set(), 0       # the optimizer's zero_grad has just run

    def finish(self) -> None:
        """The units whose gradients did not all come (parameters unused this iteration), in
        unit order on every rank; then every unit freed."""
        for u in sorted(self.arrived):
            self._unit_done(u, self.final)
        self._land_grads()
        self.release_all()

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scattered if t is not None)

    def peak_bytes(self) -> int:
        """The most gradient bytes held at once: the chunks so far, the whole gradients, a unit's
        flat gradient and the received chunk."""
        return max(self.grad_peak, self.grad_bytes())

    def param_peak_bytes(self) -> int:
        """The most parameter bytes held at once: the chunks, and the units resident or being
        gathered."""
        return self.peak

    # --- the optimizer's and checkpoints' side (ShardedStep's interface) --------------------
    def take_grads(self) -> None:
        for s, g in zip(self.slices, self.scattered):
            s.grad = g

    def whole(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Every parameter's whole tensor (on the host) of something kept like the chunks
        (`parts[u]`: this rank's of unit u); an all-gather per unit, collective over the group."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for u, (idx, part) in enumerate(zip(self.units, parts)):
            part = part.cpu() if self.staged else part.contiguous()
            got = torch.empty(self.chunk[u] * self.n, dtype=part.dtype, device=part.device)
            all_gather_single(got, part, group=self.group)
            got = got.cpu()
            for i, at in zip(idx, self.offsets[u]):
                p = self.params[i]
                out[i] = got[at:at + p.numel()].view(p.shape).clone()
        return out

    def split(self, wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        """`whole`'s inverse: this rank's chunk of every unit from whole tensors by parameter."""
        out = []
        for u, idx in enumerate(self.units):
            flat = torch.zeros(self.chunk[u] * self.n, dtype=self.slices[u].dtype)
            for i, at in zip(idx, self.offsets[u]):
                flat[at:at + self.params[i].numel()].copy_(wholes[i].reshape(-1))
            out.append(flat[self.k * self.chunk[u]:(self.k + 1) * self.chunk[u]])
        return out


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
    """InputError unless the runtime runs the plan's sharding: stages that are not interleaved."""
    from hetplan.planner.files.io import InputError
    if plan.shard and plan.schedule == "interleaved-1f1b":
        raise InputError(f"{file}: schedule: expected a schedule other than \"interleaved-1f1b\" with "
                         f"shard.stage {plan.shard} in this version")
