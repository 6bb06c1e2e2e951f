"""Hippie (issue 17; Ye et al., ICPP 2021): the schedule, exact simulated times against 1F1B and
GPipe on hand-computed cases, each stage's exchange at its own last backward, the memory count,
training equal to one device (gloo on CPU), a what-if topology where the search picks it, and
`hetplan simulate` on a plan file."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hetplan.planner.cost.memory import in_flight, peak_memory
from hetplan.planner.hardware.topology import Device, Link, Topology
from hetplan.planner.files.schedule import dry_run, format_schedule, make_schedule
from hetplan.planner.sim.simulator import Simulator, simulate
from simhelpers import device, graph, layer, link, plan, topology

# p = 3 stages, m = 4 microbatches: the first two run ahead like GPipe, the last alternates
GOLDEN_3x4 = """\
0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"""


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def two_gpus(lat=0.0):
    return topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", lat=lat)])


# --- the schedule ------------------------------------------------------------------------------
def test_schedule_runs_ahead_and_the_last_stage_alternates():
    assert format_schedule(make_schedule("hippie", 3, 4)) == GOLDEN_3x4


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 8)])
def test_every_stage_runs_each_action_once_without_deadlock(p, m):
    sched = make_schedule("hippie", p, m)
    dry_run(sched)   # raises on a deadlock
    for acts in sched:
        assert sorted((a.kind, a.microbatch) for a in acts) == sorted((k, i) for k in "FB" for i in range(m))
    # one stage, or one microbatch: the same order as 1F1B
    if p == 1 or m == 1:
        assert sched == make_schedule("1f1b", p, m)


# --- simulator: exact times on an ideal what-if topology -------------------------------------------
SLOW_FIRST = [layer(0, fwd_flops=2e9, bwd_flops=2e9), layer(1, fwd_flops=1e9, bwd_flops=1e9)]


@pytest.mark.parametrize("lat,hippie,one_f_one_b,gpipe", [(1.0, 16.0, 20.0, 20.0), (0.0, 16.0, 16.0, 18.0)])
def test_hippie_beats_1f1b_by_the_round_trip_and_gpipe_by_the_earlier_backward_wave(lat, hippie, one_f_one_b,
                                                                                     gpipe):
    # 2 stages on 1e9 FLOP/s GPUs, m = 4 microbatches of 1 sample (graph batch 1), no parameters:
    # stage 0 F = B = 2 s, stage 1 F = B = 1 s; every transfer (0 B) holds its link direction for
    # the latency `lat`.
    # lat = 1: Hippie: stage 0 F0..F3 0-8, activations arrive 3, 5, 7, 9. Stage 1 F0 3-4 B0 4-5
    #   F1 5-6 B1 6-7 F2 7-8 B2 8-9 F3 9-10 B3 10-11; gradients arrive 6, 8, 10, 12. Stage 0
    #   B0 8-10 B1 10-12 B2 12-14 B3 14-16: 16 s.
    # 1F1B (stage 0: F0 F1 B0 F2 B1 F3 B2 B3): F0 0-2, F1 2-4, then it waits for B0's round trip
    #   (arrive 3, F0 3-4, B0 4-5, back at 6): B0 6-8, F2 8-10 (at stage 1 11, F2 11-12, B2 12-13,
    #   back 14), B1 10-12 (1B1 6-7, back 8), F3 12-14 (at 15, F3 15-16, B3 16-17, back 18),
    #   B2 14-16, B3 18-20: 20 s. The two extra round trips' latency (4 x 1 s) is the difference.
    # GPipe: stage 1 F's at 3, 5, 7, 9 (9-10), B0..B3 10-14; the gradients leave at 11..14, the
    #   link takes 1 s each: arrive 12..15; stage 0 B0 12-14 .. B3 18-20: 20 s.
    # lat = 0: Hippie 8 + 4 x 2 = 16 (its gradients wait for it); 1F1B 16 (stage 0 never waits:
    #   the round trip F + B = 2 s of stage 1 is stage 0's F); GPipe stage 1 ends its F's at 9,
    #   its B's at 13 (gradients at 10..13), stage 0 B0 10-12 .. B3 16-18: 18 s.
    g = graph(SLOW_FIRST, batch=1)
    stages = [("cuda:0", 0, 1), ("cuda:1", 1, 2)]
    t = two_gpus(lat)
    got = {s: simulate(plan([(1.0, 4, stages)], 4, schedule=s), g, t).iteration_s
           for s in ("hippie", "1f1b", "gpipe")}
    assert got == {"hippie": approx(hippie), "1f1b": approx(one_f_one_b), "gpipe": approx(gpipe)}


def test_three_stages_hand_run():
    # 3 equal stages, F = 1 s, B = 2 s (1e9 / 2e9 FLOPs at 1e9 FLOP/s), m = 3, free links.
    # Stage 0 F 0-3; stage 1 F 1-4; stage 2 F0 2-3 B0 3-5 F1 5-6 B1 6-8 F2 8-9 B2 9-11.
    # Stage 1 B0 (after its F2 at 4, 2B0 at 5) 5-7, B1 8-10, B2 11-13; stage 0 B0 7-9, B1 10-12,
    # B2 13-15: 15 s. 1F1B and GPipe: (m + p - 1) x 3 = 15 s too (no latency, equal stages).
    g = graph([layer(i) for i in range(3)], batch=1)
    stages = [(f"cuda:{i}", i, i + 1) for i in range(3)]
    t = topology([device(f"cuda:{i}") for i in range(3)], [link("cuda:0", "cuda:1"), link("cuda:1", "cuda:2")])
    r = simulate(plan([(1.0, 3, stages)], 3, schedule="hippie"), g, t, trace=True)
    assert r.iteration_s == approx(15.0)
    starts = {x["name"].split(":")[-1]: x["start_s"] for x in r.tasks if x["kind"] in ("forward", "backward")}
    assert [starts[a] for a in ("2B0", "1B0", "1B1", "0B0", "0B2")] == approx([3, 5, 8, 7, 13])


# --- memory ------------------------------------------------------------------------------------------
def test_early_stages_hold_every_microbatch_the_last_one():
    # saved 100 B per layer at batch 4 -> 25 B per layer-microbatch of 1 sample; params 1000 B
    # per layer, SGD: params + grads = 2000 B per layer. 3 stages [0,2) [2,3) [3,4), m = 4:
    # stages 0 and 1 hold all 4 microbatches (GPipe's order), the last stage 1.
    g = graph([layer(i, param_bytes=1000, saved_bytes=100) for i in range(4)], batch=4, cut_bytes=[40] * 5)
    stages = [("cuda:0", 0, 2), ("cuda:1", 2, 3), ("cuda:2", 3, 4)]
    t = topology([device(f"cuda:{i}") for i in range(3)], [link("cuda:0", "cuda:1"), link("cuda:1", "cuda:2")])
    assert [in_flight("hippie", 3, s, 4) for s in range(3)] == [4, 4, 1]
    hp = peak_memory(plan([(1.0, 4, stages)], 4, schedule="hippie"), g, t)
    assert hp == {"cuda:0": 4000 + 4 * 50, "cuda:1": 2000 + 4 * 25, "cuda:2": 2000 + 1 * 25}
    gp = peak_memory(plan([(1.0, 4, stages)], 4, schedule="gpipe"), g, t)
    assert gp["cuda:2"] - hp["cuda:2"] == 3 * 25 and gp["cuda:0"] == hp["cuda:0"]
    # recompute: the stage input (40 B at batch 4 -> 10 B) per held microbatch + one full
    rc = peak_memory(plan([(1.0, 4, stages)], 4, schedule="hippie", recompute=True), g, t)
    assert rc == {"cuda:0": 4000 + 4 * 10 + 50, "cuda:1": 2000 + 4 * 10 + 25, "cuda:2": 2000 + 10 + 25}


# --- runtime: trains exactly like one device --------------------------------------------------------
def _check_equivalent(tmp_path, p: dict, iters: int = 4):
    from test_runtime import check_equivalent
    return check_equivalent(tmp_path, p, iters)


def test_two_workers_train_like_one_device_and_hold_what_the_memory_model_counts(tmp_path):
    # 2 stages, 4 microbatches of 3 samples: Hippie holds 4 on stage 0 (1F1B 2) and 1 on stage 1
    # (as 1F1B), per stage the same bytes per microbatch
    from test_runtime import plan as runtime_plan, run_plan
    stages = [("cpu:0", (0, 2)), ("cpu:1", (2, 4))]
    r = _check_equivalent(tmp_path, runtime_plan([(1.0, 4, stages)], schedule="hippie"))
    fb, _ = run_plan(tmp_path, runtime_plan([(1.0, 4, stages)], schedule="1f1b"), iters=2)
    peak = {name: [x["per_device"][d]["saved_activation_peak_bytes"] for d in ("cpu:0", "cpu:1")]
            for name, x in (("hippie", r), ("1f1b", fb))}
    one_mb = [peak["1f1b"][s] / in_flight("1f1b", 2, s, 4) for s in range(2)]
    assert peak["hippie"] == [one_mb[s] * in_flight("hippie", 2, s, 4) for s in range(2)]
    assert peak["hippie"][0] == 2 * peak["1f1b"][0] > 0 and peak["hippie"][1] == peak["1f1b"][1]


def test_gpt_three_stages_train_like_one_device(tmp_path):
    # a middle stage running ahead receives gradients while its forwards still go out
    from test_runtime import GPT, plan as runtime_plan
    _check_equivalent(tmp_path, runtime_plan([(1.0, 3, [("cpu:0", (0, 1)), ("cpu:1", (1, 3)), ("cpu:2", (3, 4))])],
                                             model=GPT, schedule="hippie", lr=0.003))


def test_hybrid_with_fine_sync_and_recompute_trains_like_one_device(tmp_path):
    # a one-stage replica beside a 2-stage Hippie pipeline; tuples across the cut; buckets
    # all-reduced as the pipeline's last backwards finish them; recomputed forwards
    from test_runtime import SKIP, plan as runtime_plan
    _check_equivalent(tmp_path, runtime_plan([(1 / 3, 2, [("cpu:0", (0, 4))]),
                                              (2 / 3, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])],
                                             model=SKIP, schedule="hippie", sync="fine", bucket_bytes=1024,
                                             recompute=True))


def test_split_stage_running_ahead_of_an_alternating_last_stage_trains_like_one_device(tmp_path):
    # a tensor-split first stage (two ranks) runs its forwards ahead, its first rank sending them
    # on; the plain last stage alternates and sends each gradient back to both split ranks
    from test_runtime_tensor import _pipeline, run_and_compare
    run_and_compare(tmp_path, _pipeline([([("cpu:0", 0.5), ("cpu:1", 0.5)], (0, 2)), ("cpu:2", (2, 4))], 3,
                                        schedule="hippie"))


# --- accelerator paths (CPU stand-ins everywhere; real GPUs where marked) ----------------------------
from test_runtime_cuda import check_close, gpus  # noqa: E402,F401  (the fixture: stand-in / real)


def test_gpu_stage_ahead_offloads_its_m_microbatches_into_a_cpu_last_stage(tmp_path, gpus):
    # the GPU stage runs its 4 forwards ahead, their saved activations in host memory, and its
    # Adam half on the host; the CPU last stage alternates, activations and gradients crossing
    # through host memory
    from test_runtime import SKIP, plan as runtime_plan
    p = runtime_plan([(1.0, 4, [("cuda:0", (0, 2)), ("cpu:0", (2, 4))])], model=SKIP, schedule="hippie",
                     placement="split", cpu_fraction=0.5)
    p["replicas"][0]["stages"][0]["offload_activations"] = True
    check_close(tmp_path, p, gpus)


# --- search ---------------------------------------------------------------------------------------
def _latency_pair(lat_s: float) -> Topology:
    # cuda:0 400 MB, cuda:1 260 MB, 1e12 FLOP/s and B/s each, a 1e10 B/s link of latency lat_s
    return Topology("two-gpus", (Device("cuda:0", "cuda", 4e8, 1e12, 1e12), Device("cuda:1", "cuda", 2.6e8, 1e12, 1e12)),
                    (Link("cuda:0", "cuda:1", 1e10, lat_s),))


def test_search_picks_hippie_over_a_slow_latency_link_to_a_small_last_device():
    # 6 layers of 40 MB (SGD: 80 MB each with gradients, 480 MB: no device holds the model), batch
    # 8, 6 MB of saved activations per sample per 3-layer stage. A 3 | 3 pipeline on cuda:0 -> cuda:1
    # at m = 8: F = 3 ms, B = 6 ms per stage-microbatch; a hop (1 MB) holds its link direction for
    # 6 ms latency + 0.1 ms = 6.1 ms; the SGD step of a stage 3 x 120 MB / 1e12 B/s = 0.36 ms.
    # * Hippie: the forwards queue on the link (a 6.1 ms hop every 3 ms): F0 at stage 1 at 9.1,
    #   F1 15.2, F2 21.3, ... ahead of stage 1's 9 ms per microbatch, so stage 1 runs F B pairs
    #   from 9.1 to 9.1 + 8 x 9 = 81.1; the last gradient is back at 87.2, stage 0's B7 ends at
    #   93.2 (its earlier B's wait for the gradients), then its step: 93.56 ms. cuda:1 holds
    #   240 MB + one microbatch's 6 MB.
    # * 1F1B: stage 0 runs F0 F1, then each further forward waits for a gradient's round trip
    #   (stage 0's B0 starts at 24.2, B1 33.2, B2 54.4, ... B7 123.8): 130.16 ms.
    # * GPipe: 115.96 ms, and cuda:1 would hold 240 MB + 8 x 6 MB > 260 MB: infeasible.
    from test_search import sim_search, uniform_graph
    g = uniform_graph(batch=8, param_bytes=4e7, act_per_sample=1e6)
    sim = Simulator(g, _latency_pair(6e-3))
    # seed 2 stops by no improvement at a ZB-H1 local optimum (107.08 ms) since the walk draws its
    # acceptance test before proposing (early rejection); seeds 0, 1, 3, 4, 5 reach Hippie
    for seed in (0, 1, 3):
        problem, result = sim_search(g, _latency_pair(6e-3), iterations=2000, seed=seed)
        best = result.best
        assert best.plan.schedule == "hippie" and best.feasible
        assert [(st.device, st.layers) for st in best.plan.replicas[0].stages] == [("cuda:0", (0, 3)),
                                                                                   ("cuda:1", (3, 6))]
        assert best.plan.replicas[0].microbatches == 8 and best.iteration_s == pytest.approx(93.56e-3)
    others = {s: sim.simulate(replace(best.plan, schedule=s)) for s in ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b")}
    assert others["1f1b"].iteration_s == pytest.approx(130.16e-3) and others["1f1b"].feasible
    assert others["gpipe"].iteration_s == pytest.approx(115.96e-3) and not others["gpipe"].feasible
    # ZB-H1 keeps 1F1B's order; interleaved 1F1B on 2 stages (v = 1) warms up with 2 forwards
    assert all(others[s].iteration_s > 1.05 * best.iteration_s for s in ("zb-h1", "interleaved-1f1b"))
    # the latency is why: over a link without it, the search picks another schedule
    _, fast = sim_search(g, _latency_pair(0.0), iterations=2000)
    assert fast.best.plan.schedule != "hippie" and fast.best.iteration_s < best.iteration_s


# --- command line --------------------------------------------------------------------------------
def test_cli_simulates_a_hippie_plan(tmp_path):
    from hetplan.planner.hardware.topology import save_topology
    topo = tmp_path / "t.json"
    save_topology(Topology("pair", (Device("cpu:0", "cpu", 1e10, 1e11, 1e10), Device("cpu:1", "cpu", 1e10, 1e11, 1e10)),
                           (Link("cpu:0", "cpu:1", 1e9, 1e-3),)), topo)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"schema": "hetplan.plan/1", "model": {"spec": "mlp"}, "global_batch": 8,
                             "schedule": "hippie", "replicas": [{"batch_fraction": 1.0, "microbatches": 4, "stages": [
                                 {"device": "cpu:0", "layers": [0, 2]}, {"device": "cpu:1", "layers": [2, 5]}]}]}))
    out = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(p), "--topology", str(topo), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["feasible"] and r["iteration_s"] > 0 and set(r["per_device"]) == {"cpu:0", "cpu:1"}
