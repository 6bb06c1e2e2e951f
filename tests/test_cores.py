"""Core binding (hetplan.planner.hardware.cores): the rule, the switch, and `hetplan run`'s workers
really bound (each worker's threads read back from the worker processes)."""
from __future__ import annotations

import json
import os

import pytest

from hetplan.planner.files.io import InputError
from hetplan.planner.hardware.cores import BIND_ENV, assign_cores, binding_enabled, bound_to_first, describe

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")


def test_assign_cores_gives_disjoint_sets_in_plan_order():
    threads = [("cpu:0", 2), ("cuda:0", 1), ("cpu:1", 3)]
    assert assign_cores(threads, [0, 1, 2, 3, 4, 5, 6]) == {
        "cpu:0": (0, 1), "cuda:0": (2,), "cpu:1": (3, 4, 5)}
    assert assign_cores(threads, [4, 5, 8, 9, 10, 11]) == {     # the usable cores, in order
        "cpu:0": (4, 5), "cuda:0": (8,), "cpu:1": (9, 10, 11)}
    assert assign_cores(threads, [0, 1, 2, 3, 4]) == {}           # 6 threads, 5 cores: no binding


def test_describe_says_what_was_bound_or_why_not():
    threads = [("cpu:0", 2), ("cpu:1", 2)]
    assert describe({"cpu:0": (0, 1), "cpu:1": (2, 3)}, threads, [0, 1, 2, 3], True) == \
        "cores bound: cpu:0 -> 0-1, cpu:1 -> 2-3"
    assert describe({}, threads, [0, 1, 2], True) == \
        "cores not bound: the workers' threads need 4 cores, this node has 3"
    assert describe({}, threads, [0, 1, 2, 3], False) == f"cores not bound ({BIND_ENV}=0)"


def test_the_switch_takes_0_or_1_and_refuses_the_rest():
    assert binding_enabled({}) is True
    assert binding_enabled({BIND_ENV: "1"}) is True
    assert binding_enabled({BIND_ENV: "0"}) is False
    with pytest.raises(InputError, match=f"{BIND_ENV}: expected 0 or 1, got 'yes'"):
        binding_enabled({BIND_ENV: "yes"})


def test_layer_timing_binding_is_restored(monkeypatch):
    before = os.sched_getaffinity(0)
    with bound_to_first(1) as cores:
        assert cores == (min(before),) and os.sched_getaffinity(0) == {min(before)}
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv(BIND_ENV, "0")
    with bound_to_first(1) as cores:
        assert cores is None and os.sched_getaffinity(0) == before


def _run(tmp_path, threads: dict[str, int]) -> dict:
    from hetplan.runtime.launch import launch
    from hetplan.runtime.worker import RunConfig
    from tests.test_runtime import plan
    p = plan([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p))
    cfg = RunConfig(plan=str(path), iters=2, warmup=1, threads=threads, timeout_s=30)
    return launch(cfg, ("cpu:0", "cpu:1"))["per_device"]


def test_run_binds_each_worker_and_all_its_threads_to_its_own_cores(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    per = _run(tmp_path, {"cpu:0": 1, "cpu:1": 1})
    # "affinity": the union of the cores every thread of the worker may use (gloo's too)
    assert per["cpu:0"]["cores"] == per["cpu:0"]["affinity"] == usable[:1]
    assert per["cpu:1"]["cores"] == per["cpu:1"]["affinity"] == usable[1:2]


def test_run_binds_nothing_when_the_threads_exceed_the_cores(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    per = _run(tmp_path, {"cpu:0": len(usable), "cpu:1": 1})
    for d in ("cpu:0", "cpu:1"):
        assert "cores" not in per[d] and per[d]["affinity"] == usable


def test_run_binds_nothing_when_switched_off(tmp_path, monkeypatch):
    usable = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(BIND_ENV, "0")
    per = _run(tmp_path, {"cpu:0": 1, "cpu:1": 1})
    for d in ("cpu:0", "cpu:1"):
        assert "cores" not in per[d] and per[d]["affinity"] == usable


def _kernel_takes_slices() -> bool:
    """Whether this kernel keeps a thread's own scheduler slice (Linux >= 6.12), asked in a
    child process (the test process keeps its own)."""
    import subprocess
    import sys
    probe = ("from hetplan.runtime.gloo_threads import SLICE_NS, short_slices, thread_slice_ns; "
             "short_slices(); print(thread_slice_ns() == SLICE_NS)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "True"


def test_run_gives_every_thread_of_every_worker_a_short_slice(tmp_path):
    # hetplan.runtime.gloo_threads: a gloo work thread woken by its peer's data runs within one short
    # slice instead of waiting out the compute thread's (fine data parallel's slow iterations)
    from hetplan.runtime.gloo_threads import SLICE_NS
    if not _kernel_takes_slices():
        pytest.skip("this kernel has no per-thread scheduler slice")
    per = _run(tmp_path, {"cpu:0": 1, "cpu:1": 1})
    for d in ("cpu:0", "cpu:1"):
        assert per[d]["slices_ns"] == [SLICE_NS]   # gloo's work and loop threads too
