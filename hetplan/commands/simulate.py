"""`hetplan simulate PLAN`: predict one training iteration of any valid plan."""
from __future__ import annotations

import json
import sys

HELP = "predict one training iteration of a plan: time, per-device busy time, peak memory"


def add_arguments(p):
    p.add_argument("plan", metavar="PLAN", help="plan file (hetplan.plan/1)")
    p.add_argument("--topology", metavar="T",
                   help="topology file; default: the file under profiles/ whose sha256 the plan records")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (chrome://tracing, Perfetto)")
    p.add_argument("--grid", action="store_true", help="print each replica's schedule as a step x device grid")


def _find_topology(args, plan):
    from planner.io import InputError
    from planner.topology import find_topology_by_sha256, load_topology

    if args.topology:
        topo = load_topology(args.topology)
        if plan.topology is not None and topo.sha256 != plan.topology.sha256:
            print(f"hetplan simulate: warning: {args.topology} is not the topology the plan was made "
                  f"for ({plan.topology.name}, sha256 {plan.topology.sha256[:12]}...)", file=sys.stderr)
        return topo
    if plan.topology is None:
        raise InputError(f"{args.plan}: topology: the plan names no topology; pass --topology FILE")
    path = find_topology_by_sha256(plan.topology.sha256)
    if path is None:
        raise InputError(f"{args.plan}: topology: no file under profiles/ has sha256 "
                         f"{plan.topology.sha256[:12]}... ({plan.topology.name}); pass --topology FILE")
    return load_topology(path)


def cost_model(graph, topology, workload):
    """The measured model on a topology profiled on this machine, else the roofline model."""
    from planner.cost import RooflineCost
    from planner.layer_timing import MeasuredCost, measured_here

    if measured_here(topology):
        return MeasuredCost(graph, topology, workload)
    return RooflineCost(graph, topology)


def _summary(result, topology) -> str:
    lines = [f"iteration: {result.iteration_s * 1e3:.3f} ms   feasible: {'yes' if result.feasible else 'NO'}",
             f"{'device':<16} {'busy ms':>10} {'fwd ms':>9} {'bwd ms':>9} {'optim ms':>9} "
             f"{'comm ms':>9} {'peak MB':>10} {'of MB':>10}"]
    for d, v in result.per_device.items():
        cap = topology.device(d).memory_bytes
        flag = "" if v["peak_memory_bytes"] <= cap else "  over memory"
        lines.append(f"{d:<16} {v['busy_s'] * 1e3:>10.3f} {v['fwd_s'] * 1e3:>9.3f} {v['bwd_s'] * 1e3:>9.3f} "
                     f"{v['optimizer_s'] * 1e3:>9.3f} {v['comm_s'] * 1e3:>9.3f} "
                     f"{v['peak_memory_bytes'] / 1e6:>10.1f} {cap / 1e6:>10.0f}{flag}")
    return "\n".join(lines)


def main(args) -> int:
    from planner.graph import capture_graph
    from planner.io import InputError
    from planner.plan import load_plan, validate_plan
    from planner.schedule import grid, make_schedule
    from planner.simulator import Simulator
    from planner.trace import write_chrome_trace
    from planner.workload import load_workload

    plan = load_plan(args.plan)
    topology = _find_topology(args, plan)
    validate_plan(plan, args.plan, None, {d.name for d in topology.devices})  # before the capture
    workload = load_workload(plan.model.spec, plan.model.args)
    batch = max(b // r.microbatches for b, r in zip(plan.replica_batches(), plan.replicas))
    graph = capture_graph(workload, batch)
    validate_plan(plan, args.plan, graph.num_layers, {d.name for d in topology.devices})
    cost = cost_model(graph, topology, workload)
    try:
        result = Simulator(graph, topology, cost).simulate(plan, trace=bool(args.trace))
    except (ValueError, KeyError) as e:
        raise InputError(f"{args.plan}: replicas: {str(e).strip(chr(39))}") from None
    if args.trace:
        write_chrome_trace(result, args.trace)
        print(f"hetplan simulate: wrote trace {args.trace}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(_summary(result, topology))
    if args.grid:
        for r, rep in enumerate(plan.replicas):
            print(f"\nreplica {r} ({plan.schedule}, {rep.microbatches} microbatches):")
            print(grid(make_schedule(plan.schedule, len(rep.stages), rep.microbatches), list(rep.devices)))
    return 0
