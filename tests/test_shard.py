"""Sharded data parallel (plan field `shard`, ZeRO stages): stage 1 trains like one device on two
CPU workers, equal and unequal shares, and beside a pipeline; each rank keeps about 1/N of the
optimizer state; the memory model's figures per stage, hand-computed; what does not run yet is
one line and exit 2."""
from __future__ import annotations

import json

import pytest

from equivalence import assert_params_match
from hetplan.planner.files.io import InputError
import dataclasses

from hetplan.planner.cost.memory import peak_memory
from hetplan.planner.files.plan import plan_from_dict
from hetplan.planner.sim.bound import lower_bound_s
from hetplan.planner.sim.simulator import Simulator, simulate
from simhelpers import device, graph, layer, link, topology
from simhelpers import plan as sim_plan
from test_cli_inputs import one_error_line
from test_train import _hetplan, assert_resumed_equals_uninterrupted, plan, reference, train

EQUAL = [(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])]
UNEQUAL = [(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 4))])]
UNEQUAL_3 = [(1 / 3, 2, [("cpu:0", (0, 4))]), (2 / 3, 2, [("cpu:1", (0, 4))])]   # ZeRO-3: as many microbatches
THREE = [(1 / 3, 1, [(f"cpu:{i}", (0, 4))]) for i in range(3)]     # 4 samples each; tensors of 10 split 4/4/2
PIPELINES = [(0.5, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))]), (0.5, 2, [("cpu:2", (0, 2)), ("cpu:3", (2, 4))])]


def sharded(replicas, stage: int = 1) -> dict:
    return {**plan(replicas), "shard": {"stage": stage}}


CASES = {"1-equal": (1, EQUAL), "1-unequal": (1, UNEQUAL), "1-three": (1, THREE), "1-pipelines": (1, PIPELINES),
         "2-equal": (2, EQUAL), "2-unequal": (2, UNEQUAL), "2-three": (2, THREE), "2-pipelines": (2, PIPELINES),
         "3-equal": (3, EQUAL), "3-unequal": (3, UNEQUAL_3), "3-three": (3, THREE), "3-pipelines": (3, PIPELINES)}


@pytest.mark.parametrize("stage,replicas", list(CASES.values()), ids=list(CASES))
def test_each_stage_trains_like_one_device(tmp_path, stage, replicas):
    rows, params = train(tmp_path, sharded(replicas, stage), steps=6)
    ref = reference(6, {"name": "adam", "lr": 0.01})
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_gradients_clip_by_the_global_norm(tmp_path, stage):
    # each rank holds a slice of every gradient: the norm is the group's, the slices scaled
    opt = {"name": "adam", "lr": 0.01, "clip_grad_norm": 0.5}
    rows, params = train(tmp_path, {**sharded(UNEQUAL_3, stage), "optimizer": opt}, steps=5)
    ref = reference(5, opt, clip=0.5)
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert all(r["grad_norm"] > 0.5 for r in rows)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_sharded_run_stopped_then_resumed_equals_uninterrupted(tmp_path, stage):
    assert_resumed_equals_uninterrupted(tmp_path, sharded(UNEQUAL_3, stage))


def test_a_sharded_checkpoint_resumes_unsharded_and_back(tmp_path):
    # the checkpoint holds whole tensors under the model's names, whatever the plan's sharding
    ref = reference(9, {"name": "adam", "lr": 0.01})
    ck = str(tmp_path / "ck")
    train(tmp_path, sharded(THREE, 3), "a", steps=3, checkpoint_dir=ck, checkpoint_every=3)
    rows, _ = train(tmp_path, plan(PIPELINES), "b", steps=6, checkpoint_dir=ck, checkpoint_every=6, resume=True)
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses[3:6], rel=1e-5)
    rows, params = train(tmp_path, sharded(PIPELINES, 2), "c", steps=9, checkpoint_dir=ck, resume=True)
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses[6:], rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


GPUS = [(1 / 3, 2, [("cuda:0", (0, 4))]), (2 / 3, 2, [("cuda:1", (0, 4))])]   # stand-ins: host memory
ON_HOST = {"name": "adam", "lr": 0.01, "placement": "cpu"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_state_on_the_host_trains_like_one_device(tmp_path, monkeypatch, stage):
    # ZeRO-Offload over shards: each GPU's host steps the GPU's slices, which are copied back
    from hetplan.planner.hardware.device import STANDIN_ENV
    monkeypatch.setenv(STANDIN_ENV, "2")
    rows, params = train(tmp_path, {**sharded(GPUS, stage), "optimizer": ON_HOST}, steps=5)
    ref = reference(5, {"name": "adam", "lr": 0.01})
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


def test_sharded_state_on_the_host_resumes(tmp_path, monkeypatch):
    from hetplan.planner.hardware.device import STANDIN_ENV
    monkeypatch.setenv(STANDIN_ENV, "2")
    assert_resumed_equals_uninterrupted(tmp_path, {**sharded(GPUS, 3), "optimizer": ON_HOST})


def test_each_replica_keeps_a_third_of_the_adam_state(tmp_path):
    def state(p: dict, name: str) -> dict[str, int]:
        path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.m.json"
        path.write_text(json.dumps(p))
        assert _hetplan("run", path, "--iters", 2, "-o", out).returncode == 0
        return {d: v["optimizer_state_bytes"] for d, v in json.loads(out.read_text())["per_device"].items()}
    whole = state(plan(THREE), "whole")
    third = state(sharded(THREE), "third")
    # Adam: two moments of each parameter (+ a step counter per tensor); slices of 10, 16, 784·16, ...
    assert sum(third.values()) == pytest.approx(whole["cpu:0"], rel=0.01)
    assert all(v == pytest.approx(whole["cpu:0"] / 3, rel=0.01) for v in third.values()), third


def test_shard_is_validated_with_one_line(tmp_path):
    def refused(p: dict, *needles: str) -> None:
        with pytest.raises(InputError) as e:
            plan_from_dict(p, "p.json")
        assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    refused({**plan(EQUAL), "shard": {"stage": 4}}, "p.json: shard.stage", "expected one of 0, 1, 2, 3", "got 4")
    refused({**sharded(EQUAL, 3), "recompute": True}, "p.json: recompute", "expected false with shard.stage 3")
    refused(sharded(UNEQUAL, 3), "p.json: replicas[1].microbatches", "expected replicas[0]'s 1 with shard.stage 3")
    refused({**plan(EQUAL), "shard": {"level": 1}}, "p.json: shard.level", "unknown field")
    refused({**plan(EQUAL), "shard": 1}, "p.json: shard", "expected an object")
    refused(sharded([(1.0, 1, [("cpu:0", (0, 4))])]), "shard.stage", "two or more replicas")
    refused(sharded([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])]),
            "replicas[1].stages", "expected the layers of replicas[0]'s stages")
    refused({**sharded(EQUAL), "optimizer": {"name": "adam", "lr": 0.01, "placement": "split", "cpu_fraction": 0.5}},
            "optimizer.placement", "expected \"device\" or \"cpu\"")
    refused({**sharded(EQUAL), "optimizer": {"name": "adam", "lr": 0.01, "torch_class": "LBFGS"}},
            "optimizer.torch_class", "element-wise")
    assert plan_from_dict(sharded(EQUAL, 2), "p.json").shard == 2


def test_what_does_not_run_yet_is_one_line_exit_2(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**sharded(EQUAL, 3), "schedule": "interleaved-1f1b"}))
    one_error_line(_hetplan("run", path, "--steps", 2), "schedule", "other than \"interleaved-1f1b\"")
    # every entry point (torchrun's workers too): the build refuses it before any group exists
    from hetplan.runtime import stage
    with pytest.raises(InputError, match="schedule: expected a schedule other than"):
        stage.build(plan_from_dict(json.loads(path.read_text()), str(path)), ["cpu:0", "cpu:1"], 0, None,
                    file=str(path))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_cpu_beside_a_gpu_shards_through_host_memory(tmp_path, monkeypatch, stage):
    # the group runs on gloo beside the GPU's tensors: every collective staged through the host
    # (the stand-in GPU takes that path too); equal slices on both, a third of the batch on the CPU
    from hetplan.planner.hardware.device import STANDIN_ENV
    monkeypatch.setenv(STANDIN_ENV, "1")
    both = [(1 / 3, 2, [("cpu:0", (0, 4))]), (2 / 3, 2, [("cuda:0", (0, 4))])]
    rows, params = train(tmp_path, sharded(both, stage), steps=5)
    ref = reference(5, {"name": "adam", "lr": 0.01})
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


def test_zero1_steps_half_and_gathers_the_parameters_after():
    # 2 replicas of 3 and 1 samples; layer: 1e9 fwd / 2e9 bwd FLOPs at batch 4: replica 0 takes
    # 2.25 s. Gradient all-reduce 2 * 1 * 0.01 + 1e6 / 1e6 = 1.02 s; SGD on 1e6 B at 1e8 B/s:
    # 0.03 s. ZeRO-1: each steps half (0.015 s), then the all-gather: half an all-reduce, 0.51 s
    g = graph([layer(0, param_bytes=10**6)], batch=4)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    p = sim_plan([(0.75, 1, [("cuda:0", 0, 1)]), (0.25, 1, [("cuda:1", 0, 1)])], 4, granularity="coarse")
    assert simulate(p, g, t).iteration_s == pytest.approx(2.25 + 1.02 + 0.03, rel=1e-12)
    z = dataclasses.replace(p, shard=1)
    r = simulate(z, g, t)
    assert r.iteration_s == pytest.approx(2.25 + 1.02 + 0.015 + 0.51, rel=1e-12)
    assert r.per_device["cuda:1"]["optimizer_s"] == pytest.approx(0.015, rel=1e-12)
    assert r.per_device["cuda:1"]["comm_s"] == pytest.approx(1.02 + 0.51, rel=1e-12)
    assert lower_bound_s(Simulator(g, t), z) <= r.iteration_s


def test_peak_memory_per_stage_hand_computed():
    # 8 layers of 1e6 B, Adam (state 2x), 2 replicas, buckets of a layer. Stage 0: 8 + 8 + 16 =
    # 32e6. Stage 1: state halved, 8 + 8 + 8 = 24e6. Stage 2: gradients half plus a bucket's whole
    # gradients and their rows (2 x 1e6): 8 + (4 + 2) + 8 = 22e6. A one-layer model: its whole
    # gradients and rows beside the slices, 1 + (0.5 + 2) + 1
    g = graph([layer(i, param_bytes=10**6) for i in range(8)], batch=4)
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1")])
    p = sim_plan([(0.5, 1, [("cuda:0", 0, 8)]), (0.5, 1, [("cuda:1", 0, 8)])], 4, optimizer="adam", bucket_bytes=1)
    assert peak_memory(p, g, t) == {"cuda:0": 32e6, "cuda:1": 32e6}
    assert peak_memory(dataclasses.replace(p, shard=1), g, t) == {"cuda:0": 24e6, "cuda:1": 24e6}
    assert peak_memory(dataclasses.replace(p, shard=2), g, t)["cuda:0"] == pytest.approx(22e6, rel=1e-6)
    # Stage 3: parameters half, plus a unit in use and the next gathered: (4 + 2) + 6 + 8 = 20e6.
    # Two microbatches: the first's whole gradients are held beside the slices and a bucket's
    # rows (8 + 4 + 1): stage 2 8 + 13 + 8, stage 3 6 + 13 + 8
    assert peak_memory(dataclasses.replace(p, shard=3), g, t)["cuda:0"] == pytest.approx(20e6, rel=1e-9)
    two = dataclasses.replace(p, replicas=tuple(dataclasses.replace(r, microbatches=2) for r in p.replicas))
    assert peak_memory(dataclasses.replace(two, shard=2), g, t)["cuda:0"] == pytest.approx(29e6, rel=1e-9)
    assert peak_memory(dataclasses.replace(two, shard=3), g, t)["cuda:0"] == pytest.approx(27e6, rel=1e-9)
    # the state on the host (placement "cpu"): each GPU's host holds its slices' state and its
    # copy of their gradients, (2 + 1) x 4e6 per GPU; the GPU its parameters and gradients
    th = topology([device("cpu:0"), device("cuda:0"), device("cuda:1")],
                  [link("cuda:0", "cuda:1"), link("cpu:0", "cuda:0"), link("cpu:0", "cuda:1")])
    off = dataclasses.replace(p, optimizer=dataclasses.replace(p.optimizer, placement="cpu"))
    assert peak_memory(off, g, th) == {"cuda:0": 16e6, "cuda:1": 16e6, "cpu:0": 48e6}
    for k, on_gpu in ((1, 16e6), (2, 14e6), (3, 12e6)):
        assert peak_memory(dataclasses.replace(off, shard=k), g, th) == pytest.approx(
            {"cuda:0": on_gpu, "cuda:1": on_gpu, "cpu:0": 24e6}, rel=1e-9)
    g1 = graph([layer(0, param_bytes=10**6)], batch=4)
    p1 = sim_plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 4, optimizer="adam", bucket_bytes=1)
    assert peak_memory(dataclasses.replace(p1, shard=2), g1, t)["cuda:0"] == 1e6 + 2.5e6 + 1e6


def test_where_replicated_data_parallel_does_not_fit_the_search_shards_and_beats_the_pipeline():
    # 6 layers of 1 GB, Adam, two equal GPUs of 20 GB: replicated, each holds 6 + 6 + 12 GB
    # (infeasible); ZeRO-1 6 + 6 + 6 GB; a 2-stage pipeline 3 + 3 + 6 GB, but with a bubble
    import random

    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import make_space, replicated_fits, simulator_problem
    from hetplan.planner.files.plan import ModelRef
    from test_search import two_gpus, uniform_graph
    graph, topo = uniform_graph(param_bytes=1e9), two_gpus(1.0, memory_bytes=20e9)
    space = make_space(topo, graph.num_layers, graph.batch, ModelRef("toy"), "adam", 1e-3)
    assert not replicated_fits(space, graph, topo)
    assert replicated_fits(space, uniform_graph(param_bytes=1e8), topo)     # 2.4 GB: no sharding drawn
    space = dataclasses.replace(space, shard_choices=(0, 1))
    result = search(simulator_problem(Simulator(graph, topo), space), random.Random(0),
                    SearchConfig(iterations=200, time_limit_s=60))
    best = result.best.plan
    assert best.shard == 1 and len(best.replicas) == 2 and all(len(r.stages) == 1 for r in best.replicas)
    named = {c.name: c for c in result.baselines}
    assert not named["data parallel, equal shares"].feasible and named["data parallel, ZeRO-1"].feasible
    assert result.best.iteration_s < named["balanced pipeline"].iteration_s


def test_zero3_gathers_each_unit_before_its_layers_in_forward_and_backward():
    # 2 layers of 1 MB, a bucket (a unit) each, a 1e6 B/s link of 0.01 s: a unit's all-gather is
    # half of a 1 MB all-reduce, 0.51 s. Forward (4 s) waits for its first unit, the second is
    # gathered beside it: 4.51 s; backward (8 s, in two chunks) the same: 8.51 s. Then the two
    # reduce-scatters of ZeRO-2 (2 x 0.51 s) and no gather after the step: 13.02 + 1.02 s
    from test_search import uniform_graph
    g = uniform_graph(num_layers=2, batch=4, param_bytes=1e6)
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    p = sim_plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 4, bucket_bytes=10**6)
    r = simulate(dataclasses.replace(p, shard=3), g, t, trace=True)
    assert r.per_device["cuda:0"]["fwd_s"] == pytest.approx(4.51, rel=1e-12)
    assert r.per_device["cuda:0"]["bwd_s"] == pytest.approx(8.51, rel=1e-12)
    assert r.iteration_s == pytest.approx(14.04, rel=1e-12)
    assert "parameter all-gather stage 0" not in {x["name"] for x in r.tasks}
    # a slow link: the second unit's gather (10.01 s) outlasts the forward's 4 s
    slow = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1e5, lat=0.01)])
    r = simulate(dataclasses.replace(p, shard=3), g, slow)
    assert r.per_device["cuda:0"]["fwd_s"] == pytest.approx(5.01 + 5.01, rel=1e-12)
    bound = lower_bound_s(Simulator(g, t), dataclasses.replace(p, shard=3))   # the compute: 4 + 8 s
    assert bound == pytest.approx(12.0, rel=1e-6) and bound <= 14.04


@pytest.mark.parametrize("layers,stage", [(24, 1), (60, 3)])
def test_on_the_shipped_dgx_a_model_too_large_to_replicate_is_sharded_and_beats_the_pipeline(layers, stage):
    # dgx-8gpu (hetplan/topologies): 8 GPUs of 80 GB beside two CPUs. Layers of 1 GB with Adam:
    # replicated, a GPU holds 4x the model. 24 GB: ZeRO-1 holds 24 + 24 + 6 GB; 60 GB: only
    # ZeRO-3 fits, 7.5 + 2 + 7.5 + 2 + 15 GB (the pipelines hold 60 GB / stages x 4)
    import random

    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.hardware.topology import load_topology, resolve_topology
    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import make_space, replicated_fits, simulator_problem
    from test_search import uniform_graph
    topo = load_topology(resolve_topology("dgx-8gpu"))
    graph = uniform_graph(num_layers=layers, batch=256, flops_per_sample=2e10, param_bytes=1e9, act_per_sample=1e6)
    space = make_space(topo, graph.num_layers, graph.batch, ModelRef("toy"), "adam", 1e-3)
    assert not replicated_fits(space, graph, topo)
    space = dataclasses.replace(space, shard_choices=(0, 1, 2, 3))    # as plan_problem makes it
    result = search(simulator_problem(Simulator(graph, topo), space), random.Random(0),
                    SearchConfig(iterations=200, time_limit_s=60))
    best = result.best.plan
    assert best.shard == stage and len(best.replicas) == 8 and all(len(r.stages) == 1 for r in best.replicas)
    assert all(d.startswith("cuda:") for d in best.devices)        # the two CPUs would slow it
    named = {c.name: c for c in result.baselines}
    assert named["data parallel, ZeRO-3"].feasible and not named["data parallel over GPUs"].feasible
    assert named["data parallel, ZeRO-1"].feasible == (stage == 1)
    assert result.best.iteration_s < named["balanced pipeline"].iteration_s


def test_zero2_reduce_scatters_each_bucket_after_backward():
    # 2 layers of one 1 MB tensor each, a 1e6 B/s link of 0.01 s. Coarse: ZeRO-1 all-reduces the
    # 2 MB after backward (2 * 0.01 + 2 = 2.02 s), ZeRO-2 reduce-scatters them, half of it (1.01 s).
    # Fine, a bucket a layer: two reduce-scatters of 1 MB (2 x 0.51 s). Both then step half and
    # gather (1.01 s)
    from test_search import uniform_graph
    g = uniform_graph(num_layers=2, batch=4, param_bytes=1e6)
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    p = sim_plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 4, granularity="coarse")
    one, two = (simulate(dataclasses.replace(p, shard=k), g, t, trace=True) for k in (1, 2))
    assert one.iteration_s - two.iteration_s == pytest.approx(1.01, rel=1e-9)
    span = {x["name"]: x["end_s"] - x["start_s"] for x in two.tasks}
    assert span["gradient reduce-scatter stage 0"] == pytest.approx(1.01, rel=1e-12)
    assert span["parameter all-gather stage 0"] == pytest.approx(1.01, rel=1e-12)
    fine = sim_plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 4, bucket_bytes=10**6)
    r = simulate(dataclasses.replace(fine, shard=2), g, t, trace=True)
    span = {x["name"]: x["end_s"] - x["start_s"] for x in r.tasks}
    assert span["gradient reduce-scatter stage 0"] == pytest.approx(1.02, rel=1e-12)


def test_plan_shards_a_6b_gpt_on_the_shipped_dgx(tmp_path):
    # `plan` from the command line, a model we never run: GPT of 32 blocks of width 4096 (6.5e9
    # parameters, captured in fake tensors) on dgx-8gpu (80 GB GPUs). Replicated data parallel
    # and ZeRO-1 do not fit; the search shards everything over the 8 GPUs and beats the pipeline
    out = tmp_path / "big.json"
    r = _hetplan("plan", "--model", "gpt", "--model-arg", "layers=32", "--model-arg", "d_model=4096",
                 "--model-arg", "heads=32", "--model-arg", "vocab=32000", "--model-arg", "context=512",
                 "--batch", "64", "--topology", "dgx-8gpu", "--json", "-o", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(out.read_text())
    assert p["shard"] == {"stage": 3} and len(p["replicas"]) == 8
    assert all(r["stages"][0]["device"].startswith("cuda:") for r in p["replicas"])
    summary = json.loads(r.stdout)
    named = {c["name"]: c for c in summary["baselines"]}
    assert not named["data parallel, ZeRO-1"]["feasible"] and named["balanced pipeline"]["feasible"]
    assert summary["iteration_s"] < named["balanced pipeline"]["iteration_s"]


_SCATTER_PROBE = """
import json, sys, torch, torch.distributed as dist
from hetplan.runtime import shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
params = list(net.parameters()) + [torch.nn.Parameter(torch.ones(7))]   # w0 b0 w1 b1 w2 b2, unused
x = torch.randn(6, 3)
want = torch.autograd.grad(net(x).square().sum(), params[:6])
launched, real = [], shard.launch_scatter
def spy(rows, group, staged):
    launched.append(rows.numel())
    return real(rows, group, staged)
shard.launch_scatter = spy
seen = []
params[0].register_post_accumulate_grad_hook(lambda p: seen.append(len(launched)))   # before the scatter's
step = shard.ShardedStep(params, dist.group.WORLD)
scatter = shard.GradScatter(step, [[4, 5], [0, 1, 2, 3], [6]])
scatter.begin()
scatter.before_backward(0)(0)
net(x).square().sum().backward()
scatter.finish()
same = all(torch.equal(s, w.reshape(-1)) for s, w in zip(step.scattered, want))
print(json.dumps({"launched": launched, "seen": seen, "same": same, "unused": step.scattered[6] is None}))
"""


def test_zero2_scatters_the_plans_buckets_each_once_complete(tmp_path):
    # The runtime's buckets are the simulator's: a bucket is reduce-scattered once all of its
    # gradients are in (the last layer's 10 + 2 values before the first layer's gradient comes),
    # then the rest (12 + 4 + 20 + 5); an unused parameter's bucket is never launched
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _SCATTER_PROBE, str(tmp_path / "rdzv")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"launched": [12, 41], "seen": [1], "same": True, "unused": True}


def test_zero1_on_a_saturated_host_pays_a_wake_up_after_its_parameter_gather():
    # two one-thread CPU workers; a layer of 10**6 parameter bytes; an all-reduce costs 0.5 s +
    # 10**6 B / 10**6 B/s, the all-gather (not profiled) half of it: 0.75 s. On a 2-core host (no
    # core to spare) its wait is a wake-up, 0.25 + 0.125 s more; on 4 cores it is not
    from test_calibration import CAL, _Contended
    cal = {**CAL, "cpu_contention_factor": 1.0, "allreduce_latency_s": 0.5, "allreduce_bytes_per_s": 1e6,
           "wake_latency_s": 0.25, "cold_compute_s": 0.125}
    g = graph([layer(0, param_bytes=10**6)])
    p = dataclasses.replace(sim_plan([(0.5, 1, [("cpu:0", 0, 1)]), (0.5, 1, [("cpu:1", 0, 1)])], 2,
                                     granularity="coarse"), shard=1)

    def gather_s(cores):
        t = topology([dataclasses.replace(device(f"cpu:{i}", flops=1e9, mem_bw=1e9), threads=1) for i in (0, 1)],
                     [link("cpu:0", "cpu:1", bw=1e30, lat=0.0)])
        t = dataclasses.replace(t, measured={"calibration": cal, "host": {"cores": cores}})
        tasks = Simulator(g, t, _Contended(g, t)).simulate(p, trace=True).tasks
        return next(x["end_s"] - x["start_s"] for x in tasks if x["name"] == "parameter all-gather stage 0")

    assert gather_s(2) == pytest.approx(0.75 + 0.375, rel=1e-12)
    assert gather_s(4) == pytest.approx(0.75, rel=1e-12)
