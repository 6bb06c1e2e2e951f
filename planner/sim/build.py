"""The task graph of a plan shape, built job by job (what is modelled: planner.sim.simulator).

`Builder(sim, plan, g, like).build()` adds every task of `plan` to `g`, durations as recipes
(planner.sim.taskgraph) evaluated per plan: the plan's devices; the gradient buckets to
exchange; per replica, each stage's compute in schedule order and the transfers between
stages; one all-reduce per exchanged bucket; one optimizer step per device holding parameters
(on its host CPU when offloaded). The same statistics are counted in the same order as tasks
are added, so per-device sums are reproducible bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from planner.cost.buckets import Bucket, coarse_buckets, grad_buckets, tied_buckets
from planner.cost.model import CostModel, host_cpu
from planner.files.plan import Plan, Replica, Stage
from planner.hardware.topology import Topology
from planner.sim.template import ReplicaTemplate, replica_template
from planner.sim.taskgraph import (COUNTED, ComputeLabel, Const, HopRecipe, LayerRange, Recompute,
                                   RouteHop, TaskGraph, TaskMeta, TransferLabel)
from planner.workload.graph import ModelGraph


class SimulatorView(Protocol):
    """What the builder uses of planner.sim.simulator.Simulator (which imports this module)."""
    graph: ModelGraph
    topology: Topology
    cost: CostModel
    _rid: dict[Any, int]   # resource id of each device and link direction

    def hops(self, a: str, b: str) -> list[RouteHop]: ...

    def _allreduce(self, devices: tuple[str, ...], n_bytes: float) -> tuple[tuple[int, ...], float]: ...


class Exchange(NamedTuple):
    """The gradient buckets held by more than one device (merged per device set under coarse
    sync), and per device the indices of those it holds, in ready order; under fine sync the
    tied parameters' buckets apart (exchanged after their devices' last backward)."""
    fine: bool
    buckets: list[Bucket]
    by_device: dict[str, list[int]]
    tied: list[Bucket] = []


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


class Builder:
    """Builds one plan shape's task graph for `sim` (a Simulator: its resource ids, routes and
    all-reduce cache); replica r is simulated by replica like[r] where that differs from r."""

    def __init__(self, sim: SimulatorView, plan: Plan, g: TaskGraph, like: tuple[int, ...] | None):
        self.sim, self.plan, self.g, self.like = sim, plan, g, like
        self.tracing = g.meta is not None   # labels are made only for a trace
        self.progress = Progress()
        self.exchange = Exchange(False, [], {})

    def build(self) -> None:
        self.plan_devices()
        self.exchange = self.exchanged_buckets()
        for r, rep in enumerate(self.plan.replicas):
            self.replica(r, rep)
        self.optimizer_steps(self.allreduces())

    # --- devices and buckets -----------------------------------------------------------------
    def plan_devices(self) -> None:
        """The plan's devices, plus the host CPUs of an offloaded optimizer, each with its
        statistics; an unknown device raises KeyError naming it."""
        plan, topology = self.plan, self.sim.topology
        devices = list(plan.devices)
        if plan.optimizer.placement == "cpu":
            devices += [h for h in (host_cpu(topology, d) for d in plan.devices) if h not in devices]
        for d in devices:
            topology.device(d)
            for s in COUNTED:
                self.g.stat_seq[(d, s)] = []
        self.g.devices = tuple(devices)

    def exchanged_buckets(self) -> Exchange:
        fine = self.plan.sync.granularity == "fine"
        shared = [b for b in grad_buckets(self.plan, self.sim.graph) if len(b.devices) > 1]
        tied = tied_buckets(self.plan, self.sim.graph)
        if not fine:
            shared, tied = coarse_buckets(shared + tied), []
        by_device: dict[str, list[int]] = {}
        for k, b in enumerate(shared):
            for d in b.devices:
                by_device.setdefault(d, []).append(k)
        return Exchange(fine, shared, by_device, tied)

    # --- one replica: compute per stage, then the transfers between stages --------------------
    def replica(self, r: int, rep: Replica) -> None:
        """The replica's tasks, stamped from its structure's template (planner.sim.template)."""
        g, hops, like, sim = self.g, self.sim.hops, self.like, self.sim
        m, stages = rep.microbatches, rep.stages
        pairs = [(a.device, b.device) for a, b in zip(stages, stages[1:])]
        routes = [(hops(a, b), hops(b, a)) for a, b in pairs]
        counts = tuple((len(x), len(y)) for x, y in routes)
        g.begin_replica((m, tuple(st.layers for st in stages), counts),
                        g.replica_tasks[like[r]] if like and like[r] != r else None)
        chunks = [self.backward_chunks(st) for st in stages]
        t = replica_template(self.plan.schedule, m, tuple(len(c) for c in chunks), counts)
        vals: list[int] = []
        lasts = []
        for st, ch in zip(stages, chunks):   # values in the order the slots number them
            vals.append(g.value(LayerRange("fwd", r, st.device, st.start, st.end)))
            lasts.append(self.backward_values(r, st, ch))
            vals += [k for k, _ in lasts[-1]]
            if m > 1:
                vals += [k for k, _ in self.backward_values(r, st, [Chunk(st.end, st.start, None)])]
        rids = [sim._rid[st.device] for st in stages]
        lanes = [st.device for st in stages]
        for st, route_pair in zip(stages[1:], routes):
            for route in route_pair:
                for h in route:
                    vals.append(g.value(HopRecipe(r, st.start, h.latency_s, h.bandwidth_bytes_per_s)))
                    rids.append(h.resource)
                    lanes.append(h.lane)
        res = [(x,) for x in rids]
        ids = g.stamp(list(map(vals.__getitem__, t.value)), list(map(res.__getitem__, t.res)), t.succ_at,
                      t.ndeps, self.labels(r, t, lanes) if self.tracing else None)
        devs = [st.device for st in stages]
        seq = g.stat_seq
        for s, stat, vs in t.counts:   # a plan's devices are distinct: each group keeps its order
            seq[(devs[s], stat)] += map(vals.__getitem__, vs)
        progress = self.progress
        for s, dev in enumerate(devs):
            for (_, bucket), end in zip(lasts[s], t.chunk_end[s]):
                if bucket is not None:
                    progress.chunk_of[(dev, bucket)] = ids[end]
            progress.last_backward[dev] = ids[t.last_backward[s]]
        g.end_replica()

    @staticmethod
    def labels(r: int, t: ReplicaTemplate, lanes: list[str]) -> list[TaskMeta]:
        """The trace's labels of a stamped replica."""
        out = []
        for lab, x in zip(t.label, t.res):
            if lab[0] == "compute":
                out.append(TaskMeta(ComputeLabel(r, lab[2]), lanes[x],
                                    "forward" if lab[2].kind == "F" else "backward"))
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
        ks = ex.by_device[st.device]
        for j, k in enumerate(ks):
            lo = st.start if j == len(ks) - 1 else min(ex.buckets[k].layers)
            chunks.append(Chunk(hi, lo, k))
            hi = lo
        return chunks

    def backward_values(self, r: int, st: Stage, chunks: list[Chunk]) -> list[tuple[int, int | None]]:
        """(value id, bucket) per backward task of one microbatch; with recompute, the first one
        also runs the stage's forward again."""
        out = []
        for j, c in enumerate(chunks):
            if self.plan.recompute and j == 0:
                recipe = Recompute(r, st.device, c.lo, c.hi, st.start, st.end)
            else:
                recipe = LayerRange("bwd", r, st.device, c.lo, c.hi)
            out.append((self.g.value(recipe), c.bucket))
        return out

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
              label: object) -> int | None:
        """One task per hop (store and forward) from task `after`; returns the last hop's task."""
        g, t = self.g, after
        for h, k in route:
            t = g.add(k, (h.resource,), (t,), TaskMeta(label, h.lane, "transfer") if self.tracing else None)
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
        for k, b in enumerate(ex.buckets):
            deps = [progress.chunk_of[(dev, k)] if ex.fine else progress.last_backward[dev]
                    for dev in b.devices]
            self.allreduce(f"b{k}", b, deps, synced)
        for k, b in enumerate(ex.tied):
            self.allreduce(f"tied{k}", b, [progress.last_backward[dev] for dev in b.devices], synced)
        return synced

    def allreduce(self, name: str, b: Bucket, deps: list[int], synced: dict[str, list[int]]) -> None:
        g = self.g
        res, d = self.sim._allreduce(b.devices, b.bytes)
        d_k = g.value(Const(d))
        t = g.add(d_k, res, deps, TaskMeta(f"allreduce {name} {b.bytes}B", "+".join(b.devices), "allreduce"))
        g.sync_res.update(res)
        for dev in b.devices:
            g.count(dev, "comm_s", d_k)
            synced.setdefault(dev, []).append(t)

    def optimizer_steps(self, synced: dict[str, list[int]]) -> None:
        """One step per device holding parameters, after its all-reduces (its last backward when
        it exchanges nothing); on its host CPU under placement "cpu"."""
        g, graph, sim = self.g, self.sim.graph, self.sim
        opt, offload = self.plan.optimizer.name, self.plan.optimizer.placement == "cpu"
        for rep in self.plan.replicas:
            for st in rep.stages:
                dev = st.device
                n = graph.stage_param_bytes(st.start, st.end)
                if n <= 0:
                    continue
                n_t = sum(len(graph.layers[i].param_names) for i in range(st.start, st.end))
                deps = synced.get(dev) or [self.progress.last_backward[dev]]
                host = host_cpu(sim.topology, dev) if offload else dev
                if host != dev:
                    self.offloaded_step(dev, host, n, n_t, deps)
                    continue
                d_k = g.value(Const(sim.cost.optimizer_s(dev, n, opt, n_t)))
                t = g.add(d_k, (sim._rid[dev],), deps, TaskMeta(f"{opt} step", dev, "optimizer"))
                g.memory_bound.add(t)
                g.count(dev, "optimizer_s", d_k)

    def offloaded_step(self, dev: str, host: str, n_bytes: float, n_tensors: int, deps: list[int]) -> None:
        """Gradients copied to the host once synced, the step there, parameters copied back."""
        g, sim, opt = self.g, self.sim, self.plan.optimizer.name
        join = g.add(g.value(Const(0.0)), (), deps, TaskMeta("sync", dev, "join"))
        t = self.host_copy(dev, host, join, f"grads {dev}->{host}", n_bytes)
        d_k = g.value(Const(sim.cost.optimizer_s(host, n_bytes, opt, n_tensors)))
        t = g.add(d_k, (sim._rid[host],), (t,), TaskMeta(f"{opt} step for {dev}", host, "optimizer"))
        g.memory_bound.add(t)
        g.count(host, "optimizer_s", d_k)
        self.host_copy(host, dev, t, f"params {host}->{dev}", n_bytes)


__all__ = ["Builder", "Exchange", "Chunk", "Progress"]
