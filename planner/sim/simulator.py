"""The execution simulator: a task graph of one training iteration and a deterministic event loop.

Tasks (per replica x stage x microbatch): forward and backward compute on the stage's device;
activation / gradient transfers between consecutive stages, one task per link hop of the
route (store-and-forward); one ring all-reduce per gradient bucket (planner.cost.buckets) among
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
merged, as the runtime does). Recompute adds the stage's forward to its backward.

Not modelled: compute slowed by concurrent communication (NCCL kernels, gloo threads), the
loss computation (part of the last stage's forward as captured), send/recv launch overhead
beyond link latency, and all-reduce algorithms other than the ring.

Speed (none of it changes a result, bit for bit): the task graph (planner.sim.taskgraph) is built
once per plan shape (everything but batch sizes) and its durations are evaluated per plan;
replicas that are identical and provably independent are simulated once (`Simulator._like`);
the event loop (planner.sim.eventloop) avoids per-task allocations. A per-plan result cache sits
on top; benchmarks/simulator_speed.py measures with it off.
"""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any

from planner.cost.buckets import coarse_buckets, grad_buckets
from planner.cost.model import CostModel, RooflineCost, host_cpu
from planner.sim.eventloop import run as run_tasks
from planner.workload.graph import ModelGraph
from planner.cost.memory import feasible as memory_feasible, peak_memory
from planner.files.plan import Plan
from planner.sim.schedule import make_schedule
from planner.sim.taskgraph import TaskGraph
from planner.hardware.topology import Topology


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    peak_memory_bytes: dict[str, float]
    feasible: bool
    per_device: dict[str, dict[str, float]]
    tasks: tuple[dict[str, Any], ...] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "peak_memory_bytes": dict(self.peak_memory_bytes),
                "feasible": self.feasible, "per_device": {d: dict(v) for d, v in self.per_device.items()}}


# Contention (CostModel.contention): simulate alone, then this many times with each CPU worker's
# compute slowed by the overlap measured on the previous timeline (a fixed point; 2 is within
# 1 % of 5 on the accuracy benchmark's plans).
CONTENTION_PASSES = 2
_STATS = ("fwd_s", "bwd_s", "optimizer_s", "compute_s", "comm_s")


@lru_cache(maxsize=1024)
def _schedule(name: str, stages: int, microbatches: int):
    return make_schedule(name, stages, microbatches)


class PrecisionMismatch(RuntimeError):
    """A plan simulated on a graph captured in another precision (a caller's mistake)."""


class Simulator:
    """Simulates plans of one graph on one topology, in the precision the graph was captured in;
    costs, routes and task graphs are cached."""

    def __init__(self, graph: ModelGraph, topology: Topology, cost: CostModel | None = None,
                 cache_size: int = 4096, shape_cache_size: int = 64, collapse: bool = True):
        self.graph, self.topology = graph, topology
        self.cost = cost if cost is not None else RooflineCost(graph, topology)
        self._rid: dict[Any, int] = {}
        self._lanes: list[str] = []
        for d in topology.devices:
            self._resource(d.name)
        self._hops: dict[tuple[str, str], list[tuple[int, float, float, str]]] = {}
        self._ar: dict[tuple[tuple[str, ...], float], tuple[tuple[int, ...], float]] = {}
        self._cache: dict[Any, SimResult] = {}
        self._cache_size = cache_size
        self._shapes: dict[Any, TaskGraph] = {}
        self._shape_cache_size = shape_cache_size
        self._collapse = collapse
        self._saturated = saturated_cpus(topology)

    # --- resources and routes ----------------------------------------------------------------
    def _resource(self, key: Any) -> int:
        if key not in self._rid:
            self._rid[key] = len(self._lanes)
            self._lanes.append(key if isinstance(key, str) else f"{key[0]}->{key[1]}")
        return self._rid[key]

    def hops(self, a: str, b: str) -> list[tuple[int, float, float, str]]:
        """(resource id, latency_s, bandwidth, lane) per link direction on the route a -> b."""
        key = (a, b)
        if key not in self._hops:
            out, cur = [], a
            links = self.topology.route(a, b)
            if links and a not in (links[0].a, links[0].b):
                links = links[::-1]   # Topology.route caches one orientation per pair
            for link in links:
                nxt = link.b if link.a == cur else link.a
                out.append((self._resource((cur, nxt)), link.latency_s, link.bandwidth_bytes_per_s,
                            f"{cur}->{nxt}"))
                cur = nxt
            self._hops[key] = out
        return self._hops[key]

    def _allreduce(self, devices: tuple[str, ...], n_bytes: float) -> tuple[tuple[int, ...], float]:
        key = (devices, n_bytes)
        if key not in self._ar:
            res: list[int] = []
            k = len(devices)
            for i in range(k):
                for h in self.hops(devices[i], devices[(i + 1) % k]):
                    if h[0] not in res:
                        res.append(h[0])
            # gloo runs the collective on the workers' own CPU cores: with no core to spare it
            # cannot overlap their compute, so it also holds their compute queues
            res += [self._rid[d] for d in devices if d in self._saturated]
            self._ar[key] = (tuple(res), self.cost.allreduce_s(devices, n_bytes))
        return self._ar[key]

    # --- building the task graph of a plan shape ---------------------------------------------
    def _transfer(self, g: TaskGraph, src: str, dst: str, after: int, label, size: tuple) -> int:
        """Chain one task per hop from `after`; returns the last hop's task id.
        size: (replica, cut) for activations at the replica's microbatch, or ("const", bytes)."""
        t = after
        for rid, lat, bw, lane in self.hops(src, dst):
            if size[0] == "const":
                k = g.value(("const", lat + size[1] / bw))
            else:
                k = g.value(("hop", size[0], size[1], lat, bw))
            t = g.add(k, (rid,), (t,), (label, lane, "transfer"))
            g.count(src, "comm_s", k)
            g.count(dst, "comm_s", k)
        return t

    def _build(self, plan: Plan, g: TaskGraph, like: tuple[int, ...] | None = None) -> None:
        """Everything of `plan` but its batch sizes becomes tasks of `g`; replica r is simulated
        by replica like[r] where that differs from r (see `_like`)."""
        graph = self.graph
        devices = list(plan.devices)
        if plan.optimizer.placement == "cpu":
            devices += [h for h in (host_cpu(self.topology, d) for d in plan.devices) if h not in devices]
        for d in devices:
            self.topology.device(d)   # raises KeyError naming the device
            for s in _STATS[:3] + _STATS[4:]:
                g.stat_seq[(d, s)] = []
        g.devices = tuple(devices)
        fine = plan.sync.granularity == "fine"
        buckets = grad_buckets(plan, graph)
        # Buckets that need an exchange, indexed by the device holding them in each replica.
        shared = [b for b in buckets if len(b.devices) > 1]
        if not fine:
            shared = coarse_buckets(shared)
        by_device: dict[str, list[int]] = {}
        for k, b in enumerate(shared):
            for d in b.devices:
                by_device.setdefault(d, []).append(k)
        chunk_of: dict[tuple[str, int], int] = {}   # (device, bucket) -> task making it final
        last_b: dict[str, int] = {}                 # device -> its last backward task
        rec = plan.recompute
        for r, rep in enumerate(plan.replicas):
            p, m = len(rep.stages), rep.microbatches
            sched = _schedule(plan.schedule, p, m)
            pairs = [(a.device, b.device) for a, b in zip(rep.stages, rep.stages[1:])]
            g.begin_replica((m, tuple(st.layers for st in rep.stages),
                             tuple((len(self.hops(a, b)), len(self.hops(b, a))) for a, b in pairs)),
                            g.replica_tasks[like[r]] if like and like[r] != r else None)
            fwd = [[None] * m for _ in range(p)]   # task id of F
            bwd_first = [[None] * m for _ in range(p)]
            bwd_last = [[None] * m for _ in range(p)]
            # Tasks are created stage by stage in schedule order; the transfers between stages
            # are wired afterwards.
            for s, st in enumerate(rep.stages):
                dev, rid, a, e = st.device, self._rid[st.device], st.start, st.end
                f_k = g.value(("fwd", r, dev, a, e))
                # Chunks of the last microbatch's backward at bucket boundaries (fine sync).
                chunks = [(e, a, None)]
                if fine and dev in by_device:
                    chunks, hi = [], e
                    ks = by_device[dev]
                    for j, k in enumerate(ks):
                        lo = a if j == len(ks) - 1 else min(shared[k].layers)
                        chunks.append((hi, lo, k))
                        hi = lo
                prev = None
                for act in sched[s]:
                    i = act.microbatch
                    if act.kind == "F":
                        prev = fwd[s][i] = g.add(f_k, (rid,), (prev,), ((r, act), dev, "forward"))
                        g.count(dev, "fwd_s", f_k)
                        continue
                    pieces = chunks if i == m - 1 else [(e, a, None)]
                    first = None
                    for hi, lo, k in pieces:
                        lo_hi = (lo, hi) if len(pieces) > 1 else (a, e)
                        if rec and first is None:
                            d_k = g.value(("bwd+fwd", r, dev, *lo_hi, a, e))
                        else:
                            d_k = g.value(("bwd", r, dev, *lo_hi))
                        prev = g.add(d_k, (rid,), (prev,), ((r, act), dev, "backward"))
                        g.count(dev, "bwd_s", d_k)
                        if first is None:
                            first = prev
                        if k is not None:
                            chunk_of[(dev, k)] = prev
                    bwd_first[s][i], bwd_last[s][i] = first, prev
                last_b[dev] = prev
            for s in range(1, p):
                src, dst = rep.stages[s - 1].device, rep.stages[s].device
                size = (r, rep.stages[s].start)
                for i in range(m):
                    t = self._transfer(g, src, dst, fwd[s - 1][i], ("act", r, s - 1, s, i), size)
                    g.wire(t, fwd[s][i])
                    t = self._transfer(g, dst, src, bwd_last[s][i], ("grad", r, s, s - 1, i), size)
                    g.wire(t, bwd_first[s - 1][i])
            g.end_replica()
        # Gradient all-reduce per shared bucket.
        synced: dict[str, list[int]] = {}
        for k, b in enumerate(shared):
            res, d = self._allreduce(b.devices, b.bytes)
            d_k = g.value(("const", d))
            deps = [chunk_of[(dev, k)] if fine else last_b[dev] for dev in b.devices]
            t = g.add(d_k, res, deps, (f"allreduce b{k} {b.bytes}B", "+".join(b.devices), "allreduce"))
            g.sync_res.update(res)
            for dev in b.devices:
                g.count(dev, "comm_s", d_k)
                synced.setdefault(dev, []).append(t)
        # Optimizer step per device holding parameters.
        opt, offload = plan.optimizer.name, plan.optimizer.placement == "cpu"
        for rep in plan.replicas:
            for st in rep.stages:
                dev = st.device
                n = sum(graph.layers[i].param_bytes for i in range(st.start, st.end))
                if n <= 0:
                    continue
                n_t = sum(len(graph.layers[i].param_names) for i in range(st.start, st.end))
                deps = synced.get(dev) or [last_b[dev]]
                host = host_cpu(self.topology, dev) if offload else dev
                if host == dev:
                    d_k = g.value(("const", self.cost.optimizer_s(dev, n, opt, n_t)))
                    t = g.add(d_k, (self._rid[dev],), deps, (f"{opt} step", dev, "optimizer"))
                    g.memory_bound.add(t)
                    g.count(dev, "optimizer_s", d_k)
                    continue
                join = g.add(g.value(("const", 0.0)), (), deps,
                             None if g.meta is None else ("sync", dev, "join"))
                t = self._host_copy(g, dev, host, join, f"grads {dev}->{host}", n)
                d_k = g.value(("const", self.cost.optimizer_s(host, n, opt, n_t)))
                t = g.add(d_k, (self._rid[host],), (t,), (f"{opt} step for {dev}", host, "optimizer"))
                g.memory_bound.add(t)
                g.count(host, "optimizer_s", d_k)
                self._host_copy(g, host, dev, t, f"params {host}->{dev}", n)

    def _host_copy(self, g: TaskGraph, src: str, dst: str, after: int, label: str, n: float) -> int:
        """Gradients to an offloaded optimizer's host, or parameters back: one task on the first
        hop of the route when the accelerator has a measured host-copy fit (cost.host_copy_s),
        else a transfer over the links like any other."""
        gpu, direction = (src, "d2h") if self.topology.device(src).kind != "cpu" else (dst, "h2d")
        d = self.cost.host_copy_s(gpu, n, direction)
        hops = self.hops(src, dst)
        if d is None or not hops:
            return self._transfer(g, src, dst, after, label, ("const", n))
        k = g.value(("const", d))
        t = g.add(k, (hops[0][0],), (after,), (label, hops[0][3], "transfer"))
        g.count(src, "comm_s", k)
        g.count(dst, "comm_s", k)
        return t

    def _busy(self, plan: Plan) -> dict[str, int]:
        """Per plan device, how many of the plan's CPU devices share its node (itself included)
        when it is a CPU, else 1: the workers that compete for the host's cores and memory
        (CostModel.contention)."""
        kinds = {d: self.topology.device(d).kind for d in plan.devices}
        nodes = {d: self.topology.device(d).node for d in plan.devices}
        out = {}
        for d in plan.devices:
            out[d] = (sum(1 for e in plan.devices if kinds[e] == "cpu" and nodes[e] == nodes[d])
                      if kinds[d] == "cpu" else 1)
        return out

    def _contended(self, plan: Plan) -> dict[str, list[str]]:
        """Per CPU device of the plan whose compute the cost model slows when other CPU workers
        of its node compute at once: those other workers. Empty when nothing is contended."""
        out = {}
        for d, k in self._busy(plan).items():
            if k > 1 and self.cost.contention(d, k) != 1.0:
                node = self.topology.device(d).node
                out[d] = [e for e in plan.devices if e != d and self.topology.device(e).kind == "cpu"
                          and self.topology.device(e).node == node]
        return out

    def _contend(self, contended: dict[str, list[str]], g: TaskGraph, base: list[float],
                 start: list[float], end: list[float]) -> list[float]:
        """Task durations slowed by contention, from a simulated timeline (processor sharing
        approximated by a fixed point: simulate, measure overlaps, slow, simulate again).
        A compute task t of a contended device d takes base[t] * contention(d, k_t) with
        k_t = 1 + sum over d's competing workers o of |[start_t, end_t) ∩ compute(o)| / (end_t - start_t);
        an optimizer step (memory-bound) takes base[t] * memory_contention(d, k_t)."""
        spans: dict[int, list[tuple[float, float]]] = {}
        for t, r in enumerate(g.res):
            if len(r) == 1 and end[t] > start[t]:
                spans.setdefault(r[0], []).append((start[t], end[t]))
        for v in spans.values():
            v.sort()
        dur = list(base)
        for d, others in contended.items():
            rid = self._rid[d]
            theirs = [(o, [a for a, _ in o]) for o in (spans.get(self._rid[x], []) for x in others)]
            for t, r in enumerate(g.res):
                if r == (rid,) and end[t] > start[t]:
                    s, e = start[t], end[t]
                    k = 1.0 + sum(_overlap(s, e, o, starts) for o, starts in theirs) / (e - s)
                    if t in g.memory_bound:
                        dur[t] = base[t] * self.cost.memory_contention(d, k)
                        continue
                    dur[t] = base[t] * self.cost.contention(d, k)
        return dur

    def _shape(self, plan: Plan, trace: bool, like: tuple[int, ...] | None = None) -> TaskGraph:
        """The cached task graph of plan's shape (everything but batch sizes) with replicas
        collapsed as `like` says; built afresh when tracing."""
        key = (tuple((rep.microbatches, rep.stages) for rep in plan.replicas), plan.schedule,
               plan.sync, plan.optimizer.name, plan.optimizer.placement, plan.recompute, like)
        g = None if trace else self._shapes.get(key)
        if g is None:
            g = TaskGraph(trace)
            self._build(plan, g, like)
            g.shared_res = tuple(sorted({x for r in g.res if len(r) > 1 for x in r}))
            # Replicas are independent when nothing else queues on their devices and links:
            # every device holds one stage, optimizers run on their devices (after the
            # device's last backward, which they wait for through the all-reduces), and no two
            # replicas or all-reduces share a link direction.
            seen: set[int] = set()
            g.collapsible = (like is None and plan.optimizer.placement == "device"
                             and len(set(plan.devices)) == len(plan.devices))
            for used in g.replica_res if g.collapsible else ():
                if used & seen or used & g.sync_res:
                    g.collapsible = False
                    break
                seen |= used
            if not trace and self._shape_cache_size > 0:
                if len(self._shapes) >= self._shape_cache_size:
                    self._shapes.pop(next(iter(self._shapes)))
                self._shapes[key] = g
        return g

    @staticmethod
    def _like(g: TaskGraph, values: list[float]) -> tuple[int, ...]:
        """For each replica, the first replica it is identical to: the same structure (microbatches,
        layer ranges, hops between stages), the same task-to-recipe pattern and the same
        duration values. In a collapsible graph such a replica's tasks run at the same times as
        its twin's, so it is simulated by reference and only its statistics are counted."""
        first: dict[tuple, int] = {}
        return tuple(first.setdefault((g.replica_shape[r], g.replica_pattern[r],
                                       tuple(values[k] for k in g.replica_recipes[r])), r)
                     for r in range(len(g.replica_shape)))

    def _evaluate(self, plan: Plan, g: TaskGraph) -> list[float]:
        """The values of g's duration recipes for plan's batch sizes (microbatch mb = batch / m):
        fwd/bwd: cost of the layer range at mb; bwd+fwd: backward chunk plus the stage's forward
        (recompute); hop: latency_s + cut_bytes_at(cut, mb) / bandwidth. Compute is timed alone;
        contention is applied per task by `_contend`."""
        cost, graph = self.cost, self.graph
        mbs = [b / rep.microbatches for b, rep in zip(plan.replica_batches(), plan.replicas)]
        out = []
        for rc in g.recipes:
            kind = rc[0]
            if kind == "const":
                out.append(rc[1])
            elif kind == "fwd":
                out.append(cost.fwd_s(rc[2], rc[3], rc[4], mbs[rc[1]]))
            elif kind == "bwd":
                out.append(cost.bwd_s(rc[2], rc[3], rc[4], mbs[rc[1]]))
            elif kind == "bwd+fwd":
                mb = mbs[rc[1]]
                out.append(cost.bwd_s(rc[2], rc[3], rc[4], mb) + cost.fwd_s(rc[2], rc[5], rc[6], mb))
            else:   # "hop"
                out.append(rc[3] + graph.cut_bytes_at(rc[2], mbs[rc[1]]) / rc[4])
        return out

    # --- entry point -------------------------------------------------------------------------
    def simulate(self, plan: Plan, trace: bool = False) -> SimResult:
        if plan.precision != self.graph.precision:
            raise PrecisionMismatch(f"the plan's precision is {plan.precision} but the graph was "
                                    f"captured in {self.graph.precision} (see ByPrecision)")
        key = (plan.global_batch, plan.replicas, plan.schedule, plan.sync, plan.optimizer,
               plan.recompute)
        if not trace and key in self._cache:
            return self._cache[key]
        g = self._shape(plan, trace)
        values = self._evaluate(plan, g)
        contended = self._contended(plan)
        if self._collapse and g.collapsible and not trace and not contended:
            like = self._like(g, values)
            if like != tuple(range(len(like))):
                g = self._shape(plan, trace, like)
                values = self._evaluate(plan, g)
        base = list(map(values.__getitem__, g.dkey))
        start, end = run_tasks(base, g.res, g.succ, list(g.ndeps), g.shared_res, len(self._lanes))
        dur = base
        for _ in range(CONTENTION_PASSES if contended else 0):
            dur = self._contend(contended, g, base, start, end)
            start, end = run_tasks(dur, g.res, g.succ, list(g.ndeps), g.shared_res, len(self._lanes))
        iteration_s = (max(end) if end else 0.0) + self.cost.iteration_overhead_s(len(plan.devices))
        slowed = {}   # device -> contended / alone compute time (scales its statistics)
        for d in contended:
            rid = self._rid[d]
            alone = sum(base[t] for t, r in enumerate(g.res) if r == (rid,))
            slowed[d] = sum(dur[t] for t, r in enumerate(g.res) if r == (rid,)) / alone if alone else 1.0
        peaks = peak_memory(plan, self.graph, self.topology)
        stats: dict[str, dict[str, float]] = {}
        for d in g.devices:
            v = stats[d] = {}
            for s in _STATS:
                if s != "compute_s":
                    acc = 0.0
                    for k in g.stat_seq[(d, s)]:   # in build order, so sums are reproducible
                        acc += values[k]
                    v[s] = acc
                else:
                    v[s] = 0.0
            if d in slowed:
                for s in _STATS[:3]:
                    v[s] *= slowed[d]
            v["compute_s"] = v["fwd_s"] + v["bwd_s"] + v["optimizer_s"]
            v["busy_s"] = v["compute_s"]
            v["idle_s"] = iteration_s - v["busy_s"]
            v["peak_memory_bytes"] = peaks.get(d, 0.0)
        tasks = None
        if trace:
            tasks = tuple({"name": _name(m[0]), "lane": m[1], "kind": m[2], "start_s": s, "end_s": e}
                          for m, s, e in zip(g.meta, start, end) if m is not None and m[2] != "join")
        result = SimResult(iteration_s=iteration_s, peak_memory_bytes=peaks,
                           feasible=memory_feasible(peaks, self.topology), per_device=stats, tasks=tasks)
        if not trace and self._cache_size > 0:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = result
        return result


def _overlap(s: float, e: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [s, e) ∩ the union of `spans` (sorted, disjoint; `starts` their start times)."""
    i = max(0, bisect_right(starts, s) - 1)
    out = 0.0
    while i < len(spans) and spans[i][0] < e:
        lo, hi = max(s, spans[i][0]), min(e, spans[i][1])
        if hi > lo:
            out += hi - lo
        i += 1
    return out


def _name(parts: Any) -> str:
    """(r, Action) -> "r:1F0"; ("act", r, s0, s1, i) -> "r:act s0->s1 mb i"; strings as they are."""
    if isinstance(parts, str):
        return parts
    if len(parts) == 2:
        return f"{parts[0]}:{parts[1]}"
    what, r, a, b, i = parts
    return f"{r}:{what} {a}->{b} mb{i}"


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


def simulate(plan: Plan, graph: ModelGraph, topology: Topology, cost: CostModel | None = None,
             trace: bool = False) -> SimResult:
    """One-shot simulation (builds a fresh `Simulator`; reuse one for many plans)."""
    return Simulator(graph, topology, cost).simulate(plan, trace=trace)


__all__ = ["SimResult", "Simulator", "ByPrecision", "PrecisionMismatch", "simulate"]


def saturated_cpus(topology: Topology) -> frozenset[str]:
    """CPU devices of a measured topology whose worker threads take every core of the host
    (`host.cores` <= the CPU workers' threads summed): there, a gloo all-reduce competes with
    the workers' compute instead of overlapping it (measured on the 2-vCPU VM: fine sync was
    slower than coarse). What-if topologies (no host facts) are never saturated."""
    cores = (topology.measured.get("host") or {}).get("cores")
    cpus = [d for d in topology.devices if d.kind == "cpu" and d.node is None]
    if not isinstance(cores, int) or not cpus or any(d.threads is None for d in cpus):
        return frozenset()
    return frozenset(d.name for d in cpus) if sum(d.threads for d in cpus) >= cores else frozenset()
