"""MCMC search over the strategy space (FlexFlow, Jia et al. 2019, section 5), plus what
FlexFlow lacked: batch fractions solved directly, and baselines that bound the result.

The search calls one narrow function, `evaluate(plan) -> result` with attributes
`iteration_s`, `feasible` and `peak_memory_bytes` (hetplan.planner.sim.simulator's SimResult), and takes a
seeded `random.Random`: no global state. Results are cached per plan (`search_key`).

Determinism: a walk stops after its share of `iterations` proposals, or after `patience`
proposals without improvement (about the number of one-choice neighbours of a plan); both
depend only on the seed. `time_limit_s` is a safety cap only: when it stops
the search, the result can depend on the machine's speed, and `SearchResult.stopped_by` says so.

Chains: a large space gets several independent walks from the same start (`chains`), each with
its own seed drawn from the search's rng, run in processes forked from this one
(`run_chains`); the best of their bests is the result. It depends on the seed and the number of
chains, not on how many run at once.

Cost of a plan for the walk: its predicted iteration time when feasible; an infeasible plan
costs its time times (2 + how far its worst device is over memory), so the walk can cross
infeasible regions but never returns one.

Early rejection (delayed-acceptance MCMC, Solonen et al. 2012): the walk draws its acceptance
test's uniform u before proposing, so it knows the highest cost it would accept,
c* = c (1 - ln u / temperature), and a new best must cost less than the best's. A proposal whose
lower bound (`Problem.bound`: hetplan.planner.sim.bound, with the exact peak memory) costs more than
both is rejected without simulating it: the walk takes exactly the decisions it takes with
every proposal simulated (`SearchConfig.early_reject`).
"""
from __future__ import annotations

import gc
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable

from hetplan.planner.search.baselines import baseline_strategies, grid_shapes, proportional_batches
from hetplan.planner.files.plan import Plan
from hetplan.planner.search.space import (Pipeline, Space, Strategy, even_split, fits, from_plan, global_neighbours,
                                  min_batch, propose, to_plan, with_split)


@dataclass(frozen=True)
class SearchConfig:
    iterations: int = 20000         # proposals; the deterministic budget
    time_limit_s: float = 10.0      # safety cap (wall clock)
    temperature: float = 30.0       # beta = temperature / current cost: a 3% worse plan is
                                    # accepted with probability exp(-0.9) ~ 0.4
    restart_every: int = 150        # proposals without improvement before returning to the best
    batch_move_prob: float = 0.2    # share of proposals that shift samples between replicas
    grid_move_prob: float = 0.05    # share of proposals that jump to a pipeline x DP grid
    patience: int | None = None     # proposals without improvement before stopping; None: `patience`
    early_reject: bool = True       # reject by Problem.bound before simulating (the same walk)
    split_by_bound: bool = True     # solve_batches models replicas by Problem.bound, not simulations
    chains: int | None = None       # independent walks sharing the budget; None: `chains(space)`
    workers: int | None = None      # processes the chains run in (speed only); None: this process's
                                    # cores; 0: one after another in this process


@dataclass(frozen=True)
class Problem:
    space: Space
    evaluate: Callable[[Plan], Any]                 # -> .iteration_s, .feasible, .peak_memory_bytes
    memory_bytes: dict[str, float]                  # device capacity
    shares: dict[str, tuple[float, ...]]            # per device, each layer's share of model time
    cut_s: Callable[[str, str, int], float] | None = None  # activations at cut i between two devices
    cost: Any = None                                # the cost model (first precision's)
    # (plan, above, memory) -> (a lower bound on its iteration_s, the peak_memory_bytes `evaluate`
    # reports for it, None without `memory`), or None where no bound is known; a bound past
    # `above` seconds may be less than the best known; bound None: no early rejection
    bound: Callable[[Plan, float, bool], tuple[float, dict[str, float] | None] | None] | None = None
    # one-replica plan -> a key equal for plans `evaluate` gives the same iteration_s, or None where
    # none is known (hetplan.planner.search.problem.twin_keys): solve_batches times such twins once
    twin_key: Callable[[Plan], Hashable | None] | None = None
    # what `evaluate` makes once and keeps (compiled loops), made before chains are forked so
    # that each does not make its own
    before_fork: Callable[[], None] | None = None
    simulator: Any = None                           # what `evaluate` simulates with (hetplan.planner.sim.interval draws it)


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    iteration_s: float
    feasible: bool
    peak_memory_bytes: dict[str, float]
    memory_ratio: float              # max over devices of peak / capacity
    cost: float                      # what the walk minimises (see module docstring)
    name: str = ""

    @property
    def strategy(self) -> Strategy:
        return from_plan(self.plan)[0]


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None                  # None when no feasible plan was found
    baselines: tuple[Candidate, ...]
    least_memory: Candidate | None          # the simulated plan with the lowest memory_ratio (None: none routed)
    iterations: int
    evaluations: int
    stopped_by: str                         # "iterations", "no improvement" or "time limit"
    elapsed_s: float
    history: tuple[tuple[float, float], ...] = field(default=(), repr=False)  # (elapsed_s, best_s)
    accepted: int = 0                       # proposals the walk moved to
    patience: int = 0                       # the no-improvement stop that applied
    bound_rejections: int = 0               # proposals rejected by their lower bound, not simulated
    chains: int = 1                         # independent walks (SearchConfig.chains)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.iterations if self.iterations else 0.0


@dataclass(frozen=True)
class Walk:
    """What one chain's walk found and counted (Searcher.walk)."""
    best: Candidate
    least_memory: Candidate | None
    iterations: int
    evaluations: int
    stopped_by: str
    history: tuple[tuple[float, float], ...]
    accepted: int
    patience: int
    bound_rejections: int


MIN_PATIENCE = 500   # proposals without improvement before a default walk stops, at least
CHAINS = 4           # walks of a default search beyond 8 devices (`chains`)


def patience(space: Space, iterations: int) -> int:
    """Proposals without improvement before a default walk stops: about the number of
    one-choice neighbours of a plan (device swaps n(n-1)/2, two shifts per cut and per device,
    the global choices), at least MIN_PATIENCE, at most half the budget."""
    n = len(space.devices)
    neighbours = n * (n - 1) // 2 + 4 * n + 2 * min(n, space.num_layers) + 16
    return max(1, min(max(MIN_PATIENCE, neighbours), iterations // 2))


def chains(space: Space) -> int:
    """Independent walks a default search makes: one up to a node's worth of devices (8), where
    a walk covers the space; else CHAINS, since there one walk's plan depends on its seed
    (docs/tuning.md, "Chains") and the search returns the best of several."""
    return 1 if len(space.devices) <= 8 else CHAINS


def level_batches(models: list[tuple[float, float]], lows: list[int], total_batch: int) -> tuple[int, ...]:
    """Integer batches summing to `total_batch` for replicas whose time is t_r(b) = a_r + c_r·b
    (`models`: (a_r, c_r)), each at least lows[r]: the level T with sum_r max(low_r, (T - a_r)/c_r)
    = B (bisection), its floors, then the remaining samples one by one to the replica whose
    t_r(b_r + 1) is smallest (the smallest max replica time). `Searcher.solve_batches`' rule, and
    the runtime's (hetplan.runtime.rebalance) from measured per-sample times."""
    B = total_batch

    def total(level: float) -> float:
        return sum(max(lo, (level - a) / c) for (a, c), lo in zip(models, lows))
    lo_t, hi_t = 0.0, max(a + c * B for a, c in models)
    for _ in range(60):
        mid = (lo_t + hi_t) / 2
        lo_t, hi_t = (mid, hi_t) if total(mid) < B else (lo_t, mid)
    batches = [max(lo, math.floor((hi_t - a) / c)) for (a, c), lo in zip(models, lows)]
    while sum(batches) > B:  # floors of a level slightly above the optimum can overshoot
        i = max((i for i in range(len(batches)) if batches[i] > lows[i]),
                key=lambda i: models[i][0] + models[i][1] * batches[i])
        batches[i] -= 1
    while sum(batches) < B:
        i = min(range(len(batches)), key=lambda i: (models[i][0] + models[i][1] * (batches[i] + 1), i))
        batches[i] += 1
    return tuple(batches)


class Searcher:
    def __init__(self, problem: Problem, rng: random.Random, config: SearchConfig = SearchConfig(),
                 progress: Callable[[str], None] | None = None):
        self.p, self.rng, self.cfg, self.progress = problem, rng, config, progress
        self.cache: dict[Hashable, Candidate] = {}
        self.twins: dict[Hashable, float] = {}   # replica_time_s per twin_key
        self.alone: dict[tuple, float] = {}      # replica_time_s per (pipeline, batch, the other choices)
        self.evaluations = 0
        self.bound_rejections = 0
        self.least_memory: Candidate | None = None

    # --- evaluation ---------------------------------------------------------------------
    def _ratio(self, peak: dict[str, float]) -> float:
        """Max over devices of peak / capacity."""
        return max((v / self.p.memory_bytes[d] for d, v in peak.items() if d in self.p.memory_bytes),
                   default=0.0)

    def evaluate(self, plan: Plan, name: str = "", bar: float = math.inf) -> Candidate | None:
        """The plan's candidate (simulated once, then cached); None without simulating when its
        lower bound costs more than a finite `bar` (`rejects`)."""
        key = search_key(plan)
        c = self.cache.get(key)
        if c is None:
            if bar < math.inf and self.rejects(plan, bar):
                self.bound_rejections += 1
                return None
            r = self.p.evaluate(plan)
            self.evaluations += 1
            peak = {d: float(v) for d, v in r.peak_memory_bytes.items()}
            ratio = self._ratio(peak)
            t = float(r.iteration_s)
            feasible = bool(r.feasible) and ratio <= 1.0 and math.isfinite(t)
            c = Candidate(plan, t, feasible, peak, ratio, walk_cost(t, feasible, ratio))
            self.cache[key] = c
            if plan.global_batch == self.p.space.global_batch and math.isfinite(t) and (
                    self.least_memory is None or ratio < self.least_memory.memory_ratio):
                self.least_memory = c
        return replace(c, name=name) if name else c

    def rejects(self, plan: Plan, bar: float) -> bool:
        """Whether the plan certainly costs more than `bar`: the walk's cost of its time bound
        and exact peak memory does. A plan that would become `least_memory` is simulated, as
        without the bound."""
        if not self.cfg.early_reject or self.p.bound is None:
            return False
        b = self.p.bound(plan, bar, True)   # a bound past the bar rejects whatever the memory (walk_cost >= t)
        if b is None:
            return False
        lb, peak = b
        ratio = self._ratio({d: float(v) for d, v in peak.items()})
        if plan.global_batch == self.p.space.global_batch and (
                self.least_memory is None or ratio < self.least_memory.memory_ratio):
            return False
        return walk_cost(lb, ratio <= 1.0, ratio) > bar

    def bar(self, cur: Candidate, best: Candidate, u: float) -> float:
        """The cost above which a proposal from `cur` is neither accepted (u: its acceptance
        test's draw) nor a new best; inf where none is known (early rejection off)."""
        T = self.cfg.temperature
        if not self.cfg.early_reject or u <= 0.0 or T <= 0.0 or not 0.0 < cur.cost < math.inf:
            return math.inf
        # accepted iff u < exp(-T (c' - c) / c), i.e. c' < c (1 - ln u / T); the margin covers rounding
        return max(cur.cost * (1.0 - math.log(u) / T), best.cost) * (1.0 + 1e-9)

    # --- batch split ----------------------------------------------------------------------
    def replica_time_s(self, s: Strategy, pipe: Pipeline, batch: int) -> float:
        """Time of `pipe` alone (one replica, whole plan at `batch`) for solve_batches' model:
        its lower bound (Problem.bound; `split_by_bound`), else its predicted time; a twin's
        (`Problem.twin_key`) where one was timed. The bound costs a fraction of a simulation and
        orders replicas as their times do; the simulator then judges the split plan. Skipping a
        twin's timing changes no decision of the walk."""
        alone = (pipe, batch, replace(s, pipelines=()))   # the plan below, unmade
        t = self.alone.get(alone)
        if t is not None:
            return t
        space = replace(self.p.space, global_batch=batch)
        plan = to_plan(space, replace(s, pipelines=(pipe,)), (batch,))
        key = self.p.twin_key(plan) if self.p.twin_key else None
        t = self.twins.get(key) if key is not None else None
        if t is None:
            b = self.p.bound(plan, math.inf, False) if self.cfg.split_by_bound and self.p.bound else None
            t = b[0] if b is not None else self.evaluate(plan).iteration_s
            if key is not None:
                self.twins[key] = t
        self.alone[alone] = t
        return t

    def solve_batches(self, s: Strategy) -> tuple[int, ...]:
        """Integer replica batches so that replicas finish together.

        Each replica's time is modelled as affine in its batch, t_r(b) = a_r + c_r·b, from two
        timings of the replica alone (`replica_time_s`, at B/8 and B samples). The continuous
        optimum is the level T with sum_r max(low_r, (T - a_r)/c_r) = B (bisection); the integer
        split takes
        its floors and hands the remaining samples, one by one, to the replica whose
        t_r(b_r + 1) is smallest, which minimises the max replica time for the model. The full
        simulator then judges the plan; batch-shift moves correct what the model misses."""
        B = self.p.space.global_batch
        lows = [min_batch(p, s.schedule) for p in s.pipelines]
        if len(s.pipelines) == 1:
            return (B,)
        models = []
        for p, lo in zip(s.pipelines, lows):
            b1 = max(lo, B // 8)
            t1, t2 = self.replica_time_s(s, p, b1), self.replica_time_s(s, p, B)
            if not (math.isfinite(t1) and math.isfinite(t2)):   # the simulator rejects this replica
                return proportional_batches(B, [1.0] * len(lows), lows)
            slope = (t2 - t1) / (B - b1) if B > b1 else t2 / B
            slope = max(slope, 1e-12 * max(t2, 1e-12))  # time never falls with more samples
            models.append((t1 - slope * b1, slope))
        return level_batches(models, lows, B)

    def solve_shares(self, s: Strategy) -> Strategy:
        """A tensor split's shares so that its devices finish together.

        Device d's time for the split stage, from the cost model at the microbatch, is affine
        in its share x: t_d(x) = a_d + c_d·x (a_d: what it runs whole, c_d: all the linear
        pairs). The shares are the level T with sum_d clip((T - a_d)/c_d, 0, 1) = 1
        (bisection), rounded to 1e-3; a device left with less than 1 % drops out of the split.
        Without a cost model the shares stay as they are."""
        cost = self.p.cost
        if not s.tensor or cost is None:
            return s
        pipe, k = s.pipelines[0], s.tensor_stage
        lo, hi = pipe.ranges(self.p.space.num_layers)[k]
        mb = self.p.space.global_batch / pipe.microbatches
        models = []
        for d, _ in s.tensor:
            a = sum(cost.tensor_part_s(ph, d, 0.0, lo, hi, mb) for ph in ("fwd", "bwd"))
            c = sum(cost.tensor_part_s(ph, d, 1.0, lo, hi, mb) for ph in ("fwd", "bwd")) - a
            models.append((a, max(c, 1e-15)))

        def total(level: float) -> float:
            return sum(min(1.0, max(0.0, (level - a) / c)) for a, c in models)
        low, high = 0.0, max(a + c for a, c in models)
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if total(mid) < 1 else (low, mid)
        raw = [min(1.0, max(0.0, (high - a) / c)) for a, c in models]
        kept = [(d, x) for (d, _), x in zip(s.tensor, raw) if x >= 0.01]
        if len(kept) < 2:
            return with_split(s, k, (max(kept, key=lambda t: t[1])[0],) if kept else (s.tensor[0][0],))
        norm = sum(x for _, x in kept)
        shares = [round(x / norm, 3) for _, x in kept[:-1]]
        t = with_split(s, k, [d for d, _ in kept])
        if not all(x > 0 for x in shares) or sum(shares) >= 1:
            return t
        shares.append(1 - sum(shares))
        return replace(t, tensor=tuple((d, x) for (d, _), x in zip(kept, shares)))

    def shift_share(self, s: Strategy) -> Strategy | None:
        """Move 1, 2 or 5 % of a tensor split from one device to another (fine-tuning with the
        full simulator what solve_shares' model misses: the per-layer waits, the steps)."""
        i, j = self.rng.sample(range(len(s.tensor)), 2)
        delta = self.rng.choice((0.01, 0.02, 0.05))
        shares = [x for _, x in s.tensor]
        if shares[i] - delta < 0.01:
            return None
        shares[i], shares[j] = round(shares[i] - delta, 3), round(shares[j] + delta, 3)
        shares[-1] = 1 - sum(shares[:-1])
        return replace(s, tensor=tuple((d, x) for (d, _), x in zip(s.tensor, shares)))

    def shift_batch(self, s: Strategy, batches: tuple[int, ...]) -> tuple[int, ...] | None:
        """Move a few samples from one replica to another (fine-tuning with the full simulator)."""
        if len(batches) < 2:
            return None
        i, j = self.rng.sample(range(len(batches)), 2)
        room = batches[i] - min_batch(s.pipelines[i], s.schedule)
        if room < 1:
            return None
        k = 1 if self.rng.random() < 0.6 else self.rng.randint(1, max(1, room // 4))
        out = list(batches)
        out[i] -= k
        out[j] += k
        return tuple(out)

    # --- the walk -----------------------------------------------------------------------------
    def baselines(self) -> list[Candidate]:
        space = self.p.space
        first = space.precisions[0]
        singles = [self.evaluate(to_plan(space, Strategy((Pipeline((d,), ()),), precision=first),
                                         (space.global_batch,)),
                                 name=f"single device {d}") for d in space.devices]
        single_s = self._single_s = {c.plan.devices[0]: c.iteration_s for c in singles}
        feasible = [c for c in singles if c.feasible]
        pool = min(feasible or singles, key=lambda c: (c.cost, c.memory_ratio))
        out = [replace(pool, name=f"fastest single device ({pool.plan.devices[0]})")]
        for name, strat, batches in baseline_strategies(space, single_s, self.p.shares, self.p.cut_s):
            out.append(self.evaluate(to_plan(space, strat, batches), name=name))
        self._grid = grid_shapes(space, single_s, self.p.shares, self.p.cut_s)
        out += [self.evaluate(to_plan(space, g.strategy, g.batches), name=g.name) for g in self._grid if g.baseline]
        return out

    def run(self) -> SearchResult:
        with no_collections():
            t0 = time.monotonic()
            bases, start = self.start()
            counted = (self.evaluations, self.bound_rejections)   # the start's
            n = self.cfg.chains if self.cfg.chains is not None else chains(self.p.space)
            if n < 1:
                raise ValueError(f"SearchConfig.chains: expected at least 1, got {n}")
            budgets = [self.cfg.iterations // n + (i < self.cfg.iterations % n) for i in range(n)]
            if n == 1:
                walks = [self.walk(start, t0, budgets[0])]
            else:
                draw = random.Random()
                draw.setstate(self.rng.getstate())   # chain 0 goes on with the rng itself
                seeds = [None] + [draw.getrandbits(64) for _ in range(n - 1)]
                walks = run_chains(self, start, t0, list(zip(seeds, budgets)), self.cfg.workers)
            return self.merged(walks, bases, t0, *counted)

    def start(self) -> tuple[list[Candidate], Candidate]:
        """The baselines, and where every walk starts: the best of them, the grids and the tensor
        seeds (feasible first)."""
        space = self.p.space
        bases = self.baselines()
        seeds = [self.evaluate(to_plan(space, g.strategy, g.batches)) for g in self._grid]
        seeds += [self.evaluate(to_plan(space, t, (space.global_batch,))) for t in self.tensor_seeds()]
        return bases, min([*bases, *seeds], key=lambda c: (not c.feasible, c.cost))

    def merged(self, walks: list[Walk], bases: list[Candidate], t0: float, evaluations: int,
               rejections: int) -> SearchResult:
        """One result from the chains' walks: the best of their bests (the first chain's on a tie),
        their proposals, simulations and rejections added up (with the start's simulations), the
        best so far over time across them."""
        best = min((w.best for w in walks), key=lambda c: (not c.feasible, c.cost))
        least = min((c for c in [self.least_memory, *(w.least_memory for w in walks)] if c is not None),
                    key=lambda c: c.memory_ratio, default=None)
        events, history, low = sorted(e for w in walks for e in w.history), [], math.inf
        for elapsed, t in events:
            if t < low:
                low = t
                history.append((elapsed, t))
        stops = {w.stopped_by for w in walks}
        stopped_by = next(s for s in ("time limit", "iterations", "no improvement") if s in stops)
        return SearchResult(best=best if best.feasible else None, baselines=tuple(bases), least_memory=least,
                            iterations=sum(w.iterations for w in walks),
                            evaluations=evaluations + sum(w.evaluations for w in walks),
                            stopped_by=stopped_by, elapsed_s=time.monotonic() - t0, history=tuple(history),
                            accepted=sum(w.accepted for w in walks), patience=max(w.patience for w in walks),
                            bound_rejections=rejections + sum(w.bound_rejections for w in walks),
                            chains=len(walks))

    def walk(self, start: Candidate, t0: float, iterations: int, label: str = "", every_s: float = 1.0) -> Walk:
        """One chain: the walk from `start` for at most `iterations` proposals (or its patience, or
        the time limit counted from t0), then `descend` from its best. Counts only its own
        simulations and rejections; reports progress every `every_s`, its lines marked `label`."""
        space, cfg, rng = self.p.space, self.cfg, self.rng
        evaluations, rejections = self.evaluations, self.bound_rejections
        cur = best = start
        history = [(time.monotonic() - t0, best.iteration_s)]
        last_gain = last_restart = accepted = 0
        stop_after = cfg.patience if cfg.patience is not None else patience(space, iterations)
        stopped_by, it = "iterations", 0
        next_report = time.monotonic() + every_s
        for it in range(1, iterations + 1):
            now = time.monotonic()
            if now - t0 > cfg.time_limit_s:
                stopped_by = "time limit"
                break
            if it - last_gain > stop_after:
                stopped_by = "no improvement"
                break
            if self.progress and now >= next_report:
                self.progress(f"search{label}: {it} iterations, {self.evaluations - evaluations} simulations, "
                              f"{self.bound_rejections - rejections} rejected by their bound, "
                              f"best {best.iteration_s * 1e3:.3f} ms{'' if best.feasible else ' (infeasible)'}; "
                              f"stops after {stop_after - (it - last_gain)} more without a gain, "
                              f"{max(0.0, cfg.time_limit_s - (now - t0)):.0f} s at most")
                next_report = now + every_s
            if it - max(last_gain, last_restart) >= cfg.restart_every:
                cur, last_restart = best, it
            u = rng.random()   # the acceptance test's draw, before proposing (see `bar`)
            cand = self._propose(cur, self.bar(cur, best, u))
            if cand is None:   # no move applied, or its bound exceeded the bar
                continue
            delta = cand.cost - cur.cost
            if delta <= 0 or (math.isfinite(cand.cost) and u < math.exp(-cfg.temperature * delta / cur.cost)):
                cur, accepted = cand, accepted + 1
            if cand.cost < best.cost * (1 - 1e-9) and (cand.feasible or not best.feasible):
                best, last_gain = cand, it
                history.append((time.monotonic() - t0, best.iteration_s))
        else:
            it = iterations
        polished = self.descend(best, deadline=t0 + cfg.time_limit_s)
        if polished is not best:
            best = polished
            history.append((time.monotonic() - t0, best.iteration_s))
        return Walk(best, self.least_memory, it, self.evaluations - evaluations, stopped_by, tuple(history),
                    accepted, stop_after, self.bound_rejections - rejections)

    def descend(self, best: Candidate, deadline: float) -> Candidate:
        """Steepest descent from the walk's best over its whole global neighbourhood
        (`global_neighbours`: every schedule, sync, placement, ... one choice away, and the
        interleaved pipeline joined under each schedule), until no neighbour is faster or the
        deadline passes: a short walk that ends one or two such choices from a better plan gets it."""
        while best.feasible:
            s, batches = from_plan(best.plan)
            found = best
            for t in global_neighbours(self.p.space, s):
                if time.monotonic() > deadline:
                    return found
                same = ([p.devices for p in t.pipelines] == [p.devices for p in s.pipelines]
                        and [min_batch(p, t.schedule) for p in t.pipelines] == [min_batch(p, s.schedule) for p in s.pipelines])
                c = self.evaluate(to_plan(self.p.space, t, batches if same else self.solve_batches(t)),
                                  bar=best.cost if self.cfg.early_reject else math.inf)
                if c is not None and c.feasible and c.cost < found.cost * (1 - 1e-9):
                    found = c
            if found is best:
                return best
            best = found
        return best

    def tensor_seeds(self) -> list[Strategy]:
        """Where the space allows a tensor split: the whole model split between the two fastest
        devices and, up to 8 devices, between all, shares solved."""
        space = self.p.space
        if not space.tensor_split or len(space.devices) < 2:
            return []
        base = Strategy((Pipeline(space.devices[:1], ()),), precision=space.precisions[0])
        fastest = sorted(space.devices, key=lambda d: (self._single_s[d], space.devices.index(d)))[:2]
        groups = [tuple(d for d in space.devices if d in fastest)]
        if 2 < len(space.devices) <= 8:
            groups.append(space.devices)
        out = [self.solve_shares(even_split(base, g)) for g in groups]
        return [t for t in out if fits(space, t)]

    def _propose(self, cur: Candidate, bar: float = math.inf) -> Candidate | None:
        """A neighbour of `cur`, evaluated; None when no move applies or its bound exceeds `bar`."""
        s, batches = from_plan(cur.plan)
        if self._grid and self.rng.random() < self.cfg.grid_move_prob:
            return self.grid_move(s, bar)
        if self.rng.random() < self.cfg.batch_move_prob:
            nb = self.shift_batch(s, batches)
            if nb is not None:
                return self.evaluate(to_plan(self.p.space, s, nb), bar=bar)
            shifted = self.shift_share(s) if s.tensor else None    # a split's shares instead
            if shifted is not None:
                return self.evaluate(to_plan(self.p.space, shifted, batches), bar=bar)
        t = propose(self.p.space, s, self.rng)
        if t is None:
            return None
        if t.tensor and _split_shape(t) != _split_shape(s):   # solved for the split as it now is
            t = self.solve_shares(t)
        if [p.devices for p in t.pipelines] == [p.devices for p in s.pipelines] and \
                [min_batch(p, t.schedule) for p in t.pipelines] == [min_batch(p, s.schedule) for p in s.pipelines] \
                and self.rng.random() < 0.5:
            nb = batches   # same replicas: keep the tuned split half of the time
        else:
            nb = self.solve_batches(t)
        return self.evaluate(to_plan(self.p.space, t, nb), bar=bar)


    def grid_move(self, s: Strategy, bar: float = math.inf) -> Candidate | None:
        """Another pipeline x DP grid (degree, device order) at 1, 2 or 4 times its degree in
        microbatches, with s's global choices: one proposal changes the degree of the whole plan."""
        g = self.rng.choice(self._grid)
        f = self.rng.choice((1, 2, 4))
        pipes = tuple(replace(p, microbatches=f * len(p.devices)) for p in g.strategy.pipelines)
        t = replace(s, pipelines=pipes)
        if not fits(self.p.space, t):
            return None
        try:
            return self.evaluate(to_plan(self.p.space, t, g.batches), bar=bar)
        except ValueError:   # a batch too small for the schedule's microbatches
            return None


def run_chains(searcher: Searcher, start: Candidate, t0: float, chains: list[tuple[int | None, int]],
               workers: int | None) -> list[Walk]:
    """Each (seed, budget) chain's walk from `start`, in chain order. A chain runs in a process
    forked from this one for it alone (it starts from the searcher as it is now: its caches, its
    baselines), `workers` at a time (None: this process's cores); the seed None goes on with the
    searcher's rng. Off Linux (or with `workers` 0) they run here one after another, each from the
    searcher's caches as the ones before left them: the same walks, fewer simulations; so do the
    chains left when a fork fails (no memory). A chain that fails, or whose process dies, fails
    the search (RuntimeError naming it)."""
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(workers, len(chains))
    if workers == 0 or not sys.platform.startswith("linux"):   # fork elsewhere: unsafe (macOS) or none
        return [_chain(searcher, start, t0, i, seed, budget, len(chains)) for i, (seed, budget) in enumerate(chains)]
    if searcher.p.before_fork is not None:
        searcher.p.before_fork()
    ctx = mp.get_context("fork")
    walks: dict[int, Walk] = {}
    running: dict[Any, tuple[int, Any]] = {}     # the parent's end of a chain's pipe -> (chain, process)
    todo = list(enumerate(chains))
    forking = True
    try:
        while todo or running:
            while forking and todo and len(running) < workers:
                i, (seed, budget) = todo[0]
                here, there = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_forked_chain, daemon=True,
                                   args=(there, searcher, start, t0, i, seed, budget, len(chains)))
                try:
                    proc.start()
                except OSError:   # no memory for another process: the rest run here
                    here.close()
                    forking = False
                    break
                finally:
                    there.close()
                todo.pop(0)
                running[here] = (i, proc)
            if not forking and todo:
                i, (seed, budget) = todo.pop(0)
                walks[i] = _chain(searcher, start, t0, i, seed, budget, len(chains))
                continue
            for conn in mp.connection.wait(list(running)):
                i, proc = running.pop(conn)
                try:
                    ok, out = conn.recv()
                except EOFError:
                    proc.join()
                    raise RuntimeError(f"search chain {i}: its process ended without a result "
                                       f"(exit code {proc.exitcode})") from None
                proc.join()
                if not ok:
                    raise RuntimeError(f"search chain {i} failed: {out}")
                walks[i] = out
    finally:
        for _, proc in running.values():
            proc.terminate()
    return [walks[i] for i in range(len(chains))]


def _forked_chain(conn, searcher: Searcher, start: Candidate, t0: float, index: int, seed: int | None,
                  budget: int, chains: int) -> None:
    try:
        out = (True, _chain(searcher, start, t0, index, seed, budget, chains))
    except BaseException as e:   # noqa: BLE001 - the parent raises it, with the chain's name
        out = (False, f"{type(e).__name__}: {e}")
    conn.send(out)
    conn.close()


def _chain(searcher: Searcher, start: Candidate, t0: float, index: int, seed: int | None, budget: int,
           chains: int) -> Walk:
    """Chain `index` of `chains`: its walk, its progress every `chains` seconds (a line a second in all)."""
    rng = searcher.rng
    if seed is not None:
        searcher.rng = random.Random(seed)
    try:
        return searcher.walk(start, t0, budget, label=f" (chain {index})", every_s=float(chains))
    finally:
        searcher.rng = rng


def search_key(plan: Plan) -> tuple:
    """What tells a search's plans apart (they share one model and topology; no prediction)."""
    return (plan.global_batch, plan.replicas, plan.schedule, plan.sync, plan.optimizer, plan.recompute,
            plan.precision, plan.shard)


def walk_cost(t: float, feasible: bool, ratio: float) -> float:
    """What the walk minimises (module docstring): t when feasible, else t (2 + over memory),
    inf for an infinite t; it grows with t, so a bound on t bounds it."""
    if feasible:
        return t
    return t * (2.0 + max(ratio - 1.0, 0.0)) if math.isfinite(t) else math.inf


def _split_shape(s: Strategy) -> tuple:
    """What a tensor split's solved shares depend on: its devices and its stage's layers and
    microbatches (the shares are solved again when one changes)."""
    if not s.tensor:
        return ()
    p = s.pipelines[0]
    return (tuple(d for d, _ in s.tensor), s.tensor_stage, p.cuts, p.microbatches, len(p.devices))


@contextmanager
def no_collections():
    """Python's cyclic collector off for the walk: the simulator's caches hold millions of tuples
    and lists, each collection walks those made since the last one, and the walk makes little
    cyclic garbage (figures: docs/tuning.md). At the end what is alive moves to the collector's
    permanent generation (gc.freeze): re-enabled, its first collection would walk all of it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def search(problem: Problem, rng: random.Random, config: SearchConfig = SearchConfig(),
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Best plan found by the MCMC walk, never predicted slower than the best baseline."""
    return Searcher(problem, rng, config, progress).run()


def memory_error(result: SearchResult, memory_bytes: dict[str, float]) -> str:
    """One line for 'no feasible plan': the smallest memory the least hungry plan needs, and where."""
    c = result.least_memory      # None: every plan needed a link the topology lacks
    devs = [d for d in c.peak_memory_bytes if d in memory_bytes] if c is not None else []
    if not devs:
        return "no feasible plan found (the simulator rejected every plan)"
    dev = max(devs, key=lambda d: c.peak_memory_bytes[d] / memory_bytes[d])
    return (f"no plan fits in memory: the least memory-hungry plan found needs "
            f"{c.peak_memory_bytes[dev]:.4g} bytes on {dev}, which has {memory_bytes[dev]:.4g}")
