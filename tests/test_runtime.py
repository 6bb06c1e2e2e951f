"""Numerical equivalence of `hetplan run` against single-process training (gloo on CPU).

Every plan below trains a tiny model for a few Adam steps with CPU worker processes; its losses
must match single-device training on the global batch to 1e-4 (relative) and its final
parameters to 1e-5, plus the slack Adam gives rounding near a zero gradient (tests/equivalence.py).
The reference: one process, the whole model, make_batch(G, seed=i),
torch.optim with the plan's lr.
"""
from __future__ import annotations

import json

import pytest
import torch

from equivalence import AdamSlack, Trained, assert_params_match
from hetplan.planner.workload.precision import autocast
from hetplan.planner.workload.load import load_workload
from hetplan.runtime.launch import launch
from hetplan.runtime.worker import RunConfig

MLP = {"spec": "mlp", "args": {"hidden": 16, "depth": 3}}          # 4 layers
SKIP = {"spec": "tests.runtime_models:skipnet", "args": {"width": 16}}   # 4 layers, skip across cuts
ITERS = 3


def reference(model: dict, global_batch: int, iters: int, opt: str = "adam", lr: float = 0.01,
              precision: str = "fp32") -> Trained:
    w = load_workload(model["spec"], model["args"])
    o = (torch.optim.Adam if opt == "adam" else torch.optim.SGD)(w.model.parameters(), lr=lr)
    slack = AdamSlack(o, dict(w.model.named_parameters()))
    losses = []
    for i in range(iters):
        x, y = w.make_batch(global_batch, i)
        o.zero_grad()
        with autocast("cpu", precision):     # forward and loss; backward outside, as the runtime
            loss = w.loss_fn(w.model(x), y)
        loss.backward()
        o.step()
        slack.after_step()
        losses.append(loss.item())
    return Trained(losses, {n: p.detach().clone() for n, p in w.model.named_parameters()}, slack.slack)


def plan(replicas, model=MLP, global_batch=12, schedule="1f1b", sync="coarse", bucket_bytes=None,
         opt="adam", placement="device", lr=0.01, recompute=False, precision="fp32", cpu_fraction=None):
    reps = [{"batch_fraction": f, "microbatches": m,
             "stages": [{"device": d, "layers": list(r)} for d, r in stages]}
            for f, m, stages in replicas]
    s = {"granularity": sync}
    if bucket_bytes:
        s["bucket_bytes"] = bucket_bytes
    return {"schema": "hetplan.plan/1", "model": model, "global_batch": global_batch, "replicas": reps,
            "schedule": schedule, "sync": s, "recompute": recompute, "precision": precision,
            "optimizer": {"name": opt, "lr": lr, "placement": placement,
                          **({"cpu_fraction": cpu_fraction} if cpu_fraction is not None else {})}}


def run_plan(tmp_path, p: dict, iters: int = ITERS):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p))
    params = tmp_path / "params.pt"
    cfg = RunConfig(plan=str(path), iters=iters, warmup=1, save_params=str(params),
                    threads={}, timeout_s=30)
    from hetplan.planner.files.plan import load_plan
    result = launch(cfg, load_plan(path).devices)       # a parameter server's device too
    return result, torch.load(params)


def check_equivalent(tmp_path, p: dict, iters: int = ITERS):
    """Run `p` for `iters` iterations; its losses and parameters equal one process's training."""
    result, params = run_plan(tmp_path, p, iters=iters)
    ref = reference(p["model"], p["global_batch"], iters, p["optimizer"]["name"], p["optimizer"]["lr"])
    assert result["losses"] == pytest.approx(ref.losses, rel=1e-4)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)
    assert len(result["iterations_s"]) == iters
    return result


def test_single_device(tmp_path):
    r = check_equivalent(tmp_path, plan([(1.0, 2, [("cpu:0", (0, 4))])]))
    assert set(r["per_device"]) == {"cpu:0"}
    dev = r["per_device"]["cpu:0"]
    assert dev["busy_s"] > 0
    # the mlp's 784*16+16 + 2*(16*16+16) + 16*10+10 = 13274 float32 parameters
    assert dev["param_bytes"] == 13274 * 4
    assert dev["optimizer_state_bytes"] >= 2 * 13274 * 4            # Adam's two moments
    # saved for backward per microbatch of 6 (1 in flight): the input 6*784*4, three ReLU outputs
    # 3*6*16*4, log_softmax 6*10*4, the int64 target 6*8, nll_loss's scalar total weight 4
    assert dev["saved_activation_peak_bytes"] == 18816 + 1152 + 240 + 48 + 4
    assert dev["peak_memory_bytes"] == (2 * dev["param_bytes"] + dev["optimizer_state_bytes"]
                                        + dev["saved_activation_peak_bytes"])


def test_dp_even_coarse_cpu_optimizer(tmp_path):
    check_equivalent(tmp_path, plan([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])],
                                     placement="cpu"))


def test_dp_uneven_fine(tmp_path):
    # 1 KB buckets: every layer of this mlp is its own bucket, so several async all-reduces
    check_equivalent(tmp_path, plan([(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 4))])],
                                    sync="fine", bucket_bytes=1024))


def test_pipeline_gpipe_recompute(tmp_path):
    r = check_equivalent(tmp_path, plan([(1.0, 3, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])], schedule="gpipe",
                                    recompute=True))
    # recompute keeps only each stage's input per microbatch; GPipe holds all 3 microbatches
    assert r["per_device"]["cpu:0"]["saved_activation_peak_bytes"] >= 3 * 4 * 784 * 4


def test_pipeline_1f1b_skip_connection(tmp_path):
    # the cut after layer 1 carries h0 and h1 (skip connection): tuple stage outputs
    check_equivalent(tmp_path, plan([(1.0, 4, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])], model=SKIP,
                                    schedule="1f1b"))


def test_hybrid_fine(tmp_path):
    # replica 0 holds the whole model on one device, replica 1 is a 2-stage pipeline: layers
    # 0-1 are summed over ranks {0, 1}, layers 2-3 over ranks {0, 2} (two sync groups)
    check_equivalent(tmp_path, plan([(1 / 3, 1, [("cpu:0", (0, 4))]),
                                     (2 / 3, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])],
                                    sync="fine", bucket_bytes=1024))


def test_hybrid_coarse_sgd(tmp_path):
    check_equivalent(tmp_path, plan([(0.5, 2, [("cpu:0", (0, 1)), ("cpu:1", (1, 4))]),
                                     (0.5, 1, [("cpu:2", (0, 4))])], model=SKIP, opt="sgd", lr=0.1))


GPT = {"spec": "gpt", "args": {"layers": 2, "heads": 2, "d_model": 16, "vocab": 32, "context": 8}}  # 4 layers


def test_gpt_three_stage_pipeline(tmp_path):
    # a middle stage receives and sends in both directions; the built-in transformer
    check_equivalent(tmp_path, plan([(1.0, 3, [("cpu:0", (0, 1)), ("cpu:1", (1, 3)), ("cpu:2", (3, 4))])],
                                    model=GPT, schedule="1f1b", lr=0.003))


@pytest.mark.parametrize("replicas", [
    [(1.0, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])],                 # two-stage 1F1B pipeline
    [(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])],     # 2-replica data parallel
], ids=["pipeline", "data-parallel"])
def test_bf16_matches_single_process_bf16_training(tmp_path, replicas):
    # bf16 crosses the stage boundary and the all-reduce sums fp32 gradients; bf16 rounding of
    # microbatch- and replica-sized reductions differs from the single process, hence the
    # tolerances: losses 2e-2 relative, parameters 1e-2 (+ 1e-2 absolute: Adam turns a near-zero
    # gradient whose sign bf16 rounding flips into a step of up to lr = 0.01 either way)
    p = plan(replicas, precision="bf16")
    result, params = run_plan(tmp_path, p)
    bf16 = reference(p["model"], 12, ITERS, precision="bf16")
    bf16_losses, bf16_params, fp32_losses = bf16.losses, bf16.params, reference(p["model"], 12, ITERS).losses
    assert result["losses"] == pytest.approx(bf16_losses, rel=2e-2)
    for name, ref in bf16_params.items():
        assert params[name].dtype == torch.float32                       # fp32 master weights
        torch.testing.assert_close(params[name], ref, rtol=1e-2, atol=2e-2, msg=name)

    def worst(ref):
        return max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref))
    # bf16 for real: ~70x closer to bf16 training than to fp32 training (1.8e-5 vs 1.3e-3 measured)
    assert worst(bf16_losses) * 10 < worst(fp32_losses)


def test_gpt_dp_on_ddp_tied_weight_and_gpipe_fallback(tmp_path):
    # plain data parallel runs on torch DDP (hetplan.runtime.ddp): the tied embedding/head weight in a
    # bucket of its own, 1F1B microbatches under no_sync(); the GPipe replica's order allows no
    # no_sync() microbatch, so that plan falls back to GradSync and must agree too
    for schedule in ("1f1b", "gpipe"):
        check_equivalent(tmp_path, plan([(0.5, 2, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])],
                                        model=GPT, schedule=schedule, sync="fine", bucket_bytes=2048,
                                        lr=0.003))
