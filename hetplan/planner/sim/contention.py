"""Workers that compete for one host: CPU compute slowed by other CPU workers of its node
(CostModel.contention, memory_contention), and hosts where a gloo all-reduce cannot overlap
compute (`saturated_cpus`).

The simulator first runs a plan's tasks alone, then CONTENTION_PASSES times with each
contended device's tasks slowed by their overlap with its competitors' compute on the previous
timeline (`contend`): processor sharing approximated by a fixed point.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Any

from hetplan.planner.cost.model import CostModel
from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.topology import Topology
from hetplan.planner.sim.taskgraph import TaskGraph

# Contention: simulate alone, then CONTENTION_PASSES times with compute slowed by the overlap of
# the previous timeline (a fixed point).
CONTENTION_PASSES = 2


def saturated_cpus(topology: Topology) -> frozenset[str]:
    """CPU devices of a measured host whose worker threads take every core (`host.cores` <= the
    CPU workers' threads summed): there a gloo all-reduce holds the workers' compute queues
    instead of overlapping them. What-if topologies are never saturated."""
    cores = (topology.measured.get("host") or {}).get("cores")
    cpus = [d for d in topology.devices if d.kind == "cpu" and d.node is None]
    if not isinstance(cores, int) or not cpus or any(d.threads is None for d in cpus):
        return frozenset()
    return frozenset(d.name for d in cpus) if sum(d.threads for d in cpus) >= cores else frozenset()


def busy(topology: Topology, plan: Plan) -> dict[str, int]:
    """Per plan device, how many of the plan's CPU devices share its node (itself included)
    when it is a CPU, else 1: the workers that compete for the host's cores and memory
    (CostModel.contention)."""
    kinds = {d: topology.device(d).kind for d in plan.devices}
    nodes = {d: topology.device(d).node for d in plan.devices}
    out = {}
    for d in plan.devices:
        out[d] = (sum(1 for e in plan.devices if kinds[e] == "cpu" and nodes[e] == nodes[d])
                  if kinds[d] == "cpu" else 1)
    return out


def contended(topology: Topology, cost: CostModel, plan: Plan) -> dict[str, list[str]]:
    """Per CPU device of the plan whose compute the cost model slows when other CPU workers
    of its node compute at once: those other workers. Empty when nothing is contended."""
    out: dict[str, list[str]] = {}
    if sum(topology.device(d).kind == "cpu" for d in plan.devices) < 2:
        return out   # no two CPU workers to compete
    for d, k in busy(topology, plan).items():
        if k > 1 and cost.contention(d, k) != 1.0:
            node = topology.device(d).node
            out[d] = [e for e in plan.devices if e != d and topology.device(e).kind == "cpu"
                      and topology.device(e).node == node]
    return out


def contend(cost: CostModel, rid: dict[Any, int], contended: dict[str, list[str]], g: TaskGraph,
            base: list[float], start: list[float], end: list[float]) -> list[float]:
    """Task durations slowed by contention, from a simulated timeline (rid: resource id per
    device). A compute task t of a contended device d takes base[t] * contention(d, k_t) with
    k_t = 1 + sum over d's competing workers o of |[start_t, end_t) ∩ compute(o)| / (end_t - start_t);
    an optimizer step (memory-bound) takes base[t] * memory_contention(d, k_t)."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for t, r in enumerate(g.res):
        if len(r) == 1 and end[t] > start[t]:
            spans.setdefault(r[0], []).append((start[t], end[t]))
    for v in spans.values():
        v.sort()
    dur = list(base)
    for d, others in contended.items():
        rd = rid[d]
        theirs = [(o, [a for a, _ in o]) for o in (spans.get(rid[x], []) for x in others)]
        for t, r in enumerate(g.res):
            if r == (rd,) and end[t] > start[t]:
                s, e = start[t], end[t]
                k = 1.0 + sum(overlap(s, e, o, starts) for o, starts in theirs) / (e - s)
                if t in g.memory_bound:
                    dur[t] = base[t] * cost.memory_contention(d, k)
                    continue
                dur[t] = base[t] * cost.contention(d, k)
    return dur


def slowdown(rid: dict[Any, int], contended: dict[str, list[str]], g: TaskGraph, base: list[float],
             dur: list[float]) -> dict[str, float]:
    """Per contended device, its compute time contended over alone (scales its statistics)."""
    out = {}
    for d in contended:
        rd = rid[d]
        alone = sum(base[t] for t, r in enumerate(g.res) if r == (rd,))
        out[d] = sum(dur[t] for t, r in enumerate(g.res) if r == (rd,)) / alone if alone else 1.0
    return out


def overlap(s: float, e: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [s, e) ∩ the union of `spans` (sorted, disjoint; `starts` their start times)."""
    i = max(0, bisect_right(starts, s) - 1)
    out = 0.0
    while i < len(spans) and spans[i][0] < e:
        lo, hi = max(s, spans[i][0]), min(e, spans[i][1])
        if hi > lo:
            out += hi - lo
        i += 1
    return out


__all__ = ["CONTENTION_PASSES", "saturated_cpus", "busy", "contended", "contend", "slowdown", "overlap"]
