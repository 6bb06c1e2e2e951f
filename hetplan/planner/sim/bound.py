"""A lower bound on a plan's simulated iteration time, without building or running its task graph
(the search's early rejection: hetplan.planner.search.mcmc).

Why it holds (hetplan.planner.sim.eventloop): every resource (a device's compute queue, one direction
of a link) runs one task at a time from time 0, a task starts after its dependencies end, and
durations are those of the recipes (hetplan.planner.sim.taskgraph), which wake-ups only lengthen. So:

* per resource, the durations of the tasks it runs add up to at most the last end;
* per stage s of a pipeline under gpipe, 1F1B, Hippie or ZB-H1 without a tensor split, every compute
  task of s starts after microbatch 0 has gone forward through stages 0..s-1 and their hops
  (`head`: each stage's first action is F0 and its actions are chained), so the last of them
  ends after head + their durations. The device's optimizer step follows its last compute
  (through its all-reduces); under gpipe, 1F1B and Hippie that last compute is the last microbatch's
  backward, which the backwards of stages s-1..0, their hops and stage 0's step follow (`tail`);
  under ZB-H1 the stage's last I pass precedes only its trailing W's, and is followed by them
  and its step, or by the I passes of stages s-1..j, their hops, j's trailing W's and step;
* the all-reduces holding one resource (a link direction of their rings) run one at a time,
  each after its release (fine sync: when its devices have run all but their last action,
  whose pieces complete the buckets; coarse sync and tied parameters: all their compute) and
  before its devices' steps; for the all-reduces released at or after any h, the last ends
  after h + their durations, and a step follows it (Jackson's head-body-tail bound of one
  machine);
* the iteration adds cost.iteration_overhead_s.
* ZeRO-2 and -3 (plan `shard`): the replicas' terms alone (each step over 1/N of the
  parameters); their reduce-scatters, and ZeRO-3's gathers inside the passes, only add.

Each task counts with its recipe's value; what only adds time is left out (wake-ups, cold
starts, host and offload copies, the pieces of a last backward before its bucket, the buffer
broadcasts). No bound (None) where no proof is written:
asynchronous modes (PipeDream's stream iteration is a difference of two ends), CPU contention
(durations rescaled by overlap), a topology whose devices are not all linked (the simulator may
refuse a plan the bound would price), a negative duration. BOUND_MARGIN absorbs the rounding of
the same sums taken in another order.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import networkx as nx

from hetplan.planner.cost.memory import stepped_params
from hetplan.planner.cost.model import host_cpu
from hetplan.planner.files.plan import Plan, Stage
from hetplan.planner.sim import contention
from hetplan.planner.sim.build import stage_messages

REPLICA_CACHE_SIZE = 8192   # replicas' terms a simulator keeps (_Bound.replica)
LAYOUT_CACHE_SIZE = 4096    # layer layouts whose all-reduces it keeps priced (_Bound.priced)
BOUND_MARGIN = 1e-9   # relative; sums of 1e5 task durations in another order differ by ~1e-12
# every stage's first action is F0; under all but zb-h1 its last is B of the last microbatch
HEAD_SCHEDULES = ("gpipe", "1f1b", "hippie", "zb-h1")


def lower_bound_s(sim: Any, plan: Plan, above: float = math.inf) -> float | None:
    """A lower bound on `sim.simulate(plan).iteration_s` (sim: a hetplan.planner.sim.simulator.Simulator),
    or None where none is proven (see the module docstring). Where the replicas' terms alone
    give more than `above`, that bound (its all-reduce terms not added)."""
    if plan.sync.mode != "sync" or not _connected(sim):
        return None
    if contention.contended(sim.topology, sim.cost, plan):
        return None
    b = _Bound(sim, plan)
    overhead = sim.cost.iteration_overhead_s(len(plan.devices))
    lb = b.value(lambda part: (part + overhead) * (1.0 - BOUND_MARGIN) > above)
    if b.negative or not math.isfinite(lb):
        return None
    return (lb + overhead) * (1.0 - BOUND_MARGIN)


def trailing_w(stages: int, m: int) -> tuple[int, ...]:
    """ZB-H1 (hetplan.planner.files.schedule.zb_h1): per stage s, the W actions after its last I, all of
    its actions after it. Stage s runs W(i - s) after each I(i) with i >= s and owes the rest
    to the end: the last I, I(m-1), is followed by its W and the s owed (m > s), else by all m."""
    return tuple(min(m, s + 1) for s in range(stages))


class BoundCache:
    """What the bound keeps for one simulator (`Simulator.bound_cache`): per replica layout its
    terms (`_Bound.replica`), per layout and sync its all-reduces (`_Bound.priced`), whether the
    topology is connected."""

    __slots__ = ("replicas", "allreduces", "connected")

    def __init__(self):
        self.replicas: dict = {}
        self.allreduces: dict = {}
        self.connected: bool | None = None


def _connected(sim: Any) -> bool:
    """Every device reaches every other through links (then no route the simulator asks fails)."""
    cache = sim.bound_cache
    if cache.connected is None:
        cache.connected = nx.is_connected(sim.topology.graph)
    return cache.connected


class _Bound:
    """One plan's terms: per resource the work it runs, per pipeline stage head + work + tail."""

    def __init__(self, sim: Any, plan: Plan):
        self.sim, self.plan, self.cost, self.graph = sim, plan, sim.cost, sim.graph
        self.rid = sim.rid
        self.work: dict[int, float] = {}    # resource id -> seconds of the tasks it runs
        self.negative = False
        self.after: dict[str, float] = {}   # device -> its optimizer step (the chain after its last compute)
        self.last_start: dict[str, float] = {}   # device -> before its last action can start
        self.done: dict[str, float] = {}         # device -> before its compute is done
        self.steps()

    def add(self, resource: int, seconds: float) -> None:
        if seconds < 0.0:
            self.negative = True
        self.work[resource] = self.work.get(resource, 0.0) + seconds

    def value(self, enough: Callable[[float], bool] = lambda part: False) -> float:
        """The bound before overhead; that of the replicas' terms where it is `enough` and the
        all-reduces would flag nothing (their durations finite, none negative)."""
        best = 0.0
        for rep, b in zip(self.plan.replicas, self.plan.replica_batches()):
            best = max(best, self.replica(rep.stages, rep.microbatches, b / rep.microbatches))
        part = max(best, max(self.work.values(), default=0.0))
        if self.plan.shard >= 2:    # its reduce-scatters and ZeRO-3's gathers only add: left out
            return part
        priced = self.priced()
        if priced.clean and enough(part):
            return part
        best = max(best, self.allreduces(priced))
        return max(best, max(self.work.values(), default=0.0))

    # --- gradient all-reduces (Builder.allreduces) --------------------------------------------------
    def priced(self) -> "Priced":
        """The plan's all-reduces (Builder.allreduces), kept per layer layout and sync: per
        bucket its devices, the resources it holds, its duration (fine buckets of saturated CPUs
        may run queued: the cheaper price) and whether it is released by `last_start`."""
        layout = tuple(rep.stages for rep in self.plan.replicas)
        key = (self.plan.sync, tuple(map(id, layout)))   # identities, held by the entry (`replica`)
        cache = self.sim.bound_cache.allreduces
        kept = cache.get(key)
        out = kept[1] if kept is not None else None
        if out is None:
            if len(cache) >= LAYOUT_CACHE_SIZE:
                cache.pop(next(iter(cache)))
            shared, tied = self.sim.exchanged(self.plan)
            fine = self.plan.sync.granularity == "fine"
            items = []
            for k, b in enumerate(shared + tied):
                res, dur = self.sim.allreduce(b.devices, b.bytes)
                early = fine and k < len(shared)
                if early:
                    dur = min(dur, self.sim.allreduce(b.devices, b.bytes, True)[1])
                items.append((b.devices, res, dur, early))
            clean = all(math.isfinite(dur) and dur >= 0.0 for *_, dur, _ in items)
            out = Priced(tuple(items), clean)
            cache[key] = (layout, out)
        return out

    def allreduces(self, priced: "Priced") -> float:
        """Adds each all-reduce to the work of its resources; returns the best head-body-tail
        bound over the resources they hold."""
        on: dict[int, list[tuple[float, float, float]]] = {}   # resource -> (release, seconds, tail)
        last_start, done, after = self.last_start, self.done, self.after
        for devices, res, dur, early in priced.items:
            ready = last_start if early else done
            item = (max(ready.get(d, 0.0) for d in devices), dur, max(after.get(d, 0.0) for d in devices))
            for x in res:
                self.add(x, dur)
                on.setdefault(x, []).append(item)
        best = 0.0
        for items in on.values():
            items.sort(reverse=True)
            body, tail = 0.0, math.inf
            for release, dur, after_ in items:   # those released at or after `release`
                body += dur
                tail = min(tail, after_)
                best = max(best, release + body + tail)
        return best

    # --- optimizer steps (Builder.optimizer_steps) ------------------------------------------------
    def steps(self) -> None:
        """Each device's step where it runs (its queue, or its host's), and per device the
        length of the step's chain after its last backward."""
        graph, cost, plan = self.graph, self.cost, self.plan
        opt, placement = plan.optimizer.name, plan.optimizer.placement
        f = plan.optimizer.cpu_fraction if placement == "split" else None
        for dev, (n, n_t) in stepped_params(plan, graph).items():
            if n <= 0:
                continue
            host = host_cpu(self.sim.topology, dev) if placement != "device" else dev
            on_host = 0.0
            if host != dev:
                fh = 1.0 if f is None else f
                on_host = cost.optimizer_s(host, fh * n, opt, n_t if f is None else round(f * n_t))
                self.add(self.rid[host], on_host)
                if f is None:
                    self.after[dev] = on_host
                    continue
                n, n_t = (1 - f) * n, n_t - round(f * n_t)
                on_host += cost.optimizer_launch_s(dev, opt, n_t)   # after the device's launches
            own = cost.optimizer_s(dev, n, opt, n_t)
            self.add(self.rid[dev], own)
            self.after[dev] = max(own, on_host)

    # --- one replica -------------------------------------------------------------------------------
    def messages(self, device: str, sends: int, receives: int) -> float:
        if not (sends or receives):
            return 0.0
        send_s, post_s = self.cost.message_issue_s(device)
        return sends * send_s + receives * post_s

    def compute(self, s: int, stages: tuple[Stage, ...], mb: float) -> tuple[float, float]:
        """(forward, backward) of one microbatch of stage s as the builder's recipes price them:
        a backward's pieces summed (they telescope), I + W under zb-h1, the forward again under
        recompute; each with the messages it issues."""
        st, cost = stages[s], self.cost
        sends, receives, grad_sends, grad_receives = stage_messages(self.graph, stages, s)
        fwd_msg = self.messages(st.device, sends, receives)
        bwd_msg = self.messages(st.device, grad_sends, grad_receives)
        if st.split:
            shares = tuple((x.device, x.share) for x in st.split)
            return (cost.tensor_stage_s("fwd", shares, st.start, st.end, mb) + fwd_msg,
                    cost.tensor_stage_s("bwd", shares, st.start, st.end, mb) + bwd_msg)
        d, a, b = st.device, st.start, st.end
        f = cost.fwd_s(d, a, b, mb)
        if self.plan.schedule == "zb-h1":
            bwd = cost.bwd_input_s(d, a, b, mb) + cost.bwd_weight_s(d, a, b, mb) if s > 0 else cost.bwd_s(d, a, b, mb)
        else:
            bwd = cost.bwd_s(d, a, b, mb) + (f if self.plan.recompute else 0.0)
        return f + fwd_msg, bwd + bwd_msg

    def weight_pass(self, s: int, stages: tuple[Stage, ...], mb: float) -> float:
        """ZB-H1: one microbatch's W pass of stage s (stage 0: its whole backward)."""
        st = stages[s]
        if s == 0:
            return self.cost.bwd_s(st.device, st.start, st.end, mb)
        return self.cost.bwd_weight_s(st.device, st.start, st.end, mb)

    def hops_s(self, a: str, b: str, cut: int, mb: float) -> list[tuple[int, float]]:
        """(resource, seconds) of each hop of the activation (or its gradient) at `cut` a -> b."""
        n = self.graph.cut_bytes_at(cut, mb)
        return [(h.resource, h.latency_s + n / h.bandwidth_bytes_per_s) for h in self.sim.hops(a, b)]

    def stage_resources(self, st: Stage) -> tuple[int, ...]:
        """As Builder.stage_resources: a tensor split holds its devices and their ring's links."""
        if not st.split:
            return (self.rid[st.device],)
        ring = self.sim.allreduce(st.devices, 0.0)[0]
        return tuple(dict.fromkeys([self.rid[d] for d in st.devices] + list(ring)))

    def replica(self, stages: tuple[Stage, ...], m: int, mb: float) -> float:
        """Adds the replica's compute and hops to the resources' work; returns its best
        head + work + tail over stages (0 where the schedule or a split allows none). Its
        terms are kept by the simulator across plans (`ReplicaTerms`)."""
        after = tuple(self.after.get(st.device, 0.0) for st in stages)
        # keyed by the stages' identity (a search's plans share them: hetplan.planner.search.space.to_plan),
        # which the entry holding them keeps from being reused
        key = (id(stages), m, mb, self.plan.schedule, self.plan.recompute, after)
        cache = self.sim.bound_cache.replicas
        kept = cache.get(key)
        if kept is None:
            if len(cache) >= REPLICA_CACHE_SIZE:
                cache.pop(next(iter(cache)))
            kept = cache[key] = (stages, self.replica_terms(stages, m, mb))
        terms = kept[1]
        for x, seconds in terms.work:
            self.add(x, seconds)
        self.done.update(terms.done)
        self.last_start.update(terms.last_start)
        return terms.best

    def replica_terms(self, stages: tuple[Stage, ...], m: int, mb: float) -> "ReplicaTerms":
        adds: list[tuple[int, float]] = []
        comp = [self.compute(s, stages, mb) for s in range(len(stages))]
        for st, (f, b) in zip(stages, comp):
            for x in self.stage_resources(st):
                adds.append((x, m * (f + b)))
        ahead, back = [], []
        for s in range(len(stages) - 1):
            a, b, cut = stages[s].device, stages[s + 1].device, stages[s + 1].start
            ahead.append(self.hops_s(a, b, cut, mb))
            back.append(self.hops_s(b, a, cut, mb))
            for x, t in ahead[-1] + back[-1]:
                adds.append((x, m * t))
        done: list[tuple[str, float]] = []
        last_start: list[tuple[str, float]] = []
        schedule = self.plan.schedule
        if schedule not in HEAD_SCHEDULES or any(st.split for st in stages):
            return ReplicaTerms(adds, done, last_start, 0.0)
        best = head = chain = 0.0   # chain: the backwards of stages < s and their hops
        below = -math.inf           # zb-h1: the longest continuation through a stage below s
        first = stages[0].device
        trailing = trailing_w(len(stages), m) if schedule == "zb-h1" else None
        for s, st in enumerate(stages):
            f, b = comp[s]
            work = m * (f + b)
            step = self.after.get(st.device, 0.0)
            done.append((st.device, head + work))
            if schedule == "zb-h1":
                # the stage's last I ends after all but its trailing W's; then those W's and its
                # step, or the gradient's I passes down to a stage j < s, j's trailing W's and step
                w = self.weight_pass(s, stages, mb)
                last_start.append((st.device, head + work - w))
                own = trailing[s] * w + step
                best = max(best, head + work - trailing[s] * w + max(own, below))
                if s < len(stages) - 1:
                    below = sum(t for _, t in back[s]) + (b - w) + max(below, own)
            else:
                last_start.append((st.device, head + work - b))
                tail = max(step, chain + self.after.get(first, 0.0)) if s else step
                best = max(best, head + work + tail)
            if s < len(stages) - 1:
                head += f + sum(t for _, t in ahead[s])
                chain += b + sum(t for _, t in back[s])
        return ReplicaTerms(adds, done, last_start, best)


class Priced(NamedTuple):
    """A plan's all-reduces as the bound prices them (`_Bound.priced`); `clean`: every duration
    finite and none negative."""
    items: tuple[tuple[tuple[str, ...], tuple[int, ...], float, bool], ...]
    clean: bool


class ReplicaTerms(NamedTuple):
    """What one replica adds to a plan's bound, given its stages, microbatches, microbatch
    size, the plan's schedule and recompute, and its devices' optimizer steps (`_Bound.after`):
    (resource, seconds) in the order they are added, its devices' `done` and `last_start`,
    and its best head + work + tail."""
    work: list[tuple[int, float]]
    done: list[tuple[str, float]]
    last_start: list[tuple[str, float]]
    best: float


__all__ = ["lower_bound_s", "BoundCache", "BOUND_MARGIN"]
