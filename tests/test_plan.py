"""The plan file: save -> load round trip, every validation rule as one clear line, CLI exit 2."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import (Plan, Predicted, TopologyRef, load_plan, plan_from_dict, plan_key,
                                plan_to_dict, save_plan, validate_plan)

BASE = {
    "schema": "hetplan.plan/1",
    "model": {"spec": "mlp", "args": {"hidden": 64, "depth": 2}},
    "global_batch": 16,
    "topology": {"name": "ws", "sha256": "ab" * 32},
    "replicas": [
        {"batch_fraction": 0.25, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 3]}]},
        {"batch_fraction": 0.75, "microbatches": 4,
         "stages": [{"device": "cuda:0", "layers": [0, 2]}, {"device": "cuda:1", "layers": [2, 3]}]},
    ],
    "schedule": "1f1b",
    "sync": {"granularity": "fine", "bucket_bytes": 100000},
    "optimizer": {"name": "adam", "lr": 0.001, "placement": "device"},
    "recompute": False,
    "precision": "fp32",
    "predicted": {"iteration_s": 0.5, "peak_memory_bytes": {"cuda:0": 1.0e6}, "baselines": {"dp": 0.7}},
}


def test_round_trip(tmp_path):
    plan = plan_from_dict(copy.deepcopy(BASE), "p.json")
    assert isinstance(plan, Plan) and plan.topology == TopologyRef("ws", "ab" * 32)
    assert plan.predicted == Predicted(0.5, {"cuda:0": 1.0e6}, {"baselines": {"dp": 0.7}})
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    assert plan_to_dict(plan) == BASE
    assert plan.replica_batches() == [4, 12] and plan.replica_offsets() == [0, 4]


def test_precision_round_trip_and_default(tmp_path):
    d = copy.deepcopy(BASE)
    del d["precision"]
    assert plan_from_dict(d, "p.json").precision == "fp32"      # absent = fp32
    d["precision"] = "bf16"
    plan = plan_from_dict(d, "p.json")
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan and plan.precision == "bf16"
    assert json.loads((tmp_path / "p.json").read_text())["precision"] == "bf16"
    assert plan_key(plan) != plan_key(plan_from_dict(copy.deepcopy(BASE), "p.json"))


def test_layers_pattern_round_trip_and_checked_type(tmp_path):
    d = copy.deepcopy(BASE)
    d["model"]["layers"] = "llm.model.layers.*"
    plan = plan_from_dict(d, "p.json")
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan and plan.model.layers == "llm.model.layers.*"
    assert plan_to_dict(plan) == d
    assert "layers" not in plan_to_dict(plan_from_dict(copy.deepcopy(BASE), "p.json"))["model"]
    for bad in (3, "  "):
        d["model"]["layers"] = bad
        with pytest.raises(InputError, match=r"p.json: model.layers: expected a module name pattern"):
            plan_from_dict(d, "p.json")


def test_split_optimizer_round_trips():
    d = copy.deepcopy(BASE)
    d["optimizer"] = {"name": "adam", "lr": 0.01, "placement": "split", "cpu_fraction": 0.25}
    plan = plan_from_dict(d, "p.json")
    assert plan.optimizer.cpu_fraction == 0.25 and plan.optimizer.placement == "split"
    assert plan_from_dict(plan_to_dict(plan), "p.json") == plan
    assert "cpu_fraction" not in plan_to_dict(plan_from_dict(copy.deepcopy(BASE), "p.json"))["optimizer"]


def test_offload_activations_round_trips_and_excludes_recompute():
    d = copy.deepcopy(BASE)
    d["replicas"][1]["stages"][0]["offload_activations"] = True
    plan = plan_from_dict(d, "p.json")
    assert plan.replicas[1].stages[0].offload_activations and not plan.replicas[1].stages[1].offload_activations
    assert plan_to_dict(plan) == plan_to_dict(plan_from_dict(plan_to_dict(plan), "p.json"))
    assert "offload_activations" not in plan_to_dict(plan)["replicas"][1]["stages"][1]
    d["recompute"] = True
    with pytest.raises(InputError, match=r"replicas\[1\].stages\[0\].offload_activations: expected false with recompute"):
        plan_from_dict(d, "p.json")


def test_zb_h1_round_trips_and_refuses_recompute_offload_and_few_microbatches():
    d = copy.deepcopy(BASE)
    d["schedule"] = "zb-h1"
    plan = plan_from_dict(d, "p.json")
    assert plan.schedule == "zb-h1" and plan_from_dict(plan_to_dict(plan), "p.json") == plan
    for key, value, message in [
            ("recompute", True, r"p.json: recompute: expected false with schedule \"zb-h1\""),
            ("replicas.1.stages.0.offload_activations", True,
             r"p.json: replicas\[1\].stages\[0\].offload_activations: expected false with schedule \"zb-h1\""),
            ("replicas.1.microbatches", 1, r"p.json: replicas\[1\].microbatches: zb-h1 needs microbatches >= stages \(2\)")]:
        bad = copy.deepcopy(d)
        _set(bad, key, value)
        with pytest.raises(InputError, match=message):
            plan_from_dict(bad, "p.json")


def test_hippie_round_trips_with_recompute_offload_and_one_microbatch():
    # what 1f1b accepts, hippie accepts; like GPipe it runs any microbatch count (a pipeline of
    # 2 stages with 1 microbatch is the same order under all three)
    d = copy.deepcopy(BASE)
    d["schedule"] = "hippie"
    plan = plan_from_dict(d, "p.json")
    assert plan.schedule == "hippie" and plan_from_dict(plan_to_dict(plan), "p.json") == plan
    for key, value in [("recompute", True), ("replicas.1.stages.0.offload_activations", True),
                       ("replicas.1.microbatches", 1), ("optimizer.placement", "cpu"),
                       ("sync.granularity", "coarse")]:
        ok = copy.deepcopy(d)
        _set(ok, key, value)
        assert plan_from_dict(ok, "p.json").schedule == "hippie"
    split = copy.deepcopy(d)   # a tensor-split stage runs under hippie as under gpipe and 1f1b
    split["replicas"] = [{"batch_fraction": 1.0, "microbatches": 2, "stages": [
        {"device": "cpu:0", "layers": [0, 2]},
        {"devices": [{"device": "cuda:0", "share": 0.5}, {"device": "cuda:1", "share": 0.5}], "layers": [2, 3]}]}]
    assert plan_from_dict(split, "p.json").replicas[0].stages[1].split


def _set(d, path, value):
    keys = path.split(".")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d[k]
    last = keys[-1]
    if value is _DEL:
        del d[last]
    elif isinstance(d, list):
        d[int(last)] = value
    else:
        d[last] = value


_DEL = object()
R1 = "replicas.1"
CASES = [
    ("global_batch", 0, "global_batch: expected an integer in [1, "),
    ("replicas", [], "replicas: expected a non-empty list"),
    ("schedule", "zb", "schedule: expected one of gpipe, 1f1b, interleaved-1f1b, zb-h1, hippie, got 'zb'"),
    ("schedule", "Hippie", "schedule: expected one of gpipe, 1f1b, interleaved-1f1b, zb-h1, hippie, got 'Hippie'"),
    ("sync.granularity", "medium", "sync.granularity: expected one of coarse, fine"),
    ("sync.bucket_bytes", 0, "sync.bucket_bytes: expected a positive integer"),
    ("optimizer.name", "lamb", "optimizer.name: expected one of sgd, adam"),
    ("optimizer.placement", "nvme", "optimizer.placement: expected one of device, cpu, split"),
    ("optimizer.placement", "split", "optimizer.cpu_fraction: expected a number in (0, 1) with placement"),
    ("optimizer", {"placement": "split", "cpu_fraction": 1}, "optimizer.cpu_fraction: expected a number in (0, 1)"),
    ("optimizer", {"placement": "split", "cpu_fraction": 0.0}, "optimizer.cpu_fraction: expected a number in (0, 1)"),
    ("optimizer", {"placement": "split", "cpu_fraction": "half"}, "optimizer.cpu_fraction: expected a number"),
    ("optimizer.cpu_fraction", 0.5, "optimizer.cpu_fraction: expected only with placement \"split\", got it with 'device'"),
    ("optimizer.lr", 0, "optimizer.lr: expected a positive number"),
    ("replicas.0.batch_fraction", 1.5, "replicas[0].batch_fraction: expected a number in (0, 1]"),
    (f"{R1}.microbatches", 0, "replicas[1].microbatches: expected a positive integer"),
    ("global_batch", 1, "replicas[0].batch_fraction: gives round(0.25 * 1) = 0 samples"),
    (f"{R1}.microbatches", 5, "replicas[1].microbatches: expected a divisor of the replica's batch 12"),
    (f"{R1}.stages", [], "replicas[1].stages: expected a non-empty list"),
    ("replicas.0.stages.0.layers", [0, 3, 4], "replicas[0].stages[0].layers: expected [start, end]"),
    (f"{R1}.stages.1.layers", [1, 3], "replicas[1].stages[1].layers: expected to start at layer 2"),
    (f"{R1}.stages.1.layers", [2, 2], "replicas[1].stages[1].layers: expected a non-empty range"),
    (f"{R1}.stages.1.device", "cuda:0", "replicas[1].stages[1].device: device 'cuda:0' is already used"),
    (f"{R1}.stages.1.device", "gpu1", None),   # no topology given: any name is accepted here
    (f"{R1}.stages.1.layers", [2, 4], "replicas[1].stages[1].layers: expected the last stage to end at layer 3"),
    ("replicas.0.batch_fraction", 0.3, "replicas: batch_fraction values sum to 1.05; expected 1"),
    ("schema", "hetplan.plan/2", "schema: expected 'hetplan.plan/1'"),
    ("model", _DEL, "model: missing"),
    ("recompute", "yes", "recompute: expected true or false"),
    ("precision", "fp16", "precision: expected one of fp32, tf32, bf16, got 'fp16'"),
    ("precision", 16, "precision: expected a string, got 16"),
    (f"{R1}.stages.0.offload_activations", "yes", "replicas[1].stages[0].offload_activations: expected true or false"),
    ("replicas.0.stages.0.offload_activations", True, "replicas[0].stages[0].offload_activations: expected only on an accelerator stage"),
]


@pytest.mark.parametrize("path,value,message", CASES)
def test_each_rule_gives_one_line(path, value, message):
    d = copy.deepcopy(BASE)
    _set(d, path, value)
    if message is None:
        plan_from_dict(d, "p.json")
        return
    with pytest.raises(InputError) as e:
        plan_from_dict(d, "p.json")
    text = str(e.value)
    assert text.startswith("p.json: ") and "\n" not in text
    assert message in text


def test_1f1b_needs_microbatches_at_least_stages():
    d = copy.deepcopy(BASE)
    d["replicas"][1]["microbatches"] = 1
    with pytest.raises(InputError, match=r"replicas\[1\].microbatches: 1f1b needs microbatches >= stages \(2\)"):
        plan_from_dict(d, "p.json")
    d["schedule"] = "gpipe"
    plan_from_dict(d, "p.json")


def test_rounded_batches_must_sum_to_global_batch():
    d = copy.deepcopy(BASE)
    d["global_batch"] = 6
    d["replicas"] = [{"batch_fraction": 0.5, "stages": [{"device": f"cuda:{i}", "layers": [0, 3]}]}
                     for i in range(2)]
    d["replicas"].append({"batch_fraction": 0.0, "stages": [{"device": "cpu:0", "layers": [0, 3]}]})
    with pytest.raises(InputError, match=r"replicas\[2\].batch_fraction: expected a number in \(0, 1\]"):
        plan_from_dict(d, "p.json")
    d["global_batch"] = 5
    d["replicas"] = d["replicas"][:2]   # round(2.5) + round(2.5) = 4 != 5 (banker's rounding)
    with pytest.raises(InputError, match="sum to 4; expected global_batch 5"):
        plan_from_dict(d, "p.json")


def test_graph_and_topology_rules():
    plan = plan_from_dict(copy.deepcopy(BASE), "p.json")
    with pytest.raises(InputError, match=r"stages\[0\].layers: expected the last stage to end at layer 4"):
        validate_plan(plan, "p.json", num_layers=4)
    with pytest.raises(InputError, match=r"replicas\[1\].stages\[1\].device: expected a device of the topology \(cpu:0, cuda:0\), got 'cuda:1'"):
        validate_plan(plan, "p.json", num_layers=3, device_names={"cpu:0", "cuda:0"})
    validate_plan(plan, "p.json", num_layers=3, device_names={"cpu:0", "cuda:0", "cuda:1"})


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="plan file not found"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="bad.json: not valid JSON"):
        load_plan(tmp_path / "bad.json")


@pytest.mark.parametrize("content,message", [
    ("{", "not valid JSON"),
    (json.dumps({**BASE, "schedule": "zb"}), "schedule: expected one of gpipe, 1f1b"),
    (json.dumps({**BASE, "global_batch": -3}), "global_batch: expected an integer in [1, "),
    (json.dumps({**BASE, "precision": "fp64"}), "precision: expected one of fp32, tf32, bf16, got 'fp64'"),
])
def test_cli_exits_2_with_one_line_on_malformed_plan(tmp_path, content, message):
    p = tmp_path / "plan.json"
    p.write_text(content)
    out = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(p) in lines[0]
