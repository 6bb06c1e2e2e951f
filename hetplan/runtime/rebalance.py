"""Batch shares that follow the devices while training runs (`run --rebalance K`; HyScale-GNN's
dynamic resource management).

Every K steps each rank sums its replica's busy time (hetplan.runtime.instruments.BusyTimer; waits
left out) over the window: the optimizer's, which no sample changes, and the rest (forward,
backward), with its samples; one all-gather gives every rank the same figures, and every rank
computes the same new shares from them with the planner's rule
(hetplan.planner.search.mcmc.level_batches, with t_r(b) = a_r + c_r·b: a_r the optimizer's seconds
a step, c_r the rest's seconds a sample), so no rank can disagree. The shares move in whole samples per microbatch,
damped (`Damping`): nothing moves while the replicas' measured step times are within `deadband` of
each other (hysteresis), and one rebalance moves a replica at most `max_step` of the global batch
and `gain` of the way (at least one sample per microbatch), and a replica keeps `floor` of its planned
batch. New shares apply from the next step; each replica's loss stays scaled by
its share in force, so a step's gradient is the global batch's mean, as on one device.

Limits: plain data parallel only (each replica one stage on one device, synchronous, every replica
the same number of microbatches); a resumed run starts again from the plan's shares.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetplan.planner.files.io import InputError
from hetplan.planner.search.mcmc import level_batches

SLOW_ENV = "HETPLAN_TEST_SLOW"    # tests and benchmarks: "RANK:FROM:UNTIL:SECONDS_PER_SAMPLE[,...]"


@dataclass(frozen=True)
class Damping:
    deadband: float = 0.10   # no change while the replicas' times are within 10 % of each other
                             # (timer noise on a shared host is a few %)
    gain: float = 0.75       # one rebalance goes three quarters of the way to the target
    max_step: float = 0.25   # and moves a replica at most a quarter of the global batch
    floor: float = 0.125     # a replica keeps an eighth of its planned batch: the per-step overhead of
                             # a tiny batch reads as a slow device (c_r is taken as time / samples), and
                             # a replica with almost nothing would never win its samples back


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
               fixed_s: list[float] | None = None, lows: list[int] | None = None) -> list[int]:
    """The new samples per microbatch of each replica from the present ones, each replica's
    measured seconds per unit (one sample in every microbatch) and per step (`fixed_s`, default
    0), at least `lows` (default 1) each; the total stays the same."""
    total, lows = sum(units), lows or [1] * len(units)
    fixed_s = fixed_s or [0.0] * len(units)
    target = level_batches([(a, max(c, 1e-12)) for a, c in zip(fixed_s, per_unit_s)], lows, total)
    now = [a + c * u for a, c, u in zip(fixed_s, per_unit_s, units)]
    best_s = max(a + c * u for a, c, u in zip(fixed_s, per_unit_s, target))
    if max(now) - min(now) <= damping.deadband * max(now) or best_s >= max(now):
        return list(units)      # hysteresis: the replicas' times within the band, or nothing better
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


class Rebalancer:
    """One rank's part: the shares in force, the window's timings, the decision every `every` steps."""

    def __init__(self, plan, built, every: int, group, start: int = 0, damping: Damping = Damping()):
        self.plan, self.built, self.every, self.group, self.damping = plan, built, every, group, damping
        self.m = plan.replicas[0].microbatches
        self.units = [b // self.m for b in plan.replica_batches()]
        self.lows = [max(1, math.ceil(damping.floor * u)) for u in self.units]
        self.devices = [r.stages[0].device for r in plan.replicas]
        self.busy_s, self.fixed_s, self.samples, self.steps = 0.0, 0.0, 0, 0
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
        self.fixed_s += busy.pop("optimizer", 0.0)
        self.busy_s += sum(busy.values())
        self.samples += self.units[self.built.replica] * self.m
        self.steps += 1
        if done % self.every:
            return
        mine = torch.tensor([self.busy_s / max(self.samples, 1), self.fixed_s / max(self.steps, 1)],
                            dtype=torch.float64)
        everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        per_unit = [float(t[0]) * self.m for t in everyone]    # rank r is replica r (one stage each)
        new = next_units(self.units, per_unit, self.damping, [float(t[1]) for t in everyone], self.lows)
        self.busy_s, self.fixed_s, self.samples, self.steps = 0.0, 0.0, 0, 0
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
