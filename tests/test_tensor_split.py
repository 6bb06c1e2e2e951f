"""Tensor split of a stage between devices ("devices": [{"device", "share"}]): the plan field,
the linear pairs found in a model, the simulator's exact times and the memory model."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hetplan.planner.cost.memory import peak_memory
from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import Share, load_plan, plan_from_dict, plan_to_dict, validate_plan
from hetplan.planner.sim.simulator import simulate
from hetplan.planner.workload.graph import SplitPair
from hetplan.planner.workload.tensor_split import find_pairs, split_bounds
from simhelpers import device, graph, layer, link, plan, topology


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def _doc(stage: dict, **extra) -> dict:
    return {"model": {"spec": "mlp"}, "global_batch": 8,
            "replicas": [{"batch_fraction": 1, "stages": [{"layers": [0, 5], **stage}]}], **extra}


SPLIT = {"devices": [{"device": "cpu:0", "share": 0.25}, {"device": "cpu:1", "share": 0.75}]}


# --- the plan field -------------------------------------------------------------------------
def test_split_stage_round_trips_and_lists_every_device():
    p = plan_from_dict(_doc(SPLIT), "p.json")
    st = p.replicas[0].stages[0]
    assert st.split == (Share("cpu:0", 0.25), Share("cpu:1", 0.75)) and st.device == "cpu:0"
    assert p.devices == ("cpu:0", "cpu:1") and p.replicas[0].devices == ("cpu:0", "cpu:1")
    assert plan_from_dict(plan_to_dict(p)) == p
    assert plan_to_dict(p)["replicas"][0]["stages"][0]["devices"][1] == {"device": "cpu:1", "share": 0.75}
    validate_plan(p, "p.json", device_names={"cpu:0", "cpu:1"})


@pytest.mark.parametrize("stage,extra,field", [
    ({"device": "cpu:0", **SPLIT}, {}, "stages[0].devices: expected either"),
    ({"devices": [{"device": "cpu:0", "share": 0.5}, {"device": "cpu:1", "share": 0.4}]}, {},
     "stages[0].devices: share values sum to 0.9"),
    ({"devices": [{"device": "cpu:0", "share": 0.5}, {"device": "cpu:0", "share": 0.5}]}, {},
     "stages[0].devices[1].device: device 'cpu:0' is already used"),
    ({"devices": [{"device": "cpu:0", "share": 1.0}]}, {}, "expected at least two devices"),
    ({"devices": [{"device": "cpu:0", "share": 1.5}, {"device": "cpu:1", "share": -0.5}]}, {},
     "stages[0].devices[0].share: expected a number in (0, 1]"),
    ({"devices": [{"device": "cpu:0"}, {"device": "cpu:1", "share": 0.5}]}, {},
     "stages[0].devices[0].share: missing"),
    ({"devices": []}, {}, "stages[0].devices: expected a non-empty list"),
    (SPLIT, {"recompute": True}, "recompute: expected false with a tensor-split stage"),
    (SPLIT, {"optimizer": {"placement": "cpu"}}, "optimizer.placement: expected \"device\""),
    (SPLIT, {"schedule": "interleaved-1f1b"}, "schedule: expected gpipe, 1f1b or hippie with a tensor-split stage"),
])
def test_bad_split_is_one_line_naming_the_field(stage, extra, field):
    with pytest.raises(InputError) as e:
        plan_from_dict(_doc(stage, **extra), "p.json")
    msg = str(e.value)
    assert msg.startswith("p.json: ") and field in msg and "\n" not in msg


def test_split_stage_needs_one_replica_and_known_devices():
    doc = _doc(SPLIT)
    doc["replicas"][0]["stages"] = [{"layers": [0, 2], **SPLIT}, {"layers": [2, 5], "device": "cpu:2"}]
    doc["replicas"][0]["microbatches"] = 2
    assert plan_from_dict(doc, "p.json").devices == ("cpu:0", "cpu:1", "cpu:2")     # a pipeline: fine
    doc["replicas"][0]["batch_fraction"] = 0.5
    doc["replicas"].append({"batch_fraction": 0.5, "stages": [{"device": "cpu:3", "layers": [0, 5]}]})
    with pytest.raises(InputError, match=r"stages\[0\]\.devices: a tensor-split stage needs a plan of one replica"):
        plan_from_dict(doc, "p.json")
    p = plan_from_dict(_doc(SPLIT), "p.json")
    with pytest.raises(InputError, match=r"stages\[0\]\.devices\[1\]\.device: expected a device of the topology"):
        validate_plan(p, "p.json", device_names={"cpu:0"})


def test_cli_refuses_a_bad_split_with_exit_2(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_doc({"devices": [{"device": "cpu:0", "share": 0.6}, {"device": "cpu:1", "share": 0.6}]})))
    r = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(f)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "share values sum to 1.2" in r.stderr


# --- pairs in a model -----------------------------------------------------------------------
def test_pairs_of_the_builtins_and_share_bounds():
    from hetplan.planner.workload.builtin import gpt, mlp
    from hetplan.planner.workload.partition import build_stages
    torch.manual_seed(0)
    st = build_stages(mlp(hidden=16, depth=4), [(0, 5)])[0]
    pairs = find_pairs(st.graph, dict(st.named_parameters()))
    assert [(p.col_weight, p.row_weight, p.hidden) for p in pairs] == [
        ("layers.0.fc.weight", "layers.1.fc.weight", 16), ("layers.2.fc.weight", "layers.3.fc.weight", 16)]
    st = build_stages(gpt(layers=2, d_model=16, heads=2, vocab=32, context=4), [(0, 4)])[0]
    pairs = find_pairs(st.graph, dict(st.named_parameters()))
    # attention's qkv -> proj is not elementwise-connected; proj -> fc crosses a LayerNorm
    assert [(p.col_weight, p.row_weight) for p in pairs] == [
        ("blocks.0.fc.weight", "blocks.0.fc_out.weight"), ("blocks.1.fc.weight", "blocks.1.fc_out.weight")]
    assert split_bounds(10, (0.25, 0.75)) == [(0, 2), (2, 10)]
    assert split_bounds(7, (1 / 3,) * 3) == [(0, 2), (2, 5), (5, 7)]


# --- simulator and memory: a hand-computed case ---------------------------------------------
def _split_case():
    """3 layers at graph batch 2: 1e9 forward, 2e9 backward FLOPs each; layers 0 and 1 hold
    1e6 B of parameters. One pair: column linear in layer 0 (80 % of its FLOPs), row linear all
    of layer 1; 1.5e6 B of split parameters, 2e6 B output, 1e6 B input gradient."""
    g = replace(graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6), layer(2)], batch=2),
                pairs=(SplitPair(0, 1, 0.8e9, 1.6e9, 1e9, 2e9, 1_500_000, 2_000_000, 1_000_000,
                                 "l0.weight", "l1.weight"),))
    t = topology([device("cuda:0", flops=1e9, mem_bw=1e8), device("cuda:1", flops=2e9, mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    p = plan([(1.0, 1, [("cuda:0", 0, 3)])], 2)
    st = replace(p.replicas[0].stages[0], split=(Share("cuda:0", 0.25), Share("cuda:1", 0.75)))
    return g, t, replace(p, replicas=(replace(p.replicas[0], stages=(st,)),))


def test_split_stage_time_is_slowest_part_per_layer_plus_activation_allreduces():
    g, t, p = _split_case()
    r = simulate(p, g, t)
    # part of a layer on a device = layer time * (1 - phi + share * phi), phi = split FLOP share
    # forward, cuda:0 (1 s a layer) | cuda:1 (0.5 s): l0 phi .8: .4 | .4; l1 phi 1: .25 | .375;
    # l2 phi 0: 1 | .5 -> max per layer .4 + .375 + 1 = 1.775
    # forward all-reduce of 2e6 B: 2 * 0.01 + 2 * 1/2 * 2e6 / 1e6 = 2.02
    # backward (2x): .8 | .8, .5 | .75, 2 | 1 -> 3.55; all-reduce of 1e6 B: 1.02
    # SGD: cuda:1 holds 2e6 - 0.25 * 1.5e6 = 1.625e6 B: 3 * 1.625e6 / 1e8 = 0.04875 s (the slower)
    assert r.iteration_s == approx(1.775 + 2.02 + 3.55 + 1.02 + 0.04875)
    d0, d1 = r.per_device["cuda:0"], r.per_device["cuda:1"]
    assert (d0["fwd_s"], d0["bwd_s"]) == (approx(0.4 + 0.25 + 1.0), approx(0.8 + 0.5 + 2.0))
    assert (d1["fwd_s"], d1["bwd_s"]) == (approx(0.4 + 0.375 + 0.5), approx(0.8 + 0.75 + 1.0))
    assert d0["comm_s"] == approx(3.04) and d1["comm_s"] == approx(3.04)
    assert d0["optimizer_s"] == approx(3 * 0.875e6 / 1e8) and d1["optimizer_s"] == approx(0.04875)
    # memory: SGD keeps no state; parameters + gradients of each device's holding
    assert r.peak_memory_bytes == {"cuda:0": approx(2 * 0.875e6), "cuda:1": approx(2 * 1.625e6)}


def test_split_stage_with_microbatches_and_adam_memory():
    g, t, p = _split_case()
    p2 = replace(p, global_batch=4, replicas=(replace(p.replicas[0], microbatches=2),),
                 optimizer=replace(p.optimizer, name="adam"))
    r = simulate(p2, g, t)
    # two microbatches of 2 samples: each as above; Adam 7x bytes: 7 * 1.625e6 / 1e8
    assert r.iteration_s == approx(2 * (1.775 + 2.02 + 3.55 + 1.02) + 7 * 1.625e6 / 1e8)
    assert peak_memory(p2, g, t) == {"cuda:0": approx(4 * 0.875e6), "cuda:1": approx(4 * 1.625e6)}


def test_split_stage_shares_trade_compute_between_devices():
    g, t, p = _split_case()
    st = p.replicas[0].stages[0]

    def at(share0):
        s = replace(st, split=(Share("cuda:0", share0), Share("cuda:1", 1 - share0)))
        return simulate(replace(p, replicas=(replace(p.replicas[0], stages=(s,)),)), g, t).iteration_s
    # cuda:1 is twice as fast: giving cuda:0 a third of the pairs balances layer 1 exactly
    assert at(1 / 3) < at(0.5) and at(1 / 3) < at(0.1)


# --- search: a what-if workstation where the split wins ---------------------------------------
def _slow_gpu_workstation():
    """A CPU and a GPU of about the same speed (1e11 and 1.2e11 FLOP/s), 10 GB/s between them."""
    from hetplan.planner.hardware.topology import Device, Link, Topology
    return Topology("slow-gpu", (Device("cpu:0", "cpu", 64e9, 1e11, 1e11),
                                 Device("cuda:0", "cuda", 8e9, 1.2e11, 2e11)),
                    (Link("cpu:0", "cuda:0", 1e10, 1e-5),))


def test_search_splits_a_wide_mlp_between_a_cpu_and_a_slow_gpu():
    # mlp 784 -> 2048 -> 2048 -> 10 at batch 16: one pair holds 99.6 % of the FLOPs and the
    # parameters. Data parallelism all-reduces 23 MB of gradients (2.3 ms at 10 GB/s), a
    # pipeline cannot balance the 2048 x 2048 layer against the rest, while the split
    # exchanges 128 KB of activations and halves both the compute and the Adam step.
    import random
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import plan_problem
    from hetplan.planner.workload.load import load_workload
    args = {"hidden": 2048, "depth": 2}
    _, problem = plan_problem(load_workload("mlp", args), ModelRef("mlp", args), 16, _slow_gpu_workstation(),
                              "adam", 1e-3)
    assert problem.space.tensor_split
    cfg = SearchConfig(iterations=300, time_limit_s=60)
    result = search(problem, random.Random(0), cfg)
    best = result.best
    (st,) = best.plan.replicas[0].stages
    assert {s.device for s in st.split} == {"cpu:0", "cuda:0"}
    # shares solved so the devices finish together: the GPU (1.2x) gets the larger share
    assert dict((s.device, s.share) for s in st.split)["cuda:0"] == pytest.approx(0.545, abs=0.02)
    assert best.iteration_s < 0.7 * min(c.iteration_s for c in result.baselines)
    without = search(replace(problem, space=replace(problem.space, tensor_split=False)), random.Random(0), cfg)
    assert not any(s.split for r in without.best.plan.replicas for s in r.stages)
    assert best.iteration_s < 0.8 * without.best.iteration_s     # 3.1 ms against 4.0 ms


def test_cli_plan_writes_a_split_plan_that_simulates(tmp_path):
    from hetplan.planner.hardware.topology import save_topology
    save_topology(_slow_gpu_workstation(), tmp_path / "t.json")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "mlp", "--model-arg", "hidden=2048",
                        "--model-arg", "depth=2", "--batch", "16", "--topology", str(tmp_path / "t.json"),
                        "-o", str(tmp_path / "p.json")], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cuda:0 5" in r.stdout and "+ cpu:0 4" in r.stdout       # 'cuda:0 55% + cpu:0 45%[0:3]'
    p = load_plan(tmp_path / "p.json")
    assert p.replicas[0].stages[0].split and p.devices == ("cuda:0", "cpu:0")
    s = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(tmp_path / "p.json"), "--json"],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert s.returncode == 0, s.stderr
    assert json.loads(s.stdout)["iteration_s"] == pytest.approx(p.predicted.iteration_s, rel=1e-9)


def test_pipeline_stage_before_a_split_stage():
    # layer 0 (1 s forward, 2 s backward) on cuda:2, then the hand-computed split above as the
    # stage [1, 4): its input goes to cuda:0 (1e6 B at 1e6 B/s: 1 s), then a copy to cuda:1 over
    # the same link (1 s, queued behind) and on from cuda:0 (0.01 + 1 s); the input gradient
    # goes back from cuda:0 alone. GPipe, one microbatch:
    # 1 + 1 + 1 + 1.01 + (1.775 + 2.02) + (3.55 + 1.02) + 1 + 2; the split devices' steps
    # (0.049 s) run during the gradient's trip and cuda:2's backward
    _, t, _ = _split_case()
    g = replace(graph([layer(0), layer(1, param_bytes=10**6), layer(2, param_bytes=10**6), layer(3)], batch=2,
                      cut_bytes=[0, 10**6, 0, 0, 0]),
                pairs=(SplitPair(1, 2, 0.8e9, 1.6e9, 1e9, 2e9, 1_500_000, 2_000_000, 1_000_000,
                                 "l1.weight", "l2.weight"),))
    t = replace(t, devices=t.devices + (device("cuda:2", flops=1e9),),
                links=t.links + (link("cuda:2", "cuda:0", bw=1e6),))
    p = plan([(1.0, 1, [("cuda:2", 0, 1), ("cuda:0", 1, 4)])], 2, schedule="gpipe")
    split = replace(p.replicas[0].stages[1], split=(Share("cuda:0", 0.25), Share("cuda:1", 0.75)))
    p = replace(p, replicas=(replace(p.replicas[0], stages=(p.replicas[0].stages[0], split)),))
    r = simulate(p, g, t)
    assert r.iteration_s == approx(1 + 1 + 1 + 1.01 + 1.775 + 2.02 + 3.55 + 1.02 + 1 + 2)
    assert r.per_device["cuda:2"]["comm_s"] == approx(2 + 2.01)
    assert r.per_device["cuda:0"]["comm_s"] == approx(2 + 3.04)
    assert r.per_device["cuda:1"]["comm_s"] == approx(2.01 + 3.04)


def test_split_stage_before_a_pipeline_stage_gets_the_gradient_on_every_device():
    # the split above as stage [0, 3), then layer 3 (1 s, 2 s) on cuda:2: the activation goes
    # from cuda:0 alone (1 s); the gradient comes back to cuda:0 (1 s) and, queued behind it,
    # to cuda:1 through cuda:0 (1 + 1.01 s) before the split's backward; then cuda:1's step
    g0, t, _ = _split_case()
    g = replace(graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6), layer(2), layer(3)], batch=2,
                      cut_bytes=[0, 0, 0, 10**6, 0]), pairs=g0.pairs)
    t = replace(t, devices=t.devices + (device("cuda:2", flops=1e9),),
                links=t.links + (link("cuda:2", "cuda:0", bw=1e6),))
    p = plan([(1.0, 1, [("cuda:0", 0, 3), ("cuda:2", 3, 4)])], 2, schedule="gpipe")
    split = replace(p.replicas[0].stages[0], split=(Share("cuda:0", 0.25), Share("cuda:1", 0.75)))
    p = replace(p, replicas=(replace(p.replicas[0], stages=(split, p.replicas[0].stages[1])),))
    r = simulate(p, g, t)
    assert r.iteration_s == approx((1.775 + 2.02) + 1 + 1 + 2 + 1 + 1 + 1.01 + (3.55 + 1.02) + 0.04875)


def test_cpu_workers_of_one_host_in_a_split_compute_at_once_under_contention():
    # the cost model's contention (a measured host's calibration) applies to a split's CPU
    # devices of one node, all busy at once; a GPU beside one CPU slows nothing
    from hetplan.planner.cost.model import RooflineCost

    class Contended(RooflineCost):
        def contention(self, device, busy):
            return 1.0 + 0.5 * (busy - 1) if self.topology.device(device).kind == "cpu" else 1.0
    g, _, _ = _split_case()
    cpus = topology([device("cpu:0"), device("cpu:1")], [link("cpu:0", "cpu:1")])
    split = (("cpu:0", 0.5), ("cpu:1", 0.5))
    plain, busy = RooflineCost(g, cpus), Contended(g, cpus)
    # layer 2 (not split) forward: 1 s alone, 1.5 s with the other CPU worker computing
    assert plain.tensor_device_s("fwd", split, "cpu:0", 0, 3, 2, 2) == approx(1.0)
    assert busy.tensor_device_s("fwd", split, "cpu:0", 0, 3, 2, 2) == approx(1.5)
    mixed = topology([device("cpu:0"), device("cuda:0")], [link("cpu:0", "cuda:0")])
    assert Contended(g, mixed).tensor_device_s("fwd", (("cpu:0", 0.5), ("cuda:0", 0.5)), "cpu:0", 0, 3, 2, 2) \
        == approx(1.0)


def test_tensor_moves_give_valid_plans_whole_model_and_pipeline_splits():
    import random
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.search.space import Pipeline, Space, Strategy, from_plan, propose, to_plan
    devices = ("cuda:0", "cuda:1", "cpu:0", "cpu:1")
    space = Space(devices=devices, kinds={d: d.split(":")[0] for d in devices}, num_layers=6, global_batch=24,
                  model=ModelRef("toy"), tensor_split=True)
    rng = random.Random(0)
    s, seen = Strategy((Pipeline(("cuda:0", "cuda:1"), (3,), 4),)), set()
    for _ in range(400):
        t = propose(space, s, rng) or s
        batches = (24,) if len(t.pipelines) == 1 else tuple([24 // len(t.pipelines)] * (len(t.pipelines) - 1)
                                                             + [24 - 24 // len(t.pipelines) * (len(t.pipelines) - 1)])
        plan = to_plan(space, t, batches)
        validate_plan(plan, "proposal", 6, set(devices))
        back = from_plan(plan)[0]
        assert (back.tensor, back.tensor_stage) == (t.tensor, t.tensor_stage if t.tensor else 0)
        if t.tensor:
            seen.add("whole" if len(t.pipelines[0].devices) == 1 else "pipeline")
            st = plan.replicas[0].stages[t.tensor_stage]
            assert [x.device for x in st.split] == [d for d, _ in t.tensor] and st.device == t.tensor[0][0]
        s = t if rng.random() < 0.5 else s
    assert seen == {"whole", "pipeline"}


def test_shift_share_moves_a_few_percent_and_keeps_the_sum():
    import random
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.search.mcmc import Problem, Searcher
    from hetplan.planner.search.space import Pipeline, Space, Strategy
    space = Space(devices=("cuda:0", "cpu:0", "cpu:1"), kinds={"cuda:0": "cuda", "cpu:0": "cpu", "cpu:1": "cpu"},
                  num_layers=3, global_batch=8, model=ModelRef("toy"), tensor_split=True)
    searcher = Searcher(Problem(space, lambda p: None, {}, {}), random.Random(1))
    s = Strategy((Pipeline(("cuda:0",), ()),), tensor=(("cuda:0", 0.5), ("cpu:0", 0.3), ("cpu:1", 0.2)))
    for _ in range(20):
        t = searcher.shift_share(s)
        if t is None:
            continue
        moved = sorted(round(b - a, 6) for (_, a), (_, b) in zip(s.tensor, t.tensor))
        assert sum(x for _, x in t.tensor) == pytest.approx(1, abs=1e-9)
        assert moved[0] < 0 < moved[-1] and moved[0] == -moved[-1] and abs(moved[-1]) in (0.01, 0.02, 0.05)
        assert [d for d, _ in t.tensor] == ["cuda:0", "cpu:0", "cpu:1"]
