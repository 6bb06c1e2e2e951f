"""`hetplan compare PLAN MEASURED`: predicted vs measured, per iteration and per device.

The prediction is the plan's recorded `predicted.iteration_s` (what the planner chose on) when
present, else the simulator's; per-device figures come from simulating the plan again on its
topology (found as `hetplan simulate` finds it: hetplan.planner.sim.predict). See hetplan/planner/files/report.py for
what each side measures and hetplan/planner/files/plot.py for the timeline of `--plot`.
"""
from __future__ import annotations

import json
import sys

HELP = "predicted vs measured: iteration time, per-device busy time and peak memory, error in percent"


def add_arguments(p):
    p.add_argument("plan", metavar="PLAN", help="plan file (hetplan.plan/1)")
    p.add_argument("measured", metavar="MEASURED", help="measured file written by `hetplan run` (hetplan.measured/1)")
    p.add_argument("--topology", metavar="T",
                   help="topology file or shipped name; default: the cached profile or file under profiles/ whose sha256 the plan records")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a timeline: simulated lanes above measured lanes, one per device")


def priced_at_shares(plan, simulator, measured, file: str) -> dict | None:
    """A rebalanced run (`run --rebalance`: the measured file's `shares`, more than one set) priced
    with the shares in force: each set simulated, weighted by the steps it held. None otherwise."""
    from dataclasses import replace

    from hetplan.planner.files.io import InputError
    history, steps = measured.extra.get("shares"), measured.extra.get("steps")
    if not isinstance(history, list) or len(history) < 2:
        return None
    if not (isinstance(steps, list) and len(steps) == 2 and all(isinstance(s, int) for s in steps)):
        raise InputError(f"{file}: steps: expected [first, total] with the shares, got {str(steps)[:60]}")
    devices = [r.stages[0].device for r in plan.replicas]
    total_s, held = 0.0, 0
    for i, h in enumerate(history):
        shares = h.get("shares") if isinstance(h, dict) else None
        if not (isinstance(shares, dict) and set(shares) == set(devices) and isinstance(h.get("step"), int)
                and all(isinstance(v, (int, float)) and 0 < v <= 1 for v in shares.values())):
            raise InputError(f"{file}: shares[{i}]: expected {{\"step\", \"shares\": {{device: fraction}}}} "
                             f"over the plan's replicas ({', '.join(devices)})")
        end = history[i + 1]["step"] if i + 1 < len(history) else steps[1]
        n = max(0, min(end, steps[1]) - max(h["step"], steps[0]))
        priced = replace(plan, replicas=tuple(replace(r, batch_fraction=shares[d])
                                              for r, d in zip(plan.replicas, devices)))
        total_s += n * simulator.simulate(priced).iteration_s
        held += n
    if held == 0:
        return None
    predicted = total_s / held
    return {"predicted_s": predicted, "measured_s": measured.iteration_s, "changes": len(history) - 1,
            "error_pct": 100 * (predicted - measured.iteration_s) / measured.iteration_s}


def compare_files(plan_path: str, measured_path: str, topology_path: str | None = None,
                  plot_path: str | None = None, command: str = "hetplan compare"):
    """Load, simulate and compare; optionally write the plot. Returns hetplan.planner.files.report.Comparison."""
    from hetplan.planner.files.io import InputError, file_sha256
    from hetplan.planner.files.measured import load_measured
    from hetplan.planner.files.plan import load_plan
    from hetplan.planner.hardware.lookup import plan_topology
    from hetplan.planner.sim.predict import predict_plan_file
    from hetplan.planner.files.report import compare
    from dataclasses import replace

    if plot_path is not None and not str(plot_path).lower().endswith(".png"):
        raise InputError(f"--plot: expected a file name ending in .png, got {plot_path!r}")
    plan = load_plan(plan_path)
    measured = load_measured(measured_path)
    matches = measured.plan_sha256 == file_sha256(plan_path)
    if not matches:
        print(f"{command}: warning: {measured_path} was measured for another plan file "
              f"(sha256 {measured.plan_sha256[:12]}...), not {plan_path}", file=sys.stderr)
    differs = conditions_differ(plan, measured)
    if differs:
        print(f"{command}: note: the run differs from the conditions the plan was priced in: "
              f"{'; '.join(differs)}", file=sys.stderr)
    topology = plan_topology(plan, plan_path, topology_path, command)
    pred = predict_plan_file(plan, plan_path, topology, trace=plot_path is not None)
    result = pred.result
    recorded = plan.predicted.iteration_s if plan.predicted is not None else None
    # the interval of the prediction compared: the plan's own where it records one
    span, prob = pred.interval, pred.probability
    if recorded is not None and plan.predicted.iteration_s_interval is not None:
        span, prob = plan.predicted.iteration_s_interval, plan.predicted.interval_probability
    comparison = compare(recorded, result.to_json(), measured, matches, span, prob)
    comparison = replace(comparison, at_shares=priced_at_shares(plan, pred.simulator, measured, measured_path))
    if plot_path is not None:
        from hetplan.planner.files.plot import plot_timeline
        events = {d: v.get("events") or [] for d, v in measured.per_device.items()}
        it = next((v["events_iteration"] for v in measured.per_device.values()
                   if isinstance(v.get("events_iteration"), int)), None)
        meas_s = measured.iterations_s[it] if it is not None and 0 <= it < len(measured.iterations_s) else None
        plot_timeline(list(result.tasks), result.iteration_s, list(dict.fromkeys(plan.devices)), events,
                      meas_s, plot_path, title=f"{plan.model.spec} batch {plan.global_batch}: "
                                               f"{plan_path}")
        print(f"{command}: wrote {plot_path}", file=sys.stderr)
    return comparison


def conditions_differ(plan, measured) -> list[str]:
    """How the measured run's threads, host and cores differ from those the plan records."""
    t = plan.topology
    if t is None:
        return []
    out = []
    for d, n in t.threads:
        got = measured.per_device.get(d, {}).get("threads")
        if isinstance(got, int) and got != n:
            out.append(f"{d} ran {got} threads, priced at {n}")
    host = measured.host.get("hostname")
    if t.host is not None and host is not None and host != t.host:
        out.append(f"measured on host {host}, priced on {t.host}")
    cores = measured.host.get("usable_cores")
    if t.cpu_cores is not None and isinstance(cores, int) and cores != t.cpu_cores:
        out.append(f"{cores} CPU cores here, {t.cpu_cores} where priced")
    return out


def format_table(comparison) -> str:
    import pandas as pd

    from hetplan.planner.files.report import table_rows
    df = pd.DataFrame(table_rows(comparison))
    return df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3f}")


def summary_line(comparison) -> str:
    src = "recorded in the plan" if comparison.prediction_source == "plan" else "simulated"
    err = comparison.error_pct
    line = (f"iteration: predicted {comparison.predicted_s * 1e3:.3f} ms ({src}), measured "
            f"{comparison.measured_s * 1e3:.3f} ms, error {err:+.1f}%")
    if comparison.interval is None:
        return line
    lo, hi = comparison.interval
    return (f"{line}; {comparison.interval_probability:.0%} interval {lo * 1e3:.3f}-{hi * 1e3:.3f} ms, "
            f"measured {'inside' if comparison.inside else 'OUTSIDE'}")


def time_to_loss(plan_path: str, measured_path: str) -> dict | None:
    """For a plan chosen by time to a target loss (its `predicted.time_to_loss`): predicted and
    measured iterations and seconds to the target; measured iterations come from the measured
    losses with the planner's running mean (None when the run did not reach the target)."""
    import math

    from hetplan.planner.files.measured import load_measured
    from hetplan.planner.files.plan import load_plan
    from hetplan.planner.search.convergence import iterations_to

    plan = load_plan(plan_path)
    ttl = plan.predicted.extra.get("time_to_loss") if plan.predicted is not None else None
    if not isinstance(ttl, dict) or not isinstance(ttl.get("target_loss"), (int, float)):
        return None
    measured = load_measured(measured_path)
    its = iterations_to(list(measured.losses), ttl["target_loss"])
    reached = its <= len(measured.losses)
    return {"target_loss": ttl["target_loss"], "predicted_iterations": ttl.get("iterations"),
            "predicted_s": ttl.get("time_s"), "measured_iterations": its if reached else None,
            "measured_s": its * measured.iteration_s if reached and math.isfinite(its) else None}


def main(args) -> int:
    comparison = compare_files(args.plan, args.measured, args.topology, args.plot)
    ttl = time_to_loss(args.plan, args.measured)
    if args.json:
        print(json.dumps({**comparison.to_json(), **({"time_to_loss": ttl} if ttl else {})}))
        return 0
    print(summary_line(comparison))
    if comparison.at_shares:
        a = comparison.at_shares
        print(f"with the shares in force ({a['changes']} changes while it ran): predicted {a['predicted_s'] * 1e3:.3f} ms, "
              f"measured {a['measured_s'] * 1e3:.3f} ms, error {a['error_pct']:+.1f}%")
    if ttl:
        meas = (f"measured {ttl['measured_iterations']:.0f} iterations, {ttl['measured_s']:.3g} s"
                if ttl["measured_s"] is not None else "not reached in the measured run")
        print(f"time to loss {ttl['target_loss']:g}: predicted {ttl['predicted_iterations']:.0f} iterations, "
              f"{ttl['predicted_s']:.3g} s; {meas}")
    print(format_table(comparison))
    return 0
