"""Time to a target loss: synchronous and asynchronous plans, predicted and measured.

For each learnable workload (benchmarks/learnable.py) on this machine's profile: the planner's
candidates for `--objective time-to-loss` (hetplan.planner.search.time_to_loss: the best synchronous
plan the search finds, its baselines, local SGD, EASGD and Hogwild on the fastest
data-parallel layout, and PipeDream, 2BW and PipeDream+SWA on the fastest one-pipeline layout,
the balanced pipeline baseline at least), each predicted (emulated iterations to the target x simulated iteration
time) and run for real (`hetplan run --iters N`: measured iterations to the target, from the
measured losses with the same running mean, x the measured median iteration). The target is the
loss synchronous training reaches after `--target-at` of the iterations. Prints both rankings
and Kendall's tau between predicted and measured times to the target.

    python benchmarks/time_to_loss.py [--topology FILE] [--iters 150]
                                      [--target-at 0.5] [--only mlp,gpt] [--csv out/time_to_loss.csv]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)
from accuracy import _write_csv, ensure_topology, kendall_tau, load_avg  # noqa: E402

WORKLOADS = {"mlp": ("benchmarks.learnable:mlp", 64), "gpt": ("benchmarks.learnable:gpt", 32)}


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default=None, help="default: the benchmarks' profile of this machine, two CPU workers (benchmarks/paths.py), measured when missing")
    p.add_argument("--iters", type=int, default=150, help="iterations run and emulated per plan")
    p.add_argument("--target-at", type=float, default=0.5,
                   help="the target: synchronous training's smoothed loss after this fraction of --iters")
    p.add_argument("--only", default=None, help="comma-separated workloads")
    p.add_argument("--csv", default="out/time_to_loss.csv")
    return p.parse_args(argv)


def candidates(spec: str, batch: int, topology, iters: int, target_at: float):
    """(target loss, ranked candidates) for one workload."""
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.search.convergence import emulate, smoothed
    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import plan_problem
    from hetplan.planner.search.time_to_loss import rank
    from hetplan.planner.workload.load import load_workload

    workload = load_workload(spec, {})
    _, problem = plan_problem(workload, ModelRef(spec, {}), batch, topology, workload.optimizer, workload.lr)
    result = search(problem, random.Random(0), SearchConfig(time_limit_s=20))
    named = [("best synchronous", result.best.plan)] + [(c.name, c.plan) for c in result.baselines if c.feasible]
    target = float(smoothed(emulate(workload, result.best.plan, iters))[int(target_at * iters) - 1])
    return target, rank(problem.evaluate, workload, named, target, iters)


def measure(plan, iters: int) -> dict:
    """`hetplan run` of the plan: its losses and median iteration."""
    from hetplan.planner.files.plan import save_plan
    with tempfile.TemporaryDirectory() as d:
        path, out = Path(d) / "plan.json", Path(d) / "measured.json"
        save_plan(plan, path)
        subprocess.run(["hetplan", "run", str(path), "--iters", str(iters), "--warmup", "1", "-o", str(out)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    from benchmarks.paths import benchmark_profile
    from hetplan.planner.hardware.topology import load_topology
    from hetplan.planner.search.convergence import iterations_to

    a = _parse_args(argv)
    topo_path = Path(a.topology) if a.topology else benchmark_profile()
    ensure_topology(topo_path, 2)
    topology = load_topology(topo_path)
    rows = []
    print(f"time_to_loss: load average {load_avg():.2f}", file=sys.stderr)
    for name, (spec, batch) in WORKLOADS.items():
        if a.only and name not in a.only.split(","):
            continue
        target, ranked = candidates(spec, batch, topology, a.iters, a.target_at)
        print(f"\n{name} (batch {batch}): target loss {target:.3f}")
        seen = set()
        mine = []
        for c in ranked:
            key = (c.plan.replicas, c.plan.schedule, c.plan.sync)
            if key in seen or not c.feasible:
                continue
            seen.add(key)
            m = measure(c.plan, a.iters)
            its = iterations_to(m["losses"], target)
            its = its if its <= a.iters else math.inf          # measured: only what was reached
            row = {"workload": name, "plan": c.name, "target_loss": target,
                   "predicted_iteration_ms": 1e3 * c.iteration_s, "measured_iteration_ms": 1e3 * m["iteration_s"],
                   "predicted_iterations": c.iterations, "measured_iterations": its,
                   "predicted_s": c.time_s, "measured_s": its * m["iteration_s"]}
            mine.append(row)
            print(f"  {c.name:60s} predicted {c.iterations:6.0f} it x {1e3 * c.iteration_s:7.2f} ms = "
                  f"{c.time_s:7.3f} s   measured {its:6.0f} it x {1e3 * m['iteration_s']:7.2f} ms = "
                  f"{row['measured_s']:7.3f} s", flush=True)
        both = [r for r in mine if math.isfinite(r["predicted_s"]) and math.isfinite(r["measured_s"])]
        tau = kendall_tau([r["predicted_s"] for r in both], [r["measured_s"] for r in both])
        best_p = min(mine, key=lambda r: r["predicted_s"])["plan"]
        best_m = min(mine, key=lambda r: r["measured_s"])["plan"]
        print(f"  Kendall tau (predicted vs measured time to loss, {len(both)} plans) {tau:.2f}; "
              f"fastest predicted: {best_p}; fastest measured: {best_m}")
        rows += mine
    _write_csv(Path(a.csv), rows)
    print(f"time_to_loss: load average {load_avg():.2f}; wrote {a.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
