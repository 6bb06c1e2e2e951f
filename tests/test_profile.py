"""`hetplan profile`: worker planning, the fit, assembly, and the real command end to end."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hetplan.planner.files.io import InputError
from hetplan.planner.hardware.calibration import calibration_from_dict
from hetplan.planner.hardware.topology import load_topology
from hetplan.runtime import profile
from hetplan.planner.hardware.fit import fit_latency_bandwidth
from hetplan.runtime.profile_bench import stats


def _hetplan(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


# --- pure parts -------------------------------------------------------------------------------
def test_plan_workers_splits_cores_and_keeps_one_per_gpu():
    specs = profile.plan_workers(4, cores=7, gpus=1)
    assert [(s.name, s.threads) for s in specs] == [
        ("cpu:0", 2), ("cpu:1", 2), ("cpu:2", 1), ("cpu:3", 1), ("cuda:0", 1)]
    assert [(s.name, s.threads) for s in profile.plan_workers(1, cores=2, gpus=0)] == [("cpu:0", 2)]


@pytest.mark.parametrize("n,cores,gpus", [(0, 2, 0), (-1, 2, 0), (3, 2, 0), (2, 2, 1)])
def test_plan_workers_rejects_what_does_not_fit(n, cores, gpus):
    with pytest.raises(InputError, match=rf"--cpu-workers: expected an integer from 1 to {max(1, cores - gpus)} "):
        profile.plan_workers(n, cores=cores, gpus=gpus)


def test_stats_median_and_relative_iqr():
    assert stats([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, (4.0 - 2.0) / 3.0)
    assert stats([2.0, 2.0, 2.0]) == (2.0, 0.0)


def test_trimmed_mean_prices_both_modes_of_a_bimodal_sample():
    from hetplan.runtime.profile_bench import trimmed_mean
    # a queued burst on bound workers: ~0.6 ms or ~3 ms; 11 fast and 9 slow draws, one outlier
    fast, slow = [0.6] * 11, [3.0] * 8 + [50.0]
    assert stats(fast + slow)[0] == 0.6                       # the median sees one mode
    assert trimmed_mean(fast + slow) == (9 * 0.6 + 7 * 3.0) / 16   # 2 cut each side: the outlier too
    assert trimmed_mean([1.0, 2.0, 3.0]) == 2.0               # fewer than 10 samples: nothing cut


def test_fit_recovers_latency_and_bandwidth_exactly():
    rows = [{"bytes": b, "s": 2e-5 + b / 3e9} for b in (4096, 65536, 1 << 20, 1 << 26)]
    latency_s, bandwidth = fit_latency_bandwidth(rows)
    assert latency_s == pytest.approx(2e-5, rel=1e-6)
    assert bandwidth == pytest.approx(3e9, rel=1e-6)


def test_fit_clamps_a_negative_intercept_to_the_smallest_time():
    rows = [{"bytes": 1000, "s": 1e-7}, {"bytes": 2000, "s": 1e-6}, {"bytes": 4000, "s": 3e-6}]
    latency_s, bandwidth = fit_latency_bandwidth(rows)
    assert latency_s == 1e-7 and bandwidth > 0


def test_assemble_takes_scalars_from_the_tables():
    workers = profile.plan_workers(2, cores=2, gpus=0)
    dev = lambda f: {"matmul_table": [{"n": 64, "flops_per_s": 1e9, "spread": 0.1},  # noqa: E731
                                      {"n": 1024, "flops_per_s": f, "spread": 0.2}],
                     "memory_copy": {"bytes": 1 << 26, "bytes_per_s": 5e9, "spread": 0.3},
                     "op_overhead": {"s": 3e-6, "spread": 0.05}}
    rows = [{"bytes": b, "s": 1e-4 + b / 2e9, "spread": 0.4} for b in (4096, 1 << 20)]
    results = [{"device": dev(4e10), "links": {"cpu:1": rows}, "allreduce": [{"bytes": 4096, "s": 1e-4, "spread": 0.6}]},
               {"device": dev(5e10), "links": {}, "allreduce": []}]
    t = profile.assemble(workers, results, profile.Settings.quick(), {"hostname": "h"}, ram_bytes=10_000)
    a, b = t.device("cpu:0"), t.device("cpu:1")
    assert (a.matmul_flops_per_s, b.matmul_flops_per_s) == (4e10, 5e10)
    assert (a.memory_bytes_per_s, a.op_overhead_s, a.memory_bytes, a.threads) == (5e9, 3e-6, 5000.0, 1)
    assert a.measured["measured_concurrently_with"] == ["cpu:1"]
    (link,) = t.links
    assert (link.a, link.b) == ("cpu:0", "cpu:1")
    assert link.latency_s == pytest.approx(1e-4) and link.bandwidth_bytes_per_s == pytest.approx(2e9)
    assert t.measured["host"] == {"hostname": "h"}
    assert profile.max_spread(t) == 0.6
    assert a.matmul_flops_per_s_by_precision is None                     # an older worker's result
    results[0]["device"]["matmul_flops_per_s_by_precision"] = {"fp32": 4e10, "tf32": 4e10, "bf16": 9e10}
    t = profile.assemble(workers, results, profile.Settings.quick(), {"hostname": "h"}, ram_bytes=10_000)
    assert t.device("cpu:0").matmul_flops_per_s_at("bf16") == 9e10
    assert "matmul_flops_per_s_by_precision" not in t.device("cpu:0").measured


def test_default_path_is_this_machines_in_the_cache(tmp_path, monkeypatch):
    from hetplan.commands.profile import default_path
    from hetplan.planner.hardware.machine import this_machine
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    assert default_path() == tmp_path / "profiles" / f"{this_machine()}.json"
    monkeypatch.delenv("HETPLAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_path() == tmp_path / "xdg" / "hetplan" / "profiles" / f"{this_machine()}.json"


def test_output_that_is_a_directory_exits_2(tmp_path):
    r = _hetplan("profile", "--quick", "-o", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"hetplan profile: error: {tmp_path}: -o: expected a file path, got a directory")


# --- the real command ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "x.json"
    r = _hetplan("profile", "--quick", "--cpu-workers", "2", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    return out, r


def test_quick_profile_writes_a_valid_measured_topology(quick_profile):
    out, r = quick_profile
    t = load_topology(out)
    summary = json.loads(r.stdout)
    assert summary["path"] == str(out) and summary["duration_s"] < 60
    cpus = [d for d in t.devices if d.kind == "cpu"]
    assert [d.name for d in cpus] == ["cpu:0", "cpu:1"]
    assert sum(d.threads for d in cpus) == max(2, profile.usable_cores() - torch.cuda.device_count())
    for d in cpus:
        table = d.measured["matmul_table"]
        assert [row["n"] for row in table] == [64, 256, 1024]
        assert all(row["best_flops_per_s"] >= row["flops_per_s"] > 1e8 and row["spread"] >= 0
                   for row in table)
        assert d.matmul_flops_per_s == table[-1]["flops_per_s"]
        assert d.memory_bytes_per_s > 1e8 and 0 < d.op_overhead_s < 1e-3 and d.memory_bytes > 1e8
        bf16 = d.measured["matmul_bf16_table"]   # measured for real; no TF32 on a CPU
        assert "matmul_tf32_table" not in d.measured
        # n=1024 is timed unless one call would exceed the cap (a CPU without native bf16)
        from hetplan.runtime.profile_worker import MAX_LOW_PRECISION_CALL_S
        skip = 2 * 1024 ** 3 / bf16[0]["flops_per_s"] > MAX_LOW_PRECISION_CALL_S   # per worker
        assert [row["n"] for row in bf16] == ([256] if skip else [256, 1024])
        assert d.matmul_flops_per_s_by_precision == {"fp32": d.matmul_flops_per_s, "tf32": d.matmul_flops_per_s,
                                                     "bf16": bf16[-1]["flops_per_s"]}
        assert bf16[-1]["flops_per_s"] > 1e8
    link = next(l for l in t.links if {l.a, l.b} == {"cpu:0", "cpu:1"})
    assert link.bandwidth_bytes_per_s > 1e6 and link.latency_s > 0
    assert [row["bytes"] for row in link.measured["p2p_table"]] == [4096, 65536, 1 << 20, 1 << 24, 1 << 26]
    assert len(t.measured["collectives"]["allreduce"]) == 5
    host = t.measured["host"]
    assert host["hostname"] == socket.gethostname() and host["quick"] is True
    assert host["cpu_bf16_native"] == profile._cpu_bf16_native()
    assert host["torch"] == torch.__version__ and host["cores"] >= 1 and host["cpu_model"]
    assert {"python", "profiled_at", "duration_s"} <= set(host)
    # the runtime's own work per schedule action (hetplan.runtime.profile_bench.action_overhead): a few
    # µs of Python per action, timed around the runtime's StageRunner
    cal = t.measured["calibration"]
    assert 0 < cal["action_overhead_s"] < 1e-3
    assert calibration_from_dict(cal).action_overhead_s == cal["action_overhead_s"]
    # and per iteration beside its actions (profile_bench.iteration_overhead: the runtime's loop
    # run for real; ~25 µs on the VM; noise may make it 0, never negative)
    assert 0 <= cal["iteration_overhead_s"] < 1e-3
    assert calibration_from_dict(cal).iteration_overhead_s == cal["iteration_overhead_s"]
    # a backward adding into existing gradients (hetplan.runtime.profile_bench.grad_accumulate): tens of
    # ps per parameter byte in cache (2.3e-11 on the VM); noise may make it 0, never negative
    assert 0 <= cal["grad_accumulate_s_per_byte"] < 1e-9
    # DDP's own work per forward and the per-byte gradient copy (hetplan.runtime.profile_bench.ddp_costs):
    # tens of µs; tens of ps per byte (6e-11 on the VM, loaded), never 0: a copy moves bytes
    assert 0 <= cal.get("ddp_forward_s", 0.0) < 1e-2 and 0 < cal["grad_copy_s_per_byte"] < 1e-8
    assert calibration_from_dict(cal).grad_copy_s_per_byte == cal["grad_copy_s_per_byte"]
    # an all-reduce right behind another (profile_bench.allreduce_queued): no more than ms
    assert 0 <= cal["allreduce_queued_s"] < 1e-2
    # ZeRO's all-gather (profile_bench.allgather_table): a curve over the all-reduce's sizes,
    # never slower for fewer bytes; the cost model prices gathers of CPU workers from it
    sizes, times = zip(*cal["allgather_curve"])
    assert list(sizes) == [r["bytes"] for r in cal_allreduce(quick_profile)] and list(times) == sorted(times)
    c = calibration_from_dict(cal)
    assert c.allgather_s(2, sizes[-1]) == pytest.approx(times[-1]) and c.allgather_s(1, sizes[-1]) == 0.0
    # issuing a message through the runtime's PeerLink (a group per direction): µs, not ms
    assert 0 < cal["send_issue_s"] < 1e-2 and 0 < cal["recv_post_s"] < 1e-2
    # a small stage's compute right after a gloo receive (profile_bench.cold_compute): tens of
    # µs on the VM; noise may make it 0 (absent from the file), never negative
    assert 0 <= cal.get("cold_compute_s", 0.0) < 5e-3
    # a send held while its sender computes (profile_bench.held_send): an expected hold per
    # window of compute, never more than the window, never less for a longer one
    from hetplan.runtime.profile_bench import HELD_WINDOWS_S
    windows, held = zip(*cal["held_send_curve"])
    assert windows == HELD_WINDOWS_S and all(0 <= h <= w for w, h in zip(windows, held))
    assert list(held) == sorted(held)
    # the reference step's rounds in three bursts across the profile (one round each, quick)
    assert [len(r["reference_ratios"]) for r in cal["raw"]["reference"]] == [3, 3]


def test_contention_is_the_mean_over_rounds_spread_across_the_profile():
    # two one-core workers on a VM slow each other or not for tens of seconds at a time: a
    # slowdown in one of three bursts counts for a third, where a median would drop it
    workers = [profile.WorkerSpec(f"cpu:{i}", "cpu", i, 1) for i in range(2)]
    results = [{"calibration": {"reference_alone_s": 1.0, "reference_together_s": 1.0,
                                "reference_ratios": [1.0, 1.0, 1.3]}} for _ in workers]
    assert profile.calibration(workers, results, [])["cpu_contention_factor"] == pytest.approx(1.1)


def cal_allreduce(quick_profile) -> list[dict]:
    path, _ = quick_profile
    return json.loads(path.read_text())["collectives"]["allreduce"]


def test_progress_goes_to_stderr(quick_profile):
    _, r = quick_profile
    assert "profile: 2 worker(s)" in r.stderr and "all-reduce over 2 workers" in r.stderr
    # rank 0's steps counted, k of the n it planned, each with the elapsed time and an ETA
    steps = [l for l in r.stderr.splitlines() if l.startswith("profile: [") and "/" in l.split("]")[0]]
    n = int(steps[0].split("/")[1].split("]")[0])
    assert [l.split("]")[0] for l in steps] == [f"profile: [{k}/{n}" for k in range(1, n + 1)]
    assert any(l.startswith(f"profile: [") and "] matmul n=1024 on 2 worker(s) at once (" in l for l in steps)
    assert any("] bf16 matmul n=256, 1024 (" in l for l in steps)
    assert all(" elapsed, ETA " in l for l in steps)


@pytest.mark.parametrize("flag,expected", [
    ("0", "--cpu-workers: expected an integer from 1 to"),
    ("100000", "--cpu-workers: expected an integer from 1 to"),
    ("two", "argument --cpu-workers: invalid int value"),
])
def test_bad_cpu_workers_exit_2_with_one_line(flag, expected, tmp_path):
    out = tmp_path / "x.json"
    r = _hetplan("profile", "--quick", "--cpu-workers", flag, "-o", str(out))
    assert r.returncode == 2
    assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_failing_worker_fails_the_profile_and_writes_nothing(tmp_path):
    out = tmp_path / "x.json"
    r = _hetplan("profile", "--quick", "--cpu-workers", "2", "-o", str(out),
                 env={profile.FAIL_ENV: "1"})
    assert r.returncode == 1
    assert "worker 1 (cpu:1) failed: RuntimeError: injected failure" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpus_are_profiled_with_host_copies(tmp_path):
    out = tmp_path / "g.json"
    r = _hetplan("profile", "--quick", "-o", str(out))
    assert r.returncode == 0, r.stderr
    t = load_topology(out)
    gpus = [d for d in t.devices if d.kind == "cuda"]
    assert len(gpus) == torch.cuda.device_count()
    for g in gpus:
        assert g.measured["host_copy_table"] and g.memory_bytes > 1e9
        assert any({l.a, l.b} == {"cpu:0", g.name} for l in t.links)


def test_a_busy_machine_gets_a_warning_and_a_quiet_one_none():
    from hetplan.runtime.host_load import busy_warning
    assert busy_warning(0.1) is None and busy_warning(None) is None
    assert "90% of the CPU" in busy_warning(0.9) and "profile a quiet one" in busy_warning(0.9)


def test_foreign_cpu_counts_other_processes_and_not_this_ones_children():
    # one second of spinning by a child of this process, then by an orphan (its shell exits, so
    # it is nobody's here): only the second is foreign; other load on the machine counts in both
    import subprocess
    import sys
    import time
    from hetplan.runtime.host_load import ForeignCPU
    spin = f"{sys.executable} -c 'import time\nt = time.time() + 1.0\nwhile time.time() < t: pass'"
    with ForeignCPU(period_s=0.05) as mine:
        subprocess.run(spin, shell=True, check=True)
    with ForeignCPU(period_s=0.05) as foreign:
        subprocess.run(f"({spin}) &", shell=True, check=True)
        time.sleep(1.2)
    assert foreign.fraction() - mine.fraction() > 0.25 / (os.cpu_count() or 1)


def test_low_precision_sweep_stops_where_one_call_would_take_too_long(tmp_path, monkeypatch):
    """A bf16 matmul on a CPU without native bf16 runs at ~1 GFLOP/s: the profile must not time
    the larger sizes (minutes each); the smaller size's rate stands for the device."""
    import torch.distributed as dist
    from dataclasses import replace
    from hetplan.planner.hardware.device import torch_device
    from hetplan.runtime import profile_worker
    settings = replace(profile_worker.Settings.quick(), cpu_low_precision_sizes=(32, 256),
                       repeats=1, min_time_s=0.001)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:   # the cap set both ways: a loaded machine's first tiny call must not decide the case
        monkeypatch.setattr(profile_worker, "MAX_LOW_PRECISION_CALL_S", 1e9)
        full = profile_worker._low_precision_matmuls(torch_device("cpu"), settings, 1e9)
        monkeypatch.setattr(profile_worker, "MAX_LOW_PRECISION_CALL_S", 1e-12)
        capped = profile_worker._low_precision_matmuls(torch_device("cpu"), settings, 1e9)
    finally:
        dist.destroy_process_group()
    assert [r["n"] for r in full["matmul_bf16_table"]] == [32, 256]
    assert [r["n"] for r in capped["matmul_bf16_table"]] == [32]
    assert capped["matmul_flops_per_s_by_precision"]["bf16"] == capped["matmul_bf16_table"][0]["flops_per_s"]
