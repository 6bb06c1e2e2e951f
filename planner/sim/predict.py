"""What the simulator predicts for a plan file: validate it, capture its model's graph, choose
the cost model (planner.cost.timing.cost_model), simulate.

Shared by `hetplan simulate` and `hetplan compare`, so that both predict the same numbers for the
same files (each finds the topology with planner.hardware.lookup.plan_topology).
"""
from __future__ import annotations

from pathlib import Path

from planner.files.io import InputError
from planner.files.plan import Plan
from planner.hardware.topology import Topology


def simulate_plan_file(plan: Plan, plan_path: str | Path, topology: Topology, trace: bool = False):
    """Validate `plan` against `topology` and its model's graph, and simulate one iteration.

    The graph is captured at the largest microbatch of the plan (activation quantities scale
    linearly with the batch from there), in the plan's precision. Returns
    planner.sim.simulator.SimResult."""
    from planner.workload.capture import capture_graph
    from planner.files.plan import validate_plan
    from planner.cost.timing import cost_model
    from planner.sim.deadlock import Deadlock
    from planner.sim.simulator import Simulator
    from planner.hardware.lookup import measured_here
    from planner.workload.load import load_plan_workload

    names = {d.name for d in topology.devices}
    validate_plan(plan, str(plan_path), None, names)   # before the (slower) capture
    workload = load_plan_workload(plan.model, str(plan_path), weights=measured_here(topology))   # else priced by shapes
    batch = max(b // r.microbatches for b, r in zip(plan.replica_batches(), plan.replicas))
    graph = capture_graph(workload, batch, plan.precision)
    validate_plan(plan, str(plan_path), graph.num_layers, names)
    cost = cost_model(graph, topology, workload, plan.global_batch)
    try:
        return Simulator(graph, topology, cost).simulate(plan, trace=trace)
    except Deadlock as e:   # the header line, then the grid of the tasks that ran and the blocked ones
        head, _, grid = str(e).partition("\n")
        raise InputError(f"{plan_path}: schedule: {head}", detail=grid) from None
    except (ValueError, KeyError) as e:
        raise InputError(f"{plan_path}: replicas: {str(e).strip(chr(39))}") from None


__all__ = ["simulate_plan_file"]
