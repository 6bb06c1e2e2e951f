"""How sure a prediction is: an interval expected to hold the measured median iteration time
with probability PROBABILITY, and the probability that one plan measures faster than another.

A prediction is made of measured inputs, each with a spread that `profile` recorded (`spread_of`):
a device's timings, each link's ping-pong table, the all-reduce table. A draw multiplies each
device's layer times, each link's time and the calibrated all-reduces by exp(sd * z), one z per
input, and simulates the plan on them (`Draws`); every plan simulated with one `Draws` sees the
same z, so two plans compare on the same draws. An input without spread is not drawn.

The simulator's own error for plans of the plan's class (`Residual`, measured by
benchmarks/accuracy.py: docs/tuning.md, "How sure: intervals") is added per plan: the measured
median is a draw's time times exp(-e), e ~ N(mean, sd), independent between plans (the accuracy
benchmark found two plans' errors uncorrelated, within a workload too).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from statistics import NormalDist, median

PROBABILITY = 0.9        # what an interval holds
BEATS = 0.9              # a plan with more parts replaces a simpler one only this surely (`choose`)
DRAWS = 48               # simulations per plan
REPEATS = 5              # a layer time is the median of this many runs (hetplan.planner.cost.timing)
_IQR_SD = 1.349          # a normal distribution's interquartile range in standard deviations
_MEDIAN_SE = 1.2533      # a median's standard error in sd / sqrt(n)
_N = NormalDist()


@dataclass(frozen=True)
class Residual:
    """The simulator's own error on one class of plans, e = log(predicted / measured): its mean
    and standard deviation, the class's name, and the standard deviation of the part of a plan's
    e that another plan of the class does not share (`own`; = sd where errors are independent)."""
    mean: float
    sd: float
    basis: str
    own: float | None = None

    @property
    def unshared(self) -> float:
        return self.sd if self.own is None else self.own


# CPU workers, by predicted iteration time (benchmarks/accuracy.py on the 2-core VM, two runs of
# 51 plans pooled; docs/tuning.md): two plans' errors independent. Accelerators and what-if topologies have no
# accuracy run yet: a wide, unbiased interval; two plans' errors assumed to differ as much as
# two CPU plans' of 20 ms and over do (the formulas' common error is shared by both).
CPU_RESIDUALS = ((0.020, Residual(-0.061, 0.121, "cpu, under 20 ms")),
                 (math.inf, Residual(0.004, 0.056, "cpu, 20 ms and over")))
ACCELERATOR_RESIDUAL = Residual(0.0, 0.15, "with an accelerator (not yet measured)", own=0.056)
ROOFLINE_RESIDUAL = Residual(0.0, 0.30, "what-if topology, priced by the roofline", own=0.056)


def residual(iteration_s: float, kinds: set[str], measured: bool) -> Residual:
    """The class of a plan predicted at `iteration_s` on devices of `kinds`, priced by
    measurements of this machine (`measured`) or by the roofline."""
    if not measured:
        return ROOFLINE_RESIDUAL
    if kinds != {"cpu"}:
        return ACCELERATOR_RESIDUAL
    return next(r for limit, r in CPU_RESIDUALS if iteration_s < limit)


@dataclass(frozen=True)
class Spread:
    """Log-scale standard deviations of the measured inputs: per device (its layer times), per
    link (keyed (a, b) as in the topology) and of the calibrated all-reduce."""
    compute: dict[str, float] = field(default_factory=dict)
    links: dict[tuple[str, str], float] = field(default_factory=dict)
    collective: float = 0.0


def _row_sd(rows: list[dict], repeats: int | None = None) -> float:
    """A table's typical standard error of one figure: its rows' median spread ((p75 - p25) /
    median) as a standard deviation, over sqrt of the repeats the figure is a median of."""
    spreads = [r["spread"] for r in rows if isinstance(r.get("spread"), (int, float))]
    if not spreads:
        return 0.0
    n = repeats or median(r.get("samples", 1) for r in rows)
    return _MEDIAN_SE * median(spreads) / _IQR_SD / math.sqrt(max(1, n))


def _fit_sd(rows: list[dict], predict) -> float:
    """Root mean square of the rows' log distance from a fit (`predict(bytes) -> s`)."""
    pairs = [(predict(r["bytes"]), r["s"]) for r in rows if r.get("s", 0) > 0]
    logs = [math.log(p / s) for p, s in pairs if p > 0]
    return math.sqrt(sum(x * x for x in logs) / len(logs)) if logs else 0.0


def spread_of(topology, repeats: int = REPEATS) -> Spread:
    """Each measured input's spread as `profile` recorded it: a device's matmul table (its
    layer times are medians of `repeats` runs); a link's ping-pong table, with the misfit of
    its latency + bytes / bandwidth line; the all-reduce table. A what-if file has none."""
    compute = {d.name: sd for d in topology.devices
               if (sd := _row_sd(d.measured.get("matmul_table", []), repeats)) > 0}
    links = {}
    for link in topology.links:
        rows = link.measured.get("p2p_table", [])
        sd = math.hypot(_row_sd(rows), _fit_sd(rows, link.transfer_s))
        if sd > 0:
            links[(link.a, link.b)] = sd
    rows = topology.measured.get("collectives", {}).get("allreduce", [])
    return Spread(compute, links, _row_sd(rows) if isinstance(rows, list) else 0.0)


class Draws:
    """`n` seeded draws of the inputs of `simulator` (a Simulator, or ByPrecision: the plan's
    precision's) and each plan's simulated iteration on them (`times`)."""

    def __init__(self, simulator, spread: Spread, n: int = DRAWS, seed: int = 0):
        self.simulator, self.spread = simulator, spread
        rng = random.Random(seed)
        self.drawn = bool(spread.compute or spread.links or spread.collective)   # else: the prediction alone
        self.n = n if self.drawn else 1
        self.z = [({d: rng.gauss(0, 1) for d in sorted(spread.compute)},
                   {k: rng.gauss(0, 1) for k in sorted(spread.links)}, rng.gauss(0, 1))
                  for _ in range(self.n)]
        self._sims: dict[tuple[str, int], object] = {}

    def base(self, plan):
        """The simulator that prices `plan` undrawn (ByPrecision: its precision's)."""
        return getattr(self.simulator, "simulators", {}).get(plan.precision, self.simulator)

    def _sim(self, base, k: int):
        from hetplan.planner.sim.simulator import Simulator
        key = (base.graph.precision, k)
        if key not in self._sims:
            zc, zl, za = self.z[k]
            s = self.spread
            topo = base.topology
            links = tuple(replace(l, latency_s=l.latency_s * f, bandwidth_bytes_per_s=l.bandwidth_bytes_per_s / f)
                          if (f := math.exp(s.links.get((l.a, l.b), 0.0) * zl.get((l.a, l.b), 0.0))) != 1.0 else l
                          for l in topo.links)
            topo = replace(topo, links=links)
            compute = {d: math.exp(s.compute[d] * z) for d, z in zc.items()}
            cost = base.cost.drawn(topo, compute, math.exp(s.collective * za))
            self._sims[key] = Simulator(base.graph, topo, cost)
        return self._sims[key]

    def times(self, plan) -> list[float]:
        """The plan's simulated iteration on each draw (its prediction alone when nothing is
        drawn); inf on every draw for a plan the simulator refuses."""
        base = self.base(plan)
        sims = [self._sim(base, k) for k in range(self.n)] if self.drawn else [base]
        try:
            return [s.simulate(plan).iteration_s for s in sims]
        except ValueError:
            return [math.inf] * len(sims)


def interval(times: list[float], res: Residual, probability: float = PROBABILITY) -> tuple[float, float]:
    """[lo, hi] holding the measured median with `probability`: the central quantiles of the
    drawn times each times exp(-e), e ~ N(res.mean, res.sd) (a mixture; its quantiles by
    bisection in log time)."""
    if any(math.isinf(t) for t in times):
        return math.inf, math.inf
    tail = (1 - probability) / 2
    if res.sd <= 0:      # the drawn times' own quantiles
        s = sorted(t * math.exp(-res.mean) for t in times)
        pick = lambda q: s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]  # noqa: E731
        return pick(tail), pick(1 - tail)
    logs = [math.log(t) - res.mean for t in times]

    def cdf(x: float) -> float:
        return sum(_N.cdf((x - m) / res.sd) for m in logs) / len(logs)

    def quantile(q: float) -> float:
        lo, hi = min(logs) - 10 * res.sd, max(logs) + 10 * res.sd
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
        return math.exp((lo + hi) / 2)
    return quantile(tail), quantile(1 - tail)


def beat_probability(a: list[float], res_a: Residual, b: list[float], res_b: Residual) -> float:
    """P(plan a measures faster than plan b), a and b simulated on the same draws: per draw
    P(log a - e_a < log b - e_b) with e_a - e_b of the residuals' unshared parts, averaged."""
    s = math.hypot(res_a.unshared, res_b.unshared)
    out = []
    for ta, tb in zip(a, b):
        if math.isinf(ta) or math.isinf(tb):
            out.append(0.0 if math.isinf(ta) and not math.isinf(tb) else
                       1.0 if math.isinf(tb) and not math.isinf(ta) else 0.5)
            continue
        gap = math.log(tb / ta) + res_a.mean - res_b.mean
        out.append(_N.cdf(gap / s) if s > 0 else float(gap > 0) + 0.5 * (gap == 0))
    return sum(out) / len(out)


def judge(draws: Draws, name: str, plan, measured: bool, baseline: bool = False) -> Judged:
    """`plan` simulated on `draws`, with the residual of its class."""
    times = draws.times(plan)
    kinds = {draws.base(plan).topology.device(d).kind for d in plan.devices}
    return Judged(name, plan, times, residual(median(times), kinds, measured), baseline)


def parts(plan) -> int:
    """How many parts a plan has beyond one device running the whole batch: its stages (a split
    stage's devices), microbatches beyond the first, offloaded activations, an optimizer off the
    device, asynchronous sync."""
    n = 0
    for r in plan.replicas:
        n += sum(max(1, len(st.split)) + st.offload_activations for st in r.stages) + r.microbatches - 1
    return n + (plan.optimizer.placement != "device") + (plan.sync.mode != "sync")


@dataclass(frozen=True)
class Judged:
    """A candidate plan with its draws' times and its class."""
    name: str
    plan: object
    times: list[float]
    residual: Residual
    baseline: bool = False      # one of the obvious plans (hetplan.planner.search.baselines)

    @property
    def middle(self) -> float:
        return median(self.times)

    def interval(self, probability: float = PROBABILITY) -> tuple[float, float]:
        return interval(self.times, self.residual, probability)


def choose(candidates: list[Judged], beats: float = BEATS) -> Judged:
    """From the simplest candidate up (fewest `parts`, a baseline before a searched plan of as
    many, then fastest), a plan replaces the one kept so far when it measures faster with
    probability at least `beats`; more than 1/2 is enough where it has no more parts and is not
    a searched plan replacing a baseline (a baseline above all)."""
    order = sorted(candidates, key=lambda c: (parts(c.plan), not c.baseline, c.middle))
    kept = order[0]
    for c in order[1:]:
        p = beat_probability(c.times, c.residual, kept.times, kept.residual)
        richer = parts(c.plan) > parts(kept.plan) or (kept.baseline and not c.baseline)
        if p >= beats or (not richer and p > 0.5):
            kept = c
    return kept


__all__ = ["PROBABILITY", "BEATS", "DRAWS", "Residual", "residual", "Spread", "spread_of", "Draws",
           "interval", "beat_probability", "judge", "parts", "Judged", "choose"]
