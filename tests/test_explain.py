"""Where a predicted iteration goes (hetplan.planner.sim.explain, `hetplan explain`): the critical path's
segments, hand-computed, add up to the prediction."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.cost.model import RooflineCost
from hetplan.planner.sim.explain import Segment, binding, by_kind, critical_path, summary_lines
from hetplan.planner.sim.simulator import Simulator
from tests.simhelpers import device, graph, layer, link, plan, topology

ROOT = Path(__file__).resolve().parent.parent


def _task(kind, lane, start, end):
    return {"name": kind, "lane": lane, "kind": kind, "start_s": start, "end_s": end}


def test_a_single_device_runs_forward_then_backward():
    # two layers of 1 GFLOP forward, 2 GFLOP backward on a 1 GFLOP/s device: 2 s, then 4 s
    topo = topology([device("cuda:0")])
    g = graph([layer(0), layer(1)])
    r = Simulator(g, topo, RooflineCost(g, topo)).simulate(plan([(1.0, 1, [("cuda:0", 0, 2)])], 1), trace=True)
    path = critical_path(r.tasks, r.iteration_s)
    assert [(s.kind, s.device) for s in path] == [("forward", "cuda:0"), ("backward", "cuda:0")]
    assert [s.seconds for s in path] == pytest.approx([2.0, 4.0], rel=1e-9)
    assert sum(s.seconds for s in path) == pytest.approx(r.iteration_s, rel=1e-12)


def test_a_pipeline_path_crosses_its_link_and_adds_up():
    topo = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1e9, lat=0.25)])
    g = graph([layer(0), layer(1)], cut_bytes=[0, 5e8, 0])
    p = plan([(1.0, 2, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2, schedule="gpipe")
    r = Simulator(g, topo, RooflineCost(g, topo)).simulate(p, trace=True)
    path = critical_path(r.tasks, r.iteration_s)
    assert sum(s.seconds for s in path) == pytest.approx(r.iteration_s, rel=1e-12)
    assert "communication" in by_kind(path) and by_kind(path)["communication"] > 0
    assert binding(path)[0] in ("cuda:0", "cuda:1")


def test_gaps_are_waits_and_the_tail_is_fixed():
    tasks = [_task("forward", "a", 0.0, 1.0), _task("transfer", "a->b", 1.5, 2.0), _task("backward", "b", 2.0, 3.0),
             _task("forward", "b", 0.0, 0.5)]
    path = critical_path(tasks, 3.25)
    assert path == [Segment("forward", "a", 1.0), Segment("wait", "", 0.5), Segment("transfer", "a->b", 0.5),
                    Segment("backward", "b", 1.0), Segment("fixed", "", 0.25)]
    lines = summary_lines(path, 3.25, {"a": 1e6, "b": 2e6})
    assert lines[0].startswith("critical path: compute 62 %") and "least on a" in lines[2]


def test_explain_json_adds_up_to_the_prediction(tmp_path):
    topo = str(ROOT / "hetplan/topologies/dgx-8gpu.json")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "gpt", "--batch", "16", "--topology",
                        topo, "--iterations", "300", "-o", "p.json"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "critical path:" in r.stdout and "binds:" in r.stdout
    e = subprocess.run([sys.executable, "-m", "hetplan", "explain", "p.json", "--topology", topo, "--json"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert e.returncode == 0, e.stderr
    out = json.loads(e.stdout)
    predicted = json.loads((tmp_path / "p.json").read_text())["predicted"]["iteration_s"]
    assert sum(s["seconds"] for s in out["critical_path"]) == pytest.approx(predicted, rel=0.01)
    assert out["next_best"] and all(set(b) == {"name", "iteration_s", "loses_on"} for b in out["next_best"])
    assert set(out["memory_headroom_bytes"]) == set(out["per_device"])
