"""The search problem for real inputs: the strategy space of a topology, and a Problem whose
`evaluate` is the simulator (hetplan.planner.search.mcmc searches it).

`plan_problem` is what `hetplan plan` searches: the workload's graph captured at a small batch
in each allowed precision and one simulator per precision with the cost model the topology calls
for; `plan_baselines` regenerates the baselines a plan file was compared against.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable

from hetplan.planner.cost.model import RooflineCost, device_record
from hetplan.planner.cost.timing import cost_model, measured_here
from hetplan.planner.files.plan import Plan
from hetplan.planner.search.baselines import device_order
from hetplan.planner.search.mcmc import Candidate, Problem, Searcher
from hetplan.planner.search.space import Pipeline, Space, Strategy, to_plan


@dataclass(frozen=True)
class _Rejected:
    """What `evaluate` returns for a plan the simulator refuses (no route, no host CPU)."""
    iteration_s: float = math.inf
    feasible: bool = False
    peak_memory_bytes: dict = field(default_factory=dict)


def make_space(topology, num_layers: int, global_batch: int, model, optimizer_name: str,
               lr: float, precisions: tuple[str, ...] = ("fp32",), tensor_split: bool = False) -> Space:
    """`tensor_split`: the graph has linear pairs (ModelGraph.pairs), so the search may split
    the whole model between devices."""
    kinds = {d.name: d.kind for d in topology.devices}
    return Space(devices=device_order(list(kinds), kinds), kinds=kinds, num_layers=num_layers,
                 global_batch=global_batch, model=model, optimizer_name=optimizer_name, lr=lr,
                 precisions=tuple(precisions), tensor_split=tensor_split)


def simulator_problem(simulator, space: Space) -> Problem:
    """A Problem over hetplan.planner.sim.simulator.Simulator (or ByPrecision): its cost model gives the layer
    shares (at the global batch), the topology the activation transfer at each cut (forward +
    backward); with ByPrecision both are the first precision's, as are the baselines."""
    graph, topology, cost = simulator.graph, simulator.topology, simulator.cost
    B = space.global_batch
    shares = {}
    for d in space.devices:
        times = [sum(cost.layer_s(d, i, B)) for i in range(graph.num_layers)]
        total = sum(times)
        shares[d] = tuple(t / total if total > 0 else 1 / len(times) for t in times)

    def evaluate(plan: Plan):
        try:
            return simulator.simulate(plan)
        except ValueError:        # no path of links between two stages, no host CPU to offload to
            return _Rejected()

    def bound(plan: Plan, above: float = math.inf, memory: bool = True):
        """(lower bound on the iteration, peak memory; None without `memory`) for early rejection
        (hetplan.planner.sim.bound); None where the bound proves nothing or the plan is one the simulator
        refuses. Once the bound passes `above`, it may stop short of its best."""
        try:
            lb = simulator.lower_bound_s(plan, above)
            return None if lb is None else (lb, simulator.peak_memory_bytes(plan) if memory else None)
        except ValueError:
            return None

    @functools.lru_cache(maxsize=None)   # the pipeline DP asks O(S·L²) times for few distinct cuts
    def cut_s(a: str, b: str, i: int) -> float:
        try:
            return 2 * topology.transfer_s(a, b, graph.cut_bytes_at(i, B))
        except ValueError:
            return math.inf
    from hetplan.planner.sim.pipeline_pass import warm
    return Problem(space, evaluate, {d.name: d.memory_bytes for d in topology.devices}, shares, cut_s,
                   cost, bound, twin_keys(simulator), warm, simulator)


def twin_keys(simulator) -> Callable[[Plan], tuple | None]:
    """`Problem.twin_key` over `simulator`: a key shared by one-replica plans whose simulations
    give the same iteration time. The key: the plan's strategy with its devices numbered in stage
    order (model and topology are the search's), the devices' records but their names, and per
    stage pair the routes both ways as (link direction, numbered by first use; latency;
    bandwidth). Given only where the simulation provably depends on nothing else: GPUs priced
    by the what-if roofline without calibration (a pure function of the device record), the
    optimizer on the devices, no offload, tensor split, tied weights or asynchronous sync, so
    that every task holds one resource and the event loop's times do not depend on resource
    ids, only on which tasks share one. None elsewhere (solve_batches then simulates)."""
    records: dict[str, str | None] = {}   # device -> its record without the name; None: a CPU

    def record(sim, name: str) -> str | None:
        if name not in records:
            d = sim.topology.device(name)
            records[name] = None if d.kind == "cpu" else device_record(d)
        return records[name]

    def key(plan: Plan) -> tuple | None:
        sim = getattr(simulator, "simulators", {}).get(plan.precision, simulator)
        if (len(plan.replicas) != 1 or plan.sync.mode != "sync" or plan.optimizer.placement != "device"
                or type(sim.cost) is not RooflineCost or sim.cost.calibration is not None or sim.graph.tied):
            return None
        rep = plan.replicas[0]
        if any(st.split or st.offload_activations for st in rep.stages):
            return None
        number: dict[str, int] = {}
        devices = tuple(number.setdefault(st.device, len(number)) for st in rep.stages)
        kinds = tuple(record(sim, d) for d in number)
        if None in kinds:
            return None
        links: dict[int, int] = {}
        try:
            routes = tuple(tuple((links.setdefault(h.resource, len(links)), h.latency_s, h.bandwidth_bytes_per_s)
                                 for h in sim.hops(x, y))
                           for a, b in zip(rep.stages, rep.stages[1:])
                           for x, y in ((a.device, b.device), (b.device, a.device)))
        except ValueError:   # no route: the simulator refuses the plan
            return None
        return (plan.global_batch, plan.schedule, plan.sync, plan.optimizer, plan.recompute, plan.precision,
                rep.batch_fraction, rep.microbatches, tuple(st.layers for st in rep.stages), devices, kinds, routes)
    return key


CAPTURE_BATCH = 8   # graphs for planning are captured at min(global batch, this) and scaled


def plan_problem(workload, model, global_batch: int, topology, optimizer_name: str, lr: float,
                 precisions: tuple[str, ...] = ("fp32",), label: str = "--model"):
    """(graph, problem) for planning `workload` on `topology`: one training step's contract checked
    (hetplan.planner.workload.step_check; InputError starting with `label`), the operator graph captured at
    min(global_batch, CAPTURE_BATCH) samples in each allowed precision (FLOPs and activations
    scale linearly with the batch), the strategy space, and one simulator per precision with the
    cost model the topology calls for (measured on a profile of this machine, else the contract's
    roofline). The graph returned is the first precision's."""
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.step_check import check_step
    from hetplan.planner.sim.simulator import ByPrecision, Simulator

    check_step(workload, global_batch, label, model.spec)
    sims = {}
    for p in precisions:
        graph = capture_graph(workload, min(global_batch, CAPTURE_BATCH), p)
        cost = cost_model(graph, topology, workload, global_batch)
        # measured once, the search never times; the split backward where a pipeline (zb-h1) fits
        cost.prepare([d.name for d in topology.devices],
                     split=len(topology.devices) > 1 and graph.num_layers > 1)
        sims[p] = Simulator(graph, topology, cost)
    first = sims[precisions[0]].graph
    space = make_space(topology, first.num_layers, global_batch, model, optimizer_name, lr, precisions,
                       tensor_split=bool(first.pairs))
    if not replicated_fits(space, first, topology):
        space = replace(space, shard_choices=(0, 1, 2, 3))
    return first, simulator_problem(ByPrecision(sims), space)


def replicated_fits(space: Space, graph, topology) -> bool:
    """Whether plain data parallel over every device (equal shares) fits in memory: where it does
    not, the search may shard (ZeRO stages 1 to 3)."""
    from hetplan.planner.cost.memory import feasible, peak_memory
    from hetplan.planner.search.baselines import proportional_batches
    devs = space.devices[:space.global_batch]
    if len(devs) < 2:
        return True
    dp = Strategy(tuple(Pipeline((d,), ()) for d in devs), precision=space.precisions[0])
    plan = to_plan(space, dp, proportional_batches(space.global_batch, [1.0] * len(devs), [1] * len(devs)))
    return feasible(peak_memory(plan, graph, topology), topology)


def plan_baselines(plan: Plan, topology, file: str = "<plan>") -> list[Candidate]:
    """The baselines `hetplan plan` evaluated for this plan's workload, batch, optimizer and
    first allowed precision (`predicted.search.precisions`, else the plan's), regenerated as
    plans (the plan file stores only their predicted figures)."""
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import PRECISIONS
    from hetplan.planner.workload.load import load_plan_workload

    searched = plan.predicted.extra.get("search") if plan.predicted else None
    allowed = searched.get("precisions", [plan.precision]) if isinstance(searched, dict) else [plan.precision]
    if not (isinstance(allowed, list) and allowed and all(a in PRECISIONS for a in allowed)):
        raise InputError(f"{file}: predicted.search.precisions: expected a non-empty list of "
                         f"{', '.join(PRECISIONS)}, got {str(allowed)[:60]}")
    workload = load_plan_workload(plan.model, file, weights=measured_here(topology))
    _, problem = plan_problem(workload, plan.model, plan.global_batch, topology,
                              plan.optimizer.name, plan.optimizer.lr, (allowed[0],), f"{file}: model.spec")
    return Searcher(problem, random.Random(0)).baselines()


__all__ = ["CAPTURE_BATCH", "make_space", "simulator_problem", "twin_keys", "plan_problem", "plan_baselines"]
