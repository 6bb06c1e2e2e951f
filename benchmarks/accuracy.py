"""Prediction accuracy: the simulator's iteration time vs `hetplan run` on this machine.

For a fixed set of hand-written plans (benchmarks/plan_sets.py), predict one iteration with the
simulator and the measured cost model (what `hetplan simulate` does on a topology profiled here),
run the plan for real `--repeats` times (`hetplan run`, median after warm-up, both at least
`--warmup`/`--iters` and WARMUP_S/MEASURED_S long: `run_window`; the plan's time is
the median of the runs, their spread shown beside it), and report MAPE, the worst error and
Kendall's tau, overall, per workload and per size class (microbatch, iteration time, pipeline
depth, sync). The plan set follows the topology: on CPU workers only, 51 plans over mlp, gpt,
cnn, a small-microbatch mlp and two Hugging Face models (Llama, ResNet; when `transformers` is
installed); with a GPU, plans of the GPU alone and of the CPU and the GPU together (batch split,
CPU pipeline stage, optimizer on the CPU).

    python benchmarks/accuracy.py [--topology FILE] [--csv out/accuracy.csv]
                                  [--iters 12] [--warmup 3] [--repeats 3] [--only mlp,gpt] [--check]
                                  [--quick] [--results PATH | --no-results]

The topology is profiled (`hetplan profile --cpu-workers 2`) when missing. `--check` exits 1
when a target is missed: MAPE <= 5 %, worst <= 10 %, tau >= 0.8. The machine load (1-minute
average) is printed before and after: the figures are only meaningful on a quiet machine.
The run's figures go to the `accuracy` section of benchmarks/results/<hostname>.json
(benchmarks/results.py).

Workloads are sized like training steps (iterations of 50-200 ms) so fixed per-message costs and
scheduling noise stay small against an iteration.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)
from benchmarks.plan_sets import plans_for, size_classes, workloads_for  # noqa: E402
from benchmarks.results import (accuracy_payload, add_results_arguments,  # noqa: E402
                                check_results_file, results_target, save_section)
from hetplan.planner.cost.timing import cache_path  # noqa: E402
from hetplan.planner.files.io import replace_atomically  # noqa: E402
from benchmarks.paths import benchmark_profile  # noqa: E402
from hetplan.runtime.host_load import ForeignCPU, busy_fraction  # noqa: E402

TARGETS = {"mape_pct": 5.0, "worst_pct": 10.0, "tau": 0.8,
           # the 90 % intervals: the share of measured medians inside, and their median width
           "coverage_pct": (80.0, 98.0), "width_pct": 20.0}
# A plan's warm-up and measured iterations last at least this long (at its predicted iteration
# time): a 2 ms two-worker plan still runs 3-7 ms iterations at its 3rd-8th iteration, so the
# median of iterations 3-11 read its steady state 0-75 % too slow (docs/tuning.md, "Small data
# parallel"); plans of 34 ms and more keep --warmup and --iters.
WARMUP_S, MEASURED_S = 0.1, 0.2


def load_avg() -> float:
    return os.getloadavg()[0]


def wait_quiet(max_busy: float = 0.15, max_wait_s: float = 300.0) -> float:
    """Wait until the machine is quiet (other engineers' tests, a previous run's stragglers):
    at most `max_busy` of the CPU used over one second, for up to `max_wait_s`. Returns the last
    busy fraction seen; it goes into the CSV so a noisy row can be told apart."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_fraction() or 0.0
    while busy > max_busy and time.monotonic() < deadline:
        print(f"accuracy: machine busy ({busy:.0%} CPU); waiting", file=sys.stderr)
        time.sleep(5)
        busy = busy_fraction() or 0.0
    return busy


def ensure_topology(path: Path, cpu_workers: int, again: bool = False, wait: bool = True) -> None:
    if path.exists() and not again:
        return
    if wait and Path("/proc/stat").exists():
        wait_quiet()
    print(f"accuracy: profiling this machine into {path} (hetplan profile --cpu-workers "
          f"{cpu_workers})", file=sys.stderr)
    subprocess.run(["hetplan", "profile", "--cpu-workers", str(cpu_workers), "-o", str(path)],
                   check=True, stdout=subprocess.DEVNULL)


def predict(plan_path: Path, topology) -> float:
    return prediction(plan_path, topology).iteration_s


def prediction(plan_path: Path, topology):
    """What `hetplan simulate` predicts: hetplan.planner.sim.predict.Prediction (time and interval)."""
    from hetplan.planner.files.plan import load_plan
    from hetplan.planner.sim.predict import predict_plan_file
    return predict_plan_file(load_plan(plan_path), plan_path, topology)


def _run_once(plan_path: Path, topology_path: Path, iters: int, warmup: int, out: Path) -> tuple[dict, float]:
    """One `hetplan run`; returns (measured file, foreign CPU fraction during it, ForeignCPU)."""
    cmd = ["hetplan", "run", str(plan_path), "--iters", str(iters), "--warmup", str(warmup),
           "--topology", str(topology_path), "-o", str(out), "--json"]
    if Path("/proc/stat").exists():
        with ForeignCPU() as fc:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=fc.env())
        foreign = fc.fraction()
    else:
        proc, foreign = subprocess.run(cmd, capture_output=True, text=True), 0.0
    if proc.returncode != 0:
        raise RuntimeError(f"hetplan run {plan_path.name} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(out.read_text()), foreign


def run_window(predicted_s: float, iters: int, warmup: int) -> tuple[int, int]:
    """(iters, warmup) for a plan predicted at `predicted_s` per iteration: at least `warmup`
    warm-up iterations and WARMUP_S of them, at least `iters - warmup` measured ones and
    MEASURED_S of them."""
    per = max(predicted_s, 1e-6)
    w = max(warmup, math.ceil(WARMUP_S / per))
    return w + max(iters - warmup, math.ceil(MEASURED_S / per)), w


def run_plan(plan_path: Path, topology_path: Path, iters: int, warmup: int, out_dir: Path,
             max_foreign: float = 0.05, attempts: int = 4) -> dict:
    """`hetplan run` on a quiet machine: a run during which other processes used more than
    `max_foreign` of the CPU is repeated (up to `attempts` runs; the quietest is kept). The
    result carries `foreign_cpu` and `attempts`."""
    out = out_dir / f"{plan_path.stem}.measured.json"
    best = None
    for k in range(attempts):
        if k:
            wait_quiet()
        m, foreign = _run_once(plan_path, topology_path, iters, warmup, out)
        if best is None or foreign < best[1]:
            best = (m, foreign)
        if foreign <= max_foreign or k + 1 == attempts:
            break
        print(f"accuracy: {plan_path.stem}: other processes used {foreign:.0%} of the CPU "
              f"during the run; measuring again", file=sys.stderr)
    m, foreign = best
    m["foreign_cpu"], m["attempts"] = foreign, k + 1
    return m


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import kendalltau
    return float(kendalltau(xs, ys).statistic) if len(xs) > 1 else 1.0


def summarise(rows: list[dict]) -> dict:
    errs = [abs(r["error_pct"]) for r in rows]
    spans = [r for r in rows if "lo_s" in r]
    return {"plans": len(rows), "mape_pct": statistics.fmean(errs), "worst_pct": max(errs),
            "worst_plan": rows[errs.index(max(errs))]["plan"],
            "tau": kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "mean_signed_pct": statistics.fmean(r["error_pct"] for r in rows),
            # e = log(predicted / measured): what hetplan.planner.sim.interval.CPU_RESIDUALS holds per class
            "log_error_mean": statistics.fmean(es := [math.log(r["predicted_s"] / r["measured_s"]) for r in rows]),
            "log_error_sd": statistics.stdev(es) if len(es) > 1 else 0.0,
            **({"coverage_pct": 100.0 * statistics.fmean(r["lo_s"] <= r["measured_s"] <= r["hi_s"] for r in spans),
                "width_pct": 100.0 * statistics.median((r["hi_s"] - r["lo_s"]) / r["predicted_s"] for r in spans)}
               if spans else {})}


def per_class(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{dimension: {class: summary + median run-to-run spread}} over the rows' `class_*` keys;
    `spread_exceeds_error` marks a class whose measurements move more between runs than the
    prediction misses by (its error is not resolved by this machine)."""
    out: dict[str, dict[str, dict]] = {}
    dims = sorted({k[len("class_"):] for r in rows for k in r if k.startswith("class_")})
    for dim in dims:
        for value in sorted({r[f"class_{dim}"] for r in rows if f"class_{dim}" in r}):
            mine = [r for r in rows if r.get(f"class_{dim}") == value]
            s = summarise(mine)
            s["run_spread_pct"] = statistics.median(r.get("run_spread_pct", 0.0) for r in mine)
            s["spread_exceeds_error"] = s["run_spread_pct"] > s["mape_pct"]
            out.setdefault(dim, {})[value] = s
    return out


def missed_targets(summary: dict, targets: dict = TARGETS) -> list[str]:
    """The targets a summary misses: MAPE and worst error above their bounds, tau below."""
    lo, hi = targets["coverage_pct"]
    cover = summary.get("coverage_pct")
    return [k for k, bad in (("mape_pct", summary["mape_pct"] > targets["mape_pct"]),
                             ("worst_pct", summary["worst_pct"] > targets["worst_pct"]),
                             ("tau", summary["tau"] < targets["tau"]),
                             ("coverage_pct", cover is not None and not lo <= cover <= hi),
                             ("width_pct", summary.get("width_pct", 0.0) > targets["width_pct"])) if bad]


def select_plans(topology, only: str | None) -> dict[str, dict]:
    """The plan set for the topology's devices (plan_sets.plans_for), restricted to the
    comma-separated workloads or plan names of `only`. ValueError when no set fits."""
    from hetplan.planner.workload.layers import num_layers
    from hetplan.planner.workload.load import load_workload
    layers = {w: num_layers(load_workload(s["spec"], s["args"]), 1)
              for w, s in workloads_for(topology).items()}
    plans = plans_for(topology, layers)
    if only:
        keep = only.split(",")
        plans = {k: v for k, v in plans.items() if k in keep or k.split("/")[0] in keep}
    return plans


def _parse_args(argv) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None, help="default: the benchmarks' profile of this machine, two CPU workers (benchmarks/paths.py), measured when missing")
    p.add_argument("--csv", default="out/accuracy.csv")
    p.add_argument("--iters", type=int, default=12,
                   help="iterations per run, at least (short plans run more: run_window)")
    p.add_argument("--warmup", type=int, default=3,
                   help="warm-up iterations left out, at least (short plans: WARMUP_S of them)")
    p.add_argument("--repeats", type=int, default=3,
                   help="separate runs of each plan; its time is their median, their spread shown")
    p.add_argument("--only", default=None, help="comma-separated workloads or plan names")
    p.add_argument("--predict-only", action="store_true", help="skip the runs (prediction only)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--reuse", metavar="CSV", default=None,
                   help="take the measured times from this earlier CSV instead of running")
    p.add_argument("--without-calibration", action="store_true",
                   help="predict on the topology minus its 'calibration' object (the contract's "
                        "formulas for all-reduce, optimizer; no contention or overheads)")
    p.add_argument("--cache-dir", default="out/accuracy-cache",
                   help="layer-timing cache of this run (HETPLAN_CACHE_DIR); emptied first unless "
                        "--keep-cache, so layers are timed now, on a quiet machine")
    p.add_argument("--keep-cache", action="store_true")
    p.add_argument("--reprofile", action="store_true",
                   help="profile this machine again first (on a quiet machine)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: --iters 3 --warmup 1, one run per plan, no waiting for a quiet "
                        "machine (figures not meaningful; marked quick in the results file)")
    add_results_arguments(p)
    a = p.parse_args(argv)
    if a.quick:
        a.iters, a.warmup = 3, 1
    if a.iters <= a.warmup or a.warmup < 0:
        p.error("--iters must exceed --warmup >= 0")
    if a.repeats < 1:
        p.error(f"--repeats: expected a positive integer, got {a.repeats}")
    return p, a


def _topology(a):
    """(path, Topology) to predict on: --topology or the benchmarks' profile, profiled when
    missing (or with --reprofile); without its calibration under --without-calibration."""
    from hetplan.planner.hardware.topology import load_topology
    topo_path = Path(a.topology) if a.topology else a.default_topology
    ensure_topology(topo_path, 2, again=a.reprofile, wait=not a.quick)
    topology = load_topology(topo_path)
    if a.without_calibration:
        from dataclasses import replace
        topology = replace(topology, measured={k: v for k, v in topology.measured.items()
                                                if k != "calibration"})
    return topo_path, topology


def _plans(p, a, topology, topo_path: Path) -> dict[str, dict]:
    """The plans to run (select_plans); a usage error when none fits or --only matches none."""
    try:
        plans = select_plans(topology, a.only)
    except ValueError as e:
        p.error(f"{topo_path}: {e}")
    if not plans:
        p.error(f"--only: no plan of this topology's set matches {a.only!r}")
    return plans


def _reused(p, a, plans: dict) -> dict[str, dict]:
    """--reuse: the earlier CSV's row of every plan (a usage error when one is missing)."""
    if not a.reuse:
        return {}
    with open(a.reuse) as f:
        reused = {r["plan"]: r for r in csv.DictReader(f)}
    for name in plans:
        if name not in reused:
            p.error(f"{a.reuse}: no row for plan {name}")
    return reused


def _row(name: str, plan: dict, a, topology, topo_path: Path, tmp: Path, reused: dict) -> dict:
    """One plan: write it, predict it, then run it (or take its earlier measurement)."""
    from hetplan.planner.files.io import write_json_atomic
    plan["topology"] = {"name": topology.name, "sha256": topology.sha256}
    path = tmp / (name.replace("/", "__") + ".json")
    write_json_atomic(path, plan)
    on_linux = Path("/proc/stat").exists()
    busy = wait_quiet() if on_linux and not (a.predict_only or a.reuse or a.quick) else 0.0
    got = prediction(path, topology)   # may time layers (MeasuredCost): on a quiet machine
    pred = got.iteration_s
    row = {"plan": name, "workload": name.split("/")[0], "predicted_s": pred,
           "lo_s": got.interval[0], "hi_s": got.interval[1], "interval_basis": got.basis}
    if a.reuse:
        m_s = float(reused[name]["measured_s"])
        row.update(measured_s=m_s, error_pct=100.0 * (pred - m_s) / m_s,
                   spread_pct=float(reused[name]["spread_pct"]), reused=a.reuse)
    elif not a.predict_only:
        row["busy_before"] = busy
        t0 = time.perf_counter()
        iters, warmup = (a.iters, a.warmup) if a.quick else run_window(pred, a.iters, a.warmup)
        runs = [run_plan(path, topo_path, iters, warmup, tmp, attempts=1 if a.quick else 4)
                for _ in range(1 if a.quick else a.repeats)]
        times = [m["iteration_s"] for m in runs]
        m_s = statistics.median(times)
        row.update(measured_s=m_s, foreign_cpu=max(m["foreign_cpu"] for m in runs),
                   attempts=sum(m["attempts"] for m in runs), runs=len(runs),
                   error_pct=100.0 * (pred - m_s) / m_s,
                   spread_pct=100.0 * statistics.median(_spread(m["iterations_s"][warmup:]) for m in runs),
                   run_spread_pct=100.0 * (max(times) - min(times)) / m_s,
                   run_s=time.perf_counter() - t0, iters=iters, warmup=warmup)
        row.update({f"class_{k}": v for k, v in size_classes(plan, m_s).items()})
        print(f"accuracy: {name:<24} predicted {pred * 1e3:8.2f} ms  measured "
              f"{m_s * 1e3:8.2f} ms  error {row['error_pct']:+6.1f} %",
              file=sys.stderr)
    else:
        print(f"accuracy: {name:<24} predicted {pred * 1e3:8.2f} ms", file=sys.stderr)
    return row


def _print_table(rows: list[dict], summary: dict, csv_path: str) -> None:
    print(f"{'plan':<24}{'predicted ms':>14}{'measured ms':>13}{'error %':>9}{'spread %':>10}")
    for r in rows:
        print(f"{r['plan']:<24}{r['predicted_s'] * 1e3:>14.2f}{r['measured_s'] * 1e3:>13.2f}"
              f"{r['error_pct']:>+9.1f}{r['spread_pct']:>10.1f}")
    for w, s in summary["per_workload"].items():
        print(f"  {w}: MAPE {s['mape_pct']:.1f} %, worst {s['worst_pct']:.1f} %, tau {s['tau']:.2f}")
    for dim, classes in summary.get("per_class", {}).items():
        for value, s in classes.items():
            flag = "  (run-to-run spread > error)" if s["spread_exceeds_error"] else ""
            print(f"  {dim} {value}: {s['plans']} plans, MAPE {s['mape_pct']:.1f} %, worst "
                  f"{s['worst_pct']:.1f} %, spread between runs {s['run_spread_pct']:.1f} %, "
                  f"90 % intervals hold {s.get('coverage_pct', float('nan')):.0f} %, log error "
                  f"{s['log_error_mean']:+.3f} +- {s['log_error_sd']:.3f}{flag}")
    print(f"MAPE {summary['mape_pct']:.1f} % (target <= {TARGETS['mape_pct']:g}), worst "
          f"{summary['worst_pct']:.1f} % ({summary['worst_plan']}; target <= "
          f"{TARGETS['worst_pct']:g}), Kendall tau {summary['tau']:.3f} (target >= "
          f"{TARGETS['tau']:g}), mean signed error {summary['mean_signed_pct']:+.1f} %")
    lo, hi = TARGETS["coverage_pct"]
    print(f"90 % intervals hold {summary.get('coverage_pct', float('nan')):.0f} % of the measured medians "
          f"(target {lo:g}-{hi:g}), median width {summary.get('width_pct', float('nan')):.1f} % "
          f"(target <= {TARGETS['width_pct']:g})")
    print(f"load average {summary['load_before']:.2f} before, {summary['load_after']:.2f} after; "
          f"wrote {csv_path}")


def main(argv=None) -> int:
    p, a = _parse_args(argv)
    results_path = results_target(a)
    if not check_results_file("accuracy", results_path):   # fail now, not after the runs
        return 2
    a.default_topology = benchmark_profile()   # in the user's cache: before --cache-dir moves it
    os.environ["HETPLAN_CACHE_DIR"] = a.cache_dir
    if not a.keep_cache:
        cache_path().unlink(missing_ok=True)
    topo_path, topology = _topology(a)
    plans = _plans(p, a, topology, topo_path)
    reused = _reused(p, a, plans)
    load_before = load_avg()
    print(f"accuracy: {len(plans)} plans on {topo_path.name}; load average {load_before:.2f}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hetplan-accuracy-") as tmp:
        rows = [_row(name, plan, a, topology, topo_path, Path(tmp), reused)
                for name, plan in plans.items()]
    if a.predict_only:
        return 0
    summary = summarise(rows)
    summary.update(load_before=load_before, load_after=load_avg(), topology=str(topo_path),
                   per_workload={w: summarise([r for r in rows if r["workload"] == w])
                                 for w in sorted({r["workload"] for r in rows})},
                   per_class=per_class(rows))
    _write_csv(Path(a.csv), rows)
    missed = summary["missed"] = missed_targets(summary)
    if results_path and not save_section("accuracy", "accuracy",
                                         accuracy_payload(rows, summary, plans, _run_facts(a)),
                                         results_path):
        return 2
    if a.json:
        print(json.dumps({"summary": summary, "rows": rows}))
    else:
        _print_table(rows, summary, a.csv)
    if a.check and missed:
        print(f"accuracy: missed target(s): {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


def _run_facts(a) -> dict:
    """How the figures were measured (recorded beside them in the results file)."""
    return {"iters": a.iters, "warmup": a.warmup, "repeats": 1 if a.quick else a.repeats,
            "quick": a.quick, "reused": a.reuse}


def _spread(xs: list[float]) -> float:
    """(p75 - p25) / median of the post-warm-up iterations."""
    import numpy as np
    med = float(np.median(xs))
    p25, p75 = np.percentile(xs, [25, 75])
    return float((p75 - p25) / med) if med > 0 else 0.0


def _write_csv(path: Path, rows: list[dict]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    replace_atomically(path, write)


if __name__ == "__main__":
    raise SystemExit(main())
