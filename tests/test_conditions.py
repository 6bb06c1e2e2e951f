"""A plan runs as it was priced: the plan file records each CPU worker's thread count (and the
profiled host and its cores), `run` without --topology uses them from any directory, and
`compare` says in one line when the measured run differs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _hetplan(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_a_plan_records_its_threads_and_runs_with_them_anywhere(tmp_path):
    topo = json.loads((ROOT / "hetplan/topologies/cpu-server-2socket.json").read_text())
    for d in topo["devices"]:
        d["threads"] = 2                                  # priced at two threads a worker
    topo["host"] = {"hostname": "elsewhere", "cores": 96}          # as `profile` writes it
    (tmp_path / "t.json").write_text(json.dumps(topo))
    r = _hetplan("plan", "--model", "mlp", "--model-arg", "hidden=16", "--model-arg", "depth=1", "--batch", "8",
                 "--topology", "t.json", "--iterations", "20", "-o", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-1500:]
    plan = json.loads((tmp_path / "p.json").read_text())
    cpus = [d for d in ("cpu:0", "cpu:1") if d in json.dumps(plan["replicas"])]
    assert plan["topology"]["threads"] == {d: 2 for d in cpus}
    assert plan["topology"]["host"] == "elsewhere" and plan["topology"]["cpu_cores"] == 96
    # no --topology, no profiles/ here: the recorded threads, not cores // workers (1 on 2 cores)
    r = _hetplan("run", "p.json", "--iters", "3", "--warmup", "1", "-o", "m.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-1500:]
    measured = json.loads((tmp_path / "m.json").read_text())
    assert {d: v["threads"] for d, v in measured["per_device"].items()} == {d: 2 for d in cpus}
    r = _hetplan("compare", "p.json", "m.json", "--topology", "t.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-1500:]
    notes = [l for l in r.stderr.splitlines() if "differs from the conditions" in l]
    assert len(notes) == 1 and "priced on elsewhere" in notes[0] and "threads" not in notes[0]
    for v in measured["per_device"].values():
        v["threads"] = 3
    (tmp_path / "m.json").write_text(json.dumps(measured))
    r = _hetplan("compare", "p.json", "m.json", "--topology", "t.json", cwd=tmp_path)
    assert f"{cpus[0]} ran 3 threads, priced at 2" in r.stderr


def test_a_bound_run_records_the_nodes_cores_not_its_own(tmp_path):
    # each worker binds itself to its core before the measured file is written: the file says
    # how many cores the node had (what `compare` checks against the plan's), not one
    import os
    plan = {"model": {"spec": "mlp", "args": {"hidden": 16, "depth": 1}}, "global_batch": 8,
            "replicas": [{"batch_fraction": 0.5, "stages": [{"device": f"cpu:{i}", "layers": [0, 2]}]}
                         for i in (0, 1)]}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    r = _hetplan("run", "p.json", "--iters", "3", "--warmup", "1", "-o", "m.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-1500:]
    assert json.loads((tmp_path / "m.json").read_text())["host"]["usable_cores"] == len(os.sched_getaffinity(0))
