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
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

from planner.cost.buckets import Bucket, coarse_buckets, grad_buckets, tied_buckets
from planner.cost.model import CostModel, host_cpu
from planner.files.plan import Plan, Replica, Stage
from planner.hardware.topology import Topology
from planner.sim.schedule import Action, make_schedule
from planner.sim.taskgraph import (COUNTED, ComputeLabel, Const, HopRecipe, LayerRange, Recompute,
                                   RouteHop, TaskGraph, TaskMeta, TransferLabel)
from planner.workload.graph import ModelGraph


@lru_cache(maxsize=1024)
def _schedule(name: str, stages: int, microbatches: int):
    return make_schedule(name, stages, microbatches)


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


class StageTasks(NamedTuple):
    """Task ids of one stage per microbatch: its forward, its first and last backward piece."""
    fwd: list[int | None]
    bwd_first: list[int | None]
    bwd_last: list[int | None]


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
        g, hops, like = self.g, self.sim.hops, self.like
        sched = _schedule(self.plan.schedule, len(rep.stages), rep.microbatches)
        pairs = [(a.device, b.device) for a, b in zip(rep.stages, rep.stages[1:])]
        g.begin_replica((rep.microbatches, tuple(st.layers for st in rep.stages),
                         tuple((len(hops(a, b)), len(hops(b, a))) for a, b in pairs)),
                        g.replica_tasks[like[r]] if like and like[r] != r else None)
        tasks = [self.stage_tasks(r, st, sched[s], rep.microbatches) for s, st in enumerate(rep.stages)]
        self.wire_transfers(r, rep, tasks)
        g.end_replica()

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

    def stage_tasks(self, r: int, st: Stage, actions: list[Action], m: int) -> StageTasks:
        """The stage's compute tasks in schedule order, each after the previous one."""
        g, dev, progress = self.g, st.device, self.progress
        rid = self.sim._rid[dev]
        tasks = StageTasks([None] * m, [None] * m, [None] * m)
        f_k = g.value(LayerRange("fwd", r, dev, st.start, st.end))
        last = self.backward_values(r, st, self.backward_chunks(st))
        other = self.backward_values(r, st, [Chunk(st.end, st.start, None)]) if m > 1 else []
        prev = None
        for act in actions:
            i = act.microbatch
            meta = None
            if self.tracing:
                meta = TaskMeta(ComputeLabel(r, act), dev, "forward" if act.kind == "F" else "backward")
            if act.kind == "F":
                prev = tasks.fwd[i] = g.add(f_k, (rid,), (prev,), meta)
                g.count(dev, "fwd_s", f_k)
                continue
            first = None
            for k, bucket in (last if i == m - 1 else other):
                prev = g.add(k, (rid,), (prev,), meta)
                g.count(dev, "bwd_s", k)
                if first is None:
                    first = prev
                if bucket is not None:
                    progress.chunk_of[(dev, bucket)] = prev
            tasks.bwd_first[i], tasks.bwd_last[i] = first, prev
        progress.last_backward[dev] = prev
        return tasks

    def wire_transfers(self, r: int, rep: Replica, tasks: list[StageTasks]) -> None:
        """Per microbatch between consecutive stages: the activation, from the forward to the next
        stage's forward; its gradient, from the backward to the previous stage's first piece."""
        g = self.g
        for s in range(1, len(rep.stages)):
            src, dst, cut = rep.stages[s - 1].device, rep.stages[s].device, rep.stages[s].start
            ahead, back = self.route(src, dst, r, cut), self.route(dst, src, r, cut)
            for i in range(rep.microbatches):
                act = TransferLabel("act", r, s - 1, s, i) if self.tracing else None
                grad = TransferLabel("grad", r, s, s - 1, i) if self.tracing else None
                g.wire(self.chain(ahead, src, dst, tasks[s - 1].fwd[i], act), tasks[s].fwd[i])
                g.wire(self.chain(back, dst, src, tasks[s].bwd_last[i], grad), tasks[s - 1].bwd_first[i])

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


__all__ = ["Builder", "Exchange", "Chunk", "StageTasks", "Progress"]
