"""The search problem for real inputs: the strategy space of a topology, and a Problem whose
`evaluate` is the simulator (planner.search.mcmc searches it).

`plan_problem` is what `hetplan plan` searches: the workload's graph captured at a small batch
in each allowed precision and one simulator per precision with the cost model the topology calls
for; `plan_baselines` regenerates the baselines a plan file was compared against.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field, replace

from planner.cost.model import RooflineCost
from planner.cost.timing import cost_model
from planner.files.plan import Plan, plan_key
from planner.search.baselines import device_order
from planner.search.mcmc import Candidate, Problem, Searcher
from planner.search.space import Space


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
    """A Problem over planner.sim.simulator.Simulator (or ByPrecision): its cost model gives the layer
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

    def bound(plan: Plan):
        """(lower bound on the iteration, peak memory) for early rejection (planner.sim.bound);
        None where the bound proves nothing or the plan is one the simulator refuses."""
        try:
            lb = simulator.lower_bound_s(plan)
            return None if lb is None else (lb, simulator.peak_memory_bytes(plan))
        except ValueError:
            return None

    @functools.lru_cache(maxsize=None)   # the pipeline DP asks O(S·L²) times for few distinct cuts
    def cut_s(a: str, b: str, i: int) -> float:
        try:
            return 2 * topology.transfer_s(a, b, graph.cut_bytes_at(i, B))
        except ValueError:
            return math.inf
    return Problem(space, evaluate, {d.name: d.memory_bytes for d in topology.devices}, shares, cut_s,
                   cost, bound, functools.partial(twin_key, simulator))


def twin_key(simulator, plan: Plan) -> tuple | None:
    """A key shared by one-replica plans whose simulations give the same iteration time: the
    plan with its devices renamed in stage order, the devices' records but their names, and
    per stage pair the routes both ways as (link direction, numbered by first use; latency;
    bandwidth). Given only where the simulation provably depends on nothing else: GPUs priced
    by the what-if roofline without calibration (a pure function of the device record), the
    optimizer on the devices, no offload, tensor split, tied weights or asynchronous sync, so
    that every task holds one resource and the event loop's times do not depend on resource
    ids, only on which tasks share one. None elsewhere (solve_batches then simulates)."""
    sim = getattr(simulator, "simulators", {}).get(plan.precision, simulator)
    if (len(plan.replicas) != 1 or plan.sync.mode != "sync" or plan.optimizer.placement != "device"
            or type(sim.cost) is not RooflineCost or sim.cost.calibration is not None or sim.graph.tied):
        return None
    stages = plan.replicas[0].stages
    names = list(dict.fromkeys(st.device for st in stages))
    devices = [sim.topology.device(d) for d in names]
    if any(st.split or st.offload_activations for st in stages) or any(d.kind == "cpu" for d in devices):
        return None
    links: dict[int, int] = {}
    try:
        routes = tuple(tuple((links.setdefault(h.resource, len(links)), h.latency_s, h.bandwidth_bytes_per_s)
                             for h in sim.hops(x, y))
                       for a, b in zip(stages, stages[1:]) for x, y in ((a.device, b.device), (b.device, a.device)))
    except ValueError:   # no route: the simulator refuses the plan
        return None
    rename = {d: f"cuda:{k}" for k, d in enumerate(names)}
    renamed = replace(plan, replicas=(replace(plan.replicas[0], stages=tuple(
        replace(st, device=rename[st.device]) for st in stages)),))
    return plan_key(renamed), tuple(repr(replace(d, name="")) for d in devices), routes


CAPTURE_BATCH = 8   # graphs for planning are captured at min(global batch, this) and scaled


def plan_problem(workload, model, global_batch: int, topology, optimizer_name: str, lr: float,
                 precisions: tuple[str, ...] = ("fp32",)):
    """(graph, problem) for planning `workload` on `topology`: the operator graph captured at
    min(global_batch, CAPTURE_BATCH) samples in each allowed precision (FLOPs and activations
    scale linearly with the batch), the strategy space, and one simulator per precision with the
    cost model the topology calls for (measured on a profile of this machine, else the contract's
    roofline). The graph returned is the first precision's."""
    from planner.workload.capture import capture_graph
    from planner.sim.simulator import ByPrecision, Simulator

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
    return first, simulator_problem(ByPrecision(sims), space)


def plan_baselines(plan: Plan, topology, file: str = "<plan>") -> list[Candidate]:
    """The baselines `hetplan plan` evaluated for this plan's workload, batch, optimizer and
    first allowed precision (`predicted.search.precisions`, else the plan's), regenerated as
    plans (the plan file stores only their predicted figures)."""
    from planner.files.io import InputError
    from planner.files.plan import PRECISIONS
    from planner.workload.load import load_plan_workload

    searched = plan.predicted.extra.get("search") if plan.predicted else None
    allowed = searched.get("precisions", [plan.precision]) if isinstance(searched, dict) else [plan.precision]
    if not (isinstance(allowed, list) and allowed and all(a in PRECISIONS for a in allowed)):
        raise InputError(f"{file}: predicted.search.precisions: expected a non-empty list of "
                         f"{', '.join(PRECISIONS)}, got {str(allowed)[:60]}")
    workload = load_plan_workload(plan.model, file)
    _, problem = plan_problem(workload, plan.model, plan.global_batch, topology,
                              plan.optimizer.name, plan.optimizer.lr, (allowed[0],))
    return Searcher(problem, random.Random(0)).baselines()


__all__ = ["CAPTURE_BATCH", "make_space", "simulator_problem", "twin_key", "plan_problem", "plan_baselines"]
