"""`hetplan demo`: profile (if needed) -> plan -> run the plan and the best baseline -> compare.

The defaults fit a small CPU machine in about two minutes: the MNIST-shaped MLP at batch 512
(iterations of ~100 ms), with this machine profiled as one CPU worker per core (up to two) when no
GPU is present, so the planner has two devices to split the work between. Every step runs the
other commands through the CLI's entry point (`args.hetplan`), in this process; the files go to
--out (default out/demo/).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

HELP = "profile this machine if needed, plan the default workload, run it and the best baseline, compare"


def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="profile with `profile --quick` (if a profile is needed)")
    p.add_argument("--model", default="mlp", metavar="M", help="workload (default mlp: MNIST-shaped MLP)")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V",
                   help="argument of the model factory (repeatable)")
    p.add_argument("--batch", type=int, default=512, help="global batch size (default 512)")
    p.add_argument("--iters", type=int, default=10, help="iterations per run (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: 2, fewer for short runs)")
    p.add_argument("--profile", metavar="T", default=None,
                   help="topology of this machine (default: its cached profile, measured if missing; `hetplan profile --list`)")
    p.add_argument("--cpu-workers", type=int, default=None, metavar="N",
                   help="CPU workers when profiling (default: min(2, cores) without a GPU, else 1)")
    p.add_argument("--out", default="out/demo", metavar="DIR", help="where the demo's files go (default out/demo/)")


def _step(run, title: str, argv: list[str], quiet: bool) -> None:
    """Run one hetplan command in this process with `run` (the CLI's entry point, `args.hetplan`);
    its stdout goes to stderr under --json."""
    print(f"\n== hetplan demo: {title}: hetplan {' '.join(argv)}", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(sys.stderr if quiet else sys.stdout):
        rc = run(argv)
    if rc != 0:
        raise _StepFailed(f"hetplan {argv[0]} failed (exit {rc})", rc)


class _StepFailed(Exception):
    def __init__(self, msg: str, rc: int):
        super().__init__(msg)
        self.rc = rc


def _default_cpu_workers() -> int:
    from hetplan.planner.hardware.device import gpu_count
    return 1 if gpu_count() else max(1, min(2, os.cpu_count() or 1))


def best_baseline(plan_path: Path, topology_path: Path, out: Path) -> tuple[str, Path | None]:
    """Regenerate the plan's best feasible baseline (the plan stores only its numbers) and save
    it next to the plan; returns (name, path), path None when it is the chosen plan itself."""
    from dataclasses import replace

    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import Predicted, load_plan, plan_key, save_plan
    from hetplan.planner.search.problem import plan_baselines
    from hetplan.planner.hardware.topology import load_topology

    plan = load_plan(plan_path)
    recorded = [b for b in (plan.predicted.extra.get("baselines", []) if plan.predicted else [])
                if b.get("feasible")]
    if not recorded:
        raise InputError(f"{plan_path}: predicted.baselines: expected the baselines `hetplan plan` records")
    name = min(recorded, key=lambda b: b["iteration_s"])["name"]
    found = {c.name: c for c in plan_baselines(plan, load_topology(topology_path), str(plan_path))}
    if name not in found:
        raise InputError(f"{plan_path}: predicted.baselines: baseline {name!r} could not be regenerated")
    c = found[name]
    if plan_key(c.plan) == plan_key(plan):
        return name, None
    path = out / "baseline.json"
    save_plan(replace(c.plan, topology=plan.topology,
                      predicted=Predicted(c.iteration_s, c.peak_memory_bytes, extra={"baseline": name})), path)
    return name, path


def main(args) -> int:
    from hetplan.commands.compare import compare_files, format_table, summary_line
    from hetplan.commands.profile import default_path
    from hetplan.planner.files.io import InputError

    from hetplan.planner.files.plan import check_batch
    check_batch(args.batch, "--batch")
    if args.iters < 2:
        raise InputError(f"--iters: expected an integer >= 2 (one warm-up, one measured), got {args.iters}")
    warmup = args.warmup if args.warmup is not None else min(2, args.iters // 2)
    if not 0 <= warmup < args.iters:
        raise InputError(f"--warmup: expected an integer in [0, --iters), got {warmup}")
    if args.cpu_workers is not None and args.cpu_workers < 1:
        raise InputError(f"--cpu-workers: expected a positive integer, got {args.cpu_workers}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: --out: expected a directory, got a file")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    quiet = bool(args.json)
    topo = Path(args.profile) if args.profile else default_path()
    try:
        if not topo.exists():
            workers = args.cpu_workers or _default_cpu_workers()
            _step(args.hetplan, "profile this machine", ["profile", "--cpu-workers", str(workers), "-o", str(topo),
                                           *(["--quick"] if args.quick else [])], quiet)
        else:
            print(f"hetplan demo: using the profile {topo}", file=sys.stderr)
        model = ["--model", args.model, *[a for kv in args.model_arg for a in ("--model-arg", kv)]]
        plan = out / "plan.json"
        _step(args.hetplan, "plan", ["plan", *model, "--batch", str(args.batch), "--topology", str(topo), "-o", str(plan)], quiet)
        print("\n== hetplan demo: regenerating the best baseline", file=sys.stderr, flush=True)
        base_name, base = best_baseline(plan, topo, out)
        runs = [("plan", plan)] + ([("baseline", base)] if base is not None else [])
        results = {}
        for label, path in runs:
            measured = out / f"{label}.measured.json"
            _step(args.hetplan, f"run the {label}", ["run", str(path), "--iters", str(args.iters), "--warmup", str(warmup),
                                        "--topology", str(topo), "-o", str(measured)], quiet)
            png = out / f"{label}.png"
            c = compare_files(str(path), str(measured), str(topo), str(png), "hetplan demo")
            results[label] = (c, path, measured, png)
            if not quiet:
                print(f"\n{label}: {summary_line(c)}\n{format_table(c)}")
    except _StepFailed as e:
        print(f"hetplan demo: {e}", file=sys.stderr)
        if created and not any(out.iterdir()):
            out.rmdir()     # a demo whose first step failed leaves no folder behind
        return e.rc
    plan_c = results["plan"][0]
    base_c = results.get("baseline", results["plan"])[0]
    speedup = base_c.measured_s / plan_c.measured_s
    predicted_speedup = base_c.predicted_s / plan_c.predicted_s
    summary = {"profile": str(topo), "out": str(out), "baseline_name": base_name,
               "baseline_is_plan": base is None,
               "measured_speedup": speedup, "predicted_speedup": predicted_speedup,
               "runs": {label: {"plan": str(p), "measured": str(m), "plot": str(png), **c.to_json()}
                        for label, (c, p, m, png) in results.items()}}
    write_summary(out / "summary.json", summary)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"\nbest baseline: {base_name}" + (" (the same plan as the chosen one)" if base is None else ""))
    print(f"measured speedup of the plan over the best baseline: {speedup:.2f}x "
          f"(predicted {predicted_speedup:.2f}x)")
    print(f"prediction error: plan {plan_c.error_pct:+.1f}%, baseline {base_c.error_pct:+.1f}%")
    print(f"files in {out}/: plan.json, *.measured.json, *.png timelines, summary.json")
    return 0


def write_summary(path: Path, summary: dict) -> None:
    from hetplan.planner.files.io import write_json_atomic
    write_json_atomic(path, summary)
