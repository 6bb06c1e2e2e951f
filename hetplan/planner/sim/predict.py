"""What the simulator predicts for a plan file: validate it, capture its model's graph, choose
the cost model (hetplan.planner.cost.timing.cost_model), simulate.

Shared by `hetplan simulate` and `hetplan compare`, so that both predict the same numbers for the
same files (each finds the topology with hetplan.planner.hardware.lookup.plan_topology).
"""
from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.topology import Topology
from hetplan.planner.sim.interval import PROBABILITY, Draws, judge, spread_of


@dataclass(frozen=True)
class Prediction:
    """A plan's simulated iteration and the interval expected to hold its measured median."""
    result: object                      # hetplan.planner.sim.simulator.SimResult
    interval: tuple[float, float]
    probability: float
    basis: str                          # the class whose residual error widened it
    simulator: object = None            # the Simulator it was priced on (its graph and cost model)

    @property
    def iteration_s(self) -> float:
        return self.result.iteration_s


def simulate_plan_file(plan: Plan, plan_path: str | Path, topology: Topology, trace: bool = False):
    """simulate one iteration of `plan` (`predict_plan_file`'s result)."""
    return predict_plan_file(plan, plan_path, topology, trace, interval=False).result


def predict_plan_file(plan: Plan, plan_path: str | Path, topology: Topology, trace: bool = False,
                      interval: bool = True) -> Prediction:
    """Validate `plan` against `topology` and its model's graph, simulate one iteration and,
    with `interval`, draw its interval (hetplan.planner.sim.interval).

    The graph is captured at the largest microbatch of the plan (activation quantities scale
    linearly with the batch from there), in the plan's precision."""
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.files.plan import validate_plan
    from hetplan.planner.cost.timing import cost_model
    from hetplan.planner.sim.deadlock import Deadlock
    from hetplan.planner.sim.simulator import Simulator
    from hetplan.planner.hardware.lookup import measured_here
    from hetplan.planner.workload.load import load_plan_workload
    from hetplan.planner.workload.step_check import check_step

    names = {d.name for d in topology.devices}
    validate_plan(plan, str(plan_path), None, names)   # before the (slower) capture
    workload = load_plan_workload(plan.model, str(plan_path), weights=measured_here(topology))   # else priced by shapes
    check_step(workload, plan.global_batch, f"{plan_path}: model.spec", plan.model.spec)
    batch = max(b // r.microbatches for b, r in zip(plan.replica_batches(), plan.replicas))
    graph = capture_graph(workload, batch, plan.precision)
    validate_plan(plan, str(plan_path), graph.num_layers, names)
    cost = cost_model(graph, topology, workload, plan.global_batch)
    sim = Simulator(graph, topology, cost)
    try:
        result = sim.simulate(plan, trace=trace)
    except Deadlock as e:   # the header line, then the grid of the tasks that ran and the blocked ones
        head, _, grid = str(e).partition("\n")
        raise InputError(f"{plan_path}: schedule: {head}", detail=grid) from None
    except (ValueError, KeyError) as e:
        raise InputError(f"{plan_path}: replicas: {str(e).strip(chr(39))}") from None
    if not interval:
        return Prediction(result, (result.iteration_s, result.iteration_s), PROBABILITY, "", sim)
    j = judge(Draws(sim, spread_of(topology)), "plan", plan, measured_here(topology))
    return Prediction(result, j.interval(), PROBABILITY, j.residual.basis, sim)


__all__ = ["Prediction", "simulate_plan_file", "predict_plan_file"]
