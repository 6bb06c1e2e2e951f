"""Batch shares that follow the devices while training runs (`run --rebalance K`; HyScale-GNN's
dynamic resource management).

Every K steps each rank takes the median over the window's steps of its replica's busy time
(hetplan.runtime.instruments.BusyTimer; waits left out, DDP's all-reduce wait after the last
bucket too), split into the optimizer's, which no sample changes, and the rest (forward,
backward), and of its wall time; one all-gather gives every rank the same figures, and every rank
computes the same new shares from them with the planner's rule
(hetplan.planner.search.mcmc.level_batches, with t_r(b) = a_r + c_r·b: a_r the optimizer's seconds
a step plus the overhead of forward and backward, learnt from two windows at different sizes
(`overhead_units`), c_r the rest's seconds a sample), so no rank can disagree. A replica left
below its plan for `PROBE_AFTER` windows gets half its way back (`probe_units`): the next window
says whether the load is still there. The shares move in whole samples per microbatch, damped
(`Damping`): nothing moves unless the new shares are predicted to save `deadband` of the
measured step (hysteresis; a load that slows a replica's communication, not its compute, moves
nothing), and one rebalance moves a replica at most `max_step` of the global batch and `gain` of
the way (at least one sample per microbatch), and a replica keeps `floor` of its planned batch.
New shares apply from the next step; each replica's loss stays scaled by its share in force, so a
step's gradient is the global batch's mean, as on one device.

While rebalancing, gloo's event-loop thread runs at nice `SHARED_NICE`, not 19
(hetplan.runtime.gloo_threads): a run that expects other processes on its cores must not let
them starve its communication.

Limits: plain data parallel only (each replica one stage on one device, synchronous, every replica
the same number of microbatches); a resumed run starts again from the plan's shares.
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetplan.planner.files.io import InputError
from hetplan.planner.search.mcmc import level_batches

SHARED_NICE = 10                  # gloo's loop thread while rebalancing: ~10 % of a core against a
                                  # nice-0 process, where nice 19's 1.5 % stalled every all-reduce
PROBE_AFTER = 5                   # windows without a move before a replica below its plan is probed
SLOW_ENV = "HETPLAN_TEST_SLOW"    # tests and benchmarks: "RANK:FROM:UNTIL:SECONDS_PER_SAMPLE[,...]"


@dataclass(frozen=True)
class Damping:
    deadband: float = 0.05   # no change unless it saves 5 % of the measured step (timer noise on
                             # a shared host is a few %)
    gain: float = 0.75       # one rebalance goes three quarters of the way to the target
    max_step: float = 0.25   # and moves a replica at most a quarter of the global batch
    floor: float = 0.125     # a replica keeps an eighth of its planned batch: until a second window
                             # size gives its overhead (overhead_units), a tiny batch reads as a slow
                             # device (its per-step cost taken per sample)


def check(plan, file: str) -> None:
    """InputError unless `plan` is plain data parallel with equal microbatches (what rebalancing
    supports)."""
    reps = plan.replicas
    if plan.sync.mode != "sync" or len(reps) < 2 or any(len(r.stages) != 1 or r.stages[0].split for r in reps):
        raise InputError(f"--rebalance: {file} is not plain data parallel; expected two or more replicas of "
                         "one stage each and sync.mode 'sync'")
    ms = {r.microbatches for r in reps}
    if len(ms) != 1:
        raise InputError(f"--rebalance: {file}: replicas[].microbatches differ ({sorted(ms)}); expected the "
                         "same number in every replica")
    m = ms.pop()
    if plan.global_batch % m or any(b % m for b in plan.replica_batches()):
        raise InputError(f"--rebalance: {file}: global_batch and every replica's batch must be multiples of "
                         f"microbatches ({m})")


def next_units(units: list[int], per_unit_s: list[float], damping: Damping = Damping(),
               fixed_s: list[float] | None = None, lows: list[int] | None = None,
               step_s: float | None = None) -> list[int]:
    """The new samples per microbatch of each replica from the present ones, each replica's
    measured seconds per unit (one sample in every microbatch) and per step (`fixed_s`, default
    0), at least `lows` (default 1) each; the total stays the same. `step_s`: the measured step
    (default: the slowest replica's busy time), against which a move must save `deadband`."""
    total, lows = sum(units), lows or [1] * len(units)
    fixed_s = fixed_s or [0.0] * len(units)
    target = level_batches([(a, max(c, 1e-12)) for a, c in zip(fixed_s, per_unit_s)], lows, total)
    now = [a + c * u for a, c, u in zip(fixed_s, per_unit_s, units)]
    best_s = max(a + c * u for a, c, u in zip(fixed_s, per_unit_s, target))
    if max(now) - best_s < damping.deadband * (step_s or max(now)):
        return list(units)      # hysteresis: too little to gain
    cap = max(1, int(damping.max_step * total))
    new = []
    for u, t, low in zip(units, target, lows):
        move = max(-cap, min(cap, int(damping.gain * (t - u))))
        new.append(max(low, u + (move or (t > u) - (t < u))))
    while sum(new) > total:       # the moves' rounding: the slowest predicted gives back
        i = max((i for i in range(len(new)) if new[i] > lows[i]), key=lambda i: fixed_s[i] + per_unit_s[i] * new[i])
        new[i] -= 1
    while sum(new) < total:
        i = min(range(len(new)), key=lambda i: (fixed_s[i] + per_unit_s[i] * (new[i] + 1), i))
        new[i] += 1
    return new


def overhead_units(prev: tuple[int, float] | None, now: tuple[int, float], q: float) -> float:
    """A replica's per-step overhead of forward and backward in units (t(u) = c·(q + u)): from the
    line through two consecutive windows' (units, seconds) when their sizes differ by a fifth or
    more, averaged with the one known (timer noise on a slope), else the one known (`q`). Without
    it a replica left with a few samples reads as slow (its kernels' fixed cost taken per sample)
    and never wins its share back."""
    if prev is None or abs(now[0] - prev[0]) < max(1, 0.2 * max(now[0], prev[0])):
        return q
    c = (now[1] - prev[1]) / (now[0] - prev[0])
    if c <= 0:
        return q
    fit = min(max(0.0, now[1] / c - now[0]), 4.0 * max(now[0], prev[0]))
    return fit if q == 0.0 else (q + fit) / 2


def probe_units(units: list[int], planned: list[int], lows: list[int]) -> list[int]:
    """Halfway back to the plan for the replica furthest below its planned units (by a tenth or
    more), from the one furthest above (at least one unit): a second point for `overhead_units`
    once the load that moved the shares may have gone."""
    below = min(range(len(units)), key=lambda i: (units[i] / planned[i], i))
    above = max(range(len(units)), key=lambda i: (units[i] / planned[i], -i))
    move = min(max(1, (planned[below] - units[below]) // 2), units[above] - lows[above])
    if units[below] >= 0.9 * planned[below] or move <= 0:      # near the plan: nothing to learn
        return list(units)
    new = list(units)
    new[below] += move
    new[above] -= move
    return new


class Rebalancer:
    """One rank's part: the shares in force, the window's timings, the decision every `every` steps."""

    def __init__(self, plan, built, every: int, group, start: int = 0, damping: Damping = Damping()):
        self.plan, self.built, self.every, self.group, self.damping = plan, built, every, group, damping
        self.m = plan.replicas[0].microbatches
        self.units = [b // self.m for b in plan.replica_batches()]
        self.lows = [max(1, math.ceil(damping.floor * u)) for u in self.units]
        self.devices = [r.stages[0].device for r in plan.replicas]
        self.planned = list(self.units)
        self.window: list[tuple[float, float, float]] = []   # each step's (busy, optimizer, wall) seconds
        self.last: list[tuple[int, float] | None] = [None] * len(self.units)   # last window's (units, busy)
        self.q = [0.0] * len(self.units)         # each replica's overhead_units
        self.still = 0                           # windows since the shares last moved
        self.clock = time.perf_counter()
        self.history: list[dict] = []            # {"step": first step in force, "shares": {...}}
        self.decided = start - start % every     # the shares of steps before decided + every are known
        self._known = threading.Condition()
        built.timer.take()                       # the build's own timings are not this run's
        self._apply(start)

    def wait_known(self, step: int) -> None:
        """Block (the prefetch thread) until the shares of `step` are decided: data is read once,
        under the shares it trains with."""
        with self._known:
            self._known.wait_for(lambda: step < self.decided + self.every)

    @property
    def slice(self) -> tuple[int, int]:
        """(offset, samples per microbatch) of this rank's replica, as one value (read by the
        prefetch thread)."""
        return self._slice

    def shares(self) -> dict[str, float]:
        G = self.plan.global_batch
        return {d: u * self.m / G for d, u in zip(self.devices, self.units)}

    def after_step(self, done: int) -> None:
        """Take this step's busy time; every `every` steps, decide (a collective on every rank)."""
        busy = self.built.timer.take_by_kind()
        now = time.perf_counter()
        fixed = busy.pop("optimizer", 0.0)
        self.window.append((sum(busy.values()), fixed, now - self.clock))
        self.clock = now
        if done % self.every:
            return
        # medians of the window's steps: one stalled step (a page fault, a timer interrupt) moves nothing
        busy_s, fixed_s, step_s = (statistics.median(col) for col in zip(*self.window))
        mine = torch.tensor([busy_s, fixed_s, step_s], dtype=torch.float64)
        everyone = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        busy = [float(t[0]) for t in everyone]                  # rank r is replica r (one stage each)
        self.q = [overhead_units(last, (u, b), q) for last, u, b, q in zip(self.last, self.units, busy, self.q)]
        self.last = list(zip(self.units, busy))
        per_unit = [b / (u + q) for b, u, q in zip(busy, self.units, self.q)]
        fixed = [float(t[1]) + q * c for t, q, c in zip(everyone, self.q, per_unit)]
        new = next_units(self.units, per_unit, self.damping, fixed, self.lows,
                         step_s=max(float(t[2]) for t in everyone))
        self.still = 0 if new != self.units else self.still + 1
        if self.still >= PROBE_AFTER:
            new, self.still = probe_units(self.units, self.planned, self.lows), 0
        self.window = []
        if new != self.units:
            self.units = new
            self._apply(done)
        with self._known:
            self.decided = done
            self._known.notify_all()

    def _apply(self, step: int) -> None:
        r, G = self.built.replica, self.plan.global_batch
        offset = sum(self.units[:r]) * self.m
        self._slice = (offset, self.units[r])
        self.built.offset, self.built.micro = offset, self.units[r]
        self.built.runner.scale = self.units[r] / G      # share / microbatches
        self.history.append({"step": step, "shares": self.shares()})


def injected_slowdown(rank: int, step: int, built) -> None:
    """Tests and benchmarks (SLOW_ENV): rank RANK sleeps SECONDS_PER_SAMPLE per sample at steps
    FROM <= step < UNTIL, inside a busy span, so the timers count it as this rank's compute."""
    for spec in filter(None, os.environ.get(SLOW_ENV, "").split(",")):
        r, start, until, per_sample = spec.split(":")
        if int(r) == rank and int(start) <= step < int(until):
            samples = built.micro * built.plan.replicas[built.replica].microbatches
            with built.timer.timer("injected slowdown"):
                time.sleep(float(per_sample) * samples)
