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

`--real-load PERIOD_S`: instead, a real load: a process spinning on worker 1's core (the workers
are bound to one core each), off for PERIOD_S seconds from each run's first step, then on, and so
on (the same clock for both runs: a clock started before the workers would spend part of the
first phase on the first run's start-up); prints the median step and the time to the run's
samples of each (`--dump FILE`: every step's time and the shares, for a picture of the phases).
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


def run(tmp: Path, name: str, p: dict, steps: int, slow: str, every: int | None,
        metrics: Path | None = None) -> dict:
    from hetplan.planner.files.plan import load_plan
    from hetplan.runtime.launch import launch
    from hetplan.runtime.rebalance import SLOW_ENV
    from hetplan.runtime.train import TrainConfig
    from hetplan.runtime.worker import RunConfig
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(p))
    os.environ[SLOW_ENV] = slow
    cfg = RunConfig(plan=str(path), timeout_s=60, quiet=True,
                    train=TrainConfig(steps=steps, log_every=1 if metrics else steps, rebalance=every,
                                      metrics=str(metrics) if metrics else None).to_dict())
    return launch(cfg, load_plan(path).devices)


class Hog:
    """A process spinning on `core`: stopped until `go` is set (the first training step), then
    off for `period_s`, on for `period_s`, and so on, so every run meets the same load at the
    same time after its first step."""

    def __init__(self, core: int, period_s: float, go):
        import signal
        import subprocess
        import threading
        self.proc = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                      "while True: pass"])
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.period_s, self.go, self.stop = period_s, go, threading.Event()
        self.thread = threading.Thread(target=self._toggle, daemon=True)

    def _toggle(self) -> None:
        import signal
        while not self.go() and not self.stop.wait(0.005):
            pass
        on = False
        while not self.stop.wait(self.period_s):
            on = not on
            os.kill(self.proc.pid, signal.SIGCONT if on else signal.SIGSTOP)

    def __enter__(self) -> "Hog":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.proc.kill()
        self.proc.wait()


def real_load(args) -> int:
    """Static shares and --rebalance under the same on/off load on worker 1's core."""
    out, dumped = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for name, every in (("static", None), ("rebalance", args.every)):
            rows = Path(d) / f"{name}.jsonl"
            with Hog(1, args.real_load, go=lambda: rows.exists() and rows.stat().st_size > 0):
                r = run(Path(d), name, plan([0.5, 0.5], args.hidden, args.batch), args.steps, "", every, rows)
            it = r["iterations_s"]
            if args.dump:
                dumped[name] = {"iterations_s": it, "shares": r["shares"]}
            out[name] = {"median_step_s": statistics.median(it), "time_to_samples_s": sum(it),
                         "samples": args.steps * args.batch, "share_changes": len(r["shares"]) - 1,
                         "cpu1_share_range": [min(h["shares"]["cpu:1"] for h in r["shares"]),
                                              max(h["shares"]["cpu:1"] for h in r["shares"])]}
    out["time_to_samples_static_over_rebalance"] = (out["static"]["time_to_samples_s"]
                                                    / out["rebalance"]["time_to_samples_s"])
    out["args"] = vars(args)
    print(json.dumps(out, indent=1))
    if args.dump:
        Path(args.dump).write_text(json.dumps(dumped))
    return 0


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--steps", type=int, default=300)
    a.add_argument("--every", type=int, default=10)
    a.add_argument("--slow-s", type=float, default=0.001, help="worker 1's added seconds a sample while slowed")
    a.add_argument("--hidden", type=int, default=256)
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--real-load", type=float, default=None, metavar="PERIOD_S",
                   help="a real load on worker 1's core, off and on every PERIOD_S seconds from the first step")
    a.add_argument("--dump", default=None, metavar="FILE", help="--real-load: each run's step times and shares, as JSON")
    args = a.parse_args(argv)
    if args.real_load is not None:
        return real_load(args)
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
