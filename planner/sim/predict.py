"""What the simulator predicts for a plan file: find its topology, choose the cost model, simulate.

Shared by `hetplan simulate` and `hetplan compare`, so that both predict the same numbers for the
same files: the topology is `--topology` when given (a warning when it is not the file the plan
was made for), else the file under profiles/ whose sha256 the plan records; the cost model is the
measured one on a topology profiled on this machine, else the roofline model of the contract.
"""
from __future__ import annotations

from pathlib import Path

from planner.files.io import InputError
from planner.files.plan import Plan
from planner.hardware.topology import Topology


def cost_model(graph, topology: Topology, workload):
    """The measured model on a topology profiled on this machine, else the roofline model."""
    from planner.cost.model import RooflineCost
    from planner.cost.timing import MeasuredCost
    from planner.hardware.lookup import measured_here

    if measured_here(topology):
        return MeasuredCost(graph, topology, workload)
    return RooflineCost(graph, topology)


def simulate_plan_file(plan: Plan, plan_path: str | Path, topology: Topology, trace: bool = False):
    """Validate `plan` against `topology` and its model's graph, and simulate one iteration.

    The graph is captured at the largest microbatch of the plan (activation quantities scale
    linearly with the batch from there), in the plan's precision. Returns
    planner.sim.simulator.SimResult."""
    from planner.workload.graph import capture_graph
    from planner.files.plan import validate_plan
    from planner.sim.simulator import Simulator
    from planner.workload.load import load_plan_workload

    names = {d.name for d in topology.devices}
    validate_plan(plan, str(plan_path), None, names)   # before the (slower) capture
    workload = load_plan_workload(plan.model, str(plan_path))
    batch = max(b // r.microbatches for b, r in zip(plan.replica_batches(), plan.replicas))
    graph = capture_graph(workload, batch, plan.precision)
    validate_plan(plan, str(plan_path), graph.num_layers, names)
    cost = cost_model(graph, topology, workload)
    try:
        return Simulator(graph, topology, cost).simulate(plan, trace=trace)
    except (ValueError, KeyError) as e:
        raise InputError(f"{plan_path}: replicas: {str(e).strip(chr(39))}") from None


__all__ = ["cost_model", "simulate_plan_file"]
