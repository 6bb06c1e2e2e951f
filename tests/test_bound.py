"""hetplan.planner.sim.bound (a lower bound on the simulated iteration) and the search's early rejection
with it (hetplan.planner.search.mcmc): the bound never exceeds the simulation, and the walk with early
rejection takes exactly the decisions of the walk that simulates every proposal."""
from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.planner.files.plan import ModelRef, plan_key
from hetplan.planner.hardware.topology import load_topology
from hetplan.planner.search.mcmc import SearchConfig, Searcher
from hetplan.planner.search.problem import make_space, simulator_problem
from hetplan.planner.search.space import Strategy, Pipeline, fits, min_batch, propose, to_plan
from hetplan.planner.sim.simulator import Simulator
from simhelpers import device, graph, layer, link, plan, topology

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from search import cluster_64, synthetic_graph  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "hetplan" / "topologies"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "hippie", "interleaved-1f1b")


# --- hand-computed cases ----------------------------------------------------------------------------
def test_a_balanced_1f1b_pipeline_is_bounded_exactly():
    # 4 layers of F = 1 s, B = 2 s at 1 sample (1e9 / 2e9 FLOPs on 1e9 FLOP/s), two stages of two
    # layers on free links, 4 microbatches of 1 sample, no parameters (no step):
    # stage 1: head F0 = 2 s, its work 4 x (2 + 4) = 24 s, then stage 0's last backward 4 s:
    # 30 s = (m + p - 1)(F + B) of a stage, which the simulator also gives.
    g = graph([layer(i) for i in range(4)], batch=1)
    topo = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1")])
    pl = plan([(1.0, 4, [("cuda:0", 0, 2), ("cuda:1", 2, 4)])], 4)
    sim = Simulator(g, topo)
    assert sim.simulate(pl).iteration_s == pytest.approx(30.0)
    assert sim.lower_bound_s(pl) == pytest.approx(30.0, rel=1e-8) and sim.lower_bound_s(pl) <= 30.0


def test_an_all_reduce_behind_the_last_backward_is_counted():
    # Two data-parallel one-stage replicas (1 layer: F = 1 s, B = 2 s per sample, 2 samples each,
    # one microbatch), 1e9 B of gradients over a 1e9 B/s link: the ring all-reduce takes
    # 2 (k - 1) / k x 1e9 / 1e9 = 1 s after both backwards (coarse: after all compute, at 6 s),
    # then SGD steps 3 x 1e9 B at 1e12 B/s = 3 ms: 6 + 1 + 0.003 = 7.003 s, which the link's
    # all-reduce term of the bound finds (the devices' work alone gives 6.003 s).
    g = graph([layer(0, param_bytes=10**9)], batch=1)
    topo = topology([device("cuda:0", mem_bw=1e12), device("cuda:1", mem_bw=1e12)],
                    [link("cuda:0", "cuda:1", bw=1e9)])
    pl = plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 4, granularity="coarse")
    sim = Simulator(g, topo)
    assert sim.simulate(pl).iteration_s == pytest.approx(7.003)
    assert sim.lower_bound_s(pl) == pytest.approx(7.003, rel=1e-8)


def test_no_bound_where_none_is_proven():
    g = graph([layer(i) for i in range(2)], batch=1)
    topo = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1")])
    pl = plan([(1.0, 2, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2)
    sim = Simulator(g, topo)
    assert sim.lower_bound_s(replace(pl, sync=replace(pl.sync, mode="pipedream"))) is None
    apart = topology([device("cuda:0"), device("cuda:1"), device("cuda:2")], [link("cuda:0", "cuda:1")])
    assert Simulator(g, apart).lower_bound_s(pl) is None   # cuda:2 unreachable: the simulator may refuse


# --- the bound never exceeds the simulation ----------------------------------------------------------
def random_plans(space, rng: random.Random, n: int, start: Strategy | None = None):
    """n plans of a random walk over `space` from `start` (default: the first device alone;
    every proposal taken), each with a random batch split and, in turn, each schedule where the
    structure allows it."""
    s = start or Strategy((Pipeline(space.devices[:1], ()),), precision=space.precisions[0])
    out, k = [], 0
    while len(out) < n and k < 50 * n:
        k += 1
        t = propose(space, s, rng)
        if t is None:
            continue
        s = t
        sched = replace(s, schedule=SCHEDULES[k % len(SCHEDULES)])
        s_try = sched if fits(space, sched) else s
        lows = [min_batch(p, s_try.schedule) for p in s_try.pipelines]
        if sum(lows) > space.global_batch:
            continue
        batches = list(lows)
        for _ in range(space.global_batch - sum(lows)):
            batches[rng.randrange(len(batches))] += 1
        try:
            out.append(to_plan(space, s_try, batches))
        except ValueError:   # no microbatch count divides a replica's batch
            continue
    return out


def check_bounds(sim, plans, tight_median: float) -> dict[str, int]:
    ratios, schedules = [], {}
    for pl in plans:
        try:
            lb = sim.lower_bound_s(pl)
            t = sim.simulate(pl).iteration_s
        except ValueError:   # the simulator refuses it (no host CPU to offload to)
            continue
        if lb is None or not math.isfinite(t):
            continue
        assert lb <= t, (lb, t, pl)
        ratios.append(lb / t)
        schedules[pl.schedule] = schedules.get(pl.schedule, 0) + 1
    assert statistics.median(ratios) >= tight_median, statistics.median(ratios)
    return schedules


def test_a_bound_past_its_limit_stops_short_above_it(gpt4):
    # lower_bound_s(plan, above): the full bound where it stays at or below `above`, else a
    # bound above `above` and at most the full one (the replicas' terms alone, all-reduces unpriced)
    topo = load_topology(EXAMPLES / "dgx-2node-ib.json")
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3)
    sim = Simulator(gpt4, topo)
    short = 0
    for pl in random_plans(space, random.Random(3), 120):
        try:
            full = sim.lower_bound_s(pl)
        except ValueError:
            continue
        if full is None:
            continue
        assert sim.lower_bound_s(pl, math.inf) == full
        for above in (0.0, 0.5 * full, full * (1 - 1e-6), full, 2 * full):
            lb = sim.lower_bound_s(pl, above)
            assert lb <= full and (lb == full or lb > above), (above, lb, full)
            if above >= full:
                assert lb == full
            short += lb < full
    assert short > 20   # the all-reduces' terms do decide some bounds


@pytest.fixture(scope="module")
def gpt4():
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    return capture_graph(load_workload("gpt", {"layers": 4}), 8)


@pytest.mark.parametrize("name", ["workstation-gtx1650", "cpu-server-2socket", "dgx-2node-ib"])
def test_bound_below_the_simulation_on_random_plans(gpt4, name):
    # gpt-4 (tensor-split pairs) on the examples: CPU + GPU (offload, optimizer on the host,
    # split optimizer), two CPU sockets, two 8-GPU nodes; every schedule and tensor splits
    topo = load_topology(EXAMPLES / f"{name}.json")
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    plans = random_plans(space, random.Random(1), 150)
    schedules = check_bounds(Simulator(gpt4, topo), plans, 0.5)
    assert set(schedules) == set(SCHEDULES) or name != "dgx-2node-ib", schedules


@pytest.mark.parametrize("name", ["dgx-8gpu", "cpu-server-2socket"])
def test_bound_below_the_simulation_on_random_sharded_plans(gpt4, name):
    # ZeRO 1-3 drawn by the walk (as where replicated data parallel does not fit): the bound
    # prices each replica's compute and its 1/N step; reduce-scatters and gathers only add
    topo = load_topology(EXAMPLES / f"{name}.json")
    space = replace(make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3), shard_choices=(0, 1, 2, 3))
    kind = space.kinds[space.devices[-1]]
    same = [d for d in space.devices if space.kinds[d] == kind][:4]   # a shard group of one kind
    plans = []
    for k in (1, 2, 3):       # walks from data parallel sharded at each stage
        start = Strategy(tuple(Pipeline((d,), ()) for d in same), precision=space.precisions[0], shard=k)
        plans.append(to_plan(space, start, [32 // len(same)] * len(same)))
        plans += [p for p in random_plans(space, random.Random(k), 60, start) if p.shard]
    assert {p.shard for p in plans} == {1, 2, 3}
    check_bounds(Simulator(gpt4, topo), plans, 0.3)


def test_bound_below_the_simulation_where_the_gpus_timed_their_steps(gpt4):
    # a split optimizer's host part starts after the device's launches (Builder.optimizer_steps)
    from simhelpers import with_timed_steps
    topo = with_timed_steps(load_topology(EXAMPLES / "workstation-gtx1650.json"))
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    check_bounds(Simulator(gpt4, topo), random_plans(space, random.Random(3), 150), 0.5)


def test_bound_below_the_simulation_with_calibrated_cpu_workers():
    # a calibrated host (message issue, wake-up, cold start, iteration overhead, held sends)
    # whose contention is 1: the bound counts the messages and the overhead, and stays below
    from hetplan.planner.hardware.calibration import calibration_to_dict, Calibration
    g = synthetic_graph(8, 16, d_model=256, seq=64)
    cal = Calibration(cpu_workers=2, cpu_contention_factor=1.0, iteration_overhead_s=1e-3, wake_latency_s=2e-4,
                      cold_compute_s=1e-4, send_issue_s=3e-5, recv_post_s=2e-5,
                      held_send_curve=((2e-4, 1e-4), (1e-3, 3e-4), (4e-3, 8e-4)))
    topo = replace(topology([device("cpu:0", flops=1e11, mem_bw=1e10), device("cpu:1", flops=1e11, mem_bw=1e10)],
                            [link("cpu:0", "cpu:1", bw=1e10, lat=1e-5)]),
                   measured={"calibration": calibration_to_dict(cal)})
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "sgd", 1e-3)
    check_bounds(Simulator(g, topo), random_plans(space, random.Random(2), 120), 0.5)


def test_bound_below_the_simulation_on_the_64_gpu_cluster():
    g = synthetic_graph(96, 256)
    topo = cluster_64(8)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    sim = Simulator(g, topo)
    searcher = Searcher(simulator_problem(sim, space), random.Random(0))
    searcher.baselines()   # the grids: pipelines x data parallel, as the search starts from
    rng, plans = random.Random(3), []
    for grid in searcher._grid[:6]:
        s = grid.strategy
        for _ in range(6):
            t = propose(space, s, rng)
            s = t if t is not None else s
            try:
                plans.append(to_plan(space, s, grid.batches if len(s.pipelines) == len(grid.batches)
                                     else searcher.solve_batches(s)))
            except ValueError:
                continue
    check_bounds(sim, plans, 0.8)


# --- the walk with early rejection -------------------------------------------------------------------
def walk(problem, early: bool, iterations: int):
    s = Searcher(problem, random.Random(5), SearchConfig(iterations=iterations, time_limit_s=600,
                                                         patience=10**9, early_reject=early, chains=1))
    seen, propose_ = [], s._propose

    def recorded(cur, bar=math.inf):
        seen.append(plan_key(cur.plan))
        return propose_(cur, bar)
    s._propose = recorded
    return s.run(), seen


def test_early_rejection_walks_the_same_plans_with_fewer_simulations():
    g = synthetic_graph(24, 64)
    topo = cluster_64(2)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    on, seen_on = walk(simulator_problem(Simulator(g, topo), space), True, 150)
    off, seen_off = walk(simulator_problem(Simulator(g, topo), space), False, 150)
    assert seen_on == seen_off and len(seen_on) == 150
    assert plan_key(on.best.plan) == plan_key(off.best.plan) and on.best.iteration_s == off.best.iteration_s
    assert on.accepted == off.accepted and on.history[-1][1] == off.history[-1][1]
    assert plan_key(on.least_memory.plan) == plan_key(off.least_memory.plan)
    assert off.bound_rejections == 0 and on.bound_rejections > 10
    assert on.evaluations < off.evaluations
    assert on.stopped_by == off.stopped_by == "iterations" and on.acceptance_rate == off.acceptance_rate


def test_link_resources_are_numbered_before_any_route_is_asked():
    # the event loop serves resources in id order, so ids handed out at first use would make a
    # plan's result depend on which plans (or bounds) asked for routes before it
    topo = cluster_64(2)
    sim = Simulator(synthetic_graph(8, 16), topo)
    lanes = list(sim.lanes)
    assert len(lanes) == len(topo.devices) + 2 * len(topo.links)
    sim.hops("node1/cuda:7", "node0/cuda:3")
    sim.lower_bound_s(plan([(1.0, 2, [("node1/cuda:7", 0, 4), ("node0/cuda:3", 4, 8)])], 16))
    assert sim.lanes == lanes


def test_the_schedules_the_bound_relies_on_start_with_f0_and_end_with_the_last_backward():
    from hetplan.planner.sim.bound import HEAD_SCHEDULES
    from hetplan.planner.files.schedule import Action, make_schedule
    for name in HEAD_SCHEDULES:
        for p, m in ((2, 2), (3, 5), (4, 8)):
            for s, acts in enumerate(make_schedule(name, p, m)):
                assert acts[0] == Action(s, "F", 0)
                if name != "zb-h1":
                    assert acts[-1] == Action(s, "B", m - 1)


def test_zb_h1s_trailing_w_passes_are_those_of_its_schedule():
    """The bound counts per stage the W passes after its last I without building the schedule."""
    from hetplan.planner.sim.bound import trailing_w
    from hetplan.planner.files.schedule import make_schedule
    for p in range(1, 9):
        for m in range(p, 3 * p + 2):
            rows = make_schedule("zb-h1", p, m)
            last_i = [max(k for k, a in enumerate(acts) if a.kind == "I") for acts in rows]
            assert all(a.kind == "W" for acts, k in zip(rows, last_i) for a in acts[k + 1:])
            assert trailing_w(p, m) == tuple(len(acts) - k - 1 for acts, k in zip(rows, last_i))


def test_early_rejection_walks_the_same_plans_through_infeasible_ones():
    # a model that fits two 300 MB GPUs only as a two-stage pipeline: most proposals are over
    # memory, costed t (2 + over); the bound's exact peak memory prices them alike
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_search import two_gpus, uniform_graph
    g = uniform_graph(batch=8, param_bytes=4e7)
    topo = two_gpus(1.0, memory_bytes=3e8, bandwidth=1e10)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("toy"), "sgd", 0.1)
    on, seen_on = walk(simulator_problem(Simulator(g, topo), space), True, 200)
    off, seen_off = walk(simulator_problem(Simulator(g, topo), space), False, 200)
    assert seen_on == seen_off and plan_key(on.best.plan) == plan_key(off.best.plan)
    assert plan_key(on.least_memory.plan) == plan_key(off.least_memory.plan)
    assert on.bound_rejections > 0 and on.evaluations < off.evaluations
    assert any(not c.feasible for c in on.baselines)


def test_cached_buckets_are_those_of_each_plan_sync_and_layout():
    # Simulator.exchanged keys its cache by sync and layer layout: plans sharing a layout but not
    # a bucket cap or a granularity get their own buckets, and every simulation and bound of a
    # walk's plans equals a fresh simulator's (which has seen no other plan)
    from hetplan.planner.cost.buckets import exchanged_buckets
    g = synthetic_graph(24, 64)
    topo = cluster_64(2)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    warm = Simulator(g, topo)
    plans = random_plans(space, random.Random(7), 40)
    for pl in plans:
        for sync in (pl.sync, replace(pl.sync, granularity="coarse"), replace(pl.sync, bucket_bytes=2**30)):
            p = replace(pl, sync=sync)
            assert warm.exchanged(p) == exchanged_buckets(p, g)
            fresh = Simulator(g, topo)
            assert outcome(warm.lower_bound_s, p) == outcome(fresh.lower_bound_s, p)
            assert outcome(warm.simulate, p) == outcome(fresh.simulate, p)


def outcome(f, *args):
    """f(*args), or "refused" where it raises ValueError (no host CPU for an offloaded optimizer)."""
    try:
        return f(*args)
    except ValueError:
        return "refused"


@pytest.mark.parametrize("name", ["workstation-gtx1650", "dgx-2node-ib"])
def test_results_and_bounds_do_not_depend_on_what_the_simulator_saw_before(gpt4, name):
    # the simulator keeps replicas' values (Builder.replica_values) and bound terms
    # (_Bound.replica) across plans: a plan's result is that of a fresh simulator
    topo = load_topology(EXAMPLES / f"{name}.json")
    space = make_space(topo, gpt4.num_layers, 32, ModelRef("gpt"), "adam", 1e-3, tensor_split=True)
    plans = random_plans(space, random.Random(2), 40)
    plans += [replace(pl, sync=replace(pl.sync, granularity="coarse" if pl.sync.granularity == "fine" else "fine"))
              for pl in plans]
    plans += [replace(pl, optimizer=replace(pl.optimizer, placement="cpu", cpu_fraction=None)) for pl in plans[:40]]
    shared = Simulator(gpt4, topo)

    def outcome(sim, pl):
        try:
            return repr((sim.lower_bound_s(pl), sim.simulate(pl)))
        except ValueError as e:   # refused (no host CPU to offload to): the same refusal
            return str(e)
    for pl in plans + plans[::-1]:
        assert outcome(shared, pl) == outcome(Simulator(gpt4, topo), pl), pl
