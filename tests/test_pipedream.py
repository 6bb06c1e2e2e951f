"""PipeDream, PipeDream-2BW and PipeDream with SWA (plan field sync.mode): the runtime's weight
stashing against a hand computation, the one-process emulation against the runtime, the
simulator's steady state and memory, and what is refused."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import plan_from_dict
from hetplan.planner.sim.simulator import simulate
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
    from hetplan.planner.workload.load import load_workload
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


@pytest.mark.parametrize("mode,swa", [("pipedream", False), ("pipedream-2bw", False), ("pipedream", True)])
def test_the_emulated_losses_are_those_the_runtime_measures(tmp_path, mode, swa):
    # SkipNet's cut after layer 1 carries two tensors; Adam; 4 microbatches on 2 stages
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_runtime import run_plan
    p = _pipeline(LEARNABLE, _sync(mode, swa), m=4, global_batch=12, lr=0.01, opt="adam", ranges=((0, 2), (2, 4)))
    r, _ = run_plan(tmp_path, p, iters=5)
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    assert emulate(w, plan_from_dict(p), 5) == pytest.approx(r["losses"], rel=1e-5)


@pytest.mark.parametrize("mode,swa", [("pipedream", False), ("pipedream-2bw", False), ("pipedream", True)])
def test_each_mode_lowers_the_loss_and_differs_from_synchronous_training(tmp_path, mode, swa):
    from test_runtime import reference, run_plan
    p = _pipeline(LEARNABLE, _sync(mode, swa), m=4, global_batch=12, lr=0.3, ranges=((0, 2), (2, 4)))
    r, _ = run_plan(tmp_path, p, iters=12)
    ref_losses = reference(LEARNABLE, 12, 12, "sgd", 0.3).losses
    losses = r["losses"]
    if mode == "pipedream-2bw":      # its first iteration's microbatches all use the initial weights
        assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    assert losses[-1] != pytest.approx(ref_losses[-1], rel=1e-3)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])
    dev = r["per_device"]["cpu:0"]
    updates = [e for e in dev["events"] if e["name"].startswith("update")]
    assert len(updates) == 4         # the last iteration's four backwards, each followed by its rule
    # SGD keeps no state: the live parameters, their gradients, the stashed versions (2 on stage
    # 0 of 2; SWA's sum one more) and the saved activations
    versions = 3 if swa else 2
    assert dev["peak_memory_bytes"] == (2 + versions) * dev["param_bytes"] + dev["saved_activation_peak_bytes"]


from test_runtime_cuda import gpus  # noqa: E402,F401  (the fixture: CPU stand-ins, then real GPUs)


@pytest.mark.parametrize("mode,swa", [("pipedream", False), ("pipedream-2bw", False), ("pipedream", True)])
def test_a_cpu_gpu_pipeline_runs_each_mode_as_emulated(tmp_path, gpus, mode, swa):
    # stage 0 on the CPU, stage 1 on cuda:0 (a stand-in without a GPU): the stream crosses host memory
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_runtime import run_plan
    p = _pipeline(LEARNABLE, _sync(mode, swa), m=4, global_batch=12, lr=0.01, opt="adam",
                  ranges=((0, 2), (2, 4)), devices=("cpu:0", "cuda:0"))
    r, _ = run_plan(tmp_path, p, iters=4)
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    rel = 1e-5 if gpus == "standin" else 1e-3
    assert r["losses"] == pytest.approx(emulate(w, plan_from_dict(p), 4), rel=rel)


# --- what is refused ----------------------------------------------------------------------------
def _dict(**changes) -> dict:
    p = _pipeline(SCALARS, _sync("pipedream"), m=2, global_batch=2, lr=0.1)
    p.update(changes)
    return p


TWO_REPLICAS = [{"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 3]}]},
                {"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:1", "layers": [0, 3]}]}]


@pytest.mark.parametrize("changes,needle", [
    ({"replicas": TWO_REPLICAS}, "replicas: sync.mode 'pipedream' needs one replica"),
    ({"schedule": "gpipe"}, "schedule: sync.mode 'pipedream' runs 1f1b"),
    ({"recompute": True}, "recompute: expected false with sync.mode 'pipedream'"),
    ({"optimizer": {"name": "sgd", "lr": 0.1, "placement": "cpu"}}, "optimizer.placement: expected \"device\""),
    ({"sync": {"mode": "pipedream-2bw", "average": "swa"}}, "sync.average: applies only to sync.mode pipedream"),
    ({"sync": {"mode": "pipedream", "average": "ema"}}, "sync.average: expected \"swa\""),
    ({"sync": {"mode": "pipedream", "period": 2}}, "sync.period: applies only to sync.mode local-sgd or easgd"),
])
def test_what_pipedream_does_not_run_is_refused_naming_the_field(changes, needle):
    with pytest.raises(InputError, match="p.json: " + needle.replace("(", r"\(")):
        plan_from_dict(_dict(**changes), "p.json")


def test_offloaded_activations_are_refused_with_pipedream():
    p = _dict()
    p["replicas"][0]["stages"][1]["device"] = "cuda:0"
    p["replicas"][0]["stages"][1]["offload_activations"] = True
    with pytest.raises(InputError, match=r"p.json: replicas\[0\].stages\[1\].offload_activations: expected false"):
        plan_from_dict(p, "p.json")


@pytest.mark.parametrize("command", ["simulate", "run"])
def test_simulate_and_run_refuse_a_pipedream_plan_of_two_replicas_in_one_line(tmp_path, command):
    from test_cli_inputs import _hetplan, one_error_line
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_dict(replicas=TWO_REPLICAS)))
    args = [command, path] + (["--topology", tmp_path / "none.json"] if command == "simulate" else ["-o", tmp_path / "m.json"])
    one_error_line(_hetplan(*args), "plan.json: replicas: sync.mode 'pipedream' needs one replica")
    assert not (tmp_path / "m.json").exists()


def test_a_plan_file_round_trips_with_its_mode_and_average():
    from hetplan.planner.files.plan import plan_to_dict
    p = plan_from_dict(_dict(sync=_sync("pipedream", swa=True)))
    assert plan_from_dict(plan_to_dict(p)) == p
    assert plan_to_dict(p)["sync"] == {**_sync("pipedream", swa=True), "bucket_bytes": p.sync.bucket_bytes}


# --- the simulator: the steady state, the staleness, the stashed versions -------------------------
def _sim_case(mode: str, swa: bool = False):
    # stage 0 (cuda:0): F 1 s, B 2 s per microbatch; stage 1 (cuda:1): F 2 s, B 4 s; 1e6 B of
    # parameters each, SGD at 1e8 B/s: an update 0.03 s; free link; 4 microbatches of 1 sample
    g = graph([layer(0, param_bytes=10**6), layer(1, fwd_flops=2e9, bwd_flops=4e9, param_bytes=10**6)], batch=1)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)], [link("cuda:0", "cuda:1")])
    p = sim_plan([(1.0, 4, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 4)
    return g, t, dataclasses.replace(p, sync=dataclasses.replace(p.sync, mode=mode, average="swa" if swa else None))


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def test_no_flush_bubble_in_the_steady_state_and_updates_per_mode():
    # synchronous 1F1B: stage 0's first F and B (3 s) + stage 1's 4 x 6 s + one step, 27.03 s.
    # Without a flush the slowest stage is never idle: PipeDream 4 x (2 + 4 + 0.03) = 24.12 s,
    # 2BW 4 x 6 + 0.03 = 24.03 s (one update per iteration)
    g, t, p = _sim_case("sync")
    assert simulate(p, g, t).iteration_s == approx(27.03)
    r = simulate(_sim_case("pipedream")[2], g, t)
    assert r.iteration_s == approx(24.12)
    assert r.per_device["cuda:1"]["optimizer_s"] == approx(0.12)      # per iteration, not per stream
    assert r.per_device["cuda:0"]["fwd_s"] == approx(4.0)
    assert r.per_device["cuda:1"]["idle_s"] == approx(0.0)
    assert [r.per_device[d]["staleness_steps"] for d in ("cuda:0", "cuda:1")] == [1.0, 0.0]
    r2 = simulate(_sim_case("pipedream-2bw")[2], g, t)
    assert r2.iteration_s == approx(24.03)
    assert r2.per_device["cuda:0"]["optimizer_s"] == approx(0.03)
    assert "staleness_steps" not in simulate(p, g, t).per_device["cuda:0"]


def test_stashed_weight_versions_are_counted_in_memory():
    # 1e6 B of parameters per stage, SGD (no state), no activations: params + grads = 2e6;
    # PipeDream stashes p - s versions (2 on stage 0, 1 on stage 1), 2BW at most 2, SWA one more
    from hetplan.planner.cost.memory import peak_memory
    g, t, p = _sim_case("sync")
    assert peak_memory(p, g, t) == {"cuda:0": 2e6, "cuda:1": 2e6}
    assert peak_memory(_sim_case("pipedream")[2], g, t) == {"cuda:0": 4e6, "cuda:1": 3e6}
    assert peak_memory(_sim_case("pipedream-2bw")[2], g, t) == {"cuda:0": 4e6, "cuda:1": 3e6}
    assert peak_memory(_sim_case("pipedream", swa=True)[2], g, t) == {"cuda:0": 5e6, "cuda:1": 4e6}


def test_a_trace_of_the_stream_shows_each_stages_updates():
    g, t, p = _sim_case("pipedream")
    r = simulate(p, g, t, trace=True)
    updates = [x for x in r.tasks if x["kind"] == "optimizer"]
    assert len(updates) == 2 * 4 * 3                                     # 2 stages x 4 x 3 iterations


# --- plan --objective time-to-loss ---------------------------------------------------------------
def test_time_to_loss_ranks_the_asynchronous_pipelines_of_the_fastest_pipeline():
    # a two-stage pipeline of the learnable SkipNet, priced on a hand-made graph: each variant's
    # time to the target = its emulated iterations x its simulated iteration
    from hetplan.planner.search.convergence import emulate, iterations_to, smoothed
    from hetplan.planner.search.time_to_loss import pipeline_variants, rank
    from hetplan.planner.sim.simulator import Simulator
    from hetplan.planner.workload.load import load_workload
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    pipe = plan_from_dict(_pipeline(LEARNABLE, {"granularity": "coarse"}, m=4, global_batch=12, lr=0.3,
                                    ranges=((0, 2), (2, 4))))
    g = graph([layer(i, param_bytes=10**3) for i in range(4)], batch=12)
    t = topology([device("cpu:0"), device("cpu:1")], [link("cpu:0", "cpu:1")])
    sim = Simulator(g, t)
    target = float(smoothed(emulate(w, pipe, 24))[11])
    ranked = {c.name: c for c in rank(sim.simulate, w, [("pipeline", pipe)], target, 24)}
    assert set(ranked) == {"pipeline", "pipeline, pipedream", "pipeline, pipedream-2bw", "pipeline, pipedream + SWA"}
    for name, plan in pipeline_variants("pipeline", pipe):
        c = ranked[name]
        assert c.iterations == iterations_to(emulate(w, plan, 24), target)
        assert c.time_s == pytest.approx(c.iterations * c.iteration_s)
        assert c.iteration_s < ranked["pipeline"].iteration_s           # no flush bubble
    dp = plan_from_dict(_pipeline(LEARNABLE, {"granularity": "coarse"}, m=4, global_batch=12, lr=0.3,
                                  ranges=((0, 4),), devices=("cpu:0",)))
    assert pipeline_variants("one stage", dp) == []


def test_stages_that_tie_a_weight_are_refused_by_run_and_not_emulated(tmp_path):
    # each stage would update its own copy of the shared weight: refused, not silently untied
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_cli_inputs import _hetplan, one_error_line
    tied = {"spec": "tests.runtime_models:tiednet", "args": {}}     # layers 1 and 3 share a weight
    p = _pipeline(tied, _sync("pipedream"), m=2, global_batch=4, lr=0.1, ranges=((0, 2), (2, 5)))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p))
    one_error_line(_hetplan("run", path, "--iters", 3, "-o", tmp_path / "m.json"),
                   "replicas[0].stages: sync.mode 'pipedream' needs stages that share no parameter")
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(ValueError, match="ties a weight across the pipeline's stages"):
        emulate(load_workload(tied["spec"], {}), plan_from_dict(p), 2)


def test_three_stages_run_as_emulated(tmp_path):
    # a middle stage (no data of its own), stage 0 two updates stale, 8 iterations of the stream
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_runtime import run_plan
    p = _pipeline(LEARNABLE, _sync("pipedream"), m=3, global_batch=12, lr=0.01, opt="adam",
                  ranges=((0, 1), (1, 2), (2, 4)), devices=("cpu:0", "cpu:1", "cpu:2"))
    r, _ = run_plan(tmp_path, p, iters=8)
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    assert r["losses"] == pytest.approx(emulate(w, plan_from_dict(p), 8), rel=1e-5)
