"""Batch shares that follow the devices while training runs (`run --rebalance K`; HyScale-GNN's
dynamic resource management).

Every K steps each rank sums its replica's busy compute time (hetplan.runtime.instruments.BusyTimer:
forward, backward, optimizer; waits left out) and its samples over the window; one all-gather gives
every rank the same figures, and every rank computes the same new shares from them with the
planner's rule (hetplan.planner.search.mcmc.level_batches, with t_r(b) = c_r·b, c_r the measured
seconds per sample), so no rank can disagree. The shares move in whole samples per microbatch,
damped (`Damping`): nothing moves while the present shares' predicted step is within `deadband` of
the target's (hysteresis), and one rebalance moves a replica at most `max_step` of the global batch
and `gain` of the way (at least one sample per microbatch). New shares apply from the next step; each replica's loss stays scaled by
its share in force, so a step's gradient is the global batch's mean, as on one device.

Limits: plain data parallel only (each replica one stage on one device, synchronous, every replica
the same number of microbatches); a resumed run starts again from the plan's shares.
"""
from __future__ import annotations

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
    deadband: float = 0.10   # no change while the present shares' predicted step is within 10 %
                             # of the target's (timer noise on a shared host is a few %)
    gain: float = 0.75       # one rebalance goes three quarters of the way to the target
    max_step: float = 0.25   # and moves a replica at most a quarter of the global batch


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


def next_units(units: list[int], per_unit_s: list[float], damping: Damping = Damping()) -> list[int]:
    """The new samples per microbatch of each replica from the present ones and each replica's
    measured seconds per unit (one sample in every microbatch); the total stays the same."""
    total, lows = sum(units), [1] * len(units)
    target = level_batches([(0.0, max(c, 1e-12)) for c in per_unit_s], lows, total)
    now_s = max(c * u for c, u in zip(per_unit_s, units))
    best_s = max(c * u for c, u in zip(per_unit_s, target))
    if now_s <= best_s * (1 + damping.deadband):
        return list(units)
    cap = max(1, int(damping.max_step * total))
    new = []
    for u, t in zip(units, target):
        move = max(-cap, min(cap, int(damping.gain * (t - u))))
        new.append(max(1, u + (move or (t > u) - (t < u))))
    while sum(new) > total:       # the moves' rounding: the slowest predicted gives back
        i = max((i for i in range(len(new)) if new[i] > 1), key=lambda i: per_unit_s[i] * new[i])
        new[i] -= 1
    while sum(new) < total:
        i = min(range(len(new)), key=lambda i: (per_unit_s[i] * (new[i] + 1), i))
        new[i] += 1
    return new


class Rebalancer:
    """One rank's part: the shares in force, the window's timings, the decision every `every` steps."""

    def __init__(self, plan, built, every: int, group, damping: Damping = Damping()):
        self.plan, self.built, self.every, self.group, self.damping = plan, built, every, group, damping
        self.m = plan.replicas[0].microbatches
        self.units = [b // self.m for b in plan.replica_batches()]
        self.devices = [r.stages[0].device for r in plan.replicas]
        self.busy_s, self.samples = 0.0, 0
        self.history: list[dict] = []            # {"step": first step in force, "shares": {...}}
        self.decided = 0                         # the shares of steps before decided + every are known
        self._known = threading.Condition()
        built.timer.take()                       # the build's own timings are not this run's
        self._apply(0)

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
        self.busy_s += self.built.timer.take()
        self.samples += self.units[self.built.replica] * self.m
        if done % self.every:
            return
        mine = torch.tensor([self.busy_s / max(self.samples, 1)], dtype=torch.float64)
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        per_unit = [float(t) * self.m for t in everyone]    # rank r is replica r (one stage each)
        new = next_units(self.units, per_unit, self.damping)
        self.busy_s, self.samples = 0.0, 0
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
