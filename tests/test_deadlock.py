"""hetplan.planner.sim.deadlock: a task graph that cannot finish is reported as the step x resource grid with
each resource's blocked task marked, by every engine and by the simulator (named), and `simulate`
shows the grid under its one error line."""
from __future__ import annotations

import numpy as np
import pytest

from hetplan.planner.files import schedule as schedules
from hetplan.planner.files.io import InputError
from hetplan.planner.sim import eventloop, fastloop, pipeline_pass, reference, template
from hetplan.planner.sim.deadlock import Deadlock
from hetplan.planner.sim.simulator import Simulator
from simhelpers import device, graph, layer, link, plan, topology

# A hand-made graph: cpu:0 runs F0, then B0, which waits for the gradient over the link; the
# link carries it after cpu:1's B0, which waits for F1 on cpu:1, which waits for cpu:0's F1:
# posted on cpu:0 after B0. A circle: B0 (cpu:0) -> grad hop -> B0 (cpu:1) -> F1 (cpu:1) -> F1 (cpu:0).
LABELS = ["F0 cpu:0", "B0 cpu:0", "F1 cpu:0", "act hop", "F1 cpu:1", "B0 cpu:1", "grad hop"]
RES = [(0,), (0,), (0,), (2,), (1,), (1,), (3,)]
SUCC = [(1, 3), (2,), (3,), (4,), (5,), (6,), (1,)]
LANES = ["cpu:0", "cpu:1", "cpu:0->cpu:1", "cpu:1->cpu:0"]
GRID = """\
simulator deadlock: 6 of 7 tasks never became ready; each resource's tasks in the order they started, [its first that never did] marked
step        cpu:0        cpu:1 cpu:0->cpu:1 cpu:1->cpu:0
   0     F0 cpu:0   [F1 cpu:1]    [act hop]   [grad hop]  <-- blocked
   1   [B0 cpu:0]                                         <-- blocked"""


def _ndeps():
    n = [0] * len(RES)
    for s in SUCC:
        for v in s:
            n[v] += 1
    return n


def test_the_reference_reports_the_grid_with_the_blocked_tasks_marked():
    with pytest.raises(Deadlock) as e:
        reference.run([1.0] * len(RES), RES, SUCC, _ndeps(), len(LANES))
    assert e.value.start == [0.0, None, None, None, None, None, None]
    assert str(e.value.named(LANES, LABELS)) == GRID
    assert str(e.value).splitlines()[1:3] == ["step   r0   r1   r2   r3",
                                              "   0   t0 [t4] [t3] [t6]  <-- blocked"]


def test_every_loop_reports_the_same_deadlock():
    want = str(pytest.raises(Deadlock, reference.run, [1.0] * 7, RES, SUCC, _ndeps(), 4).value)
    with pytest.raises(Deadlock) as e:
        eventloop.run([1.0] * 7, RES, SUCC, _ndeps(), (), 4)
    assert str(e.value) == want
    if fastloop.available():
        with pytest.raises(Deadlock) as e:
            fastloop.run(fastloop.prepare(RES, SUCC, _ndeps(), (), 4), np.ones(7))
        assert str(e.value) == want


@pytest.fixture
def backward_first(monkeypatch):
    """GPipe whose first stage runs its backwards before its forwards (a hand-written order that
    cannot run); the template's caches emptied before and after."""
    made = schedules.schedule_arrays

    def arrays(name, n, m, devices=None):
        offset, stage, kind, mb = (a.copy() for a in made(name, n, m, devices))
        a, b = offset[0], offset[1]
        stage[a:b], kind[a:b], mb[a:b] = stage[a:b][::-1], kind[a:b][::-1], mb[a:b][::-1]
        return offset, stage, kind, mb

    def rows(name, n, m, devices=None):
        out = schedules.make_schedule(name, n, m, devices)
        return [out[0][::-1]] + out[1:]

    def clear():
        for f in (template._skeleton, template.replica_core, template.replica_template, pipeline_pass.layout,
                  pipeline_pass.graph):
            f.cache_clear()
    clear()
    monkeypatch.setattr(template, "schedule_arrays", arrays)
    monkeypatch.setattr(template, "make_schedule", rows)
    yield
    monkeypatch.undo()
    clear()


def _case():
    g = graph([layer(i) for i in range(2)], batch=4, cut_bytes=[0, 1000, 1000])
    topo = topology([device("cpu:0"), device("cpu:1")], [link("cpu:0", "cpu:1", 1e9, 1e-5)])
    return g, topo, plan([(1.0, 2, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 4, schedule="gpipe")


@pytest.mark.parametrize("delta", [True, False])
def test_the_simulator_names_resources_and_tasks_in_the_grid(backward_first, delta):
    g, topo, pl = _case()
    with pytest.raises(Deadlock) as e:
        Simulator(g, topo, delta=delta).simulate(pl)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("simulator deadlock: ")
    assert lines[1].split()[:3] == ["step", "cpu:0", "cpu:1"]
    blocked = [ln for ln in lines if ln.endswith("<-- blocked")]
    assert blocked and "[" in blocked[0]
    assert "B1" in lines[2] and "[" in lines[2]    # cpu:0 blocked at once, on its first backward


def test_simulate_shows_the_grid_under_its_error_line(backward_first, tmp_path, monkeypatch):
    from hetplan.planner.sim import predict
    g, topo, pl = _case()
    monkeypatch.setattr("hetplan.planner.workload.capture.capture_graph", lambda *a, **k: g)
    monkeypatch.setattr("hetplan.planner.workload.load.load_plan_workload", lambda *a, **k: None)
    monkeypatch.setattr("hetplan.planner.workload.step_check.check_step", lambda *a, **k: None)
    monkeypatch.setattr("hetplan.planner.cost.timing.cost_model", lambda *a, **k: None)
    with pytest.raises(InputError) as e:
        predict.simulate_plan_file(pl, "plan.json", topo)
    assert str(e.value).startswith("plan.json: schedule: simulator deadlock: ") and "\n" not in str(e.value)
    assert "<-- blocked" in e.value.detail and e.value.detail.splitlines()[0].split()[:3] == ["step", "cpu:0", "cpu:1"]
