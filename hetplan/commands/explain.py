"""`hetplan explain PLAN`: where the plan's predicted iteration goes and why the others lose."""
from __future__ import annotations

import json
import sys

HELP = "where a plan's predicted iteration goes: its critical path, what binds it, memory headroom, the next-best plans"


def add_arguments(p):
    p.add_argument("plan", metavar="PLAN", help="plan file (hetplan.plan/1)")
    p.add_argument("--topology", metavar="T",
                   help="topology file or shipped name; default: the cached profile or file under profiles/ whose sha256 the plan records")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the next-best plans (they are regenerated and simulated: a few seconds)")


def explain_plan(plan, plan_path: str, topology, baselines: bool = True) -> dict:
    """The explanation as `explain --json` prints it."""
    from hetplan.planner.sim.explain import binding, by_kind, critical_path
    from hetplan.planner.sim.predict import predict_plan_file

    pred = predict_plan_file(plan, plan_path, topology, trace=True)
    result = pred.result
    path = critical_path(result.tasks, result.iteration_s)
    lane, held = binding(path)
    out = {"iteration_s": result.iteration_s, "iteration_s_interval": list(pred.interval),
           "critical_path": [s.to_json() for s in path], "by_kind": by_kind(path),
           "binding": {"lane": lane, "seconds": held},
           "memory_headroom_bytes": {d: topology.device(d).memory_bytes - v["peak_memory_bytes"]
                                     for d, v in result.per_device.items()},
           "per_device": {d: {"busy_s": v["busy_s"], "idle_s": v["idle_s"]} for d, v in result.per_device.items()}}
    if baselines:
        out["next_best"] = _next_best(plan, plan_path, topology, out["by_kind"], pred.simulator)
    return out


def _next_best(plan, plan_path: str, topology, mine: dict[str, float], simulator) -> list[dict]:
    """The plan's baselines (regenerated as `plan` made them), each simulated on the explained
    plan's simulator (one capture) unless in another precision: its time and the kinds of work it
    spends more on than this plan."""
    from hetplan.planner.files.plan import plan_key
    from hetplan.planner.search.problem import plan_baselines
    from hetplan.planner.sim.explain import by_kind, critical_path
    from hetplan.planner.sim.predict import simulate_plan_file

    seen, rows = {plan_key(plan)}, []
    for c in plan_baselines(plan, topology, plan_path):
        if not c.feasible or plan_key(c.plan) in seen:
            continue
        seen.add(plan_key(c.plan))
        r = (simulator.simulate(c.plan, trace=True) if c.plan.precision == plan.precision
             else simulate_plan_file(c.plan, plan_path, topology, trace=True))
        theirs = by_kind(critical_path(r.tasks, r.iteration_s))
        more = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in set(theirs) | set(mine)}
        rows.append({"name": c.name, "iteration_s": r.iteration_s,
                     "loses_on": {k: v for k, v in sorted(more.items(), key=lambda kv: -kv[1])
                                  if v > 1e-6 * r.iteration_s}})
    return sorted(rows, key=lambda r: r["iteration_s"])


def main(args) -> int:
    from hetplan.planner.files.plan import load_plan
    from hetplan.planner.hardware.lookup import plan_topology

    plan = load_plan(args.plan)
    topology = plan_topology(plan, args.plan, args.topology, "hetplan explain")
    out = explain_plan(plan, args.plan, topology, baselines=not args.no_baselines)
    if args.json:
        print(json.dumps(out))
        return 0
    ms = lambda s: f"{s * 1e3:.3f} ms"  # noqa: E731
    lo, hi = out["iteration_s_interval"]
    print(f"predicted iteration {ms(out['iteration_s'])} (90% interval {ms(lo)}-{ms(hi)})")
    print("critical path, in time order:")
    for s in out["critical_path"]:
        print(f"  {s['kind']:<12} {s['device'] or '-':<24} {ms(s['seconds']):>12}")
    kinds = ", ".join(f"{k} {ms(v)}" for k, v in sorted(out["by_kind"].items(), key=lambda kv: -kv[1]))
    print(f"by kind: {kinds}")
    print(f"binds: {out['binding']['lane']} ({ms(out['binding']['seconds'])} of the path)")
    for d, v in out["per_device"].items():
        print(f"  {d:<16} busy {ms(v['busy_s'])}, idle {ms(v['idle_s'])}, memory headroom "
              f"{out['memory_headroom_bytes'][d] / 1e6:.1f} MB")
    for r in out.get("next_best", []):
        loses = ", ".join(f"{k} +{ms(v)}" for k, v in r["loses_on"].items()) or "nothing on its critical path"
        print(f"next best: {r['name']}: {ms(r['iteration_s'])}; spends more on {loses}")
    print(f"hetplan explain: {args.plan}", file=sys.stderr)
    return 0
