"""Static batch shares against `run --rebalance K` while a load comes and goes on one worker.

Two CPU workers train a data-parallel MLP (shares 0.5 / 0.5) for `--steps` steps; worker 1 is
slowed by `--slow-s` seconds a sample during two phases (the middle of each third of the run),
through the runtime's test hook (hetplan.runtime.rebalance.SLOW_ENV: a sleep inside its busy
timer, so the timers see it as compute; a competing process on a core shared with other jobs
was too noisy to repeat). Prints the median step and the time to the run's samples for both,
and, for the rebalanced run, the median step of the slow phases' steps from 2K steps after each
onset against a static plan made for the slowed machine (the shares the rebalancer reached,
under a constant slowdown); target: within 10 %.

    python benchmarks/rebalance.py [--steps 300] [--every 10] [--slow-s 0.001] [--hidden 256] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)


def plan(shares: list[float], hidden: int, batch: int) -> dict:
    model = {"spec": "benchmarks.training_data:data_mlp", "args": {"hidden": hidden, "depth": 4}}
    return {"schema": "hetplan.plan/1", "model": model, "global_batch": batch,
            "optimizer": {"name": "adam", "lr": 1e-3}, "sync": {"granularity": "fine"},
            "replicas": [{"batch_fraction": f, "microbatches": 1, "stages": [{"device": f"cpu:{i}", "layers": [0, 5]}]}
                         for i, f in enumerate(shares)]}


def phases(steps: int) -> list[tuple[int, int]]:
    """Two slow phases: the middle of the first and of the last third."""
    t = steps // 3
    return [(t // 4, 3 * t // 4), (2 * t + t // 4, 2 * t + 3 * t // 4)]


def run(tmp: Path, name: str, p: dict, steps: int, slow: str, every: int | None) -> dict:
    from hetplan.planner.files.plan import load_plan
    from hetplan.runtime.launch import launch
    from hetplan.runtime.rebalance import SLOW_ENV
    from hetplan.runtime.train import TrainConfig
    from hetplan.runtime.worker import RunConfig
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(p))
    os.environ[SLOW_ENV] = slow
    cfg = RunConfig(plan=str(path), timeout_s=60, quiet=True,
                    train=TrainConfig(steps=steps, log_every=steps, rebalance=every).to_dict())
    return launch(cfg, load_plan(path).devices)


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--steps", type=int, default=300)
    a.add_argument("--every", type=int, default=10)
    a.add_argument("--slow-s", type=float, default=0.001, help="worker 1's added seconds a sample while slowed")
    a.add_argument("--hidden", type=int, default=256)
    a.add_argument("--batch", type=int, default=64)
    args = a.parse_args(argv)
    slow = ",".join(f"1:{s}:{e}:{args.slow_s}" for s, e in phases(args.steps))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, every in (("static", None), ("rebalance", args.every)):
            r = run(tmp, name, plan([0.5, 0.5], args.hidden, args.batch), args.steps, slow, every)
            it = r["iterations_s"]
            out[name] = {"median_step_s": statistics.median(it), "time_to_samples_s": sum(it),
                         "samples": args.steps * args.batch, "shares": r["shares"]}
        settled = [i for s, e in phases(args.steps) for i in range(s + 2 * args.every, e)]
        it = r["iterations_s"]
        out["rebalance"]["median_settled_slow_step_s"] = statistics.median(it[i] for i in settled)
        s0, e0 = phases(args.steps)[0]
        reached = [h for h in r["shares"] if h["step"] <= e0][-1]["shares"]
        fixed = [reached[f"cpu:{i}"] for i in range(2)]
        r = run(tmp, "slowed-static", plan(fixed, args.hidden, args.batch), 60, f"1:0:60:{args.slow_s}", None)
        out["slowed_static"] = {"shares": fixed, "median_step_s": statistics.median(r["iterations_s"][5:])}
    out["settled_over_slowed_static"] = (out["rebalance"]["median_settled_slow_step_s"]
                                         / out["slowed_static"]["median_step_s"])
    out["args"] = vars(args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
