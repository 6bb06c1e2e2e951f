"""The benchmark results file (benchmarks/results.py) and the accuracy benchmark's plan sets
(benchmarks/plan_sets.py). Nothing here runs or measures a plan."""
from __future__ import annotations

import json
import socket

import pytest
import torch

from benchmarks.plan_sets import (GPU_WORKLOADS, gpu_transformer_plans, hybrid_kinds, make_plan,
                                  plan_class, plans_for, size_classes, workloads_for)
from benchmarks.results import (accuracy_payload, plan_quality_payload, read_results,
                                update_results, validate_results)
from hetplan.planner.files.io import InputError
from hetplan.planner.workload.layers import num_layers
from hetplan.planner.files.plan import plan_from_dict, validate_plan
from hetplan.planner.hardware.topology import topology_from_dict
from hetplan.planner.workload.load import load_workload

ACCURACY = {"mape_pct": 7.9, "worst_pct": 22.9, "kendall_tau": 0.92,
            "plans": [{"name": "mlp/single", "devices": ["cpu:0"], "predicted_s": 0.1,
                       "measured_s": 0.11, "error_pct": -9.1, "workload": "mlp", "class": "cpu"}]}
PLAN_QUALITY = {"workloads": [{"name": "mlp", "chosen_s": 0.2, "best_baseline": "single-device",
                               "best_baseline_s": 0.24, "speedup": 1.2,
                               "baselines_s": {"single-device": 0.24}}]}


def _files(path):
    return sorted(p.name for p in path.parent.iterdir())


# --- update_results -----------------------------------------------------------------------------
def test_sections_round_trip_and_keep_each_other(tmp_path):
    path = tmp_path / "results" / "host.json"
    assert update_results("accuracy", ACCURACY, path) == path
    update_results("plan_quality", PLAN_QUALITY, path)
    data = json.loads(path.read_text())
    assert data["accuracy"] == ACCURACY and data["plan_quality"] == PLAN_QUALITY
    host = data["host"]
    assert host["hostname"] == socket.gethostname() and host["torch"] == torch.__version__
    assert isinstance(host["cpu_cores"], int) and host["cpu_cores"] >= 1
    if torch.cuda.is_available():
        assert host["gpu"] == torch.cuda.get_device_name()
    else:
        assert "gpu" not in host
    newer = {**ACCURACY, "mape_pct": 5.0}
    update_results("accuracy", newer, path)          # a new run replaces only its own section
    data = read_results(path)
    assert data["accuracy"]["mape_pct"] == 5.0 and data["plan_quality"] == PLAN_QUALITY
    assert _files(path) == ["host.json"]             # no temporary file left behind


@pytest.mark.parametrize("text, expected", [
    ("{not json", "not valid JSON"),
    ('{"host": {"hostname": "h", "cpu_cores": 2, "torch": "2"}, "accuracy": {"worst_pct": 1}}',
     "accuracy.mape_pct: missing"),
    ("[1, 2]", "top level: expected an object"),
])
def test_bad_existing_file_is_refused_and_left_as_it_is(tmp_path, text, expected):
    path = tmp_path / "host.json"
    path.write_text(text)
    with pytest.raises(InputError, match=expected) as e:
        update_results("plan_quality", PLAN_QUALITY, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert path.read_text() == text and _files(path) == ["host.json"]


def test_another_hosts_file_is_refused(tmp_path):
    path = tmp_path / "other.json"
    text = json.dumps({"host": {"hostname": socket.gethostname() + "-other", "cpu_cores": 8,
                                "torch": "2.0"}, "accuracy": ACCURACY})
    path.write_text(text)
    with pytest.raises(InputError, match="host.hostname: holds results of"):
        update_results("plan_quality", PLAN_QUALITY, path)
    assert path.read_text() == text


def test_a_payload_of_the_wrong_shape_is_not_written(tmp_path):
    path = tmp_path / "host.json"
    update_results("accuracy", ACCURACY, path)
    before = path.read_text()
    bad = {"workloads": [{"name": "mlp", "chosen_s": 0.2}]}          # no best_baseline...
    with pytest.raises(InputError, match=r"plan_quality.workloads\[0\].best_baseline: missing"):
        update_results("plan_quality", bad, path)
    with pytest.raises(ValueError, match="section"):
        update_results("speed", {}, path)
    assert path.read_text() == before


@pytest.mark.parametrize("bench", ["accuracy", "plan_quality"])
def test_benchmark_stops_before_running_on_a_bad_results_file(tmp_path, capsys, bench):
    import importlib
    main = importlib.import_module(f"benchmarks.{bench}").main
    bad = tmp_path / "host.json"
    bad.write_text("{")
    assert main(["--quick", "--results", str(bad), "--topology", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{bench}: {bad}: not valid JSON") and "\n" not in err
    assert not (tmp_path / "none.json").exists()        # nothing profiled, nothing run


# --- the sections built from a benchmark's rows --------------------------------------------------
def test_accuracy_payload_has_the_contract_fields():
    plans = plans_for(_topology(["cpu:0", "cuda:0"]), {"mlp": 5})
    rows = [{"plan": name, "workload": "mlp", "predicted_s": 0.1, "measured_s": 0.125,
             "error_pct": -20.0, "spread_pct": 3.0} for name in plans]
    s = accuracy_payload(rows, {"mape_pct": 20.0, "worst_pct": 20.0, "tau": float("nan")}, plans,
                         {"iters": 3, "quick": True})
    validate_results({"host": {"hostname": "h", "cpu_cores": 1, "torch": "2"}, "accuracy": s}, "t")
    assert s["kendall_tau"] is None                  # NaN (all tied) is not JSON
    assert s["run"] == {"iters": 3, "quick": True}
    by_name = {p["name"]: p for p in s["plans"]}
    assert by_name["mlp/cpu-gpu-dp-coarse"]["devices"] == ["cpu:0", "cuda:0"]
    assert by_name["mlp/gpu-single"]["class"] == "gpu"
    assert by_name["mlp/gpu-cpu-opt"]["class"] == "cpu+gpu"


def test_plan_quality_speedup_is_best_baseline_over_chosen():
    from benchmarks.plan_quality import _judge
    rows = [{"workload": "mlp", "plan": p, "predicted_s": pr, "measured_s": m}
            for p, pr, m in (("chosen", 0.09, 0.10), ("dp", 0.11, 0.12), ("single", 0.2, 0.3))]
    s = _judge(rows)
    assert s["best_baseline"] == "dp" and s["speedup"] == pytest.approx(1.2)
    pq = plan_quality_payload({"mlp": s}, rows)
    (w,) = pq["workloads"]
    assert (w["chosen_s"], w["best_baseline_s"]) == (0.10, 0.12)
    assert w["baselines_s"] == {"dp": 0.12, "single": 0.3}
    alone = plan_quality_payload({"mlp": _judge(rows[:1])}, rows[:1])   # no distinct baseline
    assert alone["workloads"][0]["speedup"] is None
    validate_results({"host": {"hostname": "h", "cpu_cores": 1, "torch": "2"},
                      "plan_quality": alone}, "t")


# --- plan sets ------------------------------------------------------------------------------------
def _topology(names: list[str]):
    dev = {"memory_bytes": 8e9, "matmul_flops_per_s": 1e11, "memory_bytes_per_s": 1e10}
    return topology_from_dict({
        "name": "measured-style", "devices": [{"name": n, **dev} for n in names],
        "links": [{"a": a, "b": b, "bandwidth_bytes_per_s": 1e10}
                  for i, a in enumerate(names) for b in names[i + 1:]],
        "host": {"hostname": "gpu-host"}})


# Width-like args shrunk so tracing is fast; depth-like args (which set the layer count) kept.
SMALL = {"hidden": 8, "d_model": 16, "heads": 2, "vocab": 32, "context": 8}


def _layer_counts(workloads: dict) -> dict[str, int]:
    out = {}
    for w, s in workloads.items():
        args = {k: SMALL.get(k, v) for k, v in s["args"].items()}
        out[w] = num_layers(load_workload(s["spec"], args), 1)
    return out


def _check_valid(plans: dict, layers: dict, devices: set[str]) -> None:
    for name, d in plans.items():
        validate_plan(plan_from_dict(d, name), name, layers[name.split("/")[0]], devices)


def test_gpu_plan_set_uses_cpu_and_gpu_together_and_validates():
    devices = ["cpu:0", "cuda:0"]
    layers = _layer_counts(GPU_WORKLOADS)
    plans = plans_for(_topology(devices), layers)
    assert len(plans) >= 10 and {n.split("/")[0] for n in plans} == {"mlp", "gpt", "cnn"}
    hybrid = {n: hybrid_kinds(p) for n, p in plans.items() if plan_class(p) == "cpu+gpu"}
    assert len(hybrid) >= 3
    assert set().union(*hybrid.values()) == {"batch-split", "pipeline", "cpu-optimizer", "split-optimizer",
                                             "tensor-split"}
    assert hybrid["mlp/cpu-gpu-tensor"] == {"tensor-split"}
    assert {"batch-split", "pipeline", "cpu-optimizer", "split-optimizer"} <= set().union(
        *(k for n, k in hybrid.items() if n.startswith("gpt/")))     # the transformer too
    assert all(plan_class(p) in ("gpu", "cpu+gpu") for p in plans.values())
    assert sum(st.get("offload_activations", False) for p in plans.values()
               for r in p["replicas"] for st in r["stages"]) == 3          # one plan per workload
    _check_valid(plans, layers, set(devices))


def test_gpu_transformer_plans_train_in_bf16():
    plans = gpu_transformer_plans(6, "cpu:0", "cuda:0")
    assert plans and all(plan_from_dict(p, n).precision == "bf16" and p["model"]["spec"] == "gpt"
                         for n, p in plans.items())
    others = plans_for(_topology(["cpu:0", "cuda:0"]), _layer_counts(GPU_WORKLOADS))
    assert {plan_from_dict(p, n).precision for n, p in others.items()
            if not n.startswith("gpt/")} == {"fp32"}


def test_size_classes_of_a_plan():
    plan = make_plan({"spec": "mlp", "args": {}, "batch": 32},
                     [(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])],
                     sync="fine")
    # replica batches 8 and 24 in 1 and 3 microbatches: the largest microbatch has 8 samples
    assert size_classes(plan, 0.015) == {"microbatch": "<=8", "iteration": "<20ms", "stages": "2+",
                                         "sync": "fine"}
    single = make_plan({"spec": "mlp", "args": {}, "batch": 512}, [(1.0, 4, [("cpu:0", (0, 4))])])
    assert size_classes(single, 0.5) == {"microbatch": ">=64", "iteration": ">100ms", "stages": "1"}


def test_cpu_plan_set_on_cpu_workers_only():
    pytest.importorskip("transformers")
    topo = _topology(["cpu:0", "cpu:1"])
    layers = _layer_counts(workloads_for(topo))
    plans = plans_for(topo, layers)
    assert len(plans) >= 30 and {plan_class(p) for p in plans.values()} == {"cpu"}
    workloads = {n.split("/")[0] for n in plans}
    assert len(workloads) >= 4 and {"llama", "resnet"} <= workloads      # models we did not write
    _check_valid(plans, layers, {"cpu:0", "cpu:1"})
    with pytest.raises(ValueError, match="two CPU workers"):
        plans_for(_topology(["cpu:0"]), layers)


def test_accuracy_reports_the_intervals_coverage_and_width():
    from benchmarks.accuracy import missed_targets, summarise
    rows = [{"plan": f"w/{i}", "workload": "w", "predicted_s": 0.1, "measured_s": m, "error_pct": 100 * (0.1 - m) / m,
             "lo_s": 0.095, "hi_s": 0.105} for i, m in enumerate([0.096, 0.1, 0.104, 0.11])]
    s = summarise(rows)
    assert s["coverage_pct"] == 75.0 and s["width_pct"] == pytest.approx(10.0)
    assert "coverage_pct" in missed_targets(s)                         # 75 % is under 80 %
    assert "coverage_pct" in missed_targets(summarise(rows[:3]))       # 100 %: wider than it need be
    most = rows[:3] * 6 + rows[3:]                                       # 18 of 19 inside: 94.7 %
    assert "coverage_pct" not in missed_targets(summarise(most))
