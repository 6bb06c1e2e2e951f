"""`plan --objective time-to-loss`: synchronous and asynchronous plans ranked by the time to reach
a target loss = iterations to it (hetplan.planner.search.convergence, emulated on the user's model) x the
simulated iteration time.

Every synchronous plan takes the same iterations (each equals single-device training), so the
fastest synchronous plan the search found stands for them. The asynchronous plans are the sync
modes of `ASYNC_MODES` on the fastest data-parallel layout (one-stage replicas) among the
search's best plan and its baselines, and those of `PIPELINE_MODES` (PipeDream, 2BW,
PipeDream+SWA) on the fastest one-pipeline layout among them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import PIPEDREAM_MODES, Plan, validate_plan
from hetplan.planner.search.convergence import emulate, iterations_to

# the asynchronous variants tried on a data-parallel layout: (mode, period, alpha)
ASYNC_MODES = (("local-sgd", 2, None), ("local-sgd", 4, None), ("local-sgd", 8, None),
               ("easgd", 1, 0.1), ("easgd", 4, 0.1), ("hogwild", None, None))
# the asynchronous pipelines tried on a one-pipeline layout: (mode, average)
PIPELINE_MODES = (("pipedream", None), ("pipedream-2bw", None), ("pipedream", "swa"))
MAX_HORIZON = 10_000   # emulated iterations per strategy at most (`--horizon`; default 200): a bound, not a loop
                       # up to whatever number the flag holds


@dataclass(frozen=True)
class Ranked:
    name: str
    plan: Plan
    iteration_s: float
    feasible: bool
    peak_memory_bytes: dict
    iterations: float          # to the target loss (inf: not reached, nor on the fitted curve)
    time_s: float              # iterations x iteration_s

    def to_json(self) -> dict:
        return {"name": self.name, "sync": self.plan.sync.mode, "period": self.plan.sync.period,
                "alpha": self.plan.sync.alpha, "average": self.plan.sync.average,
                "iteration_s": self.iteration_s, "feasible": self.feasible,
                "iterations": None if math.isinf(self.iterations) else self.iterations,
                "time_s": None if math.isinf(self.time_s) else self.time_s}


def async_variants(name: str, plan: Plan) -> list[tuple[str, Plan]]:
    """The ASYNC_MODES of a data-parallel plan that are valid for its devices."""
    if any(len(r.stages) > 1 for r in plan.replicas) or len(plan.replicas) < 2:
        return []
    out = []
    for mode, period, alpha in ASYNC_MODES:
        p = replace(plan, sync=replace(plan.sync, mode=mode, period=period, alpha=alpha), predicted=None)
        try:
            validate_plan(p)
        except InputError:          # e.g. hogwild beside a GPU
            continue
        label = mode + (f" every {period}" if period else "") + (f", alpha {alpha:g}" if alpha is not None else "")
        out.append((f"{name}, {label}", p))
    return out


def pipeline_variants(name: str, plan: Plan) -> list[tuple[str, Plan]]:
    """The PIPELINE_MODES of a one-pipeline plan (two stages or more), run as 1F1B on the
    device without recompute or offload (what they run with; hetplan.runtime.pipedream)."""
    if len(plan.replicas) != 1 or len(plan.replicas[0].stages) < 2:
        return []
    rep = plan.replicas[0]
    rep = replace(rep, stages=tuple(replace(st, offload_activations=False) for st in rep.stages))
    base = replace(plan, replicas=(rep,), schedule="1f1b", recompute=False, predicted=None,
                   optimizer=replace(plan.optimizer, placement="device", cpu_fraction=None))
    out = []
    for mode, average in PIPELINE_MODES:
        p = replace(base, sync=replace(plan.sync, mode=mode, period=None, alpha=None, server=None, average=average))
        try:
            validate_plan(p)
        except InputError:          # e.g. fewer microbatches than stages
            continue
        out.append((f"{name}, {mode}" + (" + SWA" if average else ""), p))
    return out


def _fastest_variants(named_plans, sims, make) -> list[tuple[str, Plan]]:
    """`make`'s variants of the fastest feasible plan that has any."""
    variants = {n: make(n, p) for n, p in named_plans if sims[n].feasible}
    layouts = sorted(((sims[n].iteration_s, n) for n, v in variants.items() if v), key=lambda x: x[0])
    return variants[layouts[0][1]] if layouts else []


def rank(evaluate, workload, named_plans: list[tuple[str, Plan]], target: float,
         horizon: int) -> list[Ranked]:
    """The plans, the async variants of the fastest data-parallel one and the asynchronous
    pipelines of the fastest one-pipeline plan, each with its time to `target`, fastest first;
    `evaluate(plan)` is the search problem's simulation. A convergence curve is emulated once
    per distinct combination (every synchronous plan shares one)."""
    if not 16 <= horizon <= MAX_HORIZON:
        raise InputError(f"--horizon: expected an integer from 16 to {MAX_HORIZON} iterations, got {horizon}")
    curves: dict[tuple, float] = {}
    sims = {name: evaluate(plan) for name, plan in named_plans}
    tried = (list(named_plans) + _fastest_variants(named_plans, sims, async_variants)
             + _fastest_variants(named_plans, sims, pipeline_variants))
    out = []
    for name, plan in tried:
        key = _math_key(plan)
        if key not in curves:
            try:
                curves[key] = iterations_to(emulate(workload, plan, horizon), target)
            except ValueError:       # a pipeline the emulation cannot run (stages tying a weight): not ranked
                if plan.sync.mode not in PIPEDREAM_MODES:
                    raise
                continue
        r = sims[name] if name in sims else evaluate(plan)
        its = curves[key]
        out.append(Ranked(name, plan, r.iteration_s, r.feasible, dict(r.peak_memory_bytes), its,
                          its * r.iteration_s if r.feasible else math.inf))
    return sorted(out, key=lambda c: (c.time_s, c.iteration_s))


def _math_key(plan: Plan) -> tuple:
    """What an emulated curve depends on: the sync mode and its parameters, the optimizer, and
    for an asynchronous mode the replicas' batch shares."""
    if plan.sync.mode == "sync":
        return ("sync", plan.optimizer)
    if plan.sync.mode in PIPEDREAM_MODES:    # the staleness depends on the stages and microbatches
        rep = plan.replicas[0]
        return (plan.sync.mode, plan.sync.average, plan.optimizer, plan.global_batch, rep.microbatches,
                tuple(st.layers for st in rep.stages))
    return (plan.sync.mode, plan.sync.period, plan.sync.alpha, plan.optimizer, tuple(plan.replica_batches()))


__all__ = ["ASYNC_MODES", "PIPELINE_MODES", "Ranked", "async_variants", "pipeline_variants", "rank"]
