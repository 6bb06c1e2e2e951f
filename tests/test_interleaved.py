"""Interleaved 1F1B (issue 17): the schedule, the plan rules, the simulator's exact times on a
hand-computed case, the memory count, and training equal to one device."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetplan.planner.cost.memory import in_flight, peak_memory
from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import plan_from_dict
from hetplan.planner.files.schedule import dry_run, format_schedule, interleaved_1f1b, make_schedule
from hetplan.planner.sim.simulator import simulate
from simhelpers import device, graph, layer, link, plan, topology

# p = 2 devices, v = 2 virtual stages each, m = 4 microbatches (Megatron's order)
GOLDEN_2x2x4 = """\
0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"""

INTERLEAVED = [("cuda:0", 0, 1), ("cuda:1", 1, 2), ("cuda:0", 2, 3), ("cuda:1", 3, 4)]


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def two_gpus():
    return topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1")])


# --- the schedule ------------------------------------------------------------------------------
def test_schedule_is_megatrons_order():
    assert format_schedule(make_schedule("interleaved-1f1b", 4, 4, devices=2)) == GOLDEN_2x2x4


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6), (2, 3, 6), (4, 2, 4)])
def test_schedule_equals_torch_pipelining_and_runs_without_deadlock(p, v, m):
    sched = interleaved_1f1b(p, p * v, m)
    dry_run(sched)   # raises on a deadlock
    for r, acts in enumerate(sched):
        assert sorted((a.stage, a.kind, a.microbatch) for a in acts) == sorted(
            (c * p + r, k, i) for c in range(v) for k in "FB" for i in range(m))
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_get_1f1b_rank_ops"):
        pytest.skip("this torch has no _get_1f1b_rank_ops")
    for r, acts in enumerate(sched):   # torch's ScheduleInterleaved1F1B, rank r (m a multiple of p)
        warm = schedules._get_warmup_ops(r, v, p, p, m)
        ops = schedules._get_1f1b_rank_ops(
            v, p, warm, v * m - warm, warm, r, lambda k: ((k // p) % v) * p + r,
            lambda k: (v - 1 - ((k - warm) // p) % v) * p + r)
        theirs = [f"{a.stage_index}{'F' if str(a.computation_type).endswith('FORWARD') else 'B'}"
                  f"{a.microbatch_index}" for a in ops if a is not None]
        assert [str(a) for a in acts] == theirs


# --- plan rules ----------------------------------------------------------------------------------
def _plan_dict(devices, m=4, schedule="interleaved-1f1b", **stage_extra):
    return {"model": {"spec": "mlp"}, "global_batch": 8, "schedule": schedule,
            "replicas": [{"batch_fraction": 1.0, "microbatches": m,
                          "stages": [{"device": d, "layers": [i, i + 1], **stage_extra}
                                     for i, d in enumerate(devices)]}]}


def test_plan_accepts_a_device_several_times_only_interleaved():
    p = plan_from_dict(_plan_dict(["cpu:0", "cpu:1", "cpu:0", "cpu:1"]))
    assert p.devices == ("cpu:0", "cpu:1") and p.replicas[0].pipeline_devices == ("cpu:0", "cpu:1")
    with pytest.raises(InputError, match=r"replicas\[0\].stages\[2\].device: device 'cpu:0' is already used .*"
                                         r"only under schedule \"interleaved-1f1b\""):
        plan_from_dict(_plan_dict(["cpu:0", "cpu:1", "cpu:0", "cpu:1"], schedule="1f1b"))


@pytest.mark.parametrize("devices,m,extra,message", [
    (["cpu:0", "cpu:1", "cpu:1", "cpu:0"], 4, {}, r"stages\[2\].device: interleaved-1f1b expects stage 2 on 'cpu:0'"),
    (["cpu:0", "cpu:1", "cpu:0"], 4, {}, r"replicas\[0\].stages: interleaved-1f1b expects a multiple of the 2"),
    (["cpu:0", "cpu:1", "cpu:0", "cpu:1"], 2 * 3, {}, r"microbatches: expected a divisor"),
    (["cpu:0", "cpu:1", "cpu:0", "cpu:1"], 1, {}, r"microbatches: interleaved-1f1b needs microbatches a multiple "
                                                  r"of the pipeline's 2 devices, got 1"),
    (["cpu:0", "cpu:0"], 2, {}, r"needs at least 2 devices in a pipeline of several stages"),
    (["cuda:0", "cuda:1", "cuda:0", "cuda:1"], 4, {"offload_activations": True},
     r"stages\[0\].offload_activations: expected false under interleaved-1f1b"),
])
def test_plan_rules_give_one_line(devices, m, extra, message):
    with pytest.raises(InputError, match=message):
        plan_from_dict(_plan_dict(devices, m, **extra))


def test_cli_exits_2_naming_file_and_field(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({**_plan_dict(["cpu:0", "cpu:1", "cpu:0", "cpu:1"], m=3), "global_batch": 6}))
    out = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(p) in lines[0] and "replicas[0].microbatches: interleaved-1f1b" in lines[0]


# --- simulator: exact times on an ideal what-if topology -------------------------------------------
def test_simulated_iteration_is_the_hand_computed_schedule():
    # 4 layers of 1e9 fwd / 2e9 bwd FLOPs at graph batch 4, devices of 1e9 FLOP/s, free link, no
    # parameters; m = 4 microbatches of 1 sample: one layer's F = 0.25 s (1 slot), B = 0.5 s (2).
    # Walking both devices' orders above (F(s, i) after F(s-1, i), B(s, i) after B(s+1, i)):
    # cuda:0 idles 5-6 (2B0 waits for 3B0), 17-18 (2B2 for 3B2), 20-21 (2B3 for 3B3) and ends
    # 0B3 at slot 27; cuda:1 idles 0-1 and 25-27. Busy per device: 2 stages x 4 x 3 = 24 slots,
    # so the bubble is 3 slots = (p - 1) / (v m) of 24.
    g = graph([layer(i) for i in range(4)], batch=4)
    r = simulate(plan([(1.0, 4, INTERLEAVED)], 4, schedule="interleaved-1f1b"), g, two_gpus(), trace=True)
    assert r.iteration_s == approx(27 * 0.25)
    assert r.per_device["cuda:0"]["busy_s"] == approx(24 * 0.25)
    starts = {t["name"]: t["start_s"] / 0.25 for t in r.tasks if t["kind"] in ("forward", "backward")}
    assert [starts[f"0:{a}"] for a in ("2B0", "2B2", "2B3", "0B3", "1B3")] == approx([6, 18, 21, 25, 23])
    # the same layers as a plain 1F1B pipeline of two 2-layer stages: (m + p - 1) * 6 slots
    flat = plan([(1.0, 4, [("cuda:0", 0, 2), ("cuda:1", 2, 4)])], 4, schedule="1f1b")
    assert simulate(flat, g, two_gpus()).iteration_s == approx(30 * 0.25)


def test_transfers_between_devices_are_priced_for_every_virtual_stage_cut():
    # one 0.5 s hop per activation and per gradient (cut 1 B, 2 B/s); compare with free links
    g = graph([layer(i) for i in range(4)], batch=4, cut_bytes=[4] * 5)
    slow = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=2.0)])
    pl = plan([(1.0, 4, INTERLEAVED)], 4, schedule="interleaved-1f1b")
    r = simulate(pl, g, slow)
    # 3 cuts x 4 microbatches x 2 directions, 0.5 s each, counted on both ends
    assert r.per_device["cuda:0"]["comm_s"] == approx(3 * 4 * 2 * 0.5)
    assert r.iteration_s > simulate(pl, g, two_gpus()).iteration_s


def test_receives_are_posted_two_ahead_per_peer_in_its_send_order():
    # p = 2, v = 2, m = 4 (orders above): the second device receives from the first, in that
    # device's send order, act1.0 act1.1 act3.0 act3.1 act1.2 grad1.0 act1.3 grad1.1 act3.2
    # act3.3 grad1.2 grad1.3; with two posted, each is posted as the action after the take of
    # the one two before it starts (None: at the iteration's start)
    from hetplan.planner.files.schedule import receives
    sched = make_schedule("interleaved-1f1b", 4, 4, 2)
    got = {m: (str(sched[d][take]), None if after is None else str(sched[d][after]))
           for m, (d, take, after) in receives(sched).items() if d == 1}
    assert got[("act", 1, 0)] == ("1F0", None) and got[("act", 1, 1)] == ("1F1", None)
    assert got[("act", 3, 0)] == ("3F0", "1F0")      # posted as 1F1 starts
    assert got[("act", 3, 1)] == ("3F1", "1F1")
    assert got[("grad", 1, 3)] == ("1B3", "3F3")
    # one posted (the runtime before 2026-11-25): act3.0 waited for 1F1, right before 3F0
    assert receives(sched, window=1)[("act", 3, 0)] == (1, 2, 1)


# --- memory ------------------------------------------------------------------------------------------
def test_peak_memory_counts_what_each_device_holds_at_once():
    # saved 100 B per layer at batch 4 -> 25 B per stage-microbatch of 1 sample; params 1000 B per
    # layer, SGD: params + grads of two layers = 4000 B per device. Walking GOLDEN_2x2x4, cuda:0
    # holds at most 5 stage-microbatches (0F0 0F1 2F0 2F1 0F2 before 2B0; (p-r-1)*2 + (v-1)*p + 1),
    # cuda:1 3 (1F0 1F1 3F0 before 3B0). Per stage the most in flight: 4, 3, 2, 1.
    g = graph([layer(i, param_bytes=1000, saved_bytes=100) for i in range(4)], batch=4, cut_bytes=[40] * 5)
    pl = plan([(1.0, 4, INTERLEAVED)], 4, schedule="interleaved-1f1b")
    assert peak_memory(pl, g, two_gpus()) == {"cuda:0": 4000 + 5 * 25, "cuda:1": 4000 + 3 * 25}
    assert [in_flight("interleaved-1f1b", 4, s, 4, devices=2) for s in range(4)] == [4, 3, 2, 1]
    # recompute: the stage input (40 B at batch 4 -> 10 B) per held microbatch, plus one full
    # microbatch during a backward: cuda:0 at 2B0 holds 5 x 10 + 25, cuda:1 at 3B0 3 x 10 + 25
    rc = plan([(1.0, 4, INTERLEAVED)], 4, schedule="interleaved-1f1b", recompute=True)
    assert peak_memory(rc, g, two_gpus()) == {"cuda:0": 4000 + 75, "cuda:1": 4000 + 55}


# --- runtime: trains exactly like one device --------------------------------------------------------
def _check_equivalent(tmp_path, p: dict, iters: int = 4):
    from test_runtime import check_equivalent
    return check_equivalent(tmp_path, p, iters)


@pytest.mark.parametrize("model,sync,m,recompute", [
    ({"spec": "mlp", "args": {"hidden": 16, "depth": 3}}, "coarse", 4, False),    # 4 layers, 1 per virtual stage
    ({"spec": "tests.runtime_models:skipnet", "args": {"width": 16}}, "fine", 2, True),   # tuples across cuts
], ids=["mlp-coarse-m4", "skip-fine-m2-recompute"])
def test_two_workers_with_two_virtual_stages_each_train_like_one_device(tmp_path, model, sync, m, recompute):
    from test_runtime import plan as runtime_plan
    stages = [("cpu:0", (0, 1)), ("cpu:1", (1, 2)), ("cpu:0", (2, 3)), ("cpu:1", (3, 4))]
    p = runtime_plan([(1.0, m, stages)], model=model, global_batch=12, schedule="interleaved-1f1b",
                     sync=sync, bucket_bytes=1024, recompute=recompute)
    r = _check_equivalent(tmp_path, p)
    assert set(r["per_device"]) == {"cpu:0", "cpu:1"}
    if model["spec"] == "mlp":
        # saved for backward per microbatch of 3: stage 0 its input 3x784x4 B + its ReLU's output
        # 3x16x4 B = 9600 B, stage 1 384 B. cpu:0's peak comes after 0F3 (GOLDEN_2x2x4): four of
        # stage 0 and one of stage 2 (2B0 freed the other); cpu:1's after 1F2: three of stage 1.
        # The memory model, walking the same schedule over the captured graph, says the same.
        from hetplan.planner.cost.memory import device_activation_bytes
        from hetplan.planner.files.plan import plan_from_dict as load
        from hetplan.planner.workload.capture import capture_graph
        from hetplan.planner.workload.load import load_workload
        saved = {d: v["saved_activation_peak_bytes"] for d, v in r["per_device"].items()}
        assert saved == {"cpu:0": 4 * 9600 + 384, "cpu:1": 3 * 384}
        g = capture_graph(load_workload(model["spec"], model["args"]), 12)
        assert device_activation_bytes(load(p), g, 0) == saved


def test_data_parallel_interleaved_pipelines_train_like_one_device(tmp_path):
    # two replicas, each two devices x two virtual stages: gradients summed per layer across them
    from test_runtime import plan as runtime_plan
    gpt = {"spec": "gpt", "args": {"layers": 2, "heads": 2, "d_model": 16, "vocab": 32, "context": 8}}
    reps = [(0.5, 2, [(f"cpu:{a}", (0, 1)), (f"cpu:{b}", (1, 2)), (f"cpu:{a}", (2, 3)), (f"cpu:{b}", (3, 4))])
            for a, b in ((0, 1), (2, 3))]
    _check_equivalent(tmp_path, runtime_plan(reps, model=gpt, global_batch=8, schedule="interleaved-1f1b",
                                             sync="fine", bucket_bytes=1024, lr=0.003))


def test_a_tied_weight_on_two_virtual_stages_of_one_device_is_held_once():
    # layers 1 and 3 share a 1000 B weight (counted in layer 1); cuda:1 holds stages 1 and 3, so
    # one copy: SGD params + grads 2 x 1000 B; no activations saved; nothing to exchange (one
    # replica, one device holding it). Two stages on different devices would each hold one.
    from hetplan.planner.workload.graph import TiedParam
    base = graph([layer(i, param_bytes=1000 if i == 1 else 0) for i in range(4)], batch=4)
    g = type(base)(layers=base.layers, batch=4, cut_bytes=base.cut_bytes,
                   tied=(TiedParam("l1.weight", 1000, (1, 3)),))
    pl = plan([(1.0, 4, INTERLEAVED)], 4, schedule="interleaved-1f1b")
    assert peak_memory(pl, g, two_gpus()) == {"cuda:0": 0, "cuda:1": 2000}
    assert g.device_param_bytes([(1, 2), (3, 4)]) == 1000 and g.device_param_bytes([(3, 4)]) == 1000
    r = simulate(pl, g, two_gpus())
    assert r.per_device["cuda:1"]["comm_s"] == 0 and r.per_device["cuda:1"]["optimizer_s"] > 0


# --- search ---------------------------------------------------------------------------------------
def test_search_picks_interleaving_where_the_bubble_dominates():
    # Two equal GPUs, 8 layers of 100 MB (SGD: 1.6 GB of parameters and gradients) and 1 GB each:
    # only a pipeline fits. The batch of 4 allows at most 4 microbatches, so 1F1B idles
    # (p - 1) / m = 1/4 of its compute; interleaving (v = 2) halves that: 27 slots against 30.
    import random
    from hetplan.planner.hardware.topology import Device, Link, Topology
    from hetplan.planner.search.space import from_plan, interleave, to_plan
    from hetplan.planner.sim.simulator import Simulator
    from test_search import sim_search, uniform_graph
    g = uniform_graph(num_layers=8, batch=4, param_bytes=1e8)
    topo = Topology("two-gpus", (Device("cuda:0", "cuda", 1e9, 1e12, 1e12), Device("cuda:1", "cuda", 1e9, 1e12, 1e12)),
                    (Link("cuda:0", "cuda:1", 1e18, 0.0),))
    # with ZB-H1 allowed the search picks it here ((3m + p - 1) * 2 = 26 of these slots against
    # interleaving's 27): this test isolates the interleave move among the schedules before ZB-H1.
    # The walk stops by no improvement after ~160 proposals, on either of the two by seed (seeds
    # 0 and 1 end on interleaving since the walk draws its acceptance test before proposing)
    _, with_zb = sim_search(g, topo, seed=2)
    assert with_zb.best.plan.schedule == "zb-h1"
    problem, result = sim_search(g, topo, schedules=("1f1b", "gpipe"))
    assert with_zb.best.iteration_s < result.best.iteration_s
    best = result.best.plan
    assert best.schedule == "interleaved-1f1b" and len(best.replicas) == 1
    assert len(best.replicas[0].stages) == 4 and best.replicas[0].microbatches == 4
    assert not any(c.feasible for c in result.baselines if c.name.startswith("data parallel"))
    # the same layers per device as plain 1F1B (the move back) is slower by the bubble
    s, batches = from_plan(best)
    flat = to_plan(problem.space, interleave(problem.space, s, random.Random(0)), batches)
    assert flat.schedule == "1f1b" and flat.replicas[0].microbatches == 4
    t_flat = Simulator(g, topo).simulate(flat).iteration_s
    assert result.best.iteration_s < 0.95 * t_flat


def test_interleave_move_keeps_each_devices_layers_and_goes_back():
    import random
    from hetplan.planner.files.plan import ModelRef, validate_plan
    from hetplan.planner.search.space import Pipeline, Space, Strategy, fits, interleave, to_plan
    sp = Space(devices=("cuda:0", "cuda:1"), kinds={"cuda:0": "cuda", "cuda:1": "cuda"}, num_layers=8,
               global_batch=8, model=ModelRef("mlp"))
    s = Strategy((Pipeline(("cuda:0", "cuda:1"), (3,), 4),))
    t = interleave(sp, s, random.Random(0))
    assert t.schedule == "interleaved-1f1b" and fits(sp, t)
    assert t.pipelines[0].devices == ("cuda:0", "cuda:1", "cuda:0", "cuda:1") and t.pipelines[0].cuts == (2, 5, 6)
    validate_plan(to_plan(sp, t, (8,)))
    assert interleave(sp, t, random.Random(0)) == s
    # a stage of one layer cannot be split; offload is not combined with interleaving
    assert interleave(sp, Strategy((Pipeline(("cuda:0", "cuda:1"), (1,), 4),)), random.Random(0)) is None
    assert not fits(sp, Strategy(t.pipelines, "interleaved-1f1b", offload=True))
    assert not fits(sp, Strategy(t.pipelines, "1f1b"))   # repeated devices only when interleaved


# --- accelerator paths (CPU stand-ins everywhere; real GPUs where marked) ----------------------------
from test_runtime_cuda import check_close, gpus  # noqa: E402,F401  (the fixture: stand-in / real)


def test_cpu_and_gpu_interleaved_through_host_memory(tmp_path, gpus):
    # cpu:0 holds stages 0 and 2, cuda:0 stages 1 and 3: every boundary crosses host staging,
    # tuple outputs (skip connections) included
    from test_runtime import SKIP, plan as runtime_plan
    stages = [("cpu:0", (0, 1)), ("cuda:0", (1, 2)), ("cpu:0", (2, 3)), ("cuda:0", (3, 4))]
    check_close(tmp_path, runtime_plan([(1.0, 4, stages)], model=SKIP, schedule="interleaved-1f1b",
                                       sync="fine", bucket_bytes=1024), gpus)


def test_two_gpus_interleaved(tmp_path, gpus):
    # NCCL between real GPUs (one communicator per direction), host-staged gloo for stand-ins
    import torch
    if gpus == "real" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from test_runtime import plan as runtime_plan
    stages = [("cuda:0", (0, 1)), ("cuda:1", (1, 2)), ("cuda:0", (2, 3)), ("cuda:1", (3, 4))]
    check_close(tmp_path, runtime_plan([(1.0, 2, stages)], schedule="interleaved-1f1b"), gpus)


def test_interleaved_plan_round_trips(tmp_path):
    from hetplan.planner.files.plan import load_plan, save_plan
    p = plan_from_dict(_plan_dict(["cpu:0", "cpu:1", "cpu:0", "cpu:1"]))
    save_plan(p, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == p


def test_every_proposal_around_interleaving_gives_a_valid_plan():
    # the walk from a two-GPU 1F1B pipeline reaches interleaved strategies and leaves them; every
    # proposal's plan (its batch split solved) passes the plan file's validation
    import random
    from hetplan.planner.files.plan import validate_plan
    from hetplan.planner.search.mcmc import Searcher
    from hetplan.planner.search.space import Pipeline, Strategy, propose, to_plan
    from test_search import BIG, toy_problem
    devices = ("cuda:0", "cuda:1", "cuda:2", "cpu:0")
    p = toy_problem(dict(zip(devices, (1.0, 2.0, 1.0, 0.5))), dict.fromkeys(devices, BIG), batch=8, layers=8)
    rng = random.Random(5)
    s, searcher, seen = Strategy((Pipeline(("cuda:0", "cuda:1"), (4,), 2),)), Searcher(p, rng), 0
    for _ in range(1500):
        t = propose(p.space, s, rng)
        if t is not None:
            plan = to_plan(p.space, t, searcher.solve_batches(t))
            validate_plan(plan, "<test>", 8, set(devices))
            seen += plan.schedule == "interleaved-1f1b"
            s = t
    assert seen > 0


def test_three_workers_wrap_around_from_the_last_device_to_the_first(tmp_path):
    # p = 3, v = 2: cpu:2's stage 2 sends to cpu:0's stage 3; each rank has a previous and a next
    # link to two different peers; the built-in transformer
    from test_runtime import plan as runtime_plan
    gpt = {"spec": "gpt", "args": {"layers": 4, "heads": 2, "d_model": 16, "vocab": 32, "context": 8}}  # 6 layers
    stages = [(f"cpu:{k % 3}", (k, k + 1)) for k in range(6)]
    _check_equivalent(tmp_path, runtime_plan([(1.0, 3, stages)], model=gpt, global_batch=6,
                                             schedule="interleaved-1f1b", sync="fine", bucket_bytes=1024,
                                             lr=0.003))


@pytest.mark.parametrize("replicas", [
    [(1.0, 2, ("cpu:0", "cpu:1"))],
    [(0.5, 2, ("cpu:0", "cpu:1")), (0.5, 2, ("cpu:2", "cpu:3"))],
], ids=["pipeline", "two-pipelines"])
def test_tied_weight_on_two_virtual_stages_of_one_rank(tmp_path, replicas):
    # layers 1 and 3 share a weight; both sit on the second device (its stages 1 and 3), so its
    # gradient accumulates there from two stage modules, then (two pipelines) is summed
    from test_runtime import plan as runtime_plan
    tied = {"spec": "tests.runtime_models:tiednet", "args": {"width": 16}}
    reps = [(f, m, [(a, (0, 1)), (b, (1, 2)), (a, (2, 3)), (b, (3, 5))]) for f, m, (a, b) in replicas]
    _check_equivalent(tmp_path, runtime_plan(reps, model=tied, global_batch=8, schedule="interleaved-1f1b",
                                             sync="fine", bucket_bytes=1024))


def test_bf16_interleaved_matches_single_process_bf16_training(tmp_path):
    # each virtual stage's forward and the loss under autocast; tolerances as test_runtime's bf16 test
    import torch
    from test_runtime import ITERS, plan as runtime_plan, reference, run_plan
    stages = [("cpu:0", (0, 1)), ("cpu:1", (1, 2)), ("cpu:0", (2, 3)), ("cpu:1", (3, 4))]
    p = runtime_plan([(1.0, 2, stages)], schedule="interleaved-1f1b", precision="bf16")
    result, params = run_plan(tmp_path, p)
    bf16 = reference(p["model"], 12, ITERS, precision="bf16")
    bf16_losses, bf16_params, fp32_losses = bf16.losses, bf16.params, reference(p["model"], 12, ITERS).losses
    assert result["losses"] == pytest.approx(bf16_losses, rel=2e-2)
    for name, ref in bf16_params.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name], ref, rtol=1e-2, atol=2e-2, msg=name)
    worst = lambda ref: max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref))  # noqa: E731
    assert worst(bf16_losses) * 10 < worst(fp32_losses)
