"""A profile belongs to its machine: found in the user's cache by the machine's fingerprint, from any
directory; another machine's profile never stands in for this one's (hetplan.planner.hardware.machine,
lookup)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.files.plan import plan_from_dict
from hetplan.planner.hardware.lookup import default_profile_path, local_topology, measured_here
from hetplan.planner.hardware.machine import facts, fingerprint, this_machine
from hetplan.planner.hardware.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent


def profile_of(fp: str, workers: int = 2) -> dict:
    return {"schema": "hetplan.topology/1", "name": "here",
            "host": {"hostname": "vm", "fingerprint": fp, "cpu_model": "x", "cores": 2,
                     "machine": {"gpus": []}, "profiled_at": "2026-11-28T19:00:00+00:00"},
            "devices": [{"name": f"cpu:{i}", "kind": "cpu", "threads": 1, "memory_bytes": 8e9,
                         "matmul_flops_per_s": 5e10, "memory_bytes_per_s": 1e10, "op_overhead_s": 1e-5}
                        for i in range(workers)],
            "links": [{"a": "cpu:0", "b": "cpu:1", "bandwidth_bytes_per_s": 1e9, "latency_s": 5e-5}]}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


PLAN = {"model": {"spec": "mlp", "args": {"hidden": 32}}, "global_batch": 8,
        "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:1", "layers": [0, 5]}]}]}


def test_the_fingerprint_is_the_machines_facts():
    f = facts()
    assert set(f) == {"cpu_model", "cores", "memory_bytes", "gpus", "torch"}
    assert this_machine() == fingerprint(f) and len(this_machine()) == 16
    assert fingerprint({**f, "cores": f["cores"] + 1}) != this_machine()


def test_another_machines_profile_never_stands_in(cache):
    path = default_profile_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(profile_of("0123456789abcdef")))   # same hostname, other machine
    assert not measured_here(load_topology(path))
    assert local_topology(plan_from_dict(PLAN), None) is None
    path.write_text(json.dumps(profile_of(this_machine())))
    assert measured_here(load_topology(path))
    assert local_topology(plan_from_dict(PLAN), None).device("cpu:1").threads == 1


def _hetplan(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=600)


def test_profile_list_marks_this_machines(cache, tmp_path):
    (cache / "profiles").mkdir(parents=True)
    (cache / "profiles" / f"{this_machine()}.json").write_text(json.dumps(profile_of(this_machine())))
    (cache / "profiles" / "0123456789abcdef.json").write_text(json.dumps(profile_of("0123456789abcdef")))
    r = _hetplan("profile", "--list", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = {p["fingerprint"]: p["this_machine"] for p in json.loads(r.stdout)["profiles"]}
    assert got == {this_machine(): True, "0123456789abcdef": False}
    text = _hetplan("profile", "--list", cwd=tmp_path).stdout
    assert f"* {this_machine()}" in text and "  0123456789abcdef" in text


def test_plan_without_a_profile_is_one_line(cache, tmp_path):
    r = _hetplan("plan", "--model", "mlp", "--batch", "8", "-o", "p.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("hetplan plan: error: --topology: no profile of this machine in ")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_demo_reuses_this_machines_profile_from_any_directory(cache, tmp_path):
    (cache / "profiles").mkdir(parents=True)
    path = cache / "profiles" / f"{this_machine()}.json"
    path.write_text(json.dumps(profile_of(this_machine())))
    before = path.read_bytes()
    for where in (tmp_path / "a", tmp_path / "b" / "c"):
        where.mkdir(parents=True)
        r = _hetplan("demo", "--model", "mlp", "--model-arg", "hidden=32", "--batch", "16", "--iters", "3",
                     "--json", cwd=where)
        assert r.returncode == 0, r.stderr
        assert f"using the profile {path}" in r.stderr and "hetplan profile" not in r.stderr
        assert json.loads(r.stdout)["runs"]["plan"]["measured_s"] > 0
    assert path.read_bytes() == before
