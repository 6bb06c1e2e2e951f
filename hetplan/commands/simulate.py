"""`hetplan simulate PLAN`: predict one training iteration of any valid plan."""
from __future__ import annotations

import json
import sys

HELP = "predict one training iteration of a plan: time, per-device busy time, peak memory"


def add_arguments(p):
    p.add_argument("plan", metavar="PLAN", help="plan file (hetplan.plan/1)")
    p.add_argument("--topology", metavar="T",
                   help="topology file or shipped name; default: the cached profile or file under profiles/ whose sha256 the plan records")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (chrome://tracing, Perfetto)")
    p.add_argument("--grid", action="store_true", help="print each replica's schedule as a step x device grid")


def _summary(pred, topology) -> str:
    result, (lo, hi) = pred.result, pred.interval
    lines = [f"iteration: {result.iteration_s * 1e3:.3f} ms   {pred.probability:.0%} interval "
             f"{lo * 1e3:.3f}-{hi * 1e3:.3f} ms ({pred.basis})   feasible: {'yes' if result.feasible else 'NO'}",
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
    from hetplan.planner.files.plan import load_plan
    from hetplan.planner.hardware.lookup import plan_topology
    from hetplan.planner.sim.predict import predict_plan_file
    from hetplan.planner.files.plan import PIPEDREAM_MODES
    from hetplan.planner.sim.build import STREAM_ITERATIONS
    from hetplan.planner.files.schedule import grid, make_schedule
    from hetplan.planner.sim.chrome_trace import write_chrome_trace

    plan = load_plan(args.plan)
    topology = plan_topology(plan, args.plan, args.topology, "hetplan simulate")
    pred = predict_plan_file(plan, args.plan, topology, trace=bool(args.trace))
    result = pred.result
    if args.trace:
        write_chrome_trace(result, args.trace)
        print(f"hetplan simulate: wrote trace {args.trace}", file=sys.stderr)
    if args.json:
        print(json.dumps({**result.to_json(), "iteration_s_interval": list(pred.interval),
                          "interval_probability": pred.probability, "interval_basis": pred.basis,
                          "engine": result.engine}))   # hetplan.planner.sim.engines
        return 0
    print(_summary(pred, topology))
    if args.grid:
        stream = STREAM_ITERATIONS if plan.sync.mode in PIPEDREAM_MODES else 1   # no flush between iterations
        for r, rep in enumerate(plan.replicas):
            what = f"{rep.microbatches} microbatches" + (f" x {stream} iterations, no flush" if stream > 1 else "")
            print(f"\nreplica {r} ({plan.schedule}, {what}):")
            devs = (list(rep.pipeline_devices) if plan.schedule == "interleaved-1f1b"
                    else ["+".join(st.devices) for st in rep.stages])     # a split stage: its devices
            print(grid(make_schedule(plan.schedule, len(rep.stages), rep.microbatches * stream, len(devs)), devs))
    return 0
