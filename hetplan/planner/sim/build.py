"""The task graph of a plan shape, built job by job (what is modelled: hetplan.planner.sim.simulator).

`Builder(sim, plan, g, like).build()` adds every task of `plan` to `g`, durations as recipes
(hetplan.planner.sim.taskgraph) evaluated per plan: the plan's devices; the gradient buckets to
exchange; per replica, each stage's compute in schedule order and the transfers between
stages; one all-reduce per exchanged bucket; one optimizer step per device holding parameters
(on its host CPU when offloaded; under "split" both: the device's part and, at the same time,
its host's part with the copies; a tensor-split stage: one per device of the split, over what
it holds). The same statistics are counted in the same order as tasks
are added, so per-device sums are reproducible bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from hetplan.planner.cost.buckets import Bucket
from hetplan.planner.cost.grad_sync import runs_on_ddp
from hetplan.planner.cost.memory import stage_units, stepped_params
from hetplan.planner.cost.model import CostModel, host_cpu
from hetplan.planner.files.plan import PIPEDREAM_MODES, Plan, Replica, Stage
from hetplan.planner.hardware.topology import Topology
from hetplan.planner.files.schedule import split_backward
from hetplan.planner.sim.template import ReplicaCore, ReplicaTemplate, Stream, accumulates, replica_core, replica_template
from hetplan.planner.sim.taskgraph import (COUNTED, ComputeLabel, Const, HeldSend, HopRecipe, LayerRange, Recompute,
                                   RouteHop, SavedCopy, SplitRange, SyncWork, Gathered, TaskGraph, TaskMeta,
                                   TransferLabel)
from hetplan.planner.workload.graph import ModelGraph


class SimulatorView(Protocol):
    """What the builder uses of hetplan.planner.sim.simulator.Simulator (which imports this module)."""
    graph: ModelGraph
    topology: Topology
    cost: CostModel
    rid: dict[Any, int]   # resource id of each device and link direction
    lanes: list[str]      # per resource id, its name
    saturated: frozenset[str]   # CPU devices with no core to spare (hetplan.planner.sim.contention)
    replica_values: dict[tuple, "ReplicaValues"]   # Builder.replica_values, across plan shapes

    def hops(self, a: str, b: str) -> list[RouteHop]: ...

    def allreduce(self, devices: tuple[str, ...], n_bytes: float,
                  queued: bool = False) -> tuple[tuple[int, ...], float]: ...

    def allgather(self, devices: tuple[str, ...], n_bytes: float) -> tuple[tuple[int, ...], float]: ...

    def exchanged(self, plan: Plan) -> tuple[list[Bucket], list[Bucket]]: ...


class Exchange(NamedTuple):
    """The gradient buckets held by more than one device (merged per device set under coarse
    sync), and per device the indices of those it holds, in ready order; under fine sync the
    tied parameters' buckets apart (exchanged after their devices' last backward)."""
    fine: bool
    buckets: list[Bucket]
    by_device: dict[str, list[int]]
    tied: list[Bucket] = []
    first: list[int] = []   # per bucket its first layer


class ReplicaValues(NamedTuple):
    """A replica's tasks apart from the graph they go into (`Builder.replica_values`): its
    template's arguments (replica_template keeps the templates, a few hundred), the duration
    recipe of each value slot, the resources and lane of each resource slot, its hop counts,
    and per stage whether its last backward is cut at its buckets."""
    template: tuple
    recipes: tuple
    res: tuple[tuple[int, ...], ...]
    lanes: tuple[str, ...]
    hops: tuple[tuple[int, int], ...]
    bucketed: tuple[bool, ...]
    flat_res: np.ndarray | None   # each resource slot's one resource; None where one holds several
    # its recipes as a block of values (TaskGraph.block): the distinct ones in order, and each
    # value slot's index among them
    distinct: tuple
    slot_of: np.ndarray


class Chunk(NamedTuple):
    """A piece of a stage's last-microbatch backward: layers [lo, hi); after it, `bucket`'s
    gradients are final on this device (None: no bucket completes here)."""
    hi: int
    lo: int
    bucket: int | None


@dataclass
class Progress:
    """What the all-reduces and optimizer steps wait for."""
    chunk_of: dict[tuple[str, int], int] = field(default_factory=dict)   # (device, bucket) -> task making it final
    last_backward: dict[str, int] = field(default_factory=dict)          # device -> its last backward task


# iterations of a PipeDream / 2BW stream simulated: the second's end minus the first's is the
# steady state's iteration (the first ends after the warm-up, the third holds the cool-down)
STREAM_ITERATIONS = 3
REPLICA_VALUES_CACHE_SIZE = 4096   # replicas' values a simulator keeps across plan shapes


class Builder:
    """Builds one plan shape's task graph for `sim` (a Simulator: its resource ids, routes and
    all-reduce cache); replica r is simulated by replica like[r] where that differs from r."""

    BLOCKS = True   # replicas' values as blocks where that applies (False: one recipe at a time)

    def __init__(self, sim: SimulatorView, plan: Plan, g: TaskGraph, like: tuple[int, ...] | None,
                 delta: bool = False):
        self.sim, self.plan, self.g, self.like = sim, plan, g, like
        self.delta = delta   # replicas as parts, not tasks (`releases`; hetplan.planner.sim.delta)
        # each replica's values as one block and its statistics as arrays (TaskGraph.block,
        # stat_blocks): where no replica counts anything one task at a time (tensor splits,
        # offloaded activations), so each statistic's blocks come before what else it counts
        self.blocks = self.BLOCKS and not any(st.split or st.offload_activations
                                              for rep in plan.replicas for st in rep.stages)
        self.tracing = g.meta is not None   # labels are made only for a trace
        self.progress = Progress()
        self.exchange = Exchange(False, [], {})
        self.ddp = runs_on_ddp(plan)        # else GradSync, which also copies the sums back
        # what a replica's values depend on beside the replica and its buckets (replica_values)
        self.values_key = (plan.schedule, plan.sync.mode, plan.recompute, plan.optimizer.name, self.ddp,
                           plan.optimizer.clip_grad_norm is not None, plan.shard)

    def build(self) -> None:
        self.plan_devices()
        self.exchange = self.exchanged_buckets()
        for r, rep in enumerate(self.plan.replicas):
            self.replica(r, rep)
        if self.plan.sync.mode in PIPEDREAM_MODES:   # the stages' updates are in the stream
            return
        if self.plan.sync.mode == "parameter-server":
            self.server_steps()
            return
        steps = self.optimizer_steps(self.scatters() if self.plan.shard >= 2 else self.allreduces())
        if self.plan.sync.period is not None:
            self.parameter_exchange(steps)

    # --- devices and buckets -----------------------------------------------------------------
    def plan_devices(self) -> None:
        """The plan's devices, plus the host CPUs of an offloaded optimizer or of offloaded
        activations, each with its statistics; an unknown device raises KeyError naming it."""
        plan, topology = self.plan, self.sim.topology
        devices = list(plan.devices)
        offloading = [st.device for rep in plan.replicas for st in rep.stages if st.offload_activations]
        hosted = plan.devices if plan.optimizer.placement in ("cpu", "split") else offloading
        devices += [h for h in dict.fromkeys(host_cpu(topology, d) for d in hosted) if h not in devices]
        for d in devices:
            topology.device(d)
            for s in COUNTED:
                self.g.stat_seq[(d, s)] = []
        self.g.devices = tuple(devices)

    def exchanged_buckets(self) -> Exchange:
        # other sync modes: no gradient all-reduce (hogwild: steps into shared memory; its
        # cache-line traffic not modelled)
        fine = self.plan.sync.mode == "sync" and self.plan.sync.granularity == "fine"
        shared, tied = self.sim.exchanged(self.plan)
        by_device: dict[str, list[int]] = {}
        for k, b in enumerate(shared):
            for d in b.devices:
                by_device.setdefault(d, []).append(k)
        return Exchange(fine, shared, by_device, tied, [min(b.layers) for b in shared])

    # --- one replica: compute per stage, then the transfers between stages --------------------
    def replica(self, r: int, rep: Replica) -> None:
        """The replica's tasks, stamped from its structure's template (hetplan.planner.sim.template)."""
        g, like = self.g, self.like
        stages = rep.stages
        stream = self.stream(rep.microbatches)
        held = [self.stage_buckets(st) for st in stages]
        made = self.replica_values(r, rep, held)
        # a delta build's part needs no hop tasks: the core (hetplan.planner.sim.delta builds the rest)
        t, res = (replica_core if self.delta else replica_template)(*made.template), made.res
        if not self.delta:
            g.begin_replica((rep.microbatches * STREAM_ITERATIONS if stream else rep.microbatches,
                             tuple(st.layers for st in stages), made.hops),
                            g.replica_tasks[like[r]] if like and like[r] != r else None)
        if self.blocks:   # the replica's values as one block
            base = g.block(made.distinct, r)
            vals = (made.slot_of + base).tolist()
        else:
            vals = list(map(g.value, made.recipes))
        if self.delta:
            ids = self.releases(t, vals, res)
        else:
            flat = made.flat_res
            ids = g.stamp((made.slot_of[t.value_array] + base).tolist() if self.blocks
                          else list(map(vals.__getitem__, t.value)), list(map(res.__getitem__, t.res)), t.succ_at,
                          t.ndeps, self.labels(r, t, made.lanes) if self.tracing else None,
                          None if flat is None else (t, flat[t.res_array]))
        devs = [st.device for st in stages]
        if self.blocks:   # its statistics as arrays, per stage in the template's order (deterministic)
            counted, blocks = made.slot_of[t.counted] + base, g.stat_blocks
            for s, stat, a, b in t.count_cuts:
                blocks.setdefault((devs[s], stat), []).append(counted[a:b])
        else:
            seq = g.stat_seq
            for s, stat, vs in t.counts:   # per stage, in the template's order (deterministic)
                if stages[s].split:
                    self.count_split(stages[s], stat, [vals[v] for v in vs])
                    continue
                seq[(devs[s], stat)] += map(vals.__getitem__, vs)
        progress = self.progress
        for s, st in enumerate(stages):
            if made.bucketed[s]:   # piece j of the last backward makes the stage's j-th bucket final
                for bucket, end in zip(held[s], t.chunk_end[s]):
                    progress.chunk_of[(st.device, bucket)] = ids[end]
            # a device's tasks are chained in creation order: its last is its latest stage's
            last = ids[t.last_backward[s]]
            for dev in st.devices:
                progress.last_backward[dev] = max(last, progress.last_backward.get(dev, last))
        for s, st in enumerate(stages):
            if st.offload_activations:
                self.offload_copies(r, s, st, t, ids)
            if st.split:
                self.fan_copies(r, s, stages, t, ids)
        if stream:
            g.iteration_ends = [[ids[x] for x in ends] for ends in t.iteration_end]
            g.memory_bound.update(ids[x] for x, lab in enumerate(t.label) if lab[0] == "update")
        if not self.delta:
            g.end_replica()

    def replica_values(self, r: int, rep: Replica, held: list[list[int]]) -> ReplicaValues:
        """The replica's `ReplicaValues`, kept by the simulator across plan shapes: they depend
        on the replica (its index, microbatches, stages and so its routes), the plan's
        `values_key`, whether sync is fine, and the first layer and size of each bucket its
        stages hold (`held`)."""
        ex = self.exchange
        key = (r, rep.microbatches, rep.stages, self.values_key, ex.fine,
               tuple(tuple((ex.first[k], ex.buckets[k].bytes) for k in ks) for ks in held))
        cache = self.sim.replica_values
        made = cache.get(key)
        if made is None:
            if len(cache) >= REPLICA_VALUES_CACHE_SIZE:
                cache.pop(next(iter(cache)))
            own, self.g = self.g, TaskGraph(False)   # its recipes interned apart: they outlive the graph
            try:
                made = cache[key] = self.make_replica_values(r, rep)
            finally:
                self.g = own
        return made

    def make_replica_values(self, r: int, rep: Replica) -> ReplicaValues:
        g, hops = self.g, self.sim.hops
        m, stages = rep.microbatches, rep.stages
        stream = self.stream(m)
        m = m * STREAM_ITERATIONS if stream else m
        pairs = [(a.device, b.device) for a, b in zip(stages, stages[1:])]
        routes = [(hops(a, b), hops(b, a)) for a, b in pairs]
        counts = tuple((len(x), len(y)) for x, y in routes)
        chunks = [self.backward_chunks(st) for st in stages]
        devices = len(rep.pipeline_devices) if self.plan.schedule == "interleaved-1f1b" else None
        holds = tuple(not st.split and self.sim.cost.holds_sends(st.device) for st in stages)
        args = (self.plan.schedule, m, tuple(len(c) for c in chunks), counts, devices, stream,
                holds if any(holds) else None)
        t = replica_core(*args)
        split = split_backward(self.plan.schedule)
        pieces = self.weight_values if split else self.backward_values
        vals: list[int] = []
        for s, (st, ch) in enumerate(zip(stages, chunks)):   # values in the order the slots number them
            vals.append(self.forward_value(r, s, stages))
            vals += [k for k, _ in self.with_copies(st, pieces(r, s, stages, ch, accumulates=accumulates(m - 1, stream)))]
            whole = [Chunk(st.end, st.start, None)]   # the other microbatches' backward, uncut
            if t.slots.fresh[s]:    # the first of the iteration (a stream: after each update)
                vals += [k for k, _ in pieces(r, s, stages, whole)]
            if t.slots.other[s]:    # those adding into .grad
                vals += [k for k, _ in pieces(r, s, stages, whole, accumulates=True)]
            if stream:
                vals.append(self.update_value(st))
        res = [self.stage_resources(st) for st in stages]
        lanes = ["+".join(st.devices) for st in stages]
        for st, route_pair in zip(stages[1:], routes):
            for route in route_pair:
                for h in route:
                    vals.append(g.value(HopRecipe(r, st.start, h.latency_s, h.bandwidth_bytes_per_s)))
                    res.append((h.resource,))
                    lanes.append(h.lane)
        if split:
            vals += [self.input_value(r, s, stages) for s in range(len(stages))]
        recipes = g.recipes
        vals += [g.value(HeldSend(r, stages[s].device, tuple(recipes[vals[k]] for k in window)))
                 for s, window in t.holds]
        distinct = dict.fromkeys(vals)
        at = dict(zip(distinct, range(len(distinct))))
        slot_of = np.array([at[k] for k in vals], np.int64)
        return ReplicaValues(args, tuple(map(recipes.__getitem__, vals)), tuple(res), tuple(lanes), counts,
                             tuple(c[0].bucket is not None for c in chunks),
                             np.array([x[0] for x in res], np.int64) if all(len(x) == 1 for x in res) else None,
                             tuple(map(recipes.__getitem__, distinct)), slot_of)

    def releases(self, t: ReplicaCore, vals: list[int], res: list[tuple[int, ...]]) -> dict[int, int]:
        """A delta build (hetplan.planner.sim.delta; plans without offloaded activations, tensor splits
        or streams): the replica becomes a part of g, (template, value ids per value slot,
        resources per resource slot), and only the tasks the coupling may wait for (the pieces
        that make buckets final, each stage's last backward) become tasks: release tasks, each
        on a resource of its own. Returns their ids by the template's task."""
        g = self.g
        k = g.value(Const(0.0))   # a release task's duration is set per plan (Delta.run)
        ids = {}
        for x in sorted({x for ends in t.chunk_end for x in ends} | set(t.last_backward)):
            ids[x] = g.add(k, (len(self.sim.lanes) + len(g.dkey),))
        g.parts.append((t, tuple(vals), tuple(res), ids))
        return ids

    def stream(self, m: int) -> Stream | None:
        """PipeDream and 2BW: the pipeline keeps running across iterations (1F1B without flush), so
        the replica is simulated as a stream of STREAM_ITERATIONS iterations of m microbatches
        (Simulator.simulate takes the steady state's iteration from it); PipeDream updates a
        stage after every backward, 2BW after an iteration's m."""
        mode = self.plan.sync.mode
        if mode not in PIPEDREAM_MODES:
            return None
        return Stream(m, 1 if mode == "pipedream" else m)

    def update_value(self, st: Stage) -> int:
        """The value id of one weight update of a stage's parameters on its device (the SWA
        average's element-wise work not modelled)."""
        graph = self.sim.graph
        n = graph.stage_param_bytes(st.start, st.end)
        n_t = sum(len(graph.layers[i].param_names) for i in range(st.start, st.end))
        opt = self.plan.optimizer.name
        return self.g.value(Const(self.sim.cost.optimizer_s(st.device, n, opt, n_t) if n > 0 else 0.0))

    def stage_resources(self, st: Stage) -> tuple[int, ...]:
        """What a stage's compute holds: its device's queue; a tensor-split stage's holds every
        device of the split and the link directions of their all-reduce ring (they compute in
        lock step, exchanging activations)."""
        if not st.split:
            return (self.sim.rid[st.device],)
        ring = self.sim.allreduce(st.devices, 0.0)[0]
        return tuple(dict.fromkeys([self.sim.rid[d] for d in st.devices] + list(ring)))

    def count_split(self, st: Stage, stat: str, ks: list[int]) -> None:
        """A tensor-split stage's statistics: each device its own compute (SplitPart), and the
        all-reduces as communication of every device; the transfers to and from the
        neighbouring stages are its first device's."""
        g = self.g
        for k in ks:
            recipe = g.recipes[k]
            if not isinstance(recipe, SplitRange):
                g.count(st.device, stat, k)
                continue
            for d in st.devices:
                g.count(d, stat, g.value(recipe.part(d)))
            sync = g.value(recipe.sync())
            for d in st.devices:
                g.count(d, "comm_s", sync)

    def fan_copies(self, r: int, s: int, stages, t: ReplicaTemplate, ids: list[int]) -> None:
        """A tensor-split stage's other devices get each microbatch's boundary tensors too
        (hetplan.runtime.pipeline.FanLink): the activation from the previous stage's first device after
        its forward, the gradient from the next stage's after its backward, each over its route
        (one task per hop, queued on the links like the template's), before the split stage's
        forward or backward of that microbatch."""
        g, st = self.g, stages[s]
        tasks: dict[tuple[int, str, int], int] = {}       # (stage, "F" / "B", microbatch) -> task
        for local, lab in enumerate(t.label):
            if lab[0] == "compute":
                tasks.setdefault((lab[1], lab[2].kind, lab[2].microbatch), local)   # B: its first piece
                if lab[2].kind == "B":
                    tasks[(lab[1], "B end", lab[2].microbatch)] = local          # and its last
        for src_stage, cut, what, after, before in ((s - 1, st.start, "act", "F", "F"), (s + 1, st.end, "grad", "B end", "B")):
            if not 0 <= src_stage < len(stages):
                continue
            src = stages[src_stage].device
            for d in st.devices[1:]:
                route = self.route(src, d, r, cut)
                for i in range(self.plan.replicas[r].microbatches):
                    last = self.chain(route, src, d, ids[tasks[(src_stage, after, i)]], f"{r}:{what} {src}->{d} mb{i}")
                    g.wire(last, ids[tasks[(s, before, i)]])

    def offload_copies(self, r: int, s: int, st: Stage, t: ReplicaTemplate, ids: list[int]) -> None:
        """offload_activations: each microbatch's saved activations go to the host after its
        forward (on the device->host link, beside the compute) and come back once the device
        has reached its backward, which waits for them (the runtime copies them back as
        backward unpacks them). Copies cost the measured pinned host-copy fit, else the link."""
        g, sim, dev = self.g, self.sim, st.device
        host = host_cpu(sim.topology, dev)
        ks, res, lanes = [], [], []
        for a, b, direction in ((dev, host, "d2h"), (host, dev, "h2d")):
            hops = sim.hops(a, b)
            if not hops:
                raise ValueError(f"offload_activations needs a link between {dev} and {host}")
            fit = sim.cost.host_copy_fit(dev, direction) or (hops[0].latency_s, hops[0].bandwidth_bytes_per_s)
            ks.append(g.value(SavedCopy(r, st.start, st.end, *fit)))
            res.append((hops[0].resource,))
            lanes.append(hops[0].lane)
        fwd, bwd, before, last = {}, {}, {}, None
        for local, lab in enumerate(t.label):
            if lab[0] == "compute" and lab[1] == s:
                i = lab[2].microbatch
                if lab[2].kind == "F":
                    fwd[i] = local
                elif i not in bwd:
                    bwd[i], before[i] = local, last
                last = local
        for i in sorted(fwd):
            out = g.add(ks[0], res[0], (ids[fwd[i]],), TaskMeta(f"{r}:saved {dev}->{host} mb{i}", lanes[0], "transfer"))
            back = g.add(ks[1], res[1], (out, None if before[i] is None else ids[before[i]]),
                         TaskMeta(f"{r}:saved {host}->{dev} mb{i}", lanes[1], "transfer"))
            g.wire(back, ids[bwd[i]])
            for k in ks:
                g.count(dev, "comm_s", k)
                g.count(host, "comm_s", k)

    @staticmethod
    def labels(r: int, t: ReplicaTemplate, lanes: list[str]) -> list[TaskMeta]:
        """The trace's labels of a stamped replica."""
        out = []
        for lab, x in zip(t.label, t.res):
            if lab[0] == "compute":
                out.append(TaskMeta(ComputeLabel(r, lab[2]), lanes[x],
                                    "forward" if lab[2].kind == "F" else "backward"))
            elif lab[0] == "update":
                out.append(TaskMeta(f"{r}:update after {lab[2]}", lanes[x], "optimizer"))
            else:
                out.append(TaskMeta(TransferLabel(lab[0], r, lab[1], lab[2], lab[3]), lanes[x], "transfer"))
        return out

    def backward_chunks(self, st: Stage) -> list[Chunk]:
        """Under fine sync, the last microbatch's backward cut at the boundaries of the buckets
        its device holds (the last chunk reaching down to the stage's first layer); else one."""
        ex = self.exchange
        if not (ex.fine and st.device in ex.by_device):
            return [Chunk(st.end, st.start, None)]
        chunks, hi = [], st.end
        ks = self.stage_buckets(st)
        if not ks:
            return [Chunk(st.end, st.start, None)]
        for j, k in enumerate(ks):
            lo = st.start if j == len(ks) - 1 else min(ex.buckets[k].layers)
            chunks.append(Chunk(hi, lo, k))
            hi = lo
        return chunks

    def stage_buckets(self, st: Stage) -> list[int]:
        """The exchanged buckets of stage st's layers on its device, in ready order (a device
        holding several interleaved stages holds others too)."""
        ex = self.exchange
        return [k for k in ex.by_device.get(st.device, ()) if st.start <= ex.first[k] < st.end]

    def with_copies(self, st: Stage, pieces: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        """The last microbatch's backward pieces of stage st, each with the copy of the gradients
        it makes final into their buckets' flat buffers (hetplan.planner.cost.grad_sync): under fine sync
        the piece after which its bucket is final, under coarse the last piece, all of the
        stage's buckets. Tied parameters' buckets are not priced."""
        ex, cost, g = self.exchange, self.sim.cost, self.g
        ks = self.stage_buckets(st)
        if st.split or not ks or cost.grad_copy_s(st.device, 1.0) == 0.0:
            return pieces
        out = []
        for j, (v, bucket) in enumerate(pieces):
            if ex.fine:
                n = ex.buckets[bucket].bytes if bucket is not None else 0.0
            else:
                n = sum(ex.buckets[k].bytes for k in ks) if j == len(pieces) - 1 else 0.0
            out.append((g.value(SyncWork(g.recipes[v], st.device, copied_bytes=n)) if n else v, bucket))
        return out

    def forward_value(self, r: int, s: int, stages) -> int:
        """The value id of stage s's forward of one microbatch: it consumes an activation
        (s > 0) and sends one on (not the last stage), a tensor per isend or irecv."""
        st = stages[s]
        sends, receives, _, _ = stage_messages(self.sim.graph, stages, s)
        if st.split:
            return self.g.value(SplitRange("fwd", r, _shares(st), st.start, st.end, sends, receives))
        recipe = LayerRange("fwd", r, st.device, st.start, st.end, sends, receives)
        if self.ddp and self.sim.cost.ddp_forward_s(st.device) > 0.0:
            recipe = SyncWork(recipe, st.device, ddp_forward=True)
        if self.plan.shard == 3:
            recipe = Gathered(recipe, *self.unit_gathers(st, s, forward=True))
        return self.g.value(recipe)

    def unit_gathers(self, st: Stage, s: int, forward: bool) -> tuple[float, float]:
        """ZeRO-3: (the first unit's all-gather, the others') of stage s's pass, a unit a
        gradient bucket of the stage (coarse: the stage), forward from its first layers,
        backward from its last (hetplan.runtime.shard.ParamShards); all of them first, each
        with its wait's wake-up, where gloo runs them on CPU workers with no core to spare
        (hetplan.planner.sim.contention)."""
        devices = tuple(rep.stages[s].device for rep in self.plan.replicas)
        d = [self.sim.allgather(devices, b)[1] for b in stage_units(self.plan, self.sim.graph, st.layers)]
        if any(dev in self.sim.saturated for dev in devices):   # gloo on the workers' own cores: no overlap,
            return sum(d) + len(d) * self.resumed_s(st.device), 0.0   # each wait a wake-up
        first = d[-1] if forward else d[0]
        return first, sum(d) - first

    def resumed_s(self, dev: str) -> float:
        """What a CPU worker's wait in a collective costs beside the collective: it resumes late
        and its next compute runs cold (calibration's wake_latency_s, cold_compute_s)."""
        return self.sim.cost.wake_latency_s(dev) + self.sim.cost.cold_compute_s(dev)

    def gathered(self, st: Stage, s: int, out: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        """ZeRO-3: a backward pass's pieces, the first waiting for the gathers beside them all."""
        if self.plan.shard != 3 or not out:
            return out
        g = self.g
        rest = tuple(g.recipes[v] for v, _ in out[1:])
        first = (g.value(Gathered(g.recipes[out[0][0]], *self.unit_gathers(st, s, forward=False), rest)), out[0][1])
        return [first] + out[1:]

    def backward_values(self, r: int, s: int, stages, chunks: list[Chunk],
                        accumulates: bool = False) -> list[tuple[int, int | None]]:
        """(value id, bucket) per backward task of one microbatch of stage s; with recompute, the
        first one also runs the stage's forward again. The first consumes the gradient from
        the next stage, the last sends the input's gradient back (not on the first stage)."""
        st, out = stages[s], []
        _, _, grad_sends, grad_receives = stage_messages(self.sim.graph, stages, s)
        for j, c in enumerate(chunks):
            receives = grad_receives if j == 0 else 0
            sends = grad_sends if j == len(chunks) - 1 else 0
            if st.split:   # one chunk: a lone replica exchanges no buckets; no recompute
                recipe = SplitRange("bwd", r, _shares(st), c.lo, c.hi, sends, receives)
            elif self.plan.recompute and j == 0:
                recipe = Recompute(r, st.device, c.lo, c.hi, st.start, st.end, sends, receives, accumulates)
            else:   # chunks after the first continue the same action
                recipe = LayerRange("bwd", r, st.device, c.lo, c.hi, sends, receives, action=j == 0,
                                    accumulates=accumulates)
            out.append((self.g.value(recipe), c.bucket))
        return self.gathered(st, s, out)

    def input_value(self, r: int, s: int, stages) -> int:
        """The value id of stage s's I pass (split backward) of one microbatch: the input-gradient
        part of its layers' backward; it consumes the gradient from the next stage and sends its
        input's gradient back. Stage 0's inputs need no gradient: its I computes nothing (its W
        runs the whole backward, as torch.distributed.pipelining does)."""
        st = stages[s]
        _, _, sends, receives = stage_messages(self.sim.graph, stages, s)
        v = self.g.value(LayerRange("inp", r, st.device, st.start, st.end if s > 0 else st.start,
                                    sends=sends, receives=receives))
        return self.gathered(st, s, [(v, None)])[0][0] if s > 0 else v

    def weight_values(self, r: int, s: int, stages, chunks: list[Chunk],
                      accumulates: bool = False) -> list[tuple[int, int | None]]:
        """(value id, bucket) per W task (split backward) of one microbatch of stage s: the
        weight-gradient part of each chunk's layers (stage 0: their whole backward); no messages."""
        st = stages[s]
        return self.gathered(st, s, [(self.g.value(LayerRange("wgt" if s > 0 else "bwd", r, st.device, c.lo, c.hi,
                                                              action=j == 0, accumulates=accumulates)), c.bucket)
                                     for j, c in enumerate(chunks)])

    # --- transfers ---------------------------------------------------------------------------
    def route(self, src: str, dst: str, replica: int | None = None, cut: int | None = None,
              n_bytes: float = 0.0) -> list[tuple[RouteHop, int]]:
        """Each hop of src -> dst with the value id of its duration: the activation at `cut` at
        the replica's microbatch, or else n_bytes."""
        out = []
        for h in self.sim.hops(src, dst):
            if cut is not None:
                recipe = HopRecipe(replica, cut, h.latency_s, h.bandwidth_bytes_per_s)
            else:
                recipe = Const(h.latency_s + n_bytes / h.bandwidth_bytes_per_s)
            out.append((h, self.g.value(recipe)))
        return out

    def chain(self, route: list[tuple[RouteHop, int]], src: str, dst: str, after: int | None,
              label: object, posted: int | None = None) -> int | None:
        """One task per hop (store and forward) from task `after`, the first also after task
        `posted` (where the receiver posts its receive); returns the last hop's task."""
        g, t = self.g, after
        for j, (h, k) in enumerate(route):
            deps = (t, posted) if j == 0 else (t,)
            t = g.add(k, (h.resource,), deps, TaskMeta(label, h.lane, "transfer") if self.tracing else None)
            g.count(src, "comm_s", k)
            g.count(dst, "comm_s", k)
        return t

    def host_copy(self, src: str, dst: str, after: int, label: str, n_bytes: float) -> int:
        """Gradients to an offloaded optimizer's host, or parameters back: one task on the first
        hop of the route when the accelerator has a measured host-copy fit (cost.host_copy_s),
        else a transfer over the links like any other."""
        g, sim = self.g, self.sim
        gpu, direction = (src, "d2h") if sim.topology.device(src).kind != "cpu" else (dst, "h2d")
        d = sim.cost.host_copy_s(gpu, n_bytes, direction)
        hops = sim.hops(src, dst)
        if d is None or not hops:
            return self.chain(self.route(src, dst, n_bytes=n_bytes), src, dst, after, label)
        k = g.value(Const(d))
        t = g.add(k, (hops[0].resource,), (after,), TaskMeta(label, hops[0].lane, "transfer"))
        g.count(src, "comm_s", k)
        g.count(dst, "comm_s", k)
        return t

    # --- gradient exchange and optimizer steps -------------------------------------------------
    def allreduces(self) -> dict[str, list[int]]:
        """One ring all-reduce per exchanged bucket, once its gradients are final on every device
        of its group (fine) or after those devices' last backward (coarse); a tied parameter's
        after its devices' last backward (the runtime may start it earlier). Returns each
        device's all-reduce tasks."""
        ex, progress = self.exchange, self.progress
        synced: dict[str, list[int]] = {}
        started: set[tuple[str, ...]] = set()    # device sets whose burst has begun
        for k, b in enumerate(ex.buckets):
            burst = ex.fine and all(d in self.sim.saturated for d in b.devices)
            deps = [progress.chunk_of[(dev, k)] if ex.fine and not burst else progress.last_backward[dev]
                    for dev in b.devices]
            self.allreduce(f"b{k}", b, deps, synced, queued=burst and b.devices in started)
            started.add(b.devices)
        for k, b in enumerate(ex.tied):
            self.allreduce(f"tied{k}", b, [progress.last_backward[dev] for dev in b.devices], synced)
        return synced

    def allreduce(self, name: str, b: Bucket, deps: list[int], synced: dict[str, list[int]],
                  queued: bool = False) -> None:
        g = self.g
        res, d = self.sim.allreduce(b.devices, b.bytes, queued)
        d_k = g.value(Const(d))
        t = g.add(d_k, res, deps, TaskMeta(f"allreduce {name} {b.bytes}B", "+".join(b.devices), "allreduce")
                  if self.tracing else None)
        g.sync_res.update(res)
        for dev in b.devices:
            g.count(dev, "comm_s", d_k)
            synced.setdefault(dev, []).append(t)

    def optimizer_steps(self, synced: dict[str, list[int]]) -> list[int]:
        """One step per device holding parameters, after its all-reduces (its last backward when
        it exchanges nothing); on its host CPU under placement "cpu"; under "split" the host
        CPU updates cpu_fraction of the bytes (and of the tensors, rounded) while the device
        updates the rest, both after the same all-reduces. A worker that waited for its
        all-reduces starts the step cold (cost.cold_compute_s). Returns the steps' last tasks."""
        graph, sim = self.sim.graph, self.sim
        opt, placement = self.plan.optimizer.name, self.plan.optimizer.placement
        f = self.plan.optimizer.cpu_fraction if placement == "split" else None
        steps: list[int] = []
        stepped: dict[str, int] = {}
        for dev, (n, n_t) in stepped_params(self.plan, graph).items():
            if n <= 0:
                continue
            deps = synced.get(dev) or [self.progress.last_backward[dev]]
            if synced.get(dev) and not self.ddp:
                deps = self.copy_back(dev, deps)
            if self.plan.optimizer.clip_grad_norm is not None:
                deps = [self.optimizer_task(dev, "gradient clip", sim.cost.clip_s(dev, n, self.plan.devices), deps)]
            host = host_cpu(sim.topology, dev) if placement != "device" else dev
            if host != dev and f is None:
                steps.append(self.offloaded_step(dev, host, n, n_t, deps))
                stepped[dev] = steps[-1]          # sharded: the gather waits for it
                continue
            host_part, launch = None, 0.0
            if host != dev:
                host_part = (f * n, round(f * n_t))
                n, n_t = (1 - f) * n, n_t - round(f * n_t)
                # the worker launches its device's part, then updates the host's part on its
                # own thread (hetplan.runtime.optim.StageOptimizer): where the launches are timed, that
                # part waits for them; else both start after the same all-reduces
                launch = sim.cost.optimizer_launch_s(dev, opt, n_t)
                if launch <= 0.0:
                    steps.append(self.offloaded_step(dev, host, *host_part, deps))
            cold = sim.cost.cold_compute_s(dev) if synced.get(dev) else 0.0
            step = sim.cost.optimizer_s(dev, n, opt, n_t) + cold
            if launch > 0.0:
                t = self.optimizer_task(dev, f"{opt} step launches", launch + cold, deps)
                steps.append(self.offloaded_step(dev, host, *host_part, [t]))
                t = self.optimizer_task(dev, f"{opt} step on the device", step - launch - cold, [t])
            else:
                t = self.optimizer_task(dev, f"{opt} step", step, deps)
            steps.append(t)
            stepped[dev] = t
        return self.parameter_gathers(stepped) if self.plan.shard in (1, 2) else steps   # ZeRO-3: as they run

    def stage_groups(self):
        """Sharded plans: (j, stage j of replica 0, the devices of stage j of every replica)."""
        for j, st in enumerate(self.plan.replicas[0].stages):
            yield j, st, tuple(rep.stages[j].device for rep in self.plan.replicas)

    def scatters(self) -> dict[str, list[int]]:
        """ZeRO stage 2 as the runtime runs it (hetplan.runtime.shard.GradScatter): the exchanged
        buckets' gradients reduce-scattered a bucket at a time, each collective holding backward:
        priced after the group's last backwards, half an all-reduce per bucket on NCCL, a whole
        one on gloo (which runs it as an all-reduce of the rows), and the copy of
        the gradients into the buckets' rows on each device. Returns each device's tasks, as
        `allreduces`."""
        g, graph, synced = self.g, self.sim.graph, {}
        for j, st, devices in self.stage_groups():
            # NCCL (all CUDA): half an all-reduce; gloo (hetplan.runtime.sync.Groups): an all-reduce
            share = 0.5 if all(self.sim.topology.device(d).kind == "cuda" for d in devices) else 1.0
            mine = [b for b in self.exchange.buckets if set(b.devices) == set(devices)]
            d = sum(self.sim.allreduce(b.devices, b.bytes)[1] * share for b in mine)
            if any(dev in self.sim.saturated for dev in devices):   # each bucket's wait a wake-up
                d += len(mine) * max(map(self.resumed_s, devices))
            res = self.sim.allreduce(devices, graph.stage_param_bytes(st.start, st.end))[0]
            d_k = g.value(Const(d))
            t = g.add(d_k, res, [self.progress.last_backward[dev] for dev in devices],
                      TaskMeta(f"gradient reduce-scatter stage {j}", "+".join(devices), "allreduce")
                      if self.tracing else None)
            g.sync_res.update(res)
            for dev in devices:
                g.count(dev, "comm_s", d_k)
                synced[dev] = [self.copy_task(dev, "gradient copy to the scatter",
                                              graph.stage_param_bytes(st.start, st.end), [t])]
        return synced

    def parameter_gathers(self, stepped: dict[str, int]) -> list[int]:
        """Sharded (ZeRO): each replica stepped 1/N of a stage's parameters; one all-gather per
        stage of its replicas gives every one all of them, after all their steps
        (cost.allgather_s: profiled on CPU workers, else half an all-reduce; on CPU workers with no
        core to spare, with its wait's wake-up), and each device copies its slices out and the
        others' in (the stage's bytes; hetplan.runtime.shard.ShardedStep.gather). Returns the
        copies."""
        g, graph, out = self.g, self.sim.graph, []
        for j, st, devices in self.stage_groups():
            n = graph.stage_param_bytes(st.start, st.end)
            res, d = self.sim.allgather(devices, n)
            if any(dev in self.sim.saturated for dev in devices):   # its wait a wake-up, as the scatters'
                d += max(map(self.resumed_s, devices))
            d_k = g.value(Const(d))
            t = g.add(d_k, res, [stepped[dev] for dev in devices if dev in stepped],
                      TaskMeta(f"parameter all-gather stage {j}", "+".join(devices), "allreduce")
                      if self.tracing else None)
            g.sync_res.update(res)
            for dev in devices:
                g.count(dev, "comm_s", d_k)
                out.append(self.copy_task(dev, "parameter copies of the gather", n, [t]))
        return out

    def copy_task(self, dev: str, name: str, n_bytes: float, deps: list[int]) -> int:
        """A memory-bound copy of n bytes on dev's queue after `deps` (cost.grad_copy_s; a task of
        0 s without calibration)."""
        t = self.g.add(self.g.value(Const(self.sim.cost.grad_copy_s(dev, n_bytes))), (self.sim.rid[dev],), deps,
                       TaskMeta(name, dev, "optimizer") if self.tracing else None)
        self.g.memory_bound.add(t)
        return t

    def copy_back(self, dev: str, deps: list[int]) -> list[int]:
        """GradSync writes the all-reduced buckets back into the gradients once it has waited
        for them all (hetplan.planner.cost.grad_sync): a task on dev's queue after its all-reduces, the
        step's new dependency; none where the copy costs nothing (no calibration)."""
        ex, sim = self.exchange, self.sim
        n = sum(ex.buckets[k].bytes for k in ex.by_device.get(dev, ()))
        d = sim.cost.grad_copy_s(dev, n)
        if d == 0.0:
            return deps
        t = self.g.add(self.g.value(Const(d)), (sim.rid[dev],), deps,
                       TaskMeta("gradient copy back", dev, "optimizer") if self.tracing else None)
        self.g.memory_bound.add(t)
        return [t]

    def parameter_exchange(self, steps: list[int]) -> None:
        """Local SGD and EASGD (the modes with a sync.period): every `period` iterations, one all-reduce of the
        parameters (local SGD: their weighted sum; EASGD: the elastic differences) among the
        replicas, after every step; priced per iteration as 1/period of it. Replicas that differ
        in speed wait for the slowest at the exchange, so an iteration costs the slowest
        replica's step plus that share. Not modelled: EASGD's element-wise updates."""
        devices = tuple(self.plan.devices)
        if len(devices) < 2:
            return
        g = self.g
        n = self.sim.graph.stage_param_bytes(0, self.sim.graph.num_layers)
        res, d = self.sim.allreduce(devices, n)
        d_k = g.value(Const(d / self.plan.sync.period))
        g.add(d_k, res, steps,
              TaskMeta(f"parameter exchange {n}B / {self.plan.sync.period}", "+".join(devices), "allreduce"))
        g.sync_res.update(res)
        for dev in devices:
            g.count(dev, "comm_s", d_k)

    def server_steps(self) -> None:
        """Parameter server: after its backward, each worker sends its gradients to the server,
        the server steps on them (one step per worker, in arrival order on its queue) and sends
        the parameters back. The workers do not step themselves."""
        g, sim, graph = self.g, self.sim, self.sim.graph
        server, opt = self.plan.sync.server, self.plan.optimizer.name
        n = graph.stage_param_bytes(0, graph.num_layers)
        n_t = sum(len(layer.param_names) for layer in graph.layers)
        step_k = g.value(Const(sim.cost.optimizer_s(server, n, opt, n_t)))
        for rep in self.plan.replicas:
            dev = rep.stages[0].device
            push = self.chain(self.route(dev, server, n_bytes=n), dev, server,
                              self.progress.last_backward[dev], f"grads {dev}->{server}")
            t = g.add(step_k, (sim.rid[server],), (push,), TaskMeta(f"{opt} step for {dev}", server, "optimizer"))
            g.memory_bound.add(t)
            g.count(server, "optimizer_s", step_k)
            self.chain(self.route(server, dev, n_bytes=n), server, dev, t, f"params {server}->{dev}")
            g.sync_res.update(h.resource for h in sim.hops(dev, server) + sim.hops(server, dev))
        g.sync_res.add(sim.rid[server])    # the server's queue couples the replicas

    def offloaded_step(self, dev: str, host: str, n_bytes: float, n_tensors: int, deps: list[int]) -> int:
        """Gradients copied to the host once synced, the step there, parameters copied back."""
        g, sim, opt = self.g, self.sim, self.plan.optimizer.name
        join = g.add(g.value(Const(0.0)), (), deps, TaskMeta("sync", dev, "join"))
        t = self.host_copy(dev, host, join, f"grads {dev}->{host}", n_bytes)
        t = self.optimizer_task(host, f"{opt} step for {dev}", sim.cost.optimizer_s(host, n_bytes, opt, n_tensors), [t])
        return self.host_copy(host, dev, t, f"params {host}->{dev}", n_bytes)

    def optimizer_task(self, dev: str, name: str, seconds: float, deps) -> int:
        """A memory-bound optimizer task of `seconds` on dev's queue after `deps`, counted in
        dev's optimizer time."""
        g = self.g
        d_k = g.value(Const(seconds))
        t = g.add(d_k, (self.sim.rid[dev],), deps, TaskMeta(name, dev, "optimizer") if self.tracing else None)
        g.memory_bound.add(t)
        g.count(dev, "optimizer_s", d_k)
        return t


def stage_messages(graph: ModelGraph, stages, s: int) -> tuple[int, int, int, int]:
    """(sends, receives) of stage s's forward, then of its backward, counted in tensors: the
    runtime issues one isend or posts one irecv per tensor of a message (hetplan.runtime.pipeline.PeerLink),
    an activation message holds every tensor crossing the cut, a gradient message those of them
    that carry a gradient (ModelGraph.message_tensors)."""
    st, first, last = stages[s], s == 0, s == len(stages) - 1
    return (0 if last else graph.message_tensors(st.end), 0 if first else graph.message_tensors(st.start),
            0 if first else graph.message_tensors(st.start, back=True),
            0 if last else graph.message_tensors(st.end, back=True))


def _shares(st: Stage) -> tuple[tuple[str, float], ...]:
    return tuple((s.device, s.share) for s in st.split)


__all__ = ["Builder", "Exchange", "Chunk", "Progress", "STREAM_ITERATIONS", "stage_messages"]
