"""The GPU session's call (benchmarks/gpu_session.py) in its smoke mode: the CPU standing in for
the GPU, every phase run, the same files written as on a GPU host."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.results import read_results

ROOT = Path(__file__).resolve().parent.parent


def test_the_smoke_session_runs_every_phase_and_writes_its_files(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=900)
    session = json.loads((tmp_path / "session.json").read_text())
    assert r.returncode == 0, (session, (tmp_path / "log.txt").read_text()[-3000:])
    assert [p["name"] for p in session["phases"]] == ["profile", "cuda_tests", "accuracy", "plan_quality", "capped"]
    assert all(p["status"] == "ok" for p in session["phases"])
    for name in ("log.txt", "profile.json", "accuracy.csv", "plan_quality.csv", "capped.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    results = read_results(tmp_path / "results.json")
    assert {"accuracy", "plan_quality", "capped"} <= set(results)
    capped = results["capped"]
    assert capped["predicted_peaks_bytes"]["zero-offload"] < capped["cap_bytes"] < capped["predicted_peaks_bytes"]["gpu-alone"]
    names = [p["name"] for p in capped["plans"]]
    assert names == ["zero-offload", "chosen", "cotrain", "offload", "recompute", "cpu-stage"]
    assert all("measured_s" in p for p in capped["plans"]), capped["plans"]


def test_the_memory_cap_is_read_and_applied_only_to_a_real_gpu(monkeypatch):
    import pytest
    from hetplan.planner.hardware.device import MEMORY_CAP_ENV, STANDIN_ENV, cap_fraction, memory_cap, torch_device
    monkeypatch.delenv(MEMORY_CAP_ENV, raising=False)
    assert memory_cap() is None
    monkeypatch.setenv(MEMORY_CAP_ENV, "20000000000")
    assert memory_cap() == 20_000_000_000
    assert cap_fraction(20 * 2**30, 140 * 2**30) == pytest.approx(1 / 7)
    assert cap_fraction(200 * 2**30, 140 * 2**30) == 1.0          # a cap above the card: all of it
    for bad in ("0", "-5", "20GB"):
        monkeypatch.setenv(MEMORY_CAP_ENV, bad)
        with pytest.raises(ValueError, match=MEMORY_CAP_ENV):
            memory_cap()
    monkeypatch.setenv(STANDIN_ENV, "1")
    assert torch_device("cuda:0").cap_memory(2**30) is None       # a stand-in: nothing to cap
