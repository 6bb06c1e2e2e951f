"""A host with a GPU, on any machine: `profile`, `plan`, `simulate` and `demo` with a CPU stand-in
for `cuda:0` (hetplan.planner.hardware.device), so every accelerator branch before the runtime runs in CI too:
layer timing on the accelerator (a copy of the model, its stages moved there), the profile's
host-copy and staging measurements, planning over CPU + GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hetplan.planner.hardware.machine import this_machine
from hetplan.cli import main as cli_main
from hetplan.planner.hardware.device import STANDIN_ENV, gpu_count, torch_device
from hetplan.planner.workload.partition import build_stages, place_stages
from hetplan.planner.workload.load import load_workload


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    """A quick measured profile of this machine with one stand-in GPU: (env, profile path)."""
    root = tmp_path_factory.mktemp("gpu-host")
    env = {**os.environ, STANDIN_ENV: "1", "HETPLAN_CACHE_DIR": str(root / "cache")}
    profile = root / "profiles" / "here.json"
    r = subprocess.run([sys.executable, "-m", "hetplan", "profile", "--quick", "--cpu-workers", "1",
                        "-o", str(profile)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return env, profile


def hetplan(env, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_profile_measures_the_gpu_and_its_host_copies(gpu_host):
    _, profile = gpu_host
    topo = json.loads(profile.read_text())
    gpu = next(d for d in topo["devices"] if d["name"] == "cuda:0")
    assert gpu["kind"] == "cuda" and "stand-in" in gpu["model"]
    for kind in ("pinned", "pageable"):
        for direction in ("h2d", "d2h"):
            assert gpu["host_copy"][kind][direction]["bytes_per_s"] > 0
    assert {(l["a"], l["b"]) for l in topo["links"]} == {("cpu:0", "cuda:0")}
    # the GPU times tf32 and the CPU worker does not (tf32 is fp32 there), their sweeps' rounds
    # shared all the same (a real GPU's profile hung here when each worker ran its own)
    cpu = next(d for d in topo["devices"] if d["name"] == "cpu:0")
    assert [r["n"] for r in gpu["matmul_tf32_table"]] and "matmul_tf32_table" not in cpu
    assert gpu["matmul_flops_per_s_by_precision"]["tf32"] == gpu["matmul_tf32_table"][-1]["flops_per_s"]


def test_the_gpus_optimizer_step_is_priced_from_its_own_timings(gpu_host):
    # a GPU's Adam step on a small model is its host's work and launches (H200: 0.28 ms measured
    # against 0.03 ms by memory traffic): the profile times it there, the cost model fits it
    from hetplan.planner.cost.model import CostModel, optimizer_s
    from hetplan.planner.hardware.fit import fit_optimizer
    from hetplan.planner.hardware.topology import load_topology
    _, profile = gpu_host
    topo = load_topology(profile)
    gpu = topo.device("cuda:0")
    rows = gpu.measured["optimizer_table"]["adam"]
    assert len(rows) == 6 and all(r["s"] > 0 for r in rows) and "sgd" in gpu.measured["optimizer_table"]
    fit = fit_optimizer(rows, fixed=True)
    from hetplan.planner.workload.capture import capture_graph
    cost = CostModel(capture_graph(load_workload("mlp", {"hidden": 32, "depth": 2}), 4), topo)
    step = cost.optimizer_s("cuda:0", 4e6, "adam", n_tensors=8)
    assert step == pytest.approx(fit.s_fixed + 8 * fit.s_per_tensor + 4e6 * fit.s_per_byte)
    assert step != optimizer_s(4e6, "adam", gpu)


def test_plan_and_simulate_measure_layers_on_the_gpu(gpu_host, tmp_path):
    env, profile = gpu_host
    gpt = ["--model", "gpt", "--model-arg", "layers=2", "--model-arg", "d_model=32"]
    out = tmp_path / "plan.json"
    r = hetplan(env, "plan", *gpt, "--batch", "8", "--topology", profile, "-o", out, "--json")
    assert r.returncode == 0, r.stderr
    assert "on cuda:0" in r.stderr                 # layer timing ran on the GPU
    assert json.loads(out.read_text())["predicted"]["iteration_s"] > 0
    # a hand-written CPU + GPU pipeline of the same model
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({
        "schema": "hetplan.plan/1", "model": {"spec": "gpt", "args": {"layers": 2, "d_model": 32}},
        "global_batch": 8, "schedule": "1f1b",
        "replicas": [{"batch_fraction": 1.0, "microbatches": 2,
                      "stages": [{"device": "cuda:0", "layers": [0, 2]},
                                 {"device": "cpu:0", "layers": [2, 4]}]}]}))
    r = hetplan(env, "simulate", hand, "--topology", profile, "--json")
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)
    assert sim["feasible"] and sim["iteration_s"] > 0
    assert sim["per_device"]["cuda:0"]["busy_s"] > 0 and sim["per_device"]["cpu:0"]["busy_s"] > 0


def test_demo_on_a_host_with_a_gpu(gpu_host, tmp_path, capsys, monkeypatch):
    env, profile = gpu_host
    for k in (STANDIN_ENV, "HETPLAN_CACHE_DIR"):
        monkeypatch.setenv(k, env[k])
    argv = ["demo", "--quick", "--model", "mlp", "--model-arg", "hidden=64", "--batch", "16",
            "--iters", "3", "--profile", str(profile), "--out", str(tmp_path / "demo"), "--json"]
    assert cli_main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    for r in got["runs"].values():
        assert r["measured_s"] > 0 and r["predicted_s"] > 0


def test_standin_devices(monkeypatch):
    monkeypatch.setenv(STANDIN_ENV, "2")
    assert gpu_count() == 2
    gpu, cpu = torch_device("cuda:1"), torch_device("node0/cpu:3")
    assert gpu.accelerator and not gpu.native and gpu.device.type == "cpu"
    assert not cpu.accelerator and cpu.device.type == "cpu"
    assert not gpu.host_buffer((2,), torch.float32).is_pinned()
    start, end = gpu.timing_event(), gpu.timing_event()
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0
    with pytest.raises(ValueError, match="only 2 stand-in"):
        torch_device("cuda:2")
    monkeypatch.setenv(STANDIN_ENV, "two")
    with pytest.raises(ValueError, match=STANDIN_ENV):
        gpu_count()


def test_place_stages_moves_parameters_and_factory_ops():
    # the gpt's positions come from arange(..., device=<traced device>): a stage moved to another
    # device must create them there (meta stands in for a GPU: it runs shapes, not numbers)
    w = load_workload("gpt", {"layers": 1, "d_model": 16, "heads": 2, "vocab": 32, "context": 8})
    stage = build_stages(w, [(0, 1), (1, 3)], 4)[0]
    traced = [n.kwargs["device"] for n in stage.graph.nodes if "device" in n.kwargs]
    assert traced == [torch.device("cpu")]
    place_stages([stage], "meta")
    assert [n.kwargs["device"] for n in stage.graph.nodes if "device" in n.kwargs] == [torch.device("meta")]
    assert all(p.device.type == "meta" for p in stage.parameters())
    x, _ = w.make_batch(4, 0)
    out = stage(x.to("meta"))
    assert all(t.device.type == "meta" for t in out)


@pytest.mark.parametrize("name", ["cuda:0", "cpu:0"])
def test_an_accelerators_layers_are_scaled_to_their_chained_step(name, tmp_path, monkeypatch):
    # on a GPU each layer timed on its own pays its launches and a synchronization, which a
    # stage's chained step overlaps with the device's work (H200, mlp at batch 512: backward
    # 1.62 ms predicted by the layers alone, 0.62 ms measured): the layers keep their shares of
    # the chained step's forward and backward; a CPU's layers stay as timed
    import socket
    from hetplan.planner.cost import timing
    from hetplan.planner.hardware.topology import Device, Topology
    from hetplan.planner.workload.capture import capture_graph
    monkeypatch.setenv(STANDIN_ENV, "1")
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_chained_once", lambda *a, **k: (0.25, 0.5))
    w = load_workload("mlp", {"hidden": 32, "depth": 2})
    g = capture_graph(w, 4)
    topo = Topology("h", (Device(name, name[:-2], 1e9, 1e10, 1e9, 0.0, 1),), (),
                    {"host": {"hostname": socket.gethostname(), "fingerprint": this_machine()}})
    f, b = timing.MeasuredCost(g, topo, w, repeats=1).layer_times(topo.device(name), 4)
    if name == "cuda:0":
        assert sum(f) == pytest.approx(0.25) and sum(b) == pytest.approx(0.5)
    else:
        assert sum(f) < 0.05 and sum(b) < 0.05
