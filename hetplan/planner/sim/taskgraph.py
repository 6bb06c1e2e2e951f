"""The task graph of one plan shape: tasks with resources, dependencies and duration recipes.

Built by `hetplan.planner.sim.build.Builder` once per plan shape (everything but batch sizes) and
run by `hetplan.planner.sim.eventloop.run` with durations evaluated for each plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from hetplan.planner.sim import fastloop

# Per-device statistics a task graph counts (TaskGraph.count): compute time, then communication.
TIMED = ("fwd_s", "bwd_s", "optimizer_s")
COUNTED = TIMED + ("comm_s",)


# --- duration recipes: what a task's duration depends on, evaluated per plan -------------------
# Frozen dataclasses, not NamedTuples: recipes are deduplicated by equality, and tuple equality
# ignores the type (a forward and a backward over the same range would share one recipe).
# `seconds(cost, graph, mbs)`: the duration for microbatch sizes mbs (one per replica).

@dataclass(frozen=True, slots=True)
class Const:
    """A duration that does not depend on the batch (fixed-size copies, all-reduces, steps)."""
    duration_s: float

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return self.duration_s


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Forward (phase "fwd") or backward ("bwd") of layers [start, end) on device, at the
    replica's microbatch: cost.fwd_s / cost.bwd_s, or a split backward's input-gradient ("inp":
    cost.bwd_input_s) or weight-gradient part ("wgt": cost.bwd_weight_s); plus issuing an isend
    per tensor of the messages it produces (`sends` tensors) and posting an irecv per tensor of
    those it consumes (`receives`) on the same thread (cost.message_issue_s; build.stage_messages
    counts them), and, where the task starts a schedule action (`action`; a backward
    cut into bucket chunks is one action), the runtime's own work per action
    (cost.action_overhead_s). A backward or W task with `accumulates` adds its weight gradients
    into those of an earlier microbatch (cost.grad_accumulate_s). A forward of the first or last
    layers copies the microbatch's data to an accelerator (cost.data_copy_s)."""
    phase: str
    replica: int
    device: str
    start: int
    end: int
    sends: int = 0
    receives: int = 0
    action: bool = True
    accumulates: bool = False

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        if self.phase == "fwd":
            t = cost.fwd_s(self.device, self.start, self.end, mbs[self.replica])
            if self.start == 0 or self.end == graph.num_layers:
                t += cost.data_copy_s(self.device, self.start, self.end, mbs[self.replica])
        elif self.phase == "bwd":
            t = cost.bwd_s(self.device, self.start, self.end, mbs[self.replica], call=self.action)
        elif self.phase == "inp":
            t = cost.bwd_input_s(self.device, self.start, self.end, mbs[self.replica])
        else:
            t = cost.bwd_weight_s(self.device, self.start, self.end, mbs[self.replica])
        if self.accumulates:
            t += cost.grad_accumulate_s(self.device, self.start, self.end)
        if self.sends or self.receives:
            send_s, post_s = cost.message_issue_s(self.device)
            t += self.sends * send_s + self.receives * post_s
        return t + cost.action_overhead_s(self.device) if self.action else t


@dataclass(frozen=True, slots=True)
class SyncWork:
    """A compute task plus the gradient exchange's own work on the same thread
    (hetplan.planner.cost.grad_sync): torch DDP's per forward (`ddp_forward`: cost.ddp_forward_s) and
    copying `copied_bytes` of fresh gradients into bucket buffers (cost.grad_copy_s)."""
    inner: Any
    device: str
    ddp_forward: bool = False
    copied_bytes: float = 0.0

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        t = self.inner.seconds(cost, graph, mbs) + cost.grad_copy_s(self.device, self.copied_bytes)
        return t + cost.ddp_forward_s(self.device) if self.ddp_forward else t


@dataclass(frozen=True, slots=True)
class Gathered:
    """A ZeRO-3 pass (hetplan.runtime.shard.ParamShards): `inner` waits for the first unit's
    all-gather (`first_s`); the others (`rest_s`, prefetched one ahead) run beside the pass's
    compute, `inner` and the pieces `alongside` it (a backward's later chunks), and hold it up
    only where they take longer."""
    inner: Any
    first_s: float
    rest_s: float
    alongside: tuple = ()

    @property
    def replica(self):           # its value depends on the replica's microbatch as inner's does
        return getattr(self.inner, "replica", None)

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        t = self.inner.seconds(cost, graph, mbs)
        beside = t + sum(a.seconds(cost, graph, mbs) for a in self.alongside)
        return t + self.first_s + max(0.0, self.rest_s - beside)


@dataclass(frozen=True, slots=True)
class Recompute:
    """Backward of layers [lo, hi) plus the forward of the stage's layers [start, end) again
    (activation recomputation), at the replica's microbatch; messages and the action's own
    work as LayerRange's (it is always a backward's first task)."""
    replica: int
    device: str
    lo: int
    hi: int
    start: int
    end: int
    sends: int = 0
    receives: int = 0
    accumulates: bool = False

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        mb = mbs[self.replica]
        t = cost.bwd_s(self.device, self.lo, self.hi, mb) + cost.fwd_s(self.device, self.start, self.end, mb)
        if self.accumulates:
            t += cost.grad_accumulate_s(self.device, self.lo, self.hi)
        if self.sends or self.receives:
            send_s, post_s = cost.message_issue_s(self.device)
            t += self.sends * send_s + self.receives * post_s
        return t + cost.action_overhead_s(self.device)   # a backward's first task: one action


@dataclass(frozen=True, slots=True)
class HopRecipe:
    """One link hop of the activation (or its gradient) at cut `cut`, at the replica's
    microbatch: latency_s + cut_bytes_at(cut, mb) / bandwidth."""
    replica: int
    cut: int
    latency_s: float
    bandwidth_bytes_per_s: float

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return self.latency_s + graph.cut_bytes_at(self.cut, mbs[self.replica]) / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class HeldSend:
    """How long a message whose receive is posted while its sender computes waits to leave
    (cost.held_send_s), at the replica's microbatch: `window` are the recipes of the sender's
    tasks from its isend to its next wait."""
    replica: int
    device: str
    window: tuple

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return cost.held_send_s(self.device, sum(r.seconds(cost, graph, mbs) for r in self.window))


@dataclass(frozen=True, slots=True)
class SavedCopy:
    """One microbatch's saved activations of layers [start, end) copied between a device and
    host memory (offload_activations): latency_s + graph.saved_bytes_at(...) / bytes_per_s."""
    replica: int
    start: int
    end: int
    latency_s: float
    bytes_per_s: float

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return self.latency_s + graph.saved_bytes_at(self.start, self.end, mbs[self.replica]) / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class SplitRange:
    """Forward or backward of a tensor-split stage of layers [start, end) over `split`'s
    (device, share) pairs, at the replica's microbatch: cost.tensor_stage_s (the slowest
    device per layer, plus the pairs' all-reduces); messages and the action's own work as
    LayerRange's, on the first device of the split."""
    phase: str
    replica: int
    split: tuple[tuple[str, float], ...]
    start: int
    end: int
    sends: int = 0
    receives: int = 0

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        t = cost.tensor_stage_s(self.phase, self.split, self.start, self.end, mbs[self.replica])
        if self.sends or self.receives:
            send_s, post_s = cost.message_issue_s(self.split[0][0])
            t += self.sends * send_s + self.receives * post_s
        return t + cost.action_overhead_s(self.split[0][0])   # one chunk: one action

    def part(self, device: str) -> "SplitPart":
        return SplitPart(self.phase, self.replica, self.split, device, self.start, self.end)

    def sync(self) -> "SplitSync":
        return SplitSync(self.phase, self.replica, tuple(d for d, _ in self.split), self.start, self.end)


@dataclass(frozen=True, slots=True)
class SplitPart:
    """One device's own compute in a SplitRange (its statistics): cost.tensor_device_s."""
    phase: str
    replica: int
    split: tuple[tuple[str, float], ...]
    device: str
    start: int
    end: int

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return cost.tensor_device_s(self.phase, self.split, self.device, self.start, self.end, mbs[self.replica])


@dataclass(frozen=True, slots=True)
class SplitSync:
    """The all-reduces of a SplitRange (its devices' comm_s statistics): cost.tensor_sync_s."""
    phase: str
    replica: int
    devices: tuple[str, ...]
    start: int
    end: int

    def seconds(self, cost: Any, graph: Any, mbs: list[float]) -> float:
        return cost.tensor_sync_s(self.phase, self.devices, self.start, self.end, mbs[self.replica])


Recipe = Const | LayerRange | SyncWork | Gathered | Recompute | HopRecipe | HeldSend | SavedCopy | SplitRange | SplitPart | SplitSync


# --- names of routes and tasks ------------------------------------------------------------------

class RouteHop(NamedTuple):
    """One link direction on a route: the resource id of its queue, and the link's figures."""
    resource: int
    latency_s: float
    bandwidth_bytes_per_s: float
    lane: str   # "a->b", the trace's lane


class ComputeLabel(NamedTuple):
    """A compute task: replica and schedule action; prints as "r:1F0"."""
    replica: int
    action: Any   # hetplan.planner.files.schedule.Action

    def __str__(self) -> str:
        return f"{self.replica}:{self.action}"


class TransferLabel(NamedTuple):
    """An activation ("act") or gradient ("grad") transfer between two stages of a replica for
    one microbatch; prints as "r:act s0->s1 mb i"."""
    what: str
    replica: int
    src_stage: int
    dst_stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.replica}:{self.what} {self.src_stage}->{self.dst_stage} mb{self.microbatch}"


class TaskMeta(NamedTuple):
    """What the trace shows of a task: its label (a string or a label above), lane and kind."""
    label: Any
    lane: str
    kind: str


class EngineState:
    """One graph's engines' caches: its runs so far, the fixed-order pass (False where it does
    not apply), the compiled loop's arrays; `coupling`: a delta simulation's coupling graph."""

    __slots__ = ("runs", "static", "fast", "coupling")

    def __init__(self, coupling: bool = False):
        self.runs, self.static, self.fast, self.coupling = 0, None, None, coupling


class ShapeCache:
    """What the simulator keeps for a plan shape besides its graph: recipe values that depend on
    no replica (None elsewhere), per replica its recipes and their values per microbatch size,
    the recipes of other kinds (evaluated for every plan); the CPU workers slowed by contention
    (hetplan.planner.sim.contention.contended), per device its buffer broadcasts, the iteration overhead
    (cost.iteration_overhead_s of the plan's devices and the broadcasts'); the statistics' rows
    (hetplan.planner.sim.simulator.StatRows); dkey as an array, once run; the delta build's `Delta`
    (hetplan.planner.sim.delta; False where it does not apply, None: not built)."""

    __slots__ = ("fixed", "by_replica", "unkept", "contended", "buffer_s", "overhead_s", "stat_rows", "dkey_array",
                 "delta")

    def __init__(self):
        self.fixed: list[float | None] | None = None
        self.by_replica: list[tuple[list[int], dict[float, list[float]]]] | None = None
        self.unkept: list[int] = []
        self.contended: dict[str, list[str]] | None = None
        self.buffer_s: dict[str, float] = {}
        self.overhead_s = 0.0
        self.stat_rows = None
        self.dkey_array: np.ndarray | None = None
        self.delta = None


class TaskGraph:
    """A plan shape's task graph without durations: parallel lists indexed by task id.

    A task's duration is `values[dkey[t]]`, where `values` are evaluated per plan from the
    few distinct `recipes` (see `Simulator._evaluate`): plans that differ only in batch sizes share the
    structure, so a search that moves batch fractions rebuilds nothing. `stat_seq` keeps, per
    (device, statistic), the value indices in the order they are added, so the per-device sums
    come out bit for bit as if accumulated while building.
    """

    def __init__(self, trace: bool):
        self.dkey: list[int] = []
        self.res: list[tuple[int, ...]] = []
        # each task's successors (`succ`); a stamped block's are None until first asked for
        # (the compiled loop takes `arrays`), then its template's tuples and the edges added since
        self._succ: list[tuple[int, ...] | None] = []
        self._pending = False
        self.ndeps: list[int] = []
        self.meta: list[TaskMeta | None] | None = [] if trace else None
        self.recipes: list[Recipe] = []
        self._recipe_id: dict[Recipe, int] = {}
        self.stat_seq: dict[tuple[str, str], list[int]] = {}
        # replicas' counts where their values came as blocks (`block`): per (device, statistic)
        # arrays of value indices, counted before that statistic's `stat_seq`
        self.stat_blocks: dict[tuple[str, str], list[np.ndarray]] = {}
        self.value_blocks: list[tuple[int, tuple[Recipe, ...], int]] = []   # (first index, recipes, replica)
        self.devices: tuple[str, ...] = ()
        self.shared_res: tuple[int, ...] = ()   # resources of multi-resource tasks (all-reduces)
        # Per replica (see Simulator._like): its task ids; its structure (its recipes and
        # pattern: `replica_recipes`; the resources its tasks use: `replica_resources`).
        self.replica_tasks: list[list[int]] = []
        self.replica_shape: list[tuple] = []
        # the same tasks as arrays are made from (`arrays`): the stamped blocks (first task, its
        # template, each task's one resource; None once a block came without them), the tasks
        # added one by one, and the edges added to earlier tasks (add's deps, wire) in order
        self.blocks: list[tuple[int, Any, np.ndarray]] | None = []
        self.added: list[int] = []
        self.extra: list[tuple[int, int]] = []
        self.sync_res: set[int] = set()          # resources of the gradient all-reduces
        self.memory_bound: set[int] = set()      # optimizer steps (hetplan.planner.sim.contention.contend)
        self.collapsible = False
        self._ghost: list[int] | None = None
        self.wake: dict[int, float] | None = None   # receivers' wake-ups (Simulator._wakes)
        self.state = EngineState()   # the graph engines' caches (hetplan.planner.sim.engines)
        self.cache = ShapeCache()    # the simulator's, for the plan shape (hetplan.planner.sim.simulator)
        self.n_res = 0   # the resources its tasks may hold (the simulator's), set once built
        self.parts: list[tuple] = []   # a delta build's replicas (hetplan.planner.sim.build.Builder.releases)
        # a PipeDream / 2BW stream (hetplan.planner.sim.build.Builder.stream): per stage, its last task
        # of each iteration
        self.iteration_ends: list[list[int]] | None = None

    def begin_replica(self, shape: tuple, like: list[int] | None) -> None:
        """Tasks added until `end_replica` are this replica's; with `like` (the task ids of an
        identical, independent replica) no task is created: `add` hands back like's ids in
        order, `wire` does nothing, and only the statistics are counted."""
        self._ghost, self._ghost_pos, self._first = like, 0, len(self.dkey)
        self.replica_shape.append(shape)

    def end_replica(self) -> None:
        if self._ghost is not None:
            self.replica_tasks.append(self._ghost)
            self._ghost = None
            return
        first = self._first
        self.replica_tasks.append(list(range(first, len(self.dkey))))

    def replica_resources(self, r: int) -> set[int]:
        """The resources replica r's tasks use."""
        tasks = self.replica_tasks[r]
        return set().union(*self.res[tasks[0]:tasks[-1] + 1]) if tasks else set()

    def replica_recipes(self, r: int) -> tuple[list[int], tuple[int, ...]]:
        """Replica r's duration recipes in order of first use, and each of its tasks' recipe as
        an index into them (Simulator._like); r built, not collapsed."""
        tasks = self.replica_tasks[r]
        dkey = self.dkey[tasks[0]:tasks[-1] + 1] if tasks else []
        recipes = list(dict.fromkeys(dkey))
        local = dict(zip(recipes, range(len(recipes))))
        return recipes, tuple(map(local.__getitem__, dkey))

    def wire(self, t: int, v: int) -> None:
        """Task v also waits for task t."""
        if self._ghost is None:
            if self._succ[t] is not None:
                self._succ[t] += (v,)
            self.ndeps[v] += 1
            self.extra.append((t, v))

    def value(self, recipe: Recipe) -> int:
        """Index of a duration recipe (equal recipes share one index)."""
        k = self._recipe_id.get(recipe)
        if k is None:
            k = self._recipe_id[recipe] = len(self.recipes)
            self.recipes.append(recipe)
        return k

    def block(self, recipes: tuple[Recipe, ...], replica: int) -> int:
        """Adds `recipes` as values of their own, not shared with equal recipes elsewhere (a
        replica's: hetplan.planner.sim.build.Builder.blocks; each a Const or on that replica's
        microbatch); returns the first's index."""
        base = len(self.recipes)
        self.recipes += recipes
        self.value_blocks.append((base, recipes, replica))
        return base

    def count(self, device: str, stat: str, k: int) -> None:
        self.stat_seq[(device, stat)].append(k)

    def stamp(self, dkey: list[int], res: list[tuple[int, ...]], succ: Callable[[int], list[tuple[int, ...]]],
              ndeps: tuple[int, ...], meta: list[TaskMeta] | None, block: tuple[Any, np.ndarray] | None = None
              ) -> list[int]:
        """Adds a block of tasks at once (hetplan.planner.sim.template); `succ(base)` gives their
        successors as ids with the block starting at task `base`; `block`: (its template, each
        task's one resource as an array), for `arrays`. Returns their ids (an identical
        replica's, see `begin_replica`)."""
        if self._ghost is not None:
            ids = self._ghost[self._ghost_pos:self._ghost_pos + len(dkey)]
            self._ghost_pos += len(dkey)
            return ids
        base = len(self.dkey)
        if block is None:
            if self._pending:
                self.succ   # the pending blocks' tuples made while their list is there
            self.blocks = None
        elif self.blocks is not None:
            self.blocks.append((base, *block))
        self.dkey += dkey
        self.res += res
        if self.blocks is not None and self.meta is None:   # made when asked for (`succ`)
            self._succ += [None] * len(dkey)
            self._pending = True
        else:
            self._succ += succ(base)
        self.ndeps += ndeps
        if self.meta is not None:
            self.meta += meta
        return list(range(base, base + len(dkey)))

    def add(self, k: int, res: tuple[int, ...], deps=(), meta: TaskMeta | None = None) -> int:
        """k: value index of the duration; meta is kept only when tracing."""
        if self._ghost is not None:
            self._ghost_pos += 1
            return self._ghost[self._ghost_pos - 1]
        t = len(self.dkey)
        self.dkey.append(k)
        self.res.append(res)
        self._succ.append(())
        self.ndeps.append(0)
        self.added.append(t)
        for d in deps:
            if d is not None:
                if self._succ[d] is not None:
                    self._succ[d] += (t,)
                self.ndeps[t] += 1
                self.extra.append((d, t))
        if self.meta is not None:
            self.meta.append(meta)
        return t

    @property
    def succ(self) -> list[tuple[int, ...]]:
        """Each task's successors, in the order they were wired."""
        if self._pending:
            pending = [x is None for x in self._succ]
            for base, t, flat in self.blocks:
                if pending[base]:
                    self._succ[base:base + len(flat)] = t.succ_at(base)
            for a, b in self.extra:   # edges added to a block's task since it was stamped
                if pending[a]:
                    self._succ[a] += (b,)
            self._pending = False
        return self._succ

    @property
    def shared(self) -> tuple[int, ...]:
        return self.shared_res

    def prepare_compiled(self) -> "fastloop.Prepared":
        """The compiled loop's arrays (hetplan.planner.sim.engines.Compiled), from `arrays` where it can."""
        flat = self.arrays()
        return fastloop.prepare(self.res, None if flat else self.succ, self.ndeps, self.shared_res, self.n_res,
                                self.wake, flat)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """`res` and `succ` flat (res_ptr, res_idx, succ_ptr, succ_idx: hetplan.planner.sim.fastloop),
        made from the stamped blocks' template arrays and the tasks and edges added one by
        one, not from the lists; None where a block came without its arrays."""
        if self.blocks is None:
            return None
        n = len(self.dkey)
        sizes = np.ones(n, np.int64)
        sizes[self.added] = [len(self.res[t]) for t in self.added]
        res_ptr = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=res_ptr[1:])
        res_idx = np.empty(int(res_ptr[-1]), np.int64)
        own = np.zeros(n, np.int64)   # per task its template successors
        for base, t, flat in self.blocks:   # one resource per task: a contiguous run
            res_idx[res_ptr[base]:res_ptr[base + len(flat)]] = flat
            own[base:base + len(flat)] = np.diff(t.succ_ptr)
        for t in self.added:
            res_idx[res_ptr[t]:res_ptr[t + 1]] = self.res[t]
        src, dst = (np.array(x, np.int64) for x in zip(*self.extra)) if self.extra else (np.zeros(0, np.int64),) * 2
        succ_ptr = np.zeros(n + 1, np.int64)
        np.cumsum(own + np.bincount(src, minlength=n), out=succ_ptr[1:])
        succ_idx = np.empty(int(succ_ptr[-1]), np.int64)
        for base, t, flat in self.blocks:   # a task's template successors first, in their order
            local = t.edge_src
            succ_idx[succ_ptr[base + local] + np.arange(len(local)) - t.succ_ptr[local]] = t.edge_dst + base
        order = np.argsort(src, kind="stable")   # then the edges added to it, in the order added
        s = src[order]
        rank = np.arange(len(s)) - np.searchsorted(s, s)
        succ_idx[succ_ptr[s] + own[s] + rank] = dst[order]
        return res_ptr, res_idx, succ_ptr, succ_idx


__all__ = ["TaskGraph", "ShapeCache", "TIMED", "COUNTED", "Const", "LayerRange", "Recompute", "HopRecipe", "HeldSend", "SavedCopy",
           "SplitRange", "SplitPart", "SplitSync",
           "Recipe", "RouteHop", "ComputeLabel", "TransferLabel", "TaskMeta"]
