"""Every engine (hetplan.planner.sim.engines) gives the reference loop's result bit for bit, or declines."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hetplan.planner.files.plan import ModelRef, validate_plan
from hetplan.planner.hardware.calibration import calibration_to_dict
from hetplan.planner.hardware.topology import load_topology
from hetplan.planner.search.problem import make_space
from hetplan.planner.sim import engines, fastloop, reference
from hetplan.planner.sim.engines import (DELTA, EVENT_LOOP, LINKED_PASS, PIPELINE_PASS, REFERENCE, TWINS, Compiled,
                                 FixedOrder)
from hetplan.planner.sim.eventloop import run as event_loop
from hetplan.planner.sim.simulator import Simulator
from simreference import random_case, random_cpu_pipelines, random_twin_case
from test_bound import random_plans
from test_listsched import CALIBRATION, EXAMPLES

# each engine under test, after what it needs listed (a replica engine runs inside delta
# simulation); the compiled loop and the fixed-order pass from the first task and the first run
UNDER_TEST = {
    "delta": [DELTA],
    "twins": [TWINS],
    "pipeline-pass": [DELTA, PIPELINE_PASS],
    "linked-pass": [DELTA, LINKED_PASS],
    "compiled": [Compiled("compiled")],
    "fixed-order": [FixedOrder("fixed-order", after=0)],
    "event-loop": [EVENT_LOOP],
}


def _modes(g, pl):
    """pl under each sync mode its shape allows (validated as a plan file would be)."""
    modes = [dict(mode="local-sgd", period=2), dict(mode="easgd", period=2, alpha=0.1), dict(mode="hogwild"),
             dict(mode="pipedream"), dict(mode="pipedream-2bw"), dict(mode="parameter-server", server="cpu:0")]
    out = []
    for m in modes:
        p = replace(pl, sync=replace(pl.sync, **m))
        try:
            validate_plan(p, "plan.json", g.num_layers, None)
        except Exception:   # not this shape (a local mode needs one-stage replicas, ...)
            continue
        out.append(p)
    return out


@pytest.fixture(scope="module")
def cases():
    """(graph, topology, plans): hand-drawn edge cases (zero-length tasks, shared links,
    all-reduces beside transfers, twins, held sends, wake-ups, every schedule, sync mode and
    optimizer placement), and search walks of gpt-4 with tensor splits on calibrated CPU workers
    and on GPUs."""
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    rng = random.Random(40)
    out = []
    for make, n in ((random_case, 30), (random_twin_case, 12), (random_cpu_pipelines, 12)):
        for _ in range(n):
            g, t, pl = make(rng)
            out.append((g, t, [pl, *_modes(g, pl)]))
    g = capture_graph(load_workload("gpt", {"layers": 4}), 8)
    for name in ("cpu-server-2socket", "dgx-2node-ib"):
        t = load_topology(EXAMPLES / f"{name}.json")
        t = replace(t, measured={**t.measured, "calibration": calibration_to_dict(CALIBRATION)})
        space = make_space(t, g.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
        out.append((g, t, random_plans(space, random.Random(name), 40)))
    return out


def _outcomes(g, t, plans, listed) -> list[tuple[str, str]]:
    """Each plan's (result repr or refusal, engine), each simulated twice (a graph run before)."""
    sim = Simulator(g, t, cache_size=0, engines=listed)
    out = []
    for pl in plans + plans:
        try:
            r = sim.simulate(pl)
            out.append((repr(r), r.engine))
        except ValueError as e:   # refused alike (no host CPU to offload to)
            out.append((str(e), ""))
    return out


@pytest.fixture(scope="module")
def specified(cases):
    return [[r for r, _ in _outcomes(g, t, plans, [REFERENCE])] for g, t, plans in cases]


@pytest.mark.parametrize("name", list(UNDER_TEST))
def test_each_engine_equals_the_reference_loop_or_declines(name, cases, specified, monkeypatch):
    monkeypatch.setattr(fastloop, "MIN_TASKS", 0)
    monkeypatch.setattr(engines, "COUPLING_COMPILED", 0)
    if name == "compiled" and not fastloop.available():
        pytest.skip("numba is not installed")
    listed = [*UNDER_TEST[name], REFERENCE]
    took = 0
    for (g, t, plans), want in zip(cases, specified):
        got = _outcomes(g, t, plans, listed)
        assert [r for r, _ in got] == want, name
        took += sum(name in e for _, e in got)
    assert took >= 10, (name, took)   # the engine did not always decline


def test_the_reference_loop_is_the_event_loop_on_random_graphs():
    # random graphs: single- and multi-resource tasks, joins, zero durations, wake-ups
    rng = random.Random(1)
    for _ in range(300):
        n, n_res = rng.randint(1, 40), rng.randint(2, 5)
        res = [tuple(sorted(rng.sample(range(n_res), rng.choice([0, 1, 1, 1, 2])))) for _ in range(n)]
        succ = [sorted(rng.sample(range(t + 1, n), min(n - t - 1, rng.randint(0, 2)))) for t in range(n)]
        ndeps = [0] * n
        for vs in succ:
            for v in vs:
                ndeps[v] += 1
        dur = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(n)]
        wake = {t: 0.25 for t in range(n) if rng.random() < 0.2}
        shared = tuple(sorted({x for r in res if len(r) > 1 for x in r}))
        assert reference.run(dur, res, succ, ndeps, n_res, wake) == event_loop(dur, res, succ, list(ndeps), shared,
                                                                                 n_res, wake)


def test_a_result_names_its_engine():
    g, t, pl = random_case(random.Random(3))
    assert Simulator(g, t, engines=[REFERENCE]).simulate(pl).engine == "reference"
    assert Simulator(g, t, delta=False, collapse=False, static_after=None).simulate(pl).engine == "event-loop"
