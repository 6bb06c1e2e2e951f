"""hetplan.planner.sim.delta: delta simulation gives exactly the whole graph's results (repr of every
SimResult), is the path plans of independent replicas take, runs each distinct replica once,
and falls back where a replica could be delayed by something outside it."""
from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.planner.files.plan import ModelRef, Sync
from hetplan.planner.hardware.calibration import calibration_to_dict
from hetplan.planner.hardware.topology import load_topology
from hetplan.planner.search.mcmc import SearchConfig, Searcher, search
from hetplan.planner.search.problem import make_space, simulator_problem
from hetplan.planner.search.space import propose, to_plan
from hetplan.planner.sim import delta as delta_sim
from hetplan.planner.sim.pipeline_pass import PipelineRun
from hetplan.planner.sim.simulator import Simulator
from simhelpers import device, graph, layer, link, plan, topology
from simreference import random_case, random_twin_case
from test_bound import random_plans
from test_listsched import CALIBRATION

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from search import cluster_64, synthetic_graph  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "hetplan" / "topologies"


class Paths(Counter):
    """Plans simulated with delta simulation on that took it ("delta"), fell back on their
    times ("fallback") or did not apply ("whole"); replicas run alone ("replica runs"), by the
    pass ("pipeline passes"), by the pass over shared links ("linked runs"), together ("group
    runs")."""

    def __getitem__(self, k):
        if k == "whole":
            return super().__getitem__("sims") - super().__getitem__("delta") - super().__getitem__("fallback")
        return super().__getitem__(k)


@pytest.fixture
def paths(monkeypatch):
    counts = Paths()
    simulate, delta = Simulator.simulate, delta_sim.Delta.run
    runs = {cls: cls.run for cls in (delta_sim.Structure, delta_sim.GraphRun, PipelineRun, delta_sim.Linked)}   # loops, passes
    depth = [0]   # Linked's own GraphRun (where its pass declines) is not counted again

    def counted_sim(self, pl, trace=False):
        counts["sims"] += self._delta_on
        return simulate(self, pl, trace)

    def counted(self, values, runs):
        out = delta(self, values, runs)
        counts["fallback" if out is None else "delta"] += 1
        return out

    def replica(self, values):
        if not depth[0]:
            counts["replica runs"] += 1
            counts["pipeline passes"] += isinstance(self, PipelineRun)
            counts["linked runs"] += isinstance(self, delta_sim.Linked)
            members = self.by_pass.cores if isinstance(self, delta_sim.Linked) else getattr(self, "cores", ())
            counts["group runs"] += len(members) > 1   # replicas together
        depth[0] += 1
        try:
            return runs[type(self)](self, values)
        finally:
            depth[0] -= 1
    monkeypatch.setattr(Simulator, "simulate", counted_sim)
    monkeypatch.setattr(delta_sim.Delta, "run", counted)
    for cls in runs:
        monkeypatch.setattr(cls, "run", replica)
    return counts


def outcome(sim: Simulator, pl) -> str:
    try:
        return repr(sim.simulate(pl))
    except ValueError as e:   # refused alike (no host CPU to offload to)
        return str(e)


def same_results(g, topo, plans) -> None:
    """Every plan simulates to the same result (repr: every float bit for bit) with delta
    simulation and with the whole graph (the event loop alone, no collapsing of twins)."""
    delta = Simulator(g, topo, cache_size=0)
    whole = Simulator(g, topo, cache_size=0, delta=False, collapse=False, static_after=None)
    for pl in plans:
        assert outcome(delta, pl) == outcome(whole, pl), pl


def grid_plans(g, topo, space, rng: random.Random, steps: int) -> list:
    """Plans of several replicas: the search's grid shapes (pipelines x data parallel), each
    walked `steps` random proposals from, batches split by solve_batches."""
    searcher = Searcher(simulator_problem(Simulator(g, topo), space), rng)
    searcher.baselines()
    out = []
    for grid in searcher._grid:
        s = grid.strategy
        for _ in range(steps):
            s = propose(space, s, rng) or s
            try:
                out.append(to_plan(space, s, grid.batches if len(s.pipelines) == len(grid.batches)
                                   else searcher.solve_batches(s)))
            except ValueError:
                continue
    return out


@pytest.fixture(scope="module")
def gpt4():
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    return capture_graph(load_workload("gpt", {"layers": 4}), 8)


@pytest.mark.parametrize("name,calibrated", [("workstation-gtx1650", False), ("dgx-8gpu", False),
                                             ("dgx-8gpu", True), ("cpu-server-2socket", True),
                                             ("dgx-2node-ib", False)])
def test_delta_simulation_equals_the_whole_graph_on_random_plans(gpt4, name, calibrated, paths):
    # every schedule, data parallel x pipelines, fine and coarse sync, offloaded activations and
    # optimizers, tensor splits; calibrated workers add wake-ups, cold starts, contention
    topo = load_topology(EXAMPLES / f"{name}.json")
    if calibrated:
        topo = replace(topo, measured={**topo.measured, "calibration": calibration_to_dict(CALIBRATION)})
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    plans = random_plans(space, random.Random(1), 60) + grid_plans(gpt4, topo, space, random.Random(2), 8)
    plans += [replace(p, sync=replace(p.sync, granularity="coarse")) for p in plans[::3]]
    paths.clear()
    same_results(gpt4, topo, plans)
    assert paths["delta"] >= 2, paths   # most plans here are one replica, or share a CPU link


def test_delta_simulation_equals_the_whole_graph_where_the_gpus_timed_their_steps(gpt4, paths):
    # a split optimizer's device step in two parts, the host's part after the first
    from simhelpers import with_timed_steps
    topo = with_timed_steps(load_topology(EXAMPLES / "dgx-8gpu.json"))
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3)
    plans = random_plans(space, random.Random(4), 60) + grid_plans(gpt4, topo, space, random.Random(5), 8)
    plans += [replace(p, optimizer=replace(p.optimizer, placement="split", cpu_fraction=0.3)) for p in plans]
    paths.clear()
    same_results(gpt4, topo, plans)
    assert paths["delta"] >= 2, paths


def test_delta_simulation_equals_the_whole_graph_on_rails_grid_plans(paths):
    # pipelines x data parallel on 16 GPUs (2 nodes x 8, rails), walked from every grid shape:
    # every schedule the walk reaches, fine and coarse sync
    g, topo = synthetic_graph(24, 64), cluster_64(2)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    plans = grid_plans(g, topo, space, random.Random(5), 6)
    plans += [replace(p, sync=replace(p.sync, granularity="coarse")) for p in plans[::2]]
    paths.clear()
    same_results(g, topo, plans)
    assert paths["delta"] >= 20, paths


def test_delta_simulation_equals_the_whole_graph_on_edge_cases(paths):
    # zero FLOPs, zero cut bytes, zero latencies (zero-length tasks), routes over two hops,
    # replicas sharing links (run together), all-reduces sharing links with transfers, twins
    rng = random.Random(4)
    cases = [random_case(rng) for _ in range(150)] + [random_twin_case(rng) for _ in range(60)]
    for g, t, pl in cases:
        same_results(g, t, [pl])
    assert paths["delta"] >= 20 and paths["fallback"] + paths["whole"] >= 20 and paths["group runs"] >= 5, paths


def test_delta_simulation_equals_the_whole_graph_with_held_sends(paths):
    # CPU pipelines whose sends can be held (hetplan.planner.sim.template: hold tasks on the links)
    from simreference import random_cpu_pipelines
    rng = random.Random(6)
    for _ in range(60):
        g, t, pl = random_cpu_pipelines(rng)
        same_results(g, t, [pl])
    assert paths["delta"] >= 20, paths


def rails_search_plans(seed: int, iterations: int):
    """(graph, topology, the plans a short search on 16 GPUs (2 nodes x 8, rails) simulates,
    solve_batches' lone replicas included, in the order it simulates them)."""
    g, topo = synthetic_graph(48, 128), cluster_64(2)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    seen = []

    class Recording(Simulator):
        def simulate(self, pl, trace=False):
            seen.append(pl)
            return super().simulate(pl, trace)
    search(simulator_problem(Recording(g, topo), space), random.Random(seed), SearchConfig(iterations=iterations, chains=1))
    return g, topo, seen


def test_delta_simulation_equals_the_whole_graph_on_a_rails_search(paths):
    # the plans a short rails search simulates, in its order
    g, topo, seen = rails_search_plans(0, 60)
    paths.clear()
    same_results(g, topo, seen)
    assert paths["delta"] >= 10, paths


def test_replica_values_kept_across_plans_are_those_evaluated_afresh(monkeypatch):
    # Simulator._evaluate keeps a replica's block of values per microbatch size across plan
    # shapes: the plans of a short rails search (replicas coming back at other batches) give
    # every result bit for bit as with each recipe evaluated in its own graph (Builder.BLOCKS off)
    from hetplan.planner.sim.build import Builder
    g, topo, seen = rails_search_plans(1, 80)
    for pl in list(seen):   # the same shapes with the batch moved: the same replicas at other microbatches
        b = pl.replica_batches()
        if len(b) > 1 and b[0] > pl.replicas[0].microbatches:
            b[0], b[1] = b[0] - pl.replicas[0].microbatches, b[1] + pl.replicas[0].microbatches
            seen.append(replace(pl, replicas=tuple(replace(rep, batch_fraction=x / pl.global_batch)
                                                   for rep, x in zip(pl.replicas, b))))
    kept = Simulator(g, topo, cache_size=0)
    with_blocks = [outcome(kept, pl) for pl in seen]
    evaluated = sum(len(pl.replicas) for pl in seen)
    assert len(kept._block_values) < evaluated / 2, (len(kept._block_values), evaluated)   # most came back
    monkeypatch.setattr(Builder, "BLOCKS", False)
    afresh = Simulator(g, topo, cache_size=0)
    assert [outcome(afresh, pl) for pl in seen] == with_blocks


def _node_pipelines(microbatches=lambda r: 4):
    """Pipeline across 2 nodes x data parallel within a node on cluster_64(2): replica r holds
    GPU r of every node (rail r) with microbatches(r) microbatches."""
    reps = [(1 / 8, microbatches(r), [(f"node{n}/cuda:{r}", 12 * n, 12 * n + 12) for n in range(2)])
            for r in range(8)]
    return plan(reps, 64, granularity="fine", bucket_bytes=10**9, optimizer="adam")


def test_each_distinct_replica_runs_once_and_a_changed_one_alone(paths):
    # eight rail pipelines alike: one replica run serves all eight; a plan that changes one
    # replica's microbatches runs only that replica again (the others' times are kept)
    g, topo = synthetic_graph(24, 64), cluster_64(2)
    sim = Simulator(g, topo, cache_size=0)
    whole = Simulator(g, topo, cache_size=0, delta=False)
    first = _node_pipelines()
    assert repr(sim.simulate(first)) == repr(whole.simulate(first))
    assert paths["delta"] == 1 and paths["replica runs"] == 1, paths
    moved = _node_pipelines(lambda r: 2 if r == 3 else 4)
    assert repr(sim.simulate(moved)) == repr(whole.simulate(moved))
    assert paths["delta"] == 2 and paths["replica runs"] == 2, paths


def test_replicas_sharing_a_link_direction_run_together(paths):
    # a chain cuda:0 - cuda:1 - cuda:2 - cuda:3: two replicas' activations cross cuda:1 -> cuda:2
    # and queue there (no parameters: no all-reduce), so the two run as one group; a third on
    # cuda:4 - cuda:5 alone, by the pass
    g = graph([layer(i) for i in range(4)], batch=6, cut_bytes=[10**6] * 5)
    names = [f"cuda:{i}" for i in range(6)]
    chain = [link(a, b, 1e7) for a, b in zip(names[:4], names[1:4])] + [link("cuda:4", "cuda:5", 1e7)]
    t = topology([device(d) for d in names], chain)
    pl = plan([(1 / 3, 4, [("cuda:0", 0, 2), ("cuda:2", 2, 4)]), (1 / 3, 4, [("cuda:1", 0, 2), ("cuda:3", 2, 4)]),
               (1 / 3, 4, [("cuda:4", 0, 2), ("cuda:5", 2, 4)])], 12)
    same_results(g, t, [pl])
    assert paths["delta"] == 1 and paths["group runs"] == 1 and paths["pipeline passes"] == 1, paths
    assert paths["linked runs"] == 1, paths   # the two on their own devices: the pass over the shared link
    # without the third, every replica is in the one group: the whole graph
    paths.clear()
    same_results(g, t, [plan([(0.5, 4, [("cuda:0", 0, 2), ("cuda:2", 2, 4)]),
                              (0.5, 4, [("cuda:1", 0, 2), ("cuda:3", 2, 4)])], 8)])
    assert paths["whole"] == 1 and not paths["delta"], paths
    # the same pipelines over direct links: by the pass, once (the replicas are alike)
    paths.clear()
    t = topology([device(d) for d in names], [link(a, b, 1e7) for i, a in enumerate(names) for b in names[i + 1:]])
    same_results(g, t, [pl])
    assert paths["delta"] == 1 and paths["pipeline passes"] == 1 and not paths["group runs"], paths


def test_all_reduces_holding_a_saturated_hosts_compute_queues_take_the_whole_graph(paths):
    # gloo on saturated CPU workers: the all-reduce holds the workers' compute queues, which
    # their replicas' tasks use
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=2)
    devs = [replace(device(f"cpu:{i}", mem_bw=1e8), threads=1) for i in range(2)]
    t = replace(topology(devs, [link("cpu:0", "cpu:1", bw=1e6)]), measured={"host": {"cores": 2}})
    pl = plan([(0.5, 1, [("cpu:0", 0, 4)]), (0.5, 1, [("cpu:1", 0, 4)])], 2, bucket_bytes=10**6)
    same_results(g, t, [pl])
    assert paths["whole"] == 1 and not paths["delta"], paths


def test_a_host_step_that_wakes_up_takes_the_whole_graph(paths):
    # calibrated CPU workers: the GPU's step on cpu:0 follows the gradients' copy over the link,
    # so it wakes cpu:0's worker up (a wake-up that depends on when cpu:0 was last busy)
    g, t, pl = _host_optimizer_case(1e8)
    t = replace(t, measured={"calibration": calibration_to_dict(CALIBRATION)})
    same_results(g, t, [pl])
    assert paths["whole"] == 1 and not paths["delta"], paths


def _two_replicas_and_coupling(z_s: float):
    """Replica 0: P (1 s, resource 0) then Z (z_s, resource 0); replica 1: Q (1 s, resource 1).
    Coupling: A after Z and B after Q (1 s each, both on resource 2; A the lower id), C after A
    (5 s, resource 3). Values: [1, z_s, 5]."""
    from hetplan.planner.sim.taskgraph import TaskGraph
    g = TaskGraph(trace=False)
    g.begin_replica((0,), None)
    z = g.add(1, (0,), (g.add(0, (0,)),))
    g.end_replica()
    g.begin_replica((1,), None)
    q = g.add(0, (1,))
    g.end_replica()
    g.add(2, (3,), (g.add(0, (2,), (z,)),))
    g.add(0, (2,), (q,))
    return g, [1.0, z_s, 5.0]


def test_a_zero_length_task_before_the_coupling_takes_the_whole_graph():
    # the event loop ends Z (0 s at 1 s) a round after Q, so B starts at 1 s and A at 2 s, C
    # ends at 8 s; a release task would end in Q's round and A would go first (C at 7 s)
    from hetplan.planner.sim.eventloop import run as run_tasks
    g, values = _two_replicas_and_coupling(0.0)
    dur = [values[k] for k in g.dkey]
    assert max(run_tasks(dur, g.res, g.succ, list(g.ndeps), (), 4)[1]) == 8.0
    assert delta_sim.Delta.of(g, {}, 4, {}).run(values, {}) is None
    # Z taking 0.5 s: A is ready at 1.5 s while B runs (1 to 2 s), A runs 2 to 3 s, C ends
    # at 8 s, delta simulation agrees
    g, values = _two_replicas_and_coupling(0.5)
    dur = [values[k] for k in g.dkey]
    assert max(run_tasks(dur, g.res, g.succ, list(g.ndeps), (), 4)[1]) == 8.0
    assert delta_sim.Delta.of(g, {}, 4, {}).run(values, {}) == (8.0, "delta/event-loop/event-loop")


def test_a_step_ready_as_a_zero_length_task_ends_on_its_device_takes_the_whole_graph():
    # replica 0: P (1 s, resource 0), Z0 (0 s, resource 5), Z (0 s, resource 0), W (5 s,
    # resource 4) in a chain; replica 1: Q (1 s, resource 1); a step S after Q on resource 0.
    # At 1 s S takes resource 0 first (Z is ready a round later), so Z waits for it: W ends at
    # 7 s. Alone, replica 0's Z ends at 1 s, when S is ready: the release would not show the
    # round, delta simulation must give up (else it says 6 s).
    from hetplan.planner.sim.eventloop import run as run_tasks
    from hetplan.planner.sim.taskgraph import TaskGraph
    g = TaskGraph(trace=False)
    g.begin_replica((0,), None)
    z0 = g.add(1, (5,), (g.add(0, (0,)),))
    g.add(2, (4,), (g.add(1, (0,), (z0,)),))
    g.end_replica()
    g.begin_replica((1,), None)
    q = g.add(0, (1,))
    g.end_replica()
    g.add(0, (0,), (q,))
    values = [1.0, 0.0, 5.0]
    dur = [values[k] for k in g.dkey]
    assert max(run_tasks(dur, g.res, g.succ, list(g.ndeps), (), 6)[1]) == 7.0
    assert delta_sim.Delta.of(g, {}, 6, {}).run(values, {}) is None


def test_a_dependency_into_a_replica_keeps_the_graph_whole():
    # replica 1's task waits for a coupling task: replica 1 cannot run alone
    g, _ = _two_replicas_and_coupling(0.5)
    g.wire(len(g.dkey) - 1, 2)
    assert delta_sim.Delta.of(g, {}, 4, {}) is None


def _host_optimizer_case(gpu_flops: float):
    """A CPU replica and a GPU replica, no all-reduce (hogwild), optimizer on the host CPU:
    the GPU's step runs on cpu:0's queue once the GPU's backward is done."""
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=4)
    t = topology([device("cpu:0", flops=1e9), device("cuda:0", flops=gpu_flops)], [link("cpu:0", "cuda:0", 1e9)])
    pl = plan([(0.5, 2, [("cpu:0", 0, 4)]), (0.5, 2, [("cuda:0", 0, 4)])], 4, placement="cpu")
    return g, t, replace(pl, sync=Sync(mode="hogwild"))


def test_a_host_step_ready_before_the_hosts_replica_ends_takes_the_whole_graph(paths):
    # a fast GPU: its step is ready on cpu:0 while cpu:0's replica still computes, and in the
    # event loop it runs between two of that replica's tasks: delta simulation must give up
    g, t, pl = _host_optimizer_case(1e11)
    same_results(g, t, [pl])
    assert paths["fallback"] == 1 and not paths["delta"], paths
    # a slow GPU: the step is ready after cpu:0's last task, delta simulation holds
    g, t, pl = _host_optimizer_case(1e8)
    same_results(g, t, [pl])
    assert paths["delta"] == 1, paths


def _ring_over_a_pipeline_link(stage: int):
    """Replica 0: cuda:0 -> cuda:1; replica 1: cuda:2 -> cuda:3; fine sync. The ring of stage
    `stage`'s all-reduce crosses replica 0's link cuda:0 - cuda:1 both ways (stage 1's ring
    (cuda:1, cuda:3) by 1 -> 0 -> 3, stage 0's (cuda:0, cuda:2) by 0 -> 1 -> 2)."""
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=4, cut_bytes=[10**6] * 5)
    names = [f"cuda:{i}" for i in range(4)]
    via = ([("cuda:0", "cuda:3"), ("cuda:0", "cuda:2")] if stage == 1
           else [("cuda:1", "cuda:2"), ("cuda:1", "cuda:3")])
    pairs = [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")] + via
    t = topology([device(d) for d in names], [link(a, b, 1e7) for a, b in pairs])
    pl = plan([(0.5, 2, [("cuda:0", 0, 2), ("cuda:1", 2, 4)]),
               (0.5, 2, [("cuda:2", 0, 2), ("cuda:3", 2, 4)])], 4, bucket_bytes=10**6)
    return g, t, pl


def test_an_all_reduce_over_a_pipelines_link_splits_only_when_it_comes_after_the_pipelines_use(paths):
    # stage 1's buckets are all-reduced while its last gradients still cross 1 -> 0 to stage 0:
    # the ring would queue behind them, so the plan falls back on its times
    g, t, pl = _ring_over_a_pipeline_link(1)
    sim = Simulator(g, t, cache_size=0)
    assert sim.hops("cuda:1", "cuda:3")[0].resource == sim.hops("cuda:1", "cuda:0")[0].resource
    same_results(g, t, [pl])
    assert paths["fallback"] == 1 and not paths["delta"], paths
    # stage 0's are all-reduced after its last backward: replica 0 is done with the link
    paths.clear()
    g, t, pl = _ring_over_a_pipeline_link(0)
    sim = Simulator(g, t, cache_size=0)
    assert sim.hops("cuda:0", "cuda:2")[0].resource == sim.hops("cuda:0", "cuda:1")[0].resource
    same_results(g, t, [pl])
    assert paths["delta"] == 1, paths


@pytest.mark.skipif(not delta_sim.fastloop.available(), reason="numba is not installed")
def test_coupling_graphs_run_compiled_give_the_whole_graphs_results(paths, monkeypatch):
    # every coupling graph of two tasks or more through hetplan.planner.sim.fastloop (the search's
    # take it from engines.COUPLING_COMPILED tasks): the same results, rails grid plans and edge cases
    from hetplan.planner.sim import engines
    monkeypatch.setattr(engines, "COUPLING_COMPILED", 2)
    compiled = []
    run = delta_sim.Delta.run

    def counted(self, values, runs):
        out = run(self, values, runs)
        compiled.append(self.state.fast is not None)
        return out
    monkeypatch.setattr(delta_sim.Delta, "run", counted)
    g, topo = synthetic_graph(24, 64), cluster_64(2)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    same_results(g, topo, grid_plans(g, topo, space, random.Random(7), 4))
    rng = random.Random(8)
    for g, t, pl in [random_case(rng) for _ in range(80)]:
        same_results(g, t, [pl])
    assert sum(compiled) >= 30, sum(compiled)


def test_a_coupling_graph_run_again_takes_the_fixed_order_pass(paths, monkeypatch):
    # the same plan shapes with the batch moved between replicas (simulator_speed's small
    # case): after two runs the coupling graph takes hetplan.planner.sim.listsched's pass, the same
    # results as the whole graph's event loop
    from simulator_speed import plans as speed_plans, synthetic
    g, topo = synthetic(2, 2, 8)
    passes = []
    from hetplan.planner.sim.listsched import Static
    run = Static.run

    def counted(self, dur, wake):
        out = run(self, dur, wake)
        passes.append(out is not None)
        return out
    monkeypatch.setattr(Static, "run", counted)
    same_results(g, topo, speed_plans(2, 2, 8, 8, 40) + speed_plans(2, 2, 8, 2, 20))
    assert paths["delta"] == 60 and sum(passes) >= 40, (paths, sum(passes))
