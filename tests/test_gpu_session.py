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
