"""Simulations per second of hetplan.planner.sim.simulator on synthetic graphs (roofline costs, fine sync).

(a) 4 devices (2 replicas x 2 stages), 8 layers, 8 microbatches   target >= 20,000/s (issue 16)
(b) 64 devices (8 replicas x 8 stages), 96 layers, 16 microbatches target >= 500/s (issue 16)
(c) `--search-plans`: the plans a 150-proposal search (seed 0) simulates on benchmarks/search.py's
    64-GPU cluster x 96 layers, replayed by a fresh simulator: cold task graphs and templates

The simulator's per-plan result cache is off (cache_size=0), so every call evaluates the
durations and runs the event loop; cost tables and task graphs per plan shape are warm, as in
a search. Prints the median of `--runs` timed runs, in wall-clock time and in this process's
CPU time (steadier on a shared machine). `--no-collapse` simulates identical replicas one by one.
Usage: python benchmarks/simulator_speed.py [--runs 5] [--no-collapse] [--search-plans]
"""
from __future__ import annotations

import argparse
import statistics
import time

from hetplan.planner.workload.graph import Layer, ModelGraph
from hetplan.planner.files.plan import ModelRef, Optimizer, Plan, Replica, Stage, Sync
from hetplan.planner.sim.simulator import Simulator
from hetplan.planner.hardware.topology import Device, Link, Topology


def synthetic(replicas: int, stages: int, layers: int):
    ls = tuple(Layer(index=i, name=f"l{i}", fwd_flops=2e9, bwd_flops=4e9, param_bytes=4 * 2**20,
                     activation_bytes=2**20, saved_bytes=4 * 2**20, fwd_bytes_moved=8e6,
                     bwd_bytes_moved=16e6, n_ops=10, bwd_n_ops=20) for i in range(layers))
    graph = ModelGraph(layers=ls, batch=8, cut_bytes=(2**20,) * (layers + 1))
    names = [f"cuda:{i}" for i in range(replicas * stages)]
    devices = tuple(Device(n, "cuda", 16e9, 1e13, 5e11, 5e-6) for n in names)
    links = tuple(Link(a, b, 2e10, 5e-6) for i, a in enumerate(names) for b in names[i + 1:])
    return graph, Topology("bench", devices, links)


def plans(replicas: int, stages: int, layers: int, micro: int, n: int):
    per = layers // stages
    out = []
    for k in range(n):
        base = micro * 8
        batches = [base] * replicas
        batches[k % replicas] += micro * (k % 7)
        batches[(k + 1) % replicas] -= micro * (k % 7) if replicas > 1 else 0
        total = sum(batches)
        reps = tuple(Replica(b / total, micro, tuple(
            Stage(f"cuda:{r * stages + s}", (s * per, (s + 1) * per)) for s in range(stages)))
            for r, b in enumerate(batches))
        out.append(Plan(ModelRef("synthetic"), total, reps, schedule=("1f1b", "gpipe")[k % 2],
                        sync=Sync("fine", 8 * 2**20), optimizer=Optimizer("adam")))
    return out


def rate(replicas, stages, layers, micro, n, runs, collapse=True):
    """(median wall-clock, median CPU-time) simulations per second over `runs` runs of n plans."""
    graph, topo = synthetic(replicas, stages, layers)
    sim = Simulator(graph, topo, cache_size=0, collapse=collapse)
    for p in plans(replicas, stages, layers, micro, 14):   # warm the cost tables
        sim.simulate(p)
    wall, cpu = [], []
    for run in range(runs):
        ps = plans(replicas, stages, layers, micro, n)
        t0, c0 = time.perf_counter(), time.process_time()
        for p in ps:
            sim.simulate(p)
        wall.append(n / (time.perf_counter() - t0))
        cpu.append(n / max(time.process_time() - c0, 1e-9))
    return statistics.median(wall), statistics.median(cpu)


def search_plans_rate(runs: int) -> tuple[float, int]:
    """(median CPU-time simulations per second, plans) replaying a search's simulations."""
    import random
    from search import cluster_64, synthetic_graph   # benchmarks/search.py
    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import make_space, simulator_problem
    from hetplan.planner.sim.template import _skeleton, replica_template
    graph, topo = synthetic_graph(96, 256), cluster_64(8, rails=False)
    sim = Simulator(graph, topo)
    seen = []

    def recorded(plan, trace=False):
        seen.append(plan)
        return Simulator.simulate(sim, plan, trace)
    sim.simulate = recorded
    space = make_space(topo, graph.num_layers, graph.batch, ModelRef("bench"), "adam", 1e-3)
    search(simulator_problem(sim, space), random.Random(0), SearchConfig(iterations=150, time_limit_s=1e9, chains=1))
    cpu = []
    for _ in range(runs):
        replica_template.cache_clear()
        _skeleton.cache_clear()     # cold: the schedules' skeletons too
        fresh = Simulator(graph, topo)
        c0 = time.process_time()
        for p in seen:
            try:
                fresh.simulate(p)
            except ValueError:   # rejected by the simulator, as in the search
                pass
        cpu.append(len(seen) / max(time.process_time() - c0, 1e-9))
    return statistics.median(cpu), len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs; medians are printed")
    ap.add_argument("--no-collapse", action="store_true", help="simulate identical replicas one by one")
    ap.add_argument("--search-plans", action="store_true", help="also (c): a 64-GPU search's own plans")
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs: expected a positive integer")
    c = not a.no_collapse
    wa, ca = rate(2, 2, 8, 8, 400, a.runs, c)
    print(f"(a) 4 devices, 8 layers, 8 microbatches:   {wa:8.0f} simulations/s (target 20000; "
          f"CPU time {ca:.0f}/s)")
    wb, cb = rate(8, 8, 96, 16, 10, a.runs, c)
    print(f"(b) 64 devices, 96 layers, 16 microbatches: {wb:8.1f} simulations/s (target 500; "
          f"CPU time {cb:.1f}/s)")
    if a.search_plans:
        cc, n = search_plans_rate(a.runs)
        print(f"(c) a 64-GPU search's {n} plans, cold graphs: CPU time {cc:.1f} simulations/s")


if __name__ == "__main__":
    main()
