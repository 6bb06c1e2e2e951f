"""`plan --confirm`: the few best candidates run on this machine, interleaved, the measured
fastest kept.

Each candidate runs `rounds` times for a short window (at least WARMUP_S warm-up and MEASURED_S
measured, at its predicted iteration), the runs interleaved (A B C A B C) so that a slow spell of
the machine falls on every candidate alike; a candidate's time is the median of its runs' medians.
All runs go through one launcher process (hetplan.runtime.launch), so only the first pays the start of
the worker processes' server.
"""
from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median

WARMUP_S, MEASURED_S = 0.1, 0.2
ROUNDS = 2
MOST = 4                  # candidates run at most
FIRST_LAUNCH_S = 4.0      # the first run's start (the forkserver imports torch), on a 2-core VM
LAUNCH_S = 1.5            # each later run's start and end
DEFAULT_BUDGET_S = 30.0   # `plan` confirms by default when the estimate is within this
MARGIN = 0.03             # another candidate replaces the planner's pick only when this much faster


@dataclass(frozen=True)
class Confirmed:
    name: str
    predicted_s: float
    measured_s: tuple[float, ...]        # one per round

    @property
    def median_s(self) -> float:
        return median(self.measured_s)

    def to_json(self) -> dict:
        return {"name": self.name, "predicted_s": self.predicted_s, "measured_s": list(self.measured_s),
                "median_s": self.median_s}


def window(predicted_s: float) -> tuple[int, int]:
    """(warm-up, measured) iterations covering WARMUP_S and MEASURED_S at `predicted_s`: 2-20
    and 3-50 (a prediction far too short must not make a run long)."""
    p = max(predicted_s, 1e-6)
    return min(20, max(2, math.ceil(WARMUP_S / p))), min(50, max(3, math.ceil(MEASURED_S / p)))


def estimate_s(predicted: list[float], rounds: int = ROUNDS) -> float:
    """How long confirming candidates predicted at `predicted` seconds takes."""
    runs = sum(sum(window(p)) * p + LAUNCH_S for p in predicted) * rounds
    return FIRST_LAUNCH_S + runs


def run_here(path: Path, plan, topology, iters: int, warmup: int, out: Path) -> float:
    """The median iteration of the plan file at `path` (`plan`, loaded) run on this machine
    through this process's launcher (hetplan.runtime.launch), quietly, `iters` iterations of which the
    first `warmup` are left out; the measured file goes into the folder `out`."""
    from hetplan.runtime.launch import launch, thread_shares
    from hetplan.runtime.worker import RunConfig
    cfg = RunConfig(plan=str(path), iters=iters, warmup=warmup, out=str(out / "measured.json"),
                    threads=thread_shares(plan, topology), quiet=True)
    return launch(cfg, plan.devices)["iteration_s"]


def confirm(candidates: list[tuple[str, object, float]], topology, rounds: int = ROUNDS,
            log=lambda msg: print(f"hetplan plan: {msg}", file=sys.stderr)) -> tuple[list[Confirmed], float]:
    """Run each (name, plan, predicted seconds) `rounds` times, interleaved, on this machine
    (whose profile `topology` is); their measured times, in the order given, and the share of
    the CPU other processes used meanwhile (hetplan.runtime.host_load.ForeignCPU)."""
    from hetplan.planner.files.plan import save_plan
    from hetplan.runtime.host_load import ForeignCPU
    from hetplan.runtime.launch import prestart

    prestart()
    measured: dict[str, list[float]] = {name: [] for name, _, _ in candidates}
    with tempfile.TemporaryDirectory(prefix="hetplan-confirm-") as tmp, ForeignCPU() as foreign:
        paths = {}
        for i, (name, plan, _) in enumerate(candidates):
            paths[name] = Path(tmp, f"candidate{i}.json")
            save_plan(plan, paths[name])
        for r in range(rounds):
            for name, plan, predicted_s in candidates:
                warmup, iters = window(predicted_s)
                got = run_here(paths[name], plan, topology, warmup + iters, warmup, Path(tmp))
                measured[name].append(got)
                log(f"confirm round {r + 1}/{rounds}: {name}: {got * 1e3:.2f} ms "
                    f"(predicted {predicted_s * 1e3:.2f})")
    return [Confirmed(name, p, tuple(measured[name])) for name, _, p in candidates], foreign.fraction()


def fastest(confirmed: list[Confirmed], margin: float = MARGIN) -> Confirmed:
    """The measured fastest, where it is more than `margin` faster than the first given (the
    planner's pick: short runs on a shared machine move a few per cent); else the first."""
    best = min(confirmed, key=lambda c: c.median_s)
    return best if best.median_s < (1 - margin) * confirmed[0].median_s else confirmed[0]


__all__ = ["Confirmed", "run_here", "confirm", "estimate_s", "fastest", "window", "DEFAULT_BUDGET_S"]
