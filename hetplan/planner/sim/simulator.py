"""The execution simulator: a task graph of one training iteration and a deterministic event loop.

Tasks (per replica x stage x microbatch): forward and backward compute on the stage's device;
activation / gradient transfers between consecutive stages, one task per link hop of the
route (store-and-forward); one ring all-reduce per gradient bucket (hetplan.planner.cost.buckets) among
the devices holding its layers; one optimizer step per device after its gradients are synced
(under placement "cpu": gradient copy to the host CPU, update there, parameter copy back).

Resources: each device's compute queue and each *direction* of each link (links are full
duplex) runs one task at a time; an all-reduce holds every link direction of its ring at once.
The order on a device is the schedule (consecutive actions are chained); every queue serves
ready tasks first come, first served, ties broken by task id (creation order), and events at
the same time are all applied before any task starts, so a run is deterministic.

Sync: "fine" splits the last microbatch's backward of a stage at bucket boundaries, so a
bucket's all-reduce starts when its layers' gradients are final on every device of its group,
overlapping the remaining backward; "coarse" starts a bucket's all-reduce after all backward
work of every device in its group, one flat all-reduce per device set (buckets of one set
merged, as the runtime does). On a saturated host (contention.saturated_cpus) fine buckets'
all-reduces also wait for their devices' last backward, gloo's threads getting no core while
the workers compute, and then run back to back: each after the first of its device set is
priced `queued` (cost.allreduce_s). The runtime's own sync work on the worker's thread
(hetplan.planner.cost.grad_sync): DDP's per forward, the copy of each bucket's gradients in the backward
piece that makes it final, GradSync's copy back before the step. Recompute adds the stage's forward to its backward. A split
backward (zb-h1) is two tasks per microbatch: I (cost.bwd_input_s), which receives and sends the
gradient, and W (cost.bwd_weight_s), which the fine-sync pieces and buckets follow; the measured
cost model times both passes per layer (the split backward costs more than the fused one on CPUs).

Receives: a message between stages moves only once its receiver has posted the receive (gloo
and NCCL match a send with a posted receive), and the runtime keeps POSTED_AHEAD (2) receives per
peer posted, the next one posted as an action starts (hetplan.planner.files.schedule.receives): a message's
first hop also waits for the receiver's action before that post.

PipeDream and 2BW (sync.mode): no all-reduce; the pipeline is simulated as a stream of three
iterations of 1F1B without flush, each stage's updates on its device after its backwards
(hetplan.planner.sim.build.Builder.stream); the iteration is the steady state's (`_iteration_s`), the
per-device statistics a third of the stream's, and each stage's staleness is reported.

Tensor split (a stage's "devices"): the stage's forward and backward are each one task holding
every device of the split and the links of their ring, lasting the slowest device's part per
layer plus the activation all-reduces (CostModel.tensor_stage_s); each device's statistics
count its own part. Each device steps the parameters it holds. The neighbouring stages'
transfers go to and from the split's first device, and copies of them to its other devices
(Builder.fan_copies).

A CPU worker's gloo sends leave once its event-loop thread has read the receiver's notice, which
it does when the worker waits or when the scheduler gives it the core: a message whose receive
is posted during the iteration first waits the expected hold for the sender's compute from its
isend to its next wait (cost.held_send_s, measured by the profile; hetplan.planner.sim.template).

Not modelled: compute slowed by concurrent communication (NCCL kernels, gloo threads), the
loss computation (part of the last stage's forward as captured), the notice a late-posted
receive sends back to the sender (one more latency), and all-reduce algorithms other than the
ring.

What a run means: hetplan.planner.sim.reference (the reference loop). How it is computed: the engines
of hetplan.planner.sim.engines, tried in one ordered list (`Simulator(engines=...)`), each giving the
reference's times or declining; the result names the one that ran (`SimResult.engine`).
Speed: task graphs (hetplan.planner.sim.taskgraph, built by hetplan.planner.sim.build, each replica stamped from
a template of its structure: hetplan.planner.sim.template) are cached per plan shape, results per plan,
duration values per replica and microbatch size. Contention between CPU workers:
hetplan.planner.sim.contention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, NamedTuple, Sequence

import numpy as np

from hetplan.planner.cost.buckets import Bucket, buffer_broadcasts, exchanged_buckets
from hetplan.planner.cost.model import CostModel, RooflineCost
from hetplan.planner.sim import contention
from hetplan.planner.sim.bound import BoundCache, lower_bound_s
from hetplan.planner.sim.build import STREAM_ITERATIONS, Builder
from hetplan.planner.sim.deadlock import Deadlock
from hetplan.planner.sim.engines import DELTA, TWINS, Engine, engines_of, run_graph
from hetplan.planner.sim.eventloop import shared_resources
from hetplan.planner.sim.delta import Delta, groups as delta_groups
from hetplan.planner.workload.graph import ModelGraph
from hetplan.planner.cost.memory import feasible as memory_feasible, peak_memory
from hetplan.planner.files.plan import PIPEDREAM_MODES, Plan
from hetplan.planner.sim.taskgraph import TIMED, Const, RouteHop, TaskGraph
from hetplan.planner.hardware.topology import Topology


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    peak_memory_bytes: dict[str, float]
    feasible: bool
    per_device: dict[str, dict[str, float]]
    tasks: tuple[dict[str, Any], ...] | None = field(default=None, compare=False, repr=False)
    # the engines that computed it (hetplan.planner.sim.engines): "<graph engine>", "twins/<graph engine>" or
    # "delta/<replica engines>/<coupling graph's engine>"; not part of the result's value
    engine: str = field(default="", compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "peak_memory_bytes": dict(self.peak_memory_bytes),
                "feasible": self.feasible, "per_device": {d: dict(v) for d, v in self.per_device.items()}}


# per-device statistics of a result, in the order SimResult.per_device lists them
_STATS = ("fwd_s", "bwd_s", "optimizer_s", "compute_s", "comm_s")
_STAT_AT = {s: k for k, s in enumerate(_STATS)}


STRUCTURE_CACHE_SIZE = 1024   # distinct replica structures a simulator keeps (hetplan.planner.sim.delta)
PEAK_CACHE_SIZE = 64       # plans whose peak memory a simulator keeps (Simulator._peak)
BLOCK_VALUES_CACHE_SIZE = 8192   # replicas' values per microbatch size it keeps (Simulator._evaluate)
BUCKET_CACHE_SIZE = 4096   # layer layouts whose gradient buckets a simulator keeps (Simulator.exchanged)


class ShapeKey(NamedTuple):
    """A plan's shape (everything but batch sizes) and how its replicas are collapsed; `like`
    stays last."""
    replicas: tuple
    schedule: str
    sync: Any
    optimizer: str
    placement: tuple       # (placement, cpu_fraction)
    recompute: bool
    shard: int             # plan.shard (ZeRO stage)
    delta: bool            # a delta build (hetplan.planner.sim.delta)
    like: tuple[int, ...] | None


class ResultKey(NamedTuple):
    """Everything of a plan that its simulation result depends on."""
    global_batch: int
    replicas: tuple
    schedule: str
    sync: Any
    optimizer: Any
    recompute: bool
    shard: int


class PrecisionMismatch(RuntimeError):
    """A plan simulated on a graph captured in another precision (a caller's mistake)."""


class Simulator:
    """Simulates plans of one graph on one topology, in the precision the graph was captured in;
    costs, routes and task graphs are cached. `engines`: the ordered list tried
    (hetplan.planner.sim.engines; default: DEFAULT_ENGINES less what `delta`, `collapse` and
    `static_after` turn off); `engines=[REFERENCE]` runs the specification alone."""

    def __init__(self, graph: ModelGraph, topology: Topology, cost: CostModel | None = None,
                 cache_size: int = 4096, shape_cache_size: int = 64, collapse: bool = True,
                 static_after: int | None = 2, delta: bool = True, engines: Sequence[Engine] | None = None):
        self.graph, self.topology = graph, topology
        self.cost = cost if cost is not None else RooflineCost(graph, topology)
        self.rid: dict[Any, int] = {}
        self.lanes: list[str] = []
        for d in topology.devices:
            self._resource(d.name)
        # every link direction numbered now, not at first use: the event loop serves resources in
        # id order, so a plan's result must not depend on what was simulated (or bounded) before
        for link in topology.links:
            self._resource((link.a, link.b))
            self._resource((link.b, link.a))
        self._links = {(x,) for key, x in self.rid.items() if isinstance(key, tuple)}   # as tasks' resources
        self._hops: dict[tuple[str, str], list[RouteHop]] = {}
        self._ar: dict[tuple[tuple[str, ...], float, bool], tuple[tuple[int, ...], float]] = {}
        self._buckets: dict[tuple, tuple[list[Bucket], list[Bucket]]] = {}
        self._cache: dict[Any, SimResult] = {}
        self._peaks: dict[ResultKey, dict[str, float]] = {}   # Simulator._peak
        self._coupled_plans: dict[tuple, bool] = {}            # Simulator._coupled
        self._cache_size = cache_size
        self._shapes: dict[Any, TaskGraph] = {}
        self._shape_cache_size = shape_cache_size
        self.engines = tuple(engines) if engines is not None else engines_of(delta, collapse, static_after)
        self._collapse = TWINS in self.engines   # identical independent replicas run once (_like)
        self.saturated = contention.saturated_cpus(topology)
        # delta simulation (hetplan.planner.sim.delta): independent replicas run one by one, each
        # distinct one once, its times kept across plans; else the whole graph every time
        self._delta_on = DELTA in self.engines
        self._structures: dict = {}   # replica structures (hetplan.planner.sim.delta.Structure)
        self._replica_runs: dict = {}
        self.replica_values: dict = {}   # hetplan.planner.sim.build.Builder.replica_values
        self._block_values: dict = {}     # Simulator._evaluate: (id of a block's recipes, microbatch) -> (them, values)
        self.bound_cache = BoundCache()   # what hetplan.planner.sim.bound keeps across plans
        self._wake_at: dict[tuple[int], float] | None = None

    # --- resources and routes ----------------------------------------------------------------
    def _resource(self, key: Any) -> int:
        if key not in self.rid:
            self.rid[key] = len(self.lanes)
            self.lanes.append(key if isinstance(key, str) else f"{key[0]}->{key[1]}")
        return self.rid[key]

    def hops(self, a: str, b: str) -> list[RouteHop]:
        """The link directions of the route a -> b, in order."""
        key = (a, b)
        if key not in self._hops:
            out, cur = [], a
            links = self.topology.route(a, b)
            if links and a not in (links[0].a, links[0].b):
                links = links[::-1]   # Topology.route caches one orientation per pair
            for link in links:
                nxt = link.b if link.a == cur else link.a
                out.append(RouteHop(self._resource((cur, nxt)), link.latency_s,
                                    link.bandwidth_bytes_per_s, f"{cur}->{nxt}"))
                cur = nxt
            self._hops[key] = out
        return self._hops[key]

    def allreduce(self, devices: tuple[str, ...], n_bytes: float,
                  queued: bool = False) -> tuple[tuple[int, ...], float]:
        """The resources an all-reduce holds and its duration (`queued`: issued right behind
        another of its group, cost.allreduce_s)."""
        key = (devices, n_bytes, queued)
        if key not in self._ar:
            res: list[int] = []
            k = len(devices)
            for i in range(k):
                for h in self.hops(devices[i], devices[(i + 1) % k]):
                    if h.resource not in res:
                        res.append(h.resource)
            # gloo runs the collective on the workers' own CPU cores: with no core to spare it
            # cannot overlap their compute, so it also holds their compute queues
            res += [self.rid[d] for d in devices if d in self.saturated]
            self._ar[key] = (tuple(res), self.cost.allreduce_s(devices, n_bytes, queued))
        return self._ar[key]

    def allgather(self, devices: tuple[str, ...], n_bytes: float) -> tuple[tuple[int, ...], float]:
        """The resources an all-gather of n bytes in all holds (an all-reduce's) and its
        duration (cost.allgather_s)."""
        key = (devices, n_bytes, "gather")
        if key not in self._ar:
            self._ar[key] = (self.allreduce(devices, n_bytes)[0], self.cost.allgather_s(devices, n_bytes))
        return self._ar[key]

    def exchanged(self, plan: Plan) -> tuple[list[Bucket], list[Bucket]]:
        """hetplan.planner.cost.buckets.exchanged_buckets(plan, graph), cached per layer layout and sync:
        the bound and the builder both ask, plan after plan, for layouts the search has seen.
        Callers must not change the lists."""
        key = (plan.sync, tuple(rep.stages for rep in plan.replicas))
        out = self._buckets.get(key)
        if out is None:
            if len(self._buckets) >= BUCKET_CACHE_SIZE:   # not cache_size: 0 there turns off
                self._buckets.pop(next(iter(self._buckets)))   # results, not buckets
            out = self._buckets[key] = exchanged_buckets(plan, self.graph)
        return out

    # --- building the task graph of a plan shape ---------------------------------------------
    def _build(self, plan: Plan, g: TaskGraph, like: tuple[int, ...] | None = None, delta: bool = False) -> None:
        """Everything of `plan` but its batch sizes becomes tasks of `g`; replica r is simulated
        by replica like[r] where that differs from r (see `_like`); `delta`: replicas become
        parts (hetplan.planner.sim.build.Builder.releases)."""
        Builder(self, plan, g, like, delta).build()

    def _shape(self, plan: Plan, trace: bool, like: tuple[int, ...] | None = None, delta: bool = False) -> TaskGraph:
        """The cached task graph of plan's shape (everything but batch sizes) with replicas
        collapsed as `like` says, or its delta build with its `Delta` (hetplan.planner.sim.delta; False
        where it does not apply); built afresh when tracing."""
        key = ShapeKey(tuple((rep.microbatches, rep.stages) for rep in plan.replicas), plan.schedule,
                       plan.sync, plan.optimizer.name,
                       (plan.optimizer.placement, plan.optimizer.cpu_fraction), plan.recompute, plan.shard, delta, like)
        g = None if trace else self._shapes.get(key)
        if g is None:
            g = self._delta_build(plan) if delta else self._whole_build(plan, trace, like)
            if not trace and self._shape_cache_size > 0:
                if len(self._shapes) >= self._shape_cache_size:
                    self._shapes.pop(next(iter(self._shapes)))
                self._shapes[key] = g
        return g

    def _whole_build(self, plan: Plan, trace: bool, like: tuple[int, ...] | None) -> TaskGraph:
        g = TaskGraph(trace)
        self._build(plan, g, like)
        g.shared_res = shared_resources(g.res)
        g.n_res = len(self.lanes)
        # Replicas are independent when nothing else queues on their devices and links:
        # every device holds one stage, optimizers run on their devices (after the
        # device's last backward, which they wait for through the all-reduces), and no two
        # replicas or all-reduces share a link direction.
        seen: set[int] = set()
        g.collapsible = (like is None and plan.optimizer.placement == "device"
                         and len(plan.devices) == sum(len(r.stages) for r in plan.replicas))
        for used in map(g.replica_resources, range(len(g.replica_tasks))) if g.collapsible else ():
            if used & seen or used & g.sync_res:
                g.collapsible = False
                break
            seen |= used
        return g

    def _delta_build(self, plan: Plan) -> TaskGraph:
        """The plan shape's delta build with its `Delta` (hetplan.planner.sim.delta), False where it
        does not apply."""
        g = TaskGraph(False)
        self._build(plan, g, None, True)
        if len(self._structures) >= STRUCTURE_CACHE_SIZE:
            self._structures.clear()
        self._wakes(g)   # also numbers the devices' wake-ups (_wake_at)
        g.cache.delta = Delta.of_parts(g, g.wake, self._structures, self._wake_at, self._links, self.engines) or False
        return g

    def _wakes(self, g: TaskGraph) -> dict[int, float]:
        """The wake-up of each task that receives a message (a transfer hop precedes it) on a
        device whose worker blocks for it (cost.wake_latency_s, and cost.cold_compute_s: the
        compute after the wait starts cold); the event loop adds it when the device sat idle
        waiting. Cached on the graph."""
        if g.wake is None:
            if self._wake_at is None:   # devices' wake-ups, keyed like a task's resources
                cost = self.cost
                self._wake_at = {(self.rid[d.name],): w for d in self.topology.devices
                                 if (w := cost.wake_latency_s(d.name) + cost.cold_compute_s(d.name)) > 0.0}
            links, wake_at = self._links, self._wake_at
            g.wake = {}
            res, succ = (g.res, g.succ) if wake_at else ((), ())
            for t in compress(range(len(res)), map(links.__contains__, res)):
                for v in succ[t]:
                    w = wake_at.get(res[v])
                    if w is not None:
                        g.wake[v] = w
        return g.wake

    def _run(self, g: TaskGraph, values: list[float], contended: dict[str, list[str]], trace: bool):
        """(iteration's last end, durations alone, durations run, start, end, engine) of the
        whole graph g by the graph engines; contended CPU workers' durations follow the
        timeline (hetplan.planner.sim.contention: a run per pass). Lists where contended or traced."""
        self._wakes(g)
        if g.cache.dkey_array is None:
            g.cache.dkey_array = np.array(g.dkey, np.int64)
        base = dur = np.asarray(values, np.float64)[g.cache.dkey_array]
        try:
            start, end, engine = run_graph(g, dur, self.engines)
        except Deadlock as e:   # named where the graph is traced (every task labelled)
            if not trace or e.start is None:
                raise
            raise e.named(self.lanes, [m.label if m else None for m in g.meta]) from None
        if contended or trace:
            base = dur = base.tolist()
            start, end = _listed(start), _listed(end)
        for _ in range(contention.CONTENTION_PASSES if contended else 0):
            dur = contention.contend(self.cost, self.rid, contended, g, base, start, end)
            start, end, engine = run_graph(g, dur, self.engines)
            start, end = _listed(start), _listed(end)
        return _iteration_s(g, end), base, dur, start, end, engine

    def _delta(self, plan: Plan) -> tuple[TaskGraph, list[float], float, str] | None:
        """(delta build, its values, the last end of the plan's tasks, engine) by delta simulation
        (hetplan.planner.sim.delta), or None where it does not apply to the plan's shape or times.
        Plans with offloaded activations, tensor splits or a PipeDream stream are not tried
        (their replicas' tasks are not all from the template)."""
        if (plan.sync.mode in PIPEDREAM_MODES
                or any(st.offload_activations or st.split for rep in plan.replicas for st in rep.stages)
                or self._coupled(plan)):
            return None
        g = self._shape(plan, False, delta=True)
        if not g.cache.delta:
            return None
        values = self._evaluate(plan, g)
        if self._plan_facts(plan, g):   # contended: durations depend on the timeline
            return None
        out = g.cache.delta.run(values, self._replica_runs)
        return None if out is None else (g, values, *out)

    def _coupled(self, plan: Plan) -> bool:
        """Whether a gradient all-reduce's ring holds a replica's device (a plan that
        Delta.of_parts would refuse, seen before building: this only saves the build), or
        every replica of several shares a device or link direction with another, transitively
        (they would run as one group, hetplan.planner.sim.delta.GraphRun: the whole graph costs less).
        Replicas in several groups run group by group. Kept per layout and sync."""
        key = (tuple(rep.stages for rep in plan.replicas), plan.sync)
        out = self._coupled_plans.get(key)
        if out is None:
            if len(self._coupled_plans) >= BUCKET_CACHE_SIZE:
                self._coupled_plans.pop(next(iter(self._coupled_plans)))
            out = self._coupled_plans[key] = self._couples(plan)
        return out

    def _couples(self, plan: Plan) -> bool:
        used = []
        for rep in plan.replicas:
            xs = {self.rid[st.device] for st in rep.stages}
            for a, b in zip(rep.stages, rep.stages[1:]):
                xs.update(h.resource for h in self.hops(a.device, b.device) + self.hops(b.device, a.device))
            used.append(xs)
        if len(used) > 1 and len(delta_groups(used)) == 1:
            return True
        owner = {self.rid[st.device] for rep in plan.replicas for st in rep.stages}
        buckets, tied = self.exchanged(plan)
        rings = {b.devices for b in buckets + tied}
        return any(x in owner and (x,) not in self._links
                   for devices in rings for x in self.allreduce(devices, 0.0)[0])

    def _plan_facts(self, plan: Plan, g: TaskGraph) -> dict[str, list[str]]:
        """g's contended CPU workers (contention.contended), buffer broadcasts and iteration
        overhead, kept in g.cache: they depend on the plan's shape only. Returns the former."""
        if g.cache.contended is None:
            g.cache.contended = contention.contended(self.topology, self.cost, plan)
            g.cache.buffer_s = self.buffer_sync_s(plan)
            g.cache.overhead_s = (self.cost.iteration_overhead_s(len(plan.devices))
                                  + max(g.cache.buffer_s.values(), default=0.0))
        return g.cache.contended

    def buffer_sync_s(self, plan: Plan) -> dict[str, float]:
        """Per device, its seconds in the buffer broadcasts before each iteration
        (hetplan.planner.cost.buckets.buffer_broadcasts): blocking calls one after another, each priced
        as an all-reduce of its bytes over its devices (a small collective: its latency). The
        iteration adds the most a device spends; each device counts its own as comm_s."""
        spent: dict[str, float] = {}
        for b in buffer_broadcasts(plan, self.graph):
            s = self.allreduce(b.devices, b.bytes)[1]
            for d in b.devices:
                spent[d] = spent.get(d, 0.0) + s
        return spent

    @staticmethod
    def _like(g: TaskGraph, values: list[float]) -> tuple[int, ...]:
        """For each replica, the first replica it is identical to: the same structure (microbatches,
        layer ranges, hops between stages), the same task-to-recipe pattern and the same
        duration values. In a collapsible graph such a replica's tasks run at the same times as
        its twin's, so it is simulated by reference and only its statistics are counted."""
        first: dict[tuple, int] = {}
        out = []
        for r in range(len(g.replica_shape)):
            recipes, pattern = g.replica_recipes(r)
            out.append(first.setdefault((g.replica_shape[r], pattern, tuple(map(values.__getitem__, recipes))), r))
        return tuple(out)

    def _evaluate(self, plan: Plan, g: TaskGraph) -> list[float]:
        """The values of g's duration recipes (hetplan.planner.sim.taskgraph) for plan's batch sizes,
        at each replica's microbatch (batch / microbatches). Compute is timed alone; contention
        is applied per task by `contention.contend`."""
        cost, graph = self.cost, self.graph
        mbs = [b / rep.microbatches for b, rep in zip(plan.replica_batches(), plan.replicas)]
        if g.cache.by_replica is None:
            # a Const depends on no batch; a recipe with a `replica` on that replica's microbatch
            # only; any other kind is evaluated for every plan; blocks below
            g.cache.by_replica = [([], {}) for _ in mbs]
            g.cache.fixed = [None] * len(g.recipes)
            g.cache.unkept = []
            blocked = bytearray(len(g.recipes))
            for base, recipes, _ in g.value_blocks:
                blocked[base:base + len(recipes)] = b"\x01" * len(recipes)
            for k, rc in enumerate(g.recipes):
                r = getattr(rc, "replica", None)
                if blocked[k]:
                    continue
                if isinstance(rc, Const):
                    g.cache.fixed[k] = rc.seconds(cost, graph, mbs)
                elif isinstance(r, int):
                    g.cache.by_replica[r][0].append(k)
                else:
                    g.cache.unkept.append(k)
        values = g.cache.fixed.copy()
        for k in g.cache.unkept:
            values[k] = g.recipes[k].seconds(cost, graph, mbs)
        for (ks, seen), mb in zip(g.cache.by_replica, mbs):
            vs = seen.get(mb)
            if vs is None:   # values per microbatch size: a search moves batches back and forth
                if len(seen) >= 32:
                    seen.clear()
                vs = seen[mb] = [g.recipes[k].seconds(cost, graph, mbs) for k in ks]
            for k, v in zip(ks, vs):
                values[k] = v
        # a replica's block, kept across plan shapes per microbatch size: the same recipes
        # (hetplan.planner.sim.build.ReplicaValues.distinct) come back in most plans of a search
        kept = self._block_values
        for base, recipes, r in g.value_blocks:
            got = kept.get((id(recipes), mbs[r]))
            if got is None or got[0] is not recipes:
                if len(kept) >= BLOCK_VALUES_CACHE_SIZE:
                    kept.pop(next(iter(kept)))
                got = kept[(id(recipes), mbs[r])] = (recipes, [rc.seconds(cost, graph, mbs) for rc in recipes])
            values[base:base + len(recipes)] = got[1]
        return values

    # --- entry point -------------------------------------------------------------------------
    def lower_bound_s(self, plan: Plan, above: float = math.inf) -> float | None:
        """A lower bound on simulate(plan).iteration_s without simulating (hetplan.planner.sim.bound), or
        None where none is proven; raises ValueError where simulate would (no host CPU). Once
        the bound passes `above`, it may stop short of its best."""
        self._check_precision(plan)
        return lower_bound_s(self, plan, above)

    def peak_memory_bytes(self, plan: Plan) -> dict[str, float]:
        """The peak memory simulate(plan) reports, without simulating."""
        self._check_precision(plan)
        return self._peak(plan, self._key(plan))

    def _peak(self, plan: Plan, key: "ResultKey") -> dict[str, float]:
        """hetplan.planner.cost.memory.peak_memory of the plan (a copy), kept for the last plans: a
        search asks for a proposal's bound, then simulates it."""
        out = self._peaks.get(key)
        if out is None:
            if len(self._peaks) >= PEAK_CACHE_SIZE:
                self._peaks.pop(next(iter(self._peaks)))
            out = self._peaks[key] = peak_memory(plan, self.graph, self.topology)
        return dict(out)

    @staticmethod
    def _key(plan: Plan) -> "ResultKey":
        return ResultKey(plan.global_batch, plan.replicas, plan.schedule, plan.sync, plan.optimizer, plan.recompute,
                         plan.shard)

    def _check_precision(self, plan: Plan) -> None:
        if plan.precision != self.graph.precision:
            raise PrecisionMismatch(f"the plan's precision is {plan.precision} but the graph was "
                                    f"captured in {self.graph.precision} (see ByPrecision)")

    def simulate(self, plan: Plan, trace: bool = False) -> SimResult:
        """One iteration of `plan`. Where it cannot finish, hetplan.planner.sim.deadlock.Deadlock with the
        step x resource grid of the plan's whole graph, traced (resources and tasks named)."""
        try:
            return self._simulate(plan, trace)
        except Deadlock:
            if not trace:
                self._simulate(plan, trace=True)   # raises the deadlock named, where it is one there
            raise

    def _simulate(self, plan: Plan, trace: bool) -> SimResult:
        self._check_precision(plan)
        key = self._key(plan)
        if not trace and self._cache and key in self._cache:   # (hashing a plan takes microseconds)
            return self._cache[key]
        delta = self._delta(plan) if self._delta_on and not trace else None
        if delta is not None:
            g, values, last, engine = delta
            contended, dur, base = {}, [], []
        else:
            g = self._shape(plan, trace)
            values = self._evaluate(plan, g)
            contended = self._plan_facts(plan, g)
            twins = False
            if self._collapse and g.collapsible and not trace and not contended:
                like = self._like(g, values)
                if like != tuple(range(len(like))):
                    g, twins = self._shape(plan, trace, like), True
                    values = self._evaluate(plan, g)
                    self._plan_facts(plan, g)   # its own graph: its iteration overhead too
            last, base, dur, start, end, engine = self._run(g, values, contended, trace)
            engine = f"twins/{engine}" if twins else engine
        iteration_s = last + g.cache.overhead_s
        slowed = contention.slowdown(self.rid, contended, g, base, dur)
        per_iteration = 1.0 / STREAM_ITERATIONS if g.iteration_ends else 1.0
        peaks = self._peak(plan, key)
        stats: dict[str, dict[str, float]] = {}
        if g.cache.stat_rows is None:
            g.cache.stat_rows = StatRows.of(g)
        sums = g.cache.stat_rows.sums(values, per_iteration)
        for k, d in enumerate(g.devices):
            v = stats[d] = dict(zip(_STATS, sums[k]))
            if d in slowed:
                for s in TIMED:
                    v[s] *= slowed[d]
            v["compute_s"] = v["fwd_s"] + v["bwd_s"] + v["optimizer_s"]
            v["busy_s"] = v["compute_s"]
            v["idle_s"] = iteration_s - v["busy_s"]
            v["peak_memory_bytes"] = peaks.get(d, 0.0)
        for d, spent in g.cache.buffer_s.items():
            stats[d]["comm_s"] += spent
        for d, steps in staleness(plan).items():
            stats[d]["staleness_steps"] = float(steps)
        tasks = None
        if trace:
            tasks = tuple({"name": str(m.label), "lane": m.lane, "kind": m.kind, "start_s": s, "end_s": e}
                          for m, s, e in zip(g.meta, start, end) if m is not None and m.kind != "join")
        result = SimResult(iteration_s=iteration_s, peak_memory_bytes=peaks,
                           feasible=memory_feasible(peaks, self.topology), per_device=stats, tasks=tasks,
                           engine=engine)
        if not trace and self._cache_size > 0:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = result
        return result


class StatRows(NamedTuple):
    """Per (device, statistic) of a task graph (devices in g.devices order, statistics in
    _STATS order; compute_s empty), the values it adds up, as one index array cut in
    segments: `sums` adds each segment's values for a plan."""
    index: np.ndarray     # value ids, segment after segment
    starts: np.ndarray    # the first position of each non-empty segment
    at: np.ndarray        # its (device, statistic) cell, numbered device-major
    cells: int

    @staticmethod
    def of(g: TaskGraph) -> "StatRows":
        # a cell's blocks (TaskGraph.stat_blocks), then its sequence; only the cells that count
        # something visited
        device_at = {d: k * len(_STATS) for k, d in enumerate(g.devices)}
        filled = sorted([(device_at[d] + _STAT_AT[s], 0, bl) for (d, s), bl in g.stat_blocks.items()
                         if d in device_at and s in _STAT_AT]
                        + [(device_at[d] + _STAT_AT[s], 1, [sq]) for (d, s), sq in g.stat_seq.items()
                           if sq and d in device_at and s in _STAT_AT], key=lambda x: x[:2])
        sizes = np.zeros(len(device_at) * len(_STATS), np.int64)
        pieces = []
        for cell, _, bl in filled:
            pieces += bl
            sizes[cell] += sum(map(len, bl))
        index = np.concatenate(pieces).astype(np.int64, copy=False) if pieces else np.zeros(0, np.int64)
        first = np.cumsum(sizes) - sizes
        return StatRows(index, first[sizes > 0], np.flatnonzero(sizes > 0), len(sizes))

    def sums(self, values: list[float], scale: float) -> list[list[float]]:
        """Per device, its statistics' sums times `scale` (a segment's sum is reproducible: the
        same values in the same order)."""
        out = np.zeros(self.cells)
        if len(self.index):
            out[self.at] = np.add.reduceat(np.asarray(values, np.float64)[self.index], self.starts)
        return (out * scale).reshape(-1, len(_STATS)).tolist()


def _listed(x: list[float] | np.ndarray) -> list[float]:
    return x.tolist() if isinstance(x, np.ndarray) else x


def _iteration_s(g: TaskGraph, end: list[float] | np.ndarray) -> float:
    """The iteration: the last task's end; in a PipeDream / 2BW stream the steady state's, the
    time between the ends of the stream's first two iterations (the slowest stage's)."""
    if not g.iteration_ends:
        return (float(end.max()) if isinstance(end, np.ndarray) else max(end)) if len(end) else 0.0
    return max(float(end[ends[1]] - end[ends[0]]) for ends in g.iteration_ends)


def staleness(plan: Plan) -> dict[str, int]:
    """Per device of a PipeDream / 2BW pipeline, how many updates of its stage land between a
    microbatch's forward and the update its gradient enters: p - 1 - s under PipeDream (stage
    s of p), at most 1 under 2BW (0 on the last stage); empty for every other mode."""
    mode = plan.sync.mode
    if mode not in PIPEDREAM_MODES:
        return {}
    stages = plan.replicas[0].stages
    p = len(stages)
    return {st.device: (p - 1 - s if mode == "pipedream" else int(s < p - 1)) for s, st in enumerate(stages)}


class ByPrecision:
    """Simulators of one workload on one topology, one per precision (each on the graph captured
    in it): `simulate(plan)` uses the plan's. `graph`, `topology` and `cost` are the first
    precision's (the search draws its heuristics' layer shares and cut sizes from them)."""

    def __init__(self, simulators: dict[str, Simulator]):
        self.simulators = dict(simulators)
        first = next(iter(self.simulators.values()))
        self.graph, self.topology, self.cost = first.graph, first.topology, first.cost

    def simulate(self, plan: Plan, trace: bool = False) -> SimResult:
        return self.simulators[plan.precision].simulate(plan, trace=trace)

    def lower_bound_s(self, plan: Plan, above: float = math.inf) -> float | None:
        return self.simulators[plan.precision].lower_bound_s(plan, above)

    def peak_memory_bytes(self, plan: Plan) -> dict[str, float]:
        return self.simulators[plan.precision].peak_memory_bytes(plan)


def simulate(plan: Plan, graph: ModelGraph, topology: Topology, cost: CostModel | None = None,
             trace: bool = False) -> SimResult:
    """One-shot simulation (builds a fresh `Simulator`; reuse one for many plans)."""
    return Simulator(graph, topology, cost).simulate(plan, trace=trace)


__all__ = ["SimResult", "Simulator", "ByPrecision", "PrecisionMismatch", "simulate", "staleness"]


