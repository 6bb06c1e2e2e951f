"""Plan quality: the planner's plan vs the plans a user would try, all measured for real.

For each workload (mlp, gpt, cnn, sized for the topology in benchmarks/plan_sets.py): `hetplan plan` on this
machine's profile, then every baseline of hetplan/planner/search/baselines.py regenerated as the search does
(`Searcher.baselines`), then each distinct plan predicted and run (`hetplan run`, median after
warm-up, on a quiet machine). Reports the measured speedup of the chosen plan over the best
measured baseline (target >= 1.0 within noise) and every pair of plans whose predicted and
measured order disagree (Kendall tau per workload).

    python benchmarks/plan_quality.py [--topology FILE] [--only gpt]
                                      [--iters 12] [--warmup 3] [--csv out/plan_quality.csv]
                                      [--check] [--quick] [--results PATH | --no-results]

`--check` exits 1 when the chosen plan is measured slower than the best baseline by more than
`--noise` (default 5 %). The run's figures go to the `plan_quality` section of
benchmarks/results/<hostname>.json (benchmarks/results.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)
from accuracy import (_write_csv, ensure_topology, kendall_tau, load_avg,  # noqa: E402
                      predict, run_plan, wait_quiet)
from benchmarks.plan_sets import plan_with_hetplan, workloads_for  # noqa: E402
from benchmarks.results import (add_results_arguments, check_results_file,  # noqa: E402
                                plan_quality_payload, results_target, save_section)
from benchmarks.paths import benchmark_profile  # noqa: E402


def plan_workload(w: str, spec: dict, topo_path: Path, out: Path) -> Path:
    return plan_with_hetplan(spec, topo_path, out / f"{w}.plan.json", "--json")


def baseline_plans(plan_path: Path, topology, out: Path) -> dict[str, Path]:
    """Every baseline of the search for the plan's workload, saved as plan files (name -> path);
    the ones identical to the chosen plan are left out (they would be measured twice)."""
    from hetplan.planner.files.plan import Predicted, TopologyRef, load_plan, plan_key, save_plan
    from hetplan.planner.search.problem import plan_baselines

    plan = load_plan(plan_path)
    seen = {plan_key(plan): "chosen"}
    paths = {}
    for c in plan_baselines(plan, topology, str(plan_path)):
        key = plan_key(c.plan)
        if key in seen or not c.feasible:
            continue
        seen[key] = c.name
        path = out / f"{plan_path.stem.split('.')[0]}.{c.name}.json"
        save_plan(replace(c.plan, topology=TopologyRef(topology.name, topology.sha256),
                          predicted=Predicted(c.iteration_s, c.peak_memory_bytes,
                                              extra={"baseline": c.name})), path)
        paths[c.name] = path
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None, help="default: the benchmarks' profile of this machine, two CPU workers (benchmarks/paths.py), measured when missing")
    p.add_argument("--only", default=None, help="comma-separated workloads")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.05, help="slowdown tolerated by --check")
    p.add_argument("--csv", default="out/plan_quality.csv")
    p.add_argument("--out", default="out/plan_quality", help="plan and measured files go here")
    p.add_argument("--check", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: --iters 3 --warmup 1, one run per plan, no waiting for a quiet "
                        "machine (figures not meaningful; marked quick in the results file)")
    add_results_arguments(p)
    a = p.parse_args(argv)
    if a.quick:
        a.iters, a.warmup = 3, 1
    results_path = results_target(a)
    if not check_results_file("plan_quality", results_path):   # fail now, not after the runs
        return 2
    from hetplan.planner.hardware.topology import load_topology

    topo_path = Path(a.topology) if a.topology else benchmark_profile()
    ensure_topology(topo_path, 2, wait=not a.quick)
    topology = load_topology(topo_path)
    specs = workloads_for(topology)
    workloads = a.only.split(",") if a.only else list(specs)
    unknown = [w for w in workloads if w not in specs]
    if unknown:
        p.error(f"--only: expected workloads among {', '.join(specs)}, got {', '.join(unknown)}")
    load_before = load_avg()
    rows, summary = [], {}
    tmp = Path(a.out)
    tmp.mkdir(parents=True, exist_ok=True)
    if True:   # (the plans stay in --out for `hetplan compare`)
        for w in workloads:
            if not a.quick:
                wait_quiet()
            print(f"plan_quality: {w}: hetplan plan", file=sys.stderr)
            chosen = plan_workload(w, specs[w], topo_path, tmp)
            from hetplan.commands.plan import describe
            from hetplan.planner.files.plan import load_plan
            print(f"plan_quality: {w}: chosen {describe(load_plan(chosen))}", file=sys.stderr)
            plans = {"chosen": chosen, **baseline_plans(chosen, topology, tmp)}
            res = []
            for name, path in plans.items():
                busy = 0.0 if a.quick else wait_quiet()
                pred = predict(path, topology)
                m = run_plan(path, topo_path, a.iters, a.warmup, tmp, attempts=1 if a.quick else 4)
                res.append({"workload": w, "plan": name, "predicted_s": pred,
                            "measured_s": m["iteration_s"], "busy_before": busy,
                            "error_pct": 100 * (pred - m["iteration_s"]) / m["iteration_s"]})
                print(f"plan_quality: {w}/{name:<22} predicted {pred * 1e3:8.2f} ms  measured "
                      f"{m['iteration_s'] * 1e3:8.2f} ms", file=sys.stderr)
            rows += res
            summary[w] = _judge(res)
            choice = load_plan(chosen).predicted.extra.get("choice", {})
            summary[w].update(kept=choice.get("kept"), confirmed=bool(choice.get("confirm")),
                              probability_beats_best_baseline=choice.get("probability_beats_best_baseline"))
    _write_csv(Path(a.csv), rows)
    run = {"iters": a.iters, "warmup": a.warmup, "quick": a.quick}
    if results_path and not save_section("plan_quality", "plan_quality",
                                         plan_quality_payload(summary, rows, run), results_path):
        return 2
    failed = [w for w, s in summary.items() if s["speedup"] is not None and s["speedup"] < 1 - a.noise]
    if a.json:
        print(json.dumps({"per_workload": summary, "rows": rows, "load_before": load_before,
                          "load_after": load_avg(), "failed": failed}))
    else:
        for w, s in summary.items():
            sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "n/a (no distinct baseline)"
            best_ms = f"{s['best_baseline_s'] * 1e3:.2f} ms" if s["best_baseline"] else "-"
            print(f"{w}: chosen ({s.get('kept')}{', confirmed' if s.get('confirmed') else ''}) "
                  f"{s['chosen_s'] * 1e3:.2f} ms measured; best baseline "
                  f"{s['best_baseline']} {best_ms}; measured speedup {sp}; rank tau {s['tau']:.2f}")
            for d in s["disagree"]:
                print(f"  disagree: {d}")
        print(f"load average {load_before:.2f} before, {load_avg():.2f} after; wrote {a.csv}")
    if a.check and failed:
        print(f"plan_quality: chosen plan measured slower than the best baseline: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def _judge(res: list[dict]) -> dict:
    """Speedup of the chosen plan over the best measured baseline, and the pairs of plans whose
    predicted order differs from the measured order."""
    chosen = next(r for r in res if r["plan"] == "chosen")
    bases = [r for r in res if r["plan"] != "chosen"]
    best = min(bases, key=lambda r: r["measured_s"]) if bases else None
    disagree = []
    for i, x in enumerate(res):
        for y in res[i + 1:]:
            if (x["predicted_s"] - y["predicted_s"]) * (x["measured_s"] - y["measured_s"]) < 0:
                fast_p, slow_p = (x, y) if x["predicted_s"] < y["predicted_s"] else (y, x)
                disagree.append(f"predicted {fast_p['plan']} faster than {slow_p['plan']} "
                                f"({fast_p['predicted_s'] * 1e3:.1f} vs {slow_p['predicted_s'] * 1e3:.1f} ms), "
                                f"measured {fast_p['measured_s'] * 1e3:.1f} vs {slow_p['measured_s'] * 1e3:.1f} ms")
    return {"chosen_s": chosen["measured_s"],
            "best_baseline": best["plan"] if best else None,
            "best_baseline_s": best["measured_s"] if best else None,
            "speedup": best["measured_s"] / chosen["measured_s"] if best else None,
            "tau": kendall_tau([r["predicted_s"] for r in res], [r["measured_s"] for r in res]),
            "disagree": disagree}


if __name__ == "__main__":
    raise SystemExit(main())
