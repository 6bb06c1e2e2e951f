"""Tests of the strategy space, the baselines and the MCMC search (hetplan.planner.search.space, baselines, search).

Most tests use a small analytic model instead of the simulator (`toy_evaluate`), so they pin the
search itself: exhaustive enumeration gives the true optimum of a small space. The tests at the
end go through the real simulator and the CLI.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hetplan.planner.search.baselines import partition_min_max, proportional_batches
from hetplan.planner.files.plan import ModelRef, validate_plan
from hetplan.planner.search.mcmc import Problem, SearchConfig, Searcher, search, search_key
from hetplan.planner.search.space import (Pipeline, Space, Strategy, enumerate_plans, from_plan, global_neighbours,
                                  propose, realise_microbatches, to_plan, toggle_global)

# --- a toy analytic cost model --------------------------------------------------------------
WORK = (1.0, 2.0, 2.0, 2.0, 2.0, 1.0)        # seconds per sample per unit-speed device, per layer
PARAM_BYTES = (4e6, 1e6, 1e6, 1e6, 1e6, 4e6)
ACT_BYTES = 1e6                              # per sample per layer


@dataclass(frozen=True)
class ToyResult:
    iteration_s: float
    feasible: bool
    peak_memory_bytes: dict


def toy_evaluate(speeds: dict, memory: dict, link_bytes_per_s: float = 1e9):
    """Per stage and microbatch: samples · work / speed (+1 ms overhead); a pipeline takes
    sum_k t_k + (m-1) max_k t_k; recompute costs a third more compute but keeps 1/5 of the
    activations; replicas all-reduce their parameters (hidden behind compute under 'fine');
    a CPU-placed optimizer stores 2 instead of 4 copies of the parameters on the device."""
    def evaluate(plan):
        L = plan.num_layers
        times, peak = [], {}
        for r, b in zip(plan.replicas, plan.replica_batches()):
            m, S = r.microbatches, len(r.stages)
            ts = []
            for k, st in enumerate(r.stages):
                w = sum(WORK[st.start:st.end]) * L / len(WORK) if L != len(WORK) else sum(WORK[st.start:st.end])
                ts.append((b / m) * w / speeds[st.device] * (4 / 3 if plan.recompute else 1) + 1e-3)
                in_flight = {"1f1b": min(m, S - k), "zb-h1": min(m, S),
                             "hippie": 1 if k == S - 1 else m}.get(plan.schedule, m)
                acts = (b / m) * ACT_BYTES * (st.end - st.start) * in_flight * (0.2 if plan.recompute else 1)
                copies = 2 if plan.optimizer.placement == "cpu" else 4
                peak[st.device] = copies * sum(PARAM_BYTES[st.start:st.end]) + acts
            times.append(sum(ts) + (m - 1) * max(ts))
        R = len(plan.replicas)
        sync = 2 * (R - 1) / R * sum(PARAM_BYTES) / link_bytes_per_s + (R > 1) * 1e-4 * math.ceil(
            sum(PARAM_BYTES) / plan.sync.bucket_bytes)
        if plan.sync.granularity == "fine":
            sync = max(0.0, sync - 0.5 * min(times))
        t = max(times) + sync + (0.01 if plan.optimizer.placement == "cpu" else 0.0)
        feasible = all(peak[d] <= memory[d] for d in peak)
        return ToyResult(t, feasible, peak)
    return evaluate


def toy_problem(speeds, memory, batch=6, layers=6, **space_kw):
    devices = tuple(speeds)
    space = Space(devices=devices, kinds={d: d.split(":")[0] for d in devices}, num_layers=layers,
                  global_batch=batch, model=ModelRef("toy"), **space_kw)
    shares = {d: tuple(w / sum(WORK) for w in WORK) for d in devices}
    return Problem(space, toy_evaluate(speeds, memory), dict(memory), shares)


BIG = 1e12
SMALL_SPACE = dict(bucket_choices_bytes=(2**20, 25 * 2**20))


# --- strategy space ---------------------------------------------------------------------------
def test_realise_microbatches_picks_nearest_valid_divisor():
    assert realise_microbatches(4, 12, 2, "1f1b") == 4
    assert realise_microbatches(5, 12, 2, "1f1b") == 6      # |log 6/5| = 0.18 < |log 5/4| = 0.22
    assert realise_microbatches(1, 12, 3, "1f1b") == 3      # 1F1B needs m >= stages
    assert realise_microbatches(1, 7, 3, "1f1b") == 7
    assert realise_microbatches(8, 6, 3, "gpipe") == 6
    with pytest.raises(ValueError):
        realise_microbatches(1, 2, 3, "1f1b")


def test_microbatch_counts_are_not_enumerated_up_to_the_batch():
    """realise_microbatches over the divisors found by factoring: the same counts as every m up
    to the batch for ordinary batches, and at once for 2^20 samples. Broken by: a loop up to the
    batch (plan --batch 1048576 spent tens of seconds past --time-limit)."""
    import time

    from hetplan.planner.search.space import divisors

    def slow(desired, batch, stages, schedule, devices=None):
        low = devices if schedule == "interleaved-1f1b" else (stages if schedule in ("1f1b", "zb-h1") else 1)
        step = low if schedule == "interleaved-1f1b" else 1
        divs = [m for m in range(low, batch + 1, step) if batch % m == 0]
        return min(divs, key=lambda m: (abs(math.log(m / max(desired, 1))), m))
    for batch in range(1, 200):
        assert divisors(batch) == tuple(d for d in range(1, batch + 1) if batch % d == 0)
        for desired, stages, schedule, devices in ((1, 1, "gpipe", None), (5, 2, "1f1b", None),
                                                   (16, 3, "1f1b", None), (8, 4, "interleaved-1f1b", 2)):
            try:
                want = slow(desired, batch, stages, schedule, devices)
            except ValueError:
                with pytest.raises(ValueError):
                    realise_microbatches(desired, batch, stages, schedule, devices)
                continue
            assert realise_microbatches(desired, batch, stages, schedule, devices) == want
    t0 = time.perf_counter()
    for desired in range(1, 65):
        assert realise_microbatches(desired, 2**20 - 2, 2, "1f1b") in divisors(2**20 - 2)
    assert time.perf_counter() - t0 < 1.0


def test_every_proposal_gives_a_valid_plan():
    p = toy_problem({"cuda:0": 1.0, "cuda:1": 2.0, "cpu:0": 0.5}, {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG},
                    batch=7)
    rng = random.Random(3)
    s = Strategy((Pipeline(("cuda:0",), ()),))
    searcher = Searcher(p, rng)
    seen = set()
    for _ in range(400):
        t = propose(p.space, s, rng)
        if t is None:
            continue
        plan = to_plan(p.space, t, searcher.solve_batches(t))
        validate_plan(plan, "<test>", 6, set(p.space.devices))
        seen.add(tuple(len(x.devices) for x in t.pipelines))
        s = t
    assert len(seen) >= 4   # the walk reaches DP, pipelines and hybrids


def test_enumeration_counts_a_tiny_space():
    # 2 devices, 2 layers, batch 2, gpipe only, one of each global choice:
    # one device (2 ways): m in {1, 2} -> 4 plans; DP: batches (1, 1), m = 1 -> 1 plan;
    # pipeline (2 orders, cut at 1): m in {1, 2} -> 4 plans. Total 9.
    space = Space(devices=("cpu:0", "cpu:1"), kinds={"cpu:0": "cpu", "cpu:1": "cpu"}, num_layers=2,
                  global_batch=2, model=ModelRef("toy"), bucket_choices_bytes=(2**20,), schedules=("gpipe",),
                  granularities=("fine",), recompute_choices=(False,))
    plans = list(enumerate_plans(space))
    assert len(plans) == 9
    for plan in plans:
        validate_plan(plan, "<test>", 2, {"cpu:0", "cpu:1"})


# --- baselines ----------------------------------------------------------------------------------
def test_proportional_batches_largest_remainder():
    assert proportional_batches(32, [1, 3], [1, 1]) == (8, 24)
    assert proportional_batches(10, [1, 1, 1], [1, 1, 1]) == (4, 3, 3)
    assert sum(proportional_batches(97, [0.3, 1.7, 5.0], [1, 1, 1])) == 97


def test_partition_min_max_balances_layers():
    work = [1, 2, 2, 2, 2, 1]
    cuts, worst = partition_min_max(lambda k, i, j: sum(work[i:j]), 2, 6)
    assert cuts == (3,) and worst == 5
    # a second device twice as fast takes more layers: cut 2 gives max(3, 7/2) = 3.5,
    # cut 1 gives max(1, 9/2), cut 3 gives max(5, 5/2)
    cuts, worst = partition_min_max(lambda k, i, j: sum(work[i:j]) / (2 if k == 1 else 1), 2, 6)
    assert cuts == (2,) and worst == pytest.approx(3.5)


# --- search on the toy model ----------------------------------------------------------------------
def _exhaustive_best(problem):
    best = math.inf
    for plan in enumerate_plans(problem.space):
        r = problem.evaluate(plan)
        if r.feasible:
            best = min(best, r.iteration_s)
    return best


@pytest.mark.parametrize("speeds,memory", [
    ({"cuda:0": 1.0, "cuda:1": 3.0, "cpu:0": 0.4}, {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG}),
    # memory-tight: no device holds the whole model with Adam on the device
    ({"cuda:0": 1.0, "cuda:1": 1.0, "cpu:0": 0.5}, {"cuda:0": 3.5e7, "cuda:1": 3.5e7, "cpu:0": 3.5e7}),
])
def test_search_matches_exhaustive_enumeration(speeds, memory):
    problem = toy_problem(speeds, memory, batch=6, **SMALL_SPACE)
    truth = _exhaustive_best(problem)
    result = search(problem, random.Random(0), SearchConfig(iterations=600, time_limit_s=60))
    assert result.best is not None and result.best.feasible
    assert result.best.iteration_s <= truth * 1.01
    validate_plan(result.best.plan, "<test>", 6, set(speeds))


def test_never_slower_than_the_best_baseline_and_same_seed_same_plan():
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 2.5, "cpu:0": 0.3},
                          {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG}, batch=12)
    cfg = SearchConfig(iterations=300, time_limit_s=60)
    a = search(problem, random.Random(7), cfg)
    b = search(problem, random.Random(7), cfg)
    assert a.best.plan == b.best.plan and a.iterations == b.iterations
    assert a.stopped_by in ("iterations", "no improvement")
    names = {c.name for c in a.baselines}
    assert {"data parallel, equal shares", "data parallel, proportional shares", "balanced pipeline"} <= names
    assert a.best.iteration_s <= min(c.iteration_s for c in a.baselines if c.feasible)


def test_chains_are_the_walks_of_their_seeds_and_the_best_of_them_wins():
    # chain 0 goes on with the search's rng, chain i > 0 with the i-th 64 bits a copy of it draws;
    # each is the single walk of its seed over its share of the budget, forked or here alike, and
    # the result adds their counts (the start's simulations once) and keeps the best of them
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 2.5, "cpu:0": 0.3},
                          {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG}, batch=12)
    cfg = SearchConfig(iterations=600, time_limit_s=600, chains=3, workers=2)
    forked = search(problem, random.Random(7), cfg)
    here = search(problem, random.Random(7), replace(cfg, workers=0))
    draw = random.Random(7)
    seeds = [draw.getrandbits(64) for _ in range(2)]
    singles = [search(problem, r, replace(cfg, iterations=200, chains=1))
               for r in (random.Random(7), *map(random.Random, seeds))]
    assert len({(s.iterations, s.accepted, search_key(s.best.plan)) for s in singles}) == 3   # three walks
    start = Searcher(problem, random.Random(0))
    start.start()
    assert forked.chains == here.chains == 3
    for r in (forked, here):
        assert r.iterations == sum(s.iterations for s in singles)
        assert r.accepted == sum(s.accepted for s in singles)
        assert r.best.plan == min((s.best for s in singles), key=lambda c: c.cost).plan
        assert r.patience == max(s.patience for s in singles)
    assert forked.evaluations == sum(s.evaluations for s in singles) - 2 * start.evaluations
    assert here.evaluations < forked.evaluations   # here, each chain finds what those before simulated
    # what the evaluation makes once (compiled loops) is made before forking, not in each chain
    made = []
    hooked = replace(problem, before_fork=lambda: made.append(os.getpid()))
    search(hooked, random.Random(7), cfg)
    search(hooked, random.Random(7), replace(cfg, workers=0))
    assert made == [os.getpid()]
    assert forked.stopped_by == "no improvement" and len(forked.history) >= 1
    assert [t for _, t in forked.history] == sorted((t for _, t in forked.history), reverse=True)


@pytest.mark.parametrize("how,message", [("raise", r"search chain [01] failed: ValueError: no such plan"),
                                         ("die", r"search chain [01]: its process ended without a result \(exit code 3\)")])
def test_a_chain_that_fails_or_dies_fails_the_search(how, message):
    import os
    here = os.getpid()
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 2.5, "cpu:0": 0.3},
                          {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG}, batch=12)
    evaluate = problem.evaluate

    def in_chains_only(plan):   # the start is evaluated here; the chains fail in their processes
        if os.getpid() != here:
            if how == "die":
                os._exit(3)
            raise ValueError("no such plan")
        return evaluate(plan)
    with pytest.raises(RuntimeError, match=message):
        search(replace(problem, evaluate=in_chains_only), random.Random(0),
               SearchConfig(iterations=600, time_limit_s=600, chains=2, workers=2))


def test_chains_that_cannot_be_forked_run_here(monkeypatch):
    from multiprocessing.context import ForkProcess
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 2.5, "cpu:0": 0.3},
                          {"cuda:0": BIG, "cuda:1": BIG, "cpu:0": BIG}, batch=12)
    cfg = SearchConfig(iterations=600, time_limit_s=600, chains=3, workers=2)
    forked = search(problem, random.Random(7), cfg)
    started = []

    def no_memory(self):   # the second fork fails, as for a parent holding a large model
        if started:
            raise OSError(12, "Cannot allocate memory")
        started.append(self)
        return real(self)
    real = ForkProcess.start
    monkeypatch.setattr(ForkProcess, "start", no_memory)
    mixed = search(problem, random.Random(7), cfg)
    assert len(started) == 1
    assert (mixed.iterations, mixed.accepted, search_key(mixed.best.plan)) == \
        (forked.iterations, forked.accepted, search_key(forked.best.plan))


def test_a_space_beyond_one_node_gets_four_chains():
    from hetplan.planner.search.mcmc import chains
    big = Space(devices=tuple(f"d{i}" for i in range(64)), kinds={}, num_layers=96, global_batch=256,
                model=ModelRef("toy"))
    assert [chains(replace(big, devices=big.devices[:n])) for n in (64, 16, 9, 8, 2)] == [4, 4, 4, 1, 1]


def test_solve_batches_balances_replicas():
    # DP over speeds 1 and 3: times 10·b1/1 and 10·b2/3 s (work 10 s per sample) are equal at b = (3, 9)
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 3.0}, {"cuda:0": BIG, "cuda:1": BIG}, batch=12)
    s = Strategy((Pipeline(("cuda:0",), ()), Pipeline(("cuda:1",), ())))
    assert Searcher(problem, random.Random(0)).solve_batches(s) == (3, 9)


def test_nothing_fits_reports_least_memory():
    problem = toy_problem({"cuda:0": 1.0, "cuda:1": 1.0}, {"cuda:0": 1e6, "cuda:1": 1e6}, batch=4)
    result = search(problem, random.Random(0), SearchConfig(iterations=100, time_limit_s=60))
    assert result.best is None
    from hetplan.planner.search.mcmc import memory_error
    msg = memory_error(result, problem.memory_bytes)
    assert "cuda:" in msg and "bytes" in msg
    assert result.least_memory.memory_ratio > 1


# --- with the real simulator -------------------------------------------------------------------
from hetplan.planner.workload.graph import Layer, ModelGraph  # noqa: E402
from hetplan.planner.files.plan import load_plan  # noqa: E402
from hetplan.planner.search.problem import make_space, simulator_problem  # noqa: E402
from hetplan.planner.sim.simulator import Simulator  # noqa: E402
from hetplan.planner.hardware.topology import Device, Link, Topology, save_topology  # noqa: E402


def uniform_graph(num_layers=6, batch=64, flops_per_sample=1e9, param_bytes=4e5, act_per_sample=1e4):
    layers = tuple(Layer(i, f"blocks.{i}", flops_per_sample * batch, 2 * flops_per_sample * batch,
                         int(param_bytes), int(act_per_sample * batch), int(2 * act_per_sample * batch),
                         3.0 * act_per_sample * batch, 6.0 * act_per_sample * batch, 4, 8, (f"blocks.{i}.w",))
                   for i in range(num_layers))
    return ModelGraph(layers=layers, batch=batch, cut_bytes=(int(act_per_sample * batch),) * (num_layers + 1))


def two_gpus(speed_ratio=3.0, memory_bytes=1e12, bandwidth=1e18):
    devs = (Device("cuda:0", "cuda", memory_bytes, 1e12, 1e12),
            Device("cuda:1", "cuda", memory_bytes, speed_ratio * 1e12, speed_ratio * 1e12))
    return Topology("two-gpus", devs, (Link("cuda:0", "cuda:1", bandwidth, 0.0),))


def sim_search(graph, topo, iterations=300, seed=0, **space_kw):
    space = replace(make_space(topo, graph.num_layers, graph.batch, ModelRef("toy"), "sgd", 0.1), **space_kw)
    problem = simulator_problem(Simulator(graph, topo), space)
    return problem, search(problem, random.Random(seed), SearchConfig(iterations=iterations, time_limit_s=60))


def test_speeds_1_to_3_with_free_links_reach_the_ideal():
    graph, topo = uniform_graph(), two_gpus(3.0)
    problem, result = sim_search(graph, topo)
    single = {c.plan.devices[0]: c.iteration_s for c in result.baselines if c.name.startswith("fastest")}
    sim = Simulator(graph, topo)
    t0 = sim.simulate(to_plan(problem.space, Strategy((Pipeline(("cuda:0",), ()),)), (64,))).iteration_s
    t1 = sim.simulate(to_plan(problem.space, Strategy((Pipeline(("cuda:1",), ()),)), (64,))).iteration_s
    assert t0 == pytest.approx(3 * t1, rel=1e-6) and single == {"cuda:1": pytest.approx(t1)}
    ideal = 1 / (1 / t0 + 1 / t1)        # total work / total speed
    assert result.best.iteration_s <= 1.05 * ideal
    assert sorted(result.best.plan.replica_batches()) == [16, 48]


def test_memory_tight_topology_gives_a_feasible_plan():
    # 6 layers of 40 MB of parameters with SGD (param + grad per layer = 80 MB each): one
    # device of 300 MB cannot hold the model (480 MB), two can hold it as a pipeline.
    graph = uniform_graph(param_bytes=4e7)
    topo = two_gpus(1.0, memory_bytes=3e8, bandwidth=1e10)
    problem, result = sim_search(graph, topo)
    assert not any(c.feasible for c in result.baselines if c.name.startswith("fastest"))
    best = result.best
    assert best is not None and best.feasible
    check = Simulator(graph, topo).simulate(best.plan)
    assert check.feasible and all(v <= 3e8 for v in check.peak_memory_bytes.values())


def test_zb_h1_chosen_where_a_pipeline_must_hide_its_bubble():
    # the memory-tight pair above at batch 8: the model only fits as a 2-stage pipeline, and at
    # most 8 microbatches leave a bubble of p - 1 = 1 slot. Per microbatch F = 1, B = 2 units
    # (I = W = 1): 1F1B (m + p - 1) * 3 = 27 units, ZB-H1 3m + p - 1 = 25; both fit (ZB-H1 holds
    # 2 microbatches of small activations on each stage).
    graph = uniform_graph(batch=8, param_bytes=4e7)
    topo = two_gpus(1.0, memory_bytes=3e8, bandwidth=1e10)
    # every seed: walks that stop by no improvement at interleaved 1F1B over 4 virtual stages
    # (78.37 ms; 5 of seeds 0-7 before the final descent) reach ZB-H1 by joining the chunks
    # under each schedule
    sim = Simulator(graph, topo)
    for seed in range(8):
        problem, result = sim_search(graph, topo, seed=seed)
        best = result.best
        assert best.plan.schedule == "zb-h1" and best.feasible and len(best.plan.replicas[0].stages) == 2, seed
        others = {s: sim.simulate(replace(best.plan, schedule=s)).iteration_s for s in ("1f1b", "gpipe")}
        assert best.iteration_s < 0.95 * min(others.values())


def _slow_gpu_workstation():
    """(space, simulator): 6 layers of 100 MB, Adam, little compute, a GPU beside a CPU."""
    graph = uniform_graph(param_bytes=1e8, flops_per_sample=1e6, act_per_sample=1e3)
    topo = Topology("slow-gpu-workstation", (
        Device("cpu:0", "cpu", 1e12, 1e9, 7e10), Device("cuda:0", "cuda", 1e12, 1e13, 7e10)),
        (Link("cpu:0", "cuda:0", 2e10, 0.0),))
    return make_space(topo, graph.num_layers, graph.batch, ModelRef("toy"), "adam", 1e-3), Simulator(graph, topo)


def test_split_optimizer_chosen_on_a_slow_gpu_workstation():
    # 6 layers of 100 MB, Adam, little compute: the update dominates. On cuda:0 Adam moves
    # 7 x 600 MB at 7e10 B/s = 60 ms; on cpu:0 the copies (2 x 600 MB at 2e10 B/s) and the update
    # (4.2 GB at 7e10 B/s) take 120 ms; split, f of the bytes go to the host at 120 ms · f beside
    # 60 ms · (1 - f) on the GPU: f = 0.25 gives max(45, 30) = 45 ms, the best of the grid.
    space, sim = _slow_gpu_workstation()
    # every seed (the walk alone reached it on 3 of seeds 0-7: toggles are few; the final descent
    # tries every placement and host share of the best)
    for seed in range(8):
        result = search(simulator_problem(sim, space), random.Random(seed), SearchConfig(iterations=300, time_limit_s=60))
        best = result.best.plan
        assert best.devices == ("cuda:0",) and best.optimizer.placement == "split", seed
        assert best.optimizer.cpu_fraction == 0.25
    on = {p: sim.simulate(replace(best, optimizer=replace(best.optimizer, placement=p, cpu_fraction=None)))
          for p in ("device", "cpu")}
    assert result.best.iteration_s < min(r.iteration_s for r in on.values())
    assert on["device"].iteration_s - result.best.iteration_s == pytest.approx(0.015, rel=0.05)


def test_a_search_ends_at_the_best_of_its_global_neighbourhood():
    # no proposals at all: the final descent alone takes the fastest single device (Adam on the
    # GPU, 85.8 ms) to the split optimizer at 0.25 (70.8 ms), and nothing one global choice away
    # from what it returns is faster
    space, sim = _slow_gpu_workstation()
    result = search(simulator_problem(sim, space), random.Random(0), SearchConfig(iterations=0, time_limit_s=60))
    assert result.iterations == 0
    assert result.baselines[0].plan.optimizer.placement == "device"
    best = result.best
    assert (best.plan.optimizer.placement, best.plan.optimizer.cpu_fraction) == ("split", 0.25)
    assert best.iteration_s < result.baselines[0].iteration_s
    s, batches = from_plan(best.plan)
    neighbours = global_neighbours(space, s)
    assert {t.placement for t in neighbours} >= {"device", "cpu"} and len(neighbours) >= 5
    for t in neighbours:
        assert sim.simulate(to_plan(space, t, batches)).iteration_s >= best.iteration_s * (1 - 1e-9)


def test_offload_is_the_only_way_a_tight_gpu_trains_alone():
    # 6 layers saving 2e7 B per sample each; cuda:0 has 6e7 B. Without offload it holds at least
    # one sample's 1.2e8 B (recompute: 1.3e8); offloaded, two of a layer's, 4e7 B at 1 sample per
    # microbatch. Pipelines through cpu:0 (1e9 FLOP/s against 1e13) are hundreds of times slower.
    graph = uniform_graph(batch=8, act_per_sample=1e7)
    topo = Topology("tight-gpu", (
        Device("cpu:0", "cpu", 1e12, 1e9, 1e10), Device("cuda:0", "cuda", 6e7, 1e13, 1e12)),
        (Link("cpu:0", "cuda:0", 1e11, 0.0),))
    space = make_space(topo, graph.num_layers, graph.batch, ModelRef("toy"), "sgd", 0.1)
    sim = Simulator(graph, topo)
    result = search(simulator_problem(sim, space), random.Random(0), SearchConfig(iterations=400, time_limit_s=60))
    best = result.best.plan
    assert best.devices == ("cuda:0",) and best.replicas[0].stages[0].offload_activations
    assert best.replicas[0].microbatches == 8 and result.best.feasible
    kept = sim.simulate(replace(best, replicas=(replace(best.replicas[0], stages=(
        replace(best.replicas[0].stages[0], offload_activations=False),)),)))
    assert not kept.feasible and kept.peak_memory_bytes["cuda:0"] > 1.2e8
    assert result.best.peak_memory_bytes["cuda:0"] == pytest.approx(4e7 + 2 * 6 * 4e5)


# --- CLI end to end ---------------------------------------------------------------------------------
def _write_topology(path: Path, memory_bytes: float) -> None:
    save_topology(Topology("what-if", (
        Device("cpu:0", "cpu", memory_bytes, 2e11, 2e10, 1e-5, threads=4),
        Device("cuda:0", "cuda", memory_bytes, 3e12, 1.5e11, 1e-5)),
        (Link("cpu:0", "cuda:0", 1.2e10, 1e-5),)), path)


def _hetplan(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hetplan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_cli_writes_a_plan_that_loads_back(tmp_path):
    _write_topology(tmp_path / "t.json", 64e9)
    r = _hetplan("plan", "--model", "mlp", "--model-arg", "hidden=256", "--batch", "16", "--topology", "t.json",
                 "--iterations", "200", "--seed", "3", "-o", "p.json", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plan = load_plan(tmp_path / "p.json")
    assert plan.predicted.iteration_s == out["iteration_s"]
    assert plan.topology.name == "what-if" and len(plan.topology.sha256) == 64
    names = {b["name"] for b in plan.predicted.extra["baselines"]}
    assert "balanced pipeline" in names and "data parallel, equal shares" in names
    assert out["iteration_s"] <= min(b["iteration_s"] for b in out["baselines"] if b["feasible"])
    assert "search:" in r.stderr or "searching" in r.stderr
    # two chains, forked from the process that captured the model: the same plan on one worker
    runs = [_hetplan("plan", "--model", "mlp", "--model-arg", "hidden=256", "--batch", "16", "--topology", "t.json",
                     "--iterations", "400", "--seed", "3", "--chains", "2", "--workers", w, "-o", f"c{w}.json",
                     cwd=tmp_path) for w in ("1", "2")]
    assert all(x.returncode == 0 for x in runs), runs[0].stderr + runs[1].stderr
    one, two = (load_plan(tmp_path / f"c{w}.json") for w in ("1", "2"))
    assert one.replicas == two.replicas and one.predicted.extra["search"] == two.predicted.extra["search"]
    assert one.predicted.extra["search"]["chains"] == 2 and "in 2 chains" in runs[0].stdout
    assert one.predicted.iteration_s <= plan.predicted.iteration_s   # chain 0 is the 200-proposal walk above


def test_cli_too_small_topology_and_bad_flags_exit_2(tmp_path):
    _write_topology(tmp_path / "tiny.json", 1e5)
    r = _hetplan("plan", "--model", "mlp", "--model-arg", "hidden=256", "--batch", "16", "--topology", "tiny.json",
                 "--iterations", "50", "-o", "p.json", cwd=tmp_path)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "needs" in line and "bytes on" in line and ("cuda:0" in line or "cpu:0" in line)
    assert not (tmp_path / "p.json").exists()
    for flags in (["--batch", "0"], ["--batch", "4", "--time-limit", "0"]):
        r = _hetplan("plan", "--model", "mlp", "--topology", "tiny.json", *flags, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr


def _write_bf16_topology(path: Path) -> None:
    """Compute-bound what-if devices whose bf16 matmuls are 4x their fp32 ones."""
    table = {"fp32": 2e9, "bf16": 8e9}
    save_topology(Topology("bf16-what-if", (
        Device("cpu:0", "cpu", 64e9, 2e9, 1e13, 0.0, threads=4, matmul_flops_per_s_by_precision=table),
        Device("cpu:1", "cpu", 64e9, 2e9, 1e13, 0.0, threads=4, matmul_flops_per_s_by_precision=table)),
        (Link("cpu:0", "cpu:1", 1e10, 1e-5),)), path)


def test_cli_precision_is_chosen_only_among_the_allowed(tmp_path):
    _write_bf16_topology(tmp_path / "t.json")
    base = ["plan", "--model", "mlp", "--model-arg", "hidden=256", "--batch", "16", "--topology", "t.json",
            "--iterations", "200", "--json"]
    r = _hetplan(*base, "-o", "default.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_plan(tmp_path / "default.json").precision == "fp32"   # never chosen silently
    report = load_plan(tmp_path / "default.json").predicted.extra["search"]
    assert {"iterations", "simulations", "bound_rejections", "stopped_by", "acceptance_rate"} <= set(report)
    assert 0 <= report["bound_rejections"] <= report["iterations"] <= 200
    r = _hetplan(*base, "--precision", "fp32,bf16", "-o", "mixed.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = load_plan(tmp_path / "mixed.json")
    fp32_s = load_plan(tmp_path / "default.json").predicted.iteration_s
    assert plan.precision == "bf16" and plan.predicted.iteration_s < fp32_s / 2
    assert plan.predicted.extra["search"]["precisions"] == ["fp32", "bf16"]
    # the baselines are fp32 (the first listed): the same figures as without --precision
    default_bases = load_plan(tmp_path / "default.json").predicted.extra["baselines"]
    assert plan.predicted.extra["baselines"] == default_bases


def test_cli_unknown_precision_exits_2_with_one_line(tmp_path):
    _write_bf16_topology(tmp_path / "t.json")
    for value in ("fp64", "fp32,fp32", "fp32,"):
        r = _hetplan("plan", "--model", "mlp", "--batch", "16", "--topology", "t.json",
                     "--precision", value, "-o", "p.json", cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "--precision" in lines[0], r.stderr
        assert "fp32, tf32, bf16" in lines[0] and repr(value) in lines[0]
    assert not (tmp_path / "p.json").exists()


def test_precision_is_a_global_choice_only_when_several_are_allowed():
    kw = dict(devices=("cpu:0", "cpu:1"), kinds={"cpu:0": "cpu", "cpu:1": "cpu"}, num_layers=2,
              global_batch=2, model=ModelRef("toy"), bucket_choices_bytes=(2**20,), schedules=("gpipe",),
              granularities=("fine",), recompute_choices=(False,))
    two = Space(**kw, precisions=("fp32", "bf16"))
    plans = list(enumerate_plans(two))
    assert len(plans) == 18 and {p.precision for p in plans} == {"fp32", "bf16"}  # 9 per precision
    s = Strategy((Pipeline(("cpu:0",), ()),))
    assert {(toggle_global(two, s, random.Random(i)) or s).precision for i in range(50)} == {"fp32", "bf16"}
    one = Space(**kw)   # fp32 only: no move ever changes the precision, to_plan refuses another
    assert all((toggle_global(one, s, random.Random(i)) or s).precision == "fp32" for i in range(50))
    with pytest.raises(ValueError, match="precision 'bf16' is not allowed"):
        to_plan(one, Strategy((Pipeline(("cpu:0",), ()),), precision="bf16"), (2,))


# --- pipeline x DP grids, the no-improvement stop (issue 16) ----------------------------------
def _two_nodes(batch=16, layers=8):
    from dataclasses import replace
    speeds = {f"node{n}/cuda:{g}": 1.0 for n in range(2) for g in range(4)}
    problem = toy_problem(speeds, {d: BIG for d in speeds}, batch=batch, layers=layers)
    return replace(problem, shares={d: (1 / layers,) * layers for d in speeds})   # equal layers


def test_grid_shapes_cover_every_degree_node_by_node_and_rail_by_rail():
    from hetplan.planner.search.baselines import grid_shapes
    problem = _two_nodes()
    shapes = grid_shapes(problem.space, {d: 1.0 for d in problem.space.devices}, problem.shares)
    got = {(g.degree, g.order): [p.devices for p in g.strategy.pipelines] for g in shapes}
    n = lambda i, j: f"node{i}/cuda:{j}"   # noqa: E731
    assert sorted(got) == [(1, "within nodes"), (2, "across nodes"), (2, "within nodes"),
                           (4, "across nodes"), (4, "within nodes"), (8, "within nodes")]
    assert got[(2, "across nodes")] == [(n(0, j), n(1, j)) for j in range(4)]          # rails
    assert got[(4, "within nodes")] == [tuple(n(i, j) for j in range(4)) for i in range(2)]
    assert got[(4, "across nodes")] == [(n(0, 0), n(1, 0), n(0, 1), n(1, 1)), (n(0, 2), n(1, 2), n(0, 3), n(1, 3))]
    assert {(g.degree, g.order) for g in shapes if g.baseline} == {(4, "within nodes"), (2, "across nodes")}
    for g in shapes:   # equal batches, 4p microbatches, even cuts on equal devices
        assert g.batches == (16 // (8 // g.degree),) * (8 // g.degree)
        assert all(p.microbatches == (min(4 * g.degree, b) if g.degree > 1 else 1)
                   for p, b in zip(g.strategy.pipelines, g.batches))
        assert all(p.cuts == tuple(range(8 // g.degree, 8, 8 // g.degree)) for p in g.strategy.pipelines)


def test_search_is_never_slower_than_any_grid_and_reports_its_stop():
    from hetplan.planner.search.mcmc import patience
    problem = _two_nodes()
    r = search(problem, random.Random(3), SearchConfig(iterations=100000, time_limit_s=600, patience=40))
    assert r.stopped_by == "no improvement" and r.patience == 40
    assert r.iterations < 100000 and 0 < r.accepted <= r.iterations
    assert r.acceptance_rate == r.accepted / r.iterations
    s = Searcher(problem, random.Random(0))
    s.baselines()
    grids = [s.evaluate(to_plan(problem.space, g.strategy, g.batches)) for g in s._grid]
    assert r.best.iteration_s <= min(c.iteration_s for c in grids if c.feasible)
    names = {c.name for c in r.baselines}
    assert {"pipeline within nodes x data parallel across nodes (4 x 2)",
            "pipeline across nodes x data parallel within nodes (2 x 4)"} <= names
    # the default stop: about one try per one-choice neighbour, at least 500, at most half the budget
    big = Space(devices=tuple(f"d{i}" for i in range(64)), kinds={}, num_layers=96, global_batch=256,
                model=ModelRef("toy"))
    assert patience(big, 20000) == 64 * 63 // 2 + 4 * 64 + 2 * 64 + 16
    assert patience(problem.space, 20000) == 500 and patience(problem.space, 300) == 150



def test_a_default_walk_stops_after_a_neighbourhood_of_proposals_without_improvement():
    # 32 GPUs: patience 32·31/2 + 4·32 + 2·8 + 16 = 656; seed 0's best comes at proposal 246 and
    # the walk stops 656 proposals later, not sooner for an early best (the rule before stopped
    # at max(500, twice 246))
    from hetplan.planner.search.mcmc import patience
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from search import cluster_64, synthetic_graph
    g, topo = synthetic_graph(8, 32, d_model=256, seq=64), cluster_64(4)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    r = search(simulator_problem(Simulator(g, topo), space), random.Random(0),
               SearchConfig(iterations=20000, time_limit_s=600, chains=1))
    found_at = r.iterations - r.patience - 1
    assert patience(space, 20000) == r.patience == 656
    assert r.stopped_by == "no improvement" and found_at == 246


def _rails(nodes: int, layers: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from search import cluster_64, synthetic_graph
    g, topo = synthetic_graph(layers, 32, d_model=256, seq=64), cluster_64(nodes)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    return g, topo, space


def test_twin_replicas_have_one_key_and_the_same_simulated_time():
    # hetplan.planner.search.problem.twin_keys on the rail cluster: random one-replica plans grouped by
    # key all simulate alike; renamings that keep the routes' shape share a key, others do not
    g, topo, space = _rails(2, 8)
    sim = Simulator(g, topo)
    key = simulator_problem(sim, space).twin_key
    rng = random.Random(0)
    groups: dict = {}
    for _ in range(300):
        k = rng.randint(1, 4)
        devs = tuple(rng.sample(space.devices, k))
        cuts = tuple(sorted(rng.sample(range(1, 8), k - 1)))
        s = Strategy((Pipeline(devs, cuts, rng.choice((1, 2, 4, 8))),), schedule=rng.choice(space.schedules))
        plan = to_plan(space, s, (32,))
        groups.setdefault(key(plan), set()).add(sim.simulate(plan).iteration_s)
    assert None not in groups and max(map(len, groups.values())) == 1
    assert len(groups) < 300   # some plans were twins
    one = lambda *d: to_plan(space, Strategy((Pipeline(d, (2, 5)[:len(d) - 1], 4),)), (32,))  # noqa: E731
    assert key(one("node0/cuda:0", "node0/cuda:1")) == key(one("node1/cuda:5", "node1/cuda:2"))
    assert key(one("node0/cuda:3", "node1/cuda:3")) == key(one("node1/cuda:6", "node0/cuda:6"))
    # across nodes on one rail (one hop) or through NVLink then a rail (two)
    assert key(one("node0/cuda:3", "node1/cuda:3")) != key(one("node0/cuda:3", "node1/cuda:4"))
    assert key(one("node0/cuda:0", "node0/cuda:1")) != key(one("node0/cuda:0", "node0/cuda:1", "node0/cuda:2"))
    split = to_plan(space, Strategy((Pipeline(("node0/cuda:0",), (), 1),), placement="cpu"), (32,))
    assert key(split) is None


def test_timing_twins_once_leaves_the_walk_as_it_was():
    # solve_batches (simulating its replicas) with Problem.twin_key: the same proposals, decisions
    # and best plan, fewer simulations
    g, topo, space = _rails(2, 8)
    runs = []
    for twins in (True, False):
        problem = simulator_problem(Simulator(g, topo), space)
        problem = problem if twins else replace(problem, twin_key=None)
        cfg = SearchConfig(iterations=400, time_limit_s=600, split_by_bound=False, chains=1)
        r = search(problem, random.Random(3), cfg)
        runs.append(r)
    a, b = runs
    assert (a.iterations, a.accepted, a.best.plan) == (b.iterations, b.accepted, b.best.plan)
    assert [best for _, best in a.history] == [best for _, best in b.history]
    assert a.evaluations < b.evaluations


def test_without_a_cpu_device_the_space_has_no_host_placement_nor_offload():
    # host_cpu refuses a GPU whose node has no CPU device: such proposals are not drawn
    gpus = {"cuda:0": "cuda", "cuda:1": "cuda"}
    alone = Space(devices=tuple(gpus), kinds=gpus, num_layers=4, global_batch=8, model=ModelRef("toy"))
    hosted = replace(alone, devices=(*gpus, "cpu:0"), kinds={**gpus, "cpu:0": "cpu"})
    assert alone.placements == ("device",) and alone.offload_choices == (False,)
    assert hosted.placements == ("device", "cpu", "split") and hosted.offload_choices == (False, True)
    rng = random.Random(0)
    s = Strategy((Pipeline(("cuda:0", "cuda:1"), (2,), 2),))
    drawn = [t for t in (toggle_global(alone, s, rng) for _ in range(300)) if t is not None]
    drawn += global_neighbours(alone, s)
    assert drawn and all(t.placement == "device" and not t.offload for t in drawn)
    assert any(t.placement != "device" or t.offload for t in global_neighbours(hosted, s))


def test_grid_move_changes_the_degree_of_every_pipeline_in_one_proposal():
    problem = _two_nodes()
    s = Searcher(problem, random.Random(1))
    s.baselines()
    dp = Strategy(tuple(Pipeline((d,), ()) for d in problem.space.devices), schedule="gpipe")
    degrees = set()
    for _ in range(40):
        c = s.grid_move(dp)
        if c is None:
            continue
        st = c.strategy
        assert len({len(p.devices) for p in st.pipelines}) == 1 and st.schedule == "gpipe"
        assert st.used == frozenset(problem.space.devices)
        degrees.add(len(st.pipelines[0].devices))
    assert degrees == {1, 2, 4, 8}


def test_solve_batches_models_replicas_by_their_bound_without_simulating():
    # 8 rail pipelines on 16 GPUs, one of them a stage shorter: the split comes from the
    # replicas' lower bounds (no simulation), and the bound's times order the batches
    g, topo, space = _rails(2, 8)
    problem = simulator_problem(Simulator(g, topo), space)
    pipes = tuple(Pipeline((f"node0/cuda:{r}", f"node1/cuda:{r}"), (g.num_layers // 2,), 2) for r in range(7))
    pipes += (Pipeline(("node0/cuda:7",), (), 2),)      # the whole model on one GPU: slower
    s = Strategy(pipes)
    by_bound = Searcher(problem, random.Random(0), SearchConfig(split_by_bound=True))
    batches = by_bound.solve_batches(s)
    assert by_bound.evaluations == 0 and sum(batches) == space.global_batch
    assert batches[-1] < min(batches[:-1])
    by_sim = Searcher(problem, random.Random(0), SearchConfig(split_by_bound=False))
    assert by_sim.solve_batches(s)[-1] < min(batches[:-1]) and by_sim.evaluations > 0
