"""What the simulator predicts for a plan file: find its topology, choose the cost model, simulate.

Shared by `hetplan simulate` and `hetplan compare`, so that both predict the same numbers for the
same files: the topology is `--topology` when given (a warning when it is not the file the plan
was made for), else the file under profiles/ whose sha256 the plan records; the cost model is the
measured one on a topology profiled on this machine, else the roofline model of the contract.
"""
from __future__ import annotations

import sys
from pathlib import Path

from planner.files.io import InputError
from planner.files.plan import Plan
from planner.hardware.topology import Topology, find_topology_by_sha256, load_topology


def load_given_topology(plan: Plan, topology_path: str | Path, command: str = "hetplan") -> Topology:
    """The topology file the user named; a warning (not a failure) when it is not the file the
    plan was made for (the contract: `simulate` and `run` accept another one)."""
    topo = load_topology(topology_path)
    if plan.topology is not None and topo.sha256 != plan.topology.sha256:
        print(f"{command}: warning: {topology_path} is not the topology the plan was made "
              f"for ({plan.topology.name}, sha256 {plan.topology.sha256[:12]}...)", file=sys.stderr)
    return topo


def find_topology(plan: Plan, plan_path: str | Path, topology_path: str | Path | None,
                  command: str = "hetplan") -> Topology:
    """The topology to simulate `plan` on (see the module docstring); warnings go to stderr."""
    if topology_path:
        return load_given_topology(plan, topology_path, command)
    if plan.topology is None:
        raise InputError(f"{plan_path}: topology: the plan names no topology; pass --topology FILE")
    plan_dir = Path(plan_path).resolve().parent
    roots = [Path("profiles"), plan_dir, plan_dir / "profiles", Path(__file__).resolve().parent.parent / "profiles"]
    path = find_topology_by_sha256(plan.topology.sha256, roots)
    if path is None:
        raise InputError(f"{plan_path}: topology: no file under profiles/ or beside the plan has sha256 "
                         f"{plan.topology.sha256[:12]}... ({plan.topology.name}); pass --topology FILE")
    return load_topology(path)


def cost_model(graph, topology: Topology, workload, global_batch: int):
    """On a topology profiled on this machine, the measured model with its cost curve over
    `batch_grid(global_batch)` (so `plan` and `simulate` price a plan alike); else the roofline."""
    from planner.cost.model import RooflineCost
    from planner.cost.timing import MeasuredCost, batch_grid, measured_here

    if measured_here(topology):
        return MeasuredCost(graph, topology, workload, sizes=batch_grid(global_batch))
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
    cost = cost_model(graph, topology, workload, plan.global_batch)
    try:
        return Simulator(graph, topology, cost).simulate(plan, trace=trace)
    except (ValueError, KeyError) as e:
        raise InputError(f"{plan_path}: replicas: {str(e).strip(chr(39))}") from None


__all__ = ["load_given_topology", "find_topology", "cost_model", "simulate_plan_file"]
