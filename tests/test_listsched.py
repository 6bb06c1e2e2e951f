"""hetplan.planner.sim.listsched: the fixed-order pass gives exactly the event loop's results, on random
plans of every space the search draws from, and it is the path those plans take."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.planner.files.plan import ModelRef
from hetplan.planner.hardware.calibration import Calibration, calibration_to_dict
from hetplan.planner.hardware.topology import load_topology
from hetplan.planner.search.problem import make_space
from hetplan.planner.sim import listsched
from hetplan.planner.sim.engines import run_graph
from hetplan.planner.sim.eventloop import run as run_tasks
from hetplan.planner.sim.simulator import Simulator
from simhelpers import device, graph, layer, link, plan, topology
from simreference import random_case, random_twin_case
from test_bound import SCHEDULES, random_plans

EXAMPLES = Path(__file__).resolve().parent.parent / "hetplan" / "topologies"
CALIBRATION = Calibration(cpu_workers=2, cpu_contention_factor=1.0, iteration_overhead_s=1e-3,
                          wake_latency_s=2e-4, cold_compute_s=1e-4, send_issue_s=3e-5, recv_post_s=2e-5,
                          held_send_curve=((2e-4, 1e-4), (1e-3, 3e-4), (4e-3, 8e-4)))


@pytest.fixture
def passes(monkeypatch):
    """Counts, per schedule, the plans whose times came from the fixed-order pass."""
    counts: Counter = Counter()
    run = listsched.Static.run

    def counted(self, dur, wake):
        out = run(self, dur, wake)
        counts[counted.schedule if out is not None else "event loop"] += 1
        return out
    monkeypatch.setattr(listsched.Static, "run", counted)
    counts.set = lambda s: setattr(counted, "schedule", s)
    return counts


def same_results(g, topo, plans, passes) -> None:
    """Every plan simulates to the same result (repr: every float bit for bit, or the same
    refusal) with the fixed-order pass and with the event loop alone."""
    fast = Simulator(g, topo, cache_size=0, static_after=0, delta=False)   # whole graphs (not hetplan.planner.sim.delta)
    loop = Simulator(g, topo, cache_size=0, static_after=None, delta=False)
    for pl in plans:
        passes.set(pl.schedule)
        out = []
        for sim in (fast, loop):
            try:
                out.append(repr(sim.simulate(pl)))
            except ValueError as e:   # refused alike (no host CPU to offload to)
                out.append(str(e))
        assert out[0] == out[1], pl


@pytest.fixture(scope="module")
def gpt4():
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    return capture_graph(load_workload("gpt", {"layers": 4}), 8)


@pytest.mark.parametrize("name,calibrated", [("workstation-gtx1650", False), ("workstation-gtx1650", True),
                                             ("cpu-server-2socket", True), ("dgx-2node-ib", False)])
def test_fixed_order_pass_equals_the_event_loop_on_random_plans(gpt4, name, calibrated, passes):
    # gpt-4 with tensor-split pairs: every schedule, data parallel x pipelines, fine and coarse
    # sync, offloaded activations and optimizers, split optimizers, tensor splits; calibrated
    # CPU workers add wake-ups, cold starts, message costs and the iteration overhead
    topo = load_topology(EXAMPLES / f"{name}.json")
    if calibrated:
        topo = replace(topo, measured={**topo.measured, "calibration": calibration_to_dict(CALIBRATION)})
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    plans = random_plans(space, random.Random(1), 120)
    plans += [replace(p, sync=replace(p.sync, granularity="coarse")) for p in plans[::3]]
    same_results(gpt4, topo, plans, passes)
    assert set(SCHEDULES) <= set(passes), passes   # the pass served every schedule
    assert passes["event loop"] < 0.2 * sum(passes.values()), passes


def test_fixed_order_pass_equals_the_event_loop_on_edge_cases(passes):
    # zero FLOPs, zero cut bytes, zero latencies (zero-length tasks), routes over two hops,
    # all-reduces sharing links with transfers, twin replicas (collapsed)
    rng = random.Random(4)
    for _ in range(150):
        g, t, pl = random_case(rng)
        same_results(g, t, [pl], passes)
    for _ in range(60):
        g, t, pl = random_twin_case(rng)
        same_results(g, t, [pl], passes)
    assert sum(passes.values()) - passes["event loop"] >= 50, passes   # the rest share links with all-reduces


def test_fixed_order_pass_equals_the_event_loop_with_held_sends(passes, monkeypatch):
    # CPU pipelines whose sends can be held (hetplan.planner.sim.template: hold tasks on the links),
    # none of them compiled (hetplan.planner.sim.fastloop)
    from hetplan.planner.sim import fastloop
    from simreference import random_cpu_pipelines
    monkeypatch.setattr(fastloop, "MIN_TASKS", 10**9)
    rng = random.Random(7)
    for _ in range(60):
        g, t, pl = random_cpu_pipelines(rng)
        same_results(g, t, [pl], passes)
    # a hold can be ready before an earlier message's hop on its link: such plans take the loop
    assert sum(passes.values()) - passes["event loop"] >= 10, passes


def test_a_link_carrying_two_routes_falls_back_where_the_order_flips():
    # a chain cuda:0 - cuda:1 - cuda:2 - cuda:3, two replicas: cuda:0 -> cuda:2 and cuda:1 ->
    # cuda:3 both cross cuda:1 -> cuda:2. Ids put all of replica 0's first; in time replica 1's
    # first activation comes before replica 0's last. The pass must see that and give the event
    # loop's times.
    g = graph([layer(i) for i in range(4)], batch=4, cut_bytes=[10**6] * 5)
    names = [f"cuda:{i}" for i in range(4)]
    t = topology([device(d) for d in names], [link(a, b, 1e7) for a, b in zip(names, names[1:])])
    pl = plan([(0.5, 4, [("cuda:0", 0, 2), ("cuda:2", 2, 4)]), (0.5, 4, [("cuda:1", 0, 2), ("cuda:3", 2, 4)])], 8)
    sim = Simulator(g, t, cache_size=0)
    shape = sim._shape(pl, False)
    values = sim._evaluate(pl, shape)
    dur = [values[k] for k in shape.dkey]
    static = listsched.Static.of(shape)
    assert static is not None and static.run(dur, {}) is None
    sim._wakes(shape)   # none here
    assert run_graph(shape, dur, sim.engines)[:2] == run_tasks(dur, shape.res, shape.succ, list(shape.ndeps),
                                                 shape.shared_res, len(sim.lanes))


def test_a_resource_shared_by_all_reduces_and_other_work_takes_the_event_loop():
    # gloo on saturated CPU workers: the all-reduce also holds the workers' compute queues
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=2)
    devs = [replace(device(f"cpu:{i}", mem_bw=1e8), threads=1) for i in range(2)]
    t = replace(topology(devs, [link("cpu:0", "cpu:1", bw=1e6)]), measured={"host": {"cores": 2}})
    pl = plan([(0.5, 1, [("cpu:0", 0, 4)]), (0.5, 1, [("cpu:1", 0, 4)])], 2, bucket_bytes=10**6)
    sim = Simulator(g, t)
    sim.simulate(pl)
    assert listsched.Static.of(sim._shape(pl, False)) is None


def test_a_shape_takes_the_pass_from_its_third_simulation(passes):
    # the first two simulations of a shape run the event loop (most shapes of a search are
    # simulated once or twice); the next ones, of any batch split, take the pass
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=8, cut_bytes=[10**6] * 5)
    names = [f"cuda:{i}" for i in range(4)]
    t = topology([device(d) for d in names], [link(a, b, 1e8, 1e-5) for i, a in enumerate(names) for b in names[i + 1:]])
    sim = Simulator(g, t, cache_size=0, delta=False)
    passes.set("1f1b")
    for f in (0.25, 0.75, 0.375, 0.625):   # replicas never alike (alike ones are collapsed: another graph)
        pl = plan([(f, 2, [("cuda:0", 0, 2), ("cuda:1", 2, 4)]), (1 - f, 2, [("cuda:2", 0, 2), ("cuda:3", 2, 4)])], 8,
                  bucket_bytes=10**6)
        assert repr(sim.simulate(pl)) == repr(Simulator(g, t, static_after=None).simulate(pl))
    assert passes == {"1f1b": 2}


def _zero_length_case(t1_after_zero_first: bool):
    """A (1 s on resource 0), then Z (0 s on resource 1) after A; T1 and T2 (1 s each) share
    resource 2, one after Z and one after A: both ready at 1 s, the one after Z a round later."""
    from hetplan.planner.sim.taskgraph import TaskGraph
    g = TaskGraph(trace=False)
    a = g.add(0, (0,))
    z = g.add(0, (1,), (a,))
    g.add(0, (2,), (z if t1_after_zero_first else a,))
    g.add(0, (2,), (a if t1_after_zero_first else z,))
    return g, [1.0, 0.0, 1.0, 1.0]


def test_a_zero_length_task_delays_what_it_releases_by_one_round():
    # the event loop starts the task released at 1 s by A before the one released by Z (a round
    # later at 1 s), whatever their ids: with the lower id after Z the pass must give up
    g, dur = _zero_length_case(t1_after_zero_first=True)
    loop = run_tasks(dur, g.res, g.succ, list(g.ndeps), (), 3)
    assert loop == ([0.0, 1.0, 2.0, 1.0], [1.0, 1.0, 3.0, 2.0])
    assert listsched.Static.of(g).run(dur, {}) is None
    g, dur = _zero_length_case(t1_after_zero_first=False)   # ids in that order: the pass applies
    loop = run_tasks(dur, g.res, g.succ, list(g.ndeps), (), 3)
    assert loop == ([0.0, 1.0, 1.0, 2.0], [1.0, 1.0, 2.0, 3.0])
    assert listsched.Static.of(g).run(dur, {}) == loop


def test_kept_duration_values_follow_each_plans_batches_and_unknown_kinds_are_always_evaluated():
    # values are kept per replica and microbatch size for recipes that name their replica; a
    # recipe of another kind (one wrapping another, say) is evaluated for every plan
    from dataclasses import dataclass
    from typing import Any
    from hetplan.planner.sim.taskgraph import Const

    @dataclass(frozen=True)
    class Wrapped:
        inner: Any

        def seconds(self, cost, graph_, mbs):
            return self.inner.seconds(cost, graph_, mbs)
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=8, cut_bytes=[10**6] * 5)
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", 1e8)])
    plans = [plan([(1.0, m, [("cuda:0", 0, 2), ("cuda:1", 2, 4)])], b) for b, m in ((8, 2), (16, 2), (8, 2))]
    sim = Simulator(g, t, cache_size=0)
    shape = sim._shape(plans[0], False)
    shape.recipes = [rc if isinstance(rc, Const) or i % 2 else Wrapped(rc) for i, rc in enumerate(shape.recipes)]
    assert any(isinstance(rc, Wrapped) for rc in shape.recipes)
    for p in plans:
        mbs = [b / r.microbatches for b, r in zip(p.replica_batches(), p.replicas)]
        assert sim._evaluate(p, shape) == [rc.seconds(sim.cost, g, mbs) for rc in shape.recipes]
