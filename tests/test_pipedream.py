"""PipeDream, PipeDream-2BW and PipeDream with SWA (plan field sync.mode): the runtime's weight
stashing against a hand computation, the one-process emulation against the runtime, the
simulator's steady state and memory, and what is refused."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from planner.files.io import InputError
from planner.files.plan import plan_from_dict
from planner.sim.simulator import simulate
from simhelpers import device, graph, layer, link, plan as sim_plan, topology

SCALARS = {"spec": "tests.runtime_models:scalars", "args": {}}
LEARNABLE = {"spec": "tests.runtime_models:learnable", "args": {"width": 16}}


def _sync(mode: str, swa: bool = False) -> dict:
    return {"granularity": "coarse", "mode": mode, **({"average": "swa"} if swa else {})}


def _pipeline(model: dict, sync: dict, m: int, global_batch: int, lr: float, opt: str = "sgd",
              ranges=((0, 2), (2, 3)), devices=("cpu:0", "cpu:1")) -> dict:
    from test_runtime import plan
    p = plan([(1.0, m, list(zip(devices, ranges)))], model=model, global_batch=global_batch,
             opt=opt, lr=lr)
    p["sync"] = sync
    return p


# --- the defining equality: backward uses the weights its forward used ---------------------------
def by_hand(mode: str, swa: bool, batches, w0, lr: float, m: int, stash: bool = True):
    """y = b * (c * (a * x)), loss (y - t)^2, SGD; stage 0 holds (a, c), stage 1 holds b. With
    p = 2 stages stage 0 runs one forward ahead (1F1B warm-up of p - 1 - s = 1), so microbatch
    k's forward on stage s used the weights after max(0, k - (1 - s)) of its backwards
    (PipeDream: one update per backward) or after that many // m (2BW: one per iteration).
    `stash=False`: the backward uses the stage's weights of its own moment instead (wrong)."""
    hist = [[(w0[0], w0[1])], [(w0[2],)]]         # per stage: weights after each update
    live, acc, swa_sum, losses = [[w0[0], w0[1]], [w0[2]]], [[0.0, 0.0], [0.0]], [None, None], []
    samples = [(x, t) for xs, ts in batches for x, t in zip(xs, ts)]
    for k, (x, t) in enumerate(samples):
        seen = [max(0, k - (1 - s)) for s in (0, 1)]
        v = [n if mode == "pipedream" else n // m for n in seen]
        (a, c), (b,) = hist[0][v[0]], hist[1][v[1]]
        h1 = a * x
        h2 = c * h1
        d = 2 * (b * h2 - t)
        if k % m == 0:
            losses.append(0.0)
        losses[-1] += (b * h2 - t) ** 2 / m
        if not stash:                               # backward with the stage's current weights
            b_now = live[1][0]
            a, c = live[0]
            b_back = b_now
        else:
            b_back = b
        d_h2 = d * b_back                            # what stage 1 sends back
        grads = [[d_h2 * c * x, d_h2 * h1], [d * h2]]
        scale = 1.0 if mode == "pipedream" else 1.0 / m   # 2BW: the iteration's mean gradient
        for s in (0, 1):
            acc[s] = [g0 + scale * g for g0, g in zip(acc[s], grads[s])]
            end = (k + 1) % m == 0
            if mode == "pipedream" or end:
                live[s] = [w - lr * g for w, g in zip(live[s], acc[s])]
                acc[s] = [0.0] * len(acc[s])
                if swa:
                    swa_sum[s] = list(live[s]) if swa_sum[s] is None else [u + w for u, w in zip(swa_sum[s], live[s])]
                    if end:
                        live[s], swa_sum[s] = [u / m for u in swa_sum[s]], None
                hist[s].append(tuple(live[s]))
    return losses, live


def _batches(p: dict, iters: int):
    from planner.workload.load import load_workload
    w = load_workload(p["model"]["spec"], p["model"]["args"])
    out = []
    for i in range(iters):
        x, y = w.make_batch(p["global_batch"], i)
        out.append((x[:, 0].tolist(), y[:, 0].tolist()))
    w0 = [float(l.weight.detach()) for l in w.model]
    return out, w0


@pytest.mark.parametrize("mode,swa", [("pipedream", False), ("pipedream-2bw", False), ("pipedream", True)])
def test_each_stage_runs_backward_with_the_weights_its_forward_used(tmp_path, mode, swa):
    from test_runtime import run_plan
    iters, m = 3, 2
    p = _pipeline(SCALARS, _sync(mode, swa), m=m, global_batch=2, lr=0.1)
    r, params = run_plan(tmp_path, p, iters=iters)
    batches, w0 = _batches(p, iters)
    losses, live = by_hand(mode, swa, batches, w0, 0.1, m)
    assert r["losses"] == pytest.approx(losses, rel=1e-5)
    got = [float(params[f"{i}.weight"]) for i in range(3)]
    assert got == pytest.approx(live[0] + live[1], rel=1e-5)
    if mode == "pipedream" and not swa:           # the stash is what makes these values
        _, wrong = by_hand(mode, swa, batches, w0, 0.1, m, stash=False)
        assert got != pytest.approx(wrong[0] + wrong[1], rel=1e-3)
