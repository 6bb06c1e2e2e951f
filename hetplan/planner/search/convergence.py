"""Loss against iterations for a plan's sync mode, and the time it takes to reach a target loss.

How fast a strategy's loss falls per iteration is a property of its mathematics (which gradients
at which parameters are combined how), not of the hardware, so it is measured by emulating the
strategy in one process on the user's model and data (`emulate`): synchronous training (every
synchronous plan: one step on the global batch), local SGD, EASGD and Hogwild with the plan's
replicas, batch shares and optimizer. The emulated curve, smoothed, gives the iterations to the
target (`iterations_to`); beyond its horizon, a power law fitted to it extrapolates
(`fit_power_law`). Time to the target = those iterations x the simulated iteration time.

Hogwild and the asynchronous parameter server are emulated with staleness of one iteration:
every worker's gradient is taken at the parameters of the iteration's start, then the workers'
steps are applied in turn. PipeDream, 2BW and PipeDream+SWA run their stages' actions in one
process with the runtime's weight versions, so their staleness is the runtime's
(hetplan.planner.search.pipeline_emulation).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from hetplan.planner.files.plan import PIPEDREAM_MODES
from hetplan.planner.search.pipeline_emulation import emulate_pipeline

SMOOTH_WINDOW = 8      # iterations in the running mean that must reach the target


@dataclass(frozen=True)
class PowerLaw:
    """loss(i) = floor + scale * (i + 1) ** -exponent, i counted from 0."""
    floor: float
    scale: float
    exponent: float

    def iterations_to(self, target: float) -> float:
        """The first i with loss(i) <= target (inf when the floor is above it)."""
        if target <= self.floor or self.scale <= 0 or self.exponent <= 0:
            return math.inf
        return max(0.0, ((target - self.floor) / self.scale) ** (-1.0 / self.exponent) - 1.0)


def smoothed(losses: list[float], window: int = SMOOTH_WINDOW) -> np.ndarray:
    """Running mean over the last `window` iterations (fewer at the start)."""
    x = np.asarray(losses, dtype=float)
    c = np.cumsum(np.insert(x, 0, 0.0))
    n = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - n]) / n


def fit_power_law(losses: list[float]) -> PowerLaw:
    """Least squares of log(loss - floor) on log(i + 1) over the smoothed curve's second half
    (the first is transient), for the floor in a grid below its last value that fits best."""
    y = smoothed(losses)
    half = len(y) // 2
    i = np.arange(half, len(y), dtype=float)
    tail = y[half:]
    best = None
    for floor in np.linspace(0.0, 0.999 * float(tail.min()), 64):
        a, b = np.polyfit(np.log(i + 1), np.log(tail - floor), 1)
        err = float(np.sum((floor + np.exp(b) * (i + 1) ** a - tail) ** 2))
        if best is None or err < best[0]:
            best = (err, PowerLaw(float(floor), float(np.exp(b)), float(-a)))
    return best[1]


def iterations_to(losses: list[float], target: float) -> float:
    """Iterations until the smoothed loss reaches `target`: counted where the curve gets there,
    else extrapolated by a power law fitted to it (inf when it levels off above)."""
    y = smoothed(losses)
    hit = np.nonzero(y <= target)[0]
    if len(hit):
        return float(hit[0] + 1)
    if len(losses) < 2 * SMOOTH_WINDOW:
        return math.inf
    return max(float(len(losses)), fit_power_law(losses).iterations_to(target) + 1)


def emulate(workload, plan, iterations: int) -> list[float]:
    """The plan's loss per iteration (replicas' mean losses weighted by batch fraction), trained
    in this process as the plan's sync mode combines them, from the model's initial weights."""
    import torch

    from hetplan.planner.workload.inputs import call_args, slice_inputs

    torch.manual_seed(0)
    if plan.sync.mode in PIPEDREAM_MODES:
        return emulate_pipeline(workload, plan, iterations)
    model = copy.deepcopy(workload.model)
    shares = plan.replica_batches()
    fractions = [b / plan.global_batch for b in shares]
    offsets = plan.replica_offsets()
    mode = plan.sync.mode
    n = 1 if mode == "sync" else len(shares)
    shared = mode in ("hogwild", "parameter-server")     # one copy of the parameters
    models = [model] * n if shared else [model] + [copy.deepcopy(model) for _ in range(n - 1)]
    opts = [_optimizer(m.parameters(), plan.optimizer) for m in models[:1 if mode == "parameter-server" else n]]
    center = [p.detach().clone() for p in model.parameters()] if mode == "easgd" else None
    losses = []
    for it in range(iterations):
        x, y = workload.make_batch(plan.global_batch, it)
        if n == 1:
            slices = [(0, plan.global_batch)]
        else:
            slices = [(o, o + b) for o, b in zip(offsets, shares)]
        grads, total = [], 0.0
        for r, (lo, hi) in enumerate(slices):
            m = models[r]
            m.zero_grad(set_to_none=True)
            args, kwargs = call_args(slice_inputs(x, lo, hi))
            loss = workload.loss_fn(m(*args, **kwargs), slice_inputs(y, lo, hi))
            loss.backward()
            total += (fractions[r] if n > 1 else 1.0) * float(loss.detach())
            if shared:                     # taken at the iteration's start, applied below
                grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
            else:
                opts[r].step()
        if shared:                         # hogwild: each worker's optimizer; a server: its one
            for r, g in enumerate(grads):
                for p, gp in zip(model.parameters(), g):
                    p.grad = gp
                opts[r % len(opts)].step()
        elif plan.sync.period is not None and (it + 1) % plan.sync.period == 0:
            _exchange(models, fractions, center, plan.sync)
        losses.append(total)
    return losses


def _optimizer(params, spec):
    from hetplan.planner.workload.optimizer import make_optimizer
    return make_optimizer(params, spec.name, spec.lr)


def _exchange(models, fractions, center, sync) -> None:
    """hetplan.runtime.sync_modes's exchange, on model copies in one process."""
    import torch
    with torch.no_grad():
        for k, ps in enumerate(zip(*(m.parameters() for m in models))):
            if center is None:                                  # local SGD
                avg = sum(f * p for f, p in zip(fractions, ps))
                for p in ps:
                    p.copy_(avg)
                continue
            ds = [sync.alpha * (p - center[k]) for p in ps]     # EASGD
            for p, d in zip(ps, ds):
                p.sub_(d)
            center[k].add_(sum(ds))


__all__ = ["PowerLaw", "emulate", "iterations_to", "fit_power_law", "smoothed", "SMOOTH_WINDOW"]
