"""hetplan.planner.sim.fastloop: the compiled event loop gives hetplan.planner.sim.eventloop.run's times bit for bit,
on random graphs with what the rules single out (tasks holding several resources, pure joins,
zero-length tasks, wake-ups, ties), and in the simulator on random plans."""
from __future__ import annotations

import random

import numpy as np
import pytest

from hetplan.planner.sim import fastloop
from hetplan.planner.sim.eventloop import run as python_loop, shared_resources

pytestmark = pytest.mark.skipif(not fastloop.available(), reason="numba is not installed")


def random_graph(rng: random.Random, n: int, n_res: int):
    """A DAG (edges from lower to higher ids, some added out of order) over n tasks: most hold one
    resource, some several (all-reduces), some none (joins); durations with ties and zeros."""
    res, succ = [], [[] for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)                       # ids are not a topological order
    rank = {t: i for i, t in enumerate(order)}
    for t in range(n):
        kind = rng.random()
        if kind < 0.08:
            res.append(())
        elif kind < 0.2 and n_res > 1:
            res.append(tuple(sorted(rng.sample(range(n_res), rng.randint(2, min(4, n_res))))))
        else:
            res.append((rng.randrange(n_res),))
    for t in range(n):
        for _ in range(rng.randint(0, 3)):
            v = rng.randrange(n)
            if rank[v] > rank[t] and v not in succ[t]:
                succ[t].append(v)
    ndeps = [0] * n
    for vs in succ:
        for v in vs:
            ndeps[v] += 1
    dur = [rng.choice((0.0, 1.0, 2.0, 0.5, rng.random(), rng.random() * 3)) for _ in range(n)]
    wake = {t: rng.choice((0.25, 1e-3)) for t in range(n) if len(res[t]) == 1 and rng.random() < 0.3}
    return dur, res, [tuple(s) for s in succ], ndeps, wake


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_loop_gives_the_python_loops_times(seed):
    rng = random.Random(seed)
    n, n_res = rng.choice((5, 30, 200, 1500)), rng.choice((1, 3, 8, 40))
    dur, res, succ, ndeps, wake = random_graph(rng, n, n_res)
    shared = shared_resources(res)
    want = python_loop(dur, res, succ, list(ndeps), shared, n_res, wake)
    p = fastloop.prepare(res, succ, ndeps, shared, n_res, wake)
    start, end = fastloop.run(p, np.array(dur))
    assert start.tolist() == want[0] and end.tolist() == want[1]
    again = fastloop.run(p, np.array(dur))          # the prepared graph is not consumed
    assert again[1].tolist() == want[1]


def test_a_deadlock_is_reported_as_the_python_loop_reports_it():
    res, succ, ndeps = [(0,), (0,)], [(1,), (0,)], [1, 1]
    with pytest.raises(RuntimeError, match="deadlock"):
        python_loop([1.0, 1.0], res, succ, list(ndeps), (), 1)
    with pytest.raises(RuntimeError, match="deadlock"):
        fastloop.run(fastloop.prepare(res, succ, ndeps, (), 1), np.array([1.0, 1.0]))


def _results(g, topo, plans, delta: bool) -> list[str]:
    from hetplan.planner.sim.simulator import Simulator
    sim = Simulator(g, topo, cache_size=0, delta=delta)
    out = []
    for pl in plans:
        try:
            out.append(repr(sim.simulate(pl)))
        except ValueError as e:      # refused alike (no host CPU to offload to)
            out.append(str(e))
    return out


@pytest.mark.parametrize("delta", [True, False])
def test_the_simulator_gives_the_same_results_compiled_and_in_python(monkeypatch, delta):
    # every graph compiled (MIN_TASKS 0): whole graphs and delta simulation's replicas, on the
    # fixed-order pass's random plans (every schedule, sync, offload, tensor split) and edge cases
    from dataclasses import replace
    from pathlib import Path

    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.hardware.topology import load_topology
    from hetplan.planner.search.problem import make_space
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    from simreference import random_case, random_cpu_pipelines
    from test_bound import random_plans
    from test_listsched import CALIBRATION, EXAMPLES
    from hetplan.planner.hardware.calibration import calibration_to_dict

    g = capture_graph(load_workload("gpt", {"layers": 4}), 8)
    topo = load_topology(EXAMPLES / "cpu-server-2socket.json")
    topo = replace(topo, measured={**topo.measured, "calibration": calibration_to_dict(CALIBRATION)})
    space = make_space(topo, g.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    cases = [(g, topo, random_plans(space, random.Random(2), 60))]
    rng = random.Random(5)
    cases += [(c[0], c[1], [c[2]]) for c in (random_case(rng) for _ in range(40))]
    cases += [(c[0], c[1], [c[2]]) for c in (random_cpu_pipelines(rng) for _ in range(20))]
    monkeypatch.setattr(fastloop, "MIN_TASKS", 0)
    compiled = [_results(*c, delta) for c in cases]
    monkeypatch.setattr(fastloop, "_numba", False)     # fastloop.available() is False: Python
    assert [_results(*c, delta) for c in cases] == compiled


@pytest.mark.parametrize("seed", range(2))
def test_a_graphs_arrays_are_its_lists_flattened(seed):
    # TaskGraph.arrays, assembled from the stamped templates' arrays and the tasks and edges
    # added one by one, is what flattening its res and succ lists gives (the compiled loop's
    # input); on whole graphs and on graphs whose twin replicas are collapsed into one
    from hetplan.planner.sim.simulator import Simulator
    from simreference import random_case, random_twin_case
    rng = random.Random(seed)
    made = collapsed = 0

    def check(tg, pl):
        got = tg.arrays()
        if got is None:   # a block without arrays (a tensor-split stage): the lists are flattened
            assert any(st.split for rep in pl.replicas for st in rep.stages)
            return 0
        want = (*fastloop._csr(tg.res), *fastloop._csr(tg.succ))
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), pl
        return 1
    for _ in range(80):
        g, t, pl = random_case(rng) if rng.random() < 0.5 else random_twin_case(rng)
        sim = Simulator(g, t, cache_size=0, shape_cache_size=0)
        try:
            tg = sim._shape(pl, False)
        except ValueError:   # refused (no host CPU to offload to)
            continue
        made += check(tg, pl)
        like = sim._like(tg, sim._evaluate(pl, tg)) if tg.collapsible else None
        if like is not None and like != tuple(range(len(like))):
            collapsed += check(sim._shape(pl, False, like), pl)
    assert made >= 60 and collapsed >= 5, (made, collapsed)


def test_successors_made_when_asked_are_those_made_while_stamping():
    # a stamped block's successor tuples wait until asked for (TaskGraph.succ); a traced graph
    # makes them at once: the same lists, with the edges added since (all-reduces, steps, copies)
    # and tensor-split stages (blocks without arrays)
    from dataclasses import replace

    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.hardware.topology import load_topology
    from hetplan.planner.search.problem import make_space
    from hetplan.planner.sim.simulator import Simulator
    from hetplan.planner.sim.taskgraph import TaskGraph
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    from test_bound import random_plans
    from test_listsched import EXAMPLES

    g = capture_graph(load_workload("gpt", {"layers": 4}), 8)
    topo = load_topology(EXAMPLES / "dgx-2node-ib.json")
    space = make_space(topo, g.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    sim = Simulator(g, topo, cache_size=0, shape_cache_size=0)
    splits = 0
    for pl in random_plans(space, random.Random(3), 80):
        if pl.sync.mode != "sync":
            pl = replace(pl, sync=replace(pl.sync, mode="sync"))
        lazy, traced = TaskGraph(False), TaskGraph(True)
        try:
            sim._build(pl, lazy)
            sim._build(pl, traced)
        except ValueError:
            continue
        assert lazy.succ == traced.succ, pl
        splits += any(st.split for rep in pl.replicas for st in rep.stages)
    assert splits >= 1, splits
