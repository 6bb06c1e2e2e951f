"""A GPU host in one call: profile, the CUDA tests, the GPU accuracy set, plan quality on the GPU
workloads and the capped ZeRO-Offload / CoTrain case (benchmarks/capped.py), each phase within its
own time budget, its results written as it finishes.

    python benchmarks/gpu_session.py --out DIR [--smoke] [--budget-s 600]

DIR receives session.json (each phase's status, seconds and command), log.txt (every phase's
output), results.json (the accuracy, plan_quality and capped sections, benchmarks/results.py's
shape), profile.json, accuracy.csv, plan_quality.csv and capped.json; scratch files go to a
temporary directory. A call cut short still leaves every finished phase's files. Nothing is
installed from the network: the project with `pip install -e . --no-deps --no-build-isolation`.
With --smoke the CPU stands in for the GPU (HETPLAN_STANDIN_GPUS=1), the workloads are small and
the call takes a few minutes: CI runs it so the call cannot rot between GPU sessions.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass(frozen=True)
class Phase:
    name: str
    budget_s: float
    command: list[str]
    outputs: tuple[tuple[str, str], ...] = ()     # (scratch path, name in DIR) copied when it ends


def phases(out: Path, work: Path, smoke: bool) -> list[Phase]:
    """The session's phases in order; --smoke shrinks each to a few plans."""
    profile, results = str(out / "profile.json"), str(out / "results.json")
    bench = lambda name: [PY, str(ROOT / "benchmarks" / f"{name}.py")]  # noqa: E731
    common = ["--topology", profile, "--results", results]
    install = [PY, "-m", "pip", "install", "-q", "-e", str(ROOT), "--no-deps", "--no-build-isolation"]
    if smoke:
        return [
            Phase("profile", 90, [PY, "-m", "hetplan", "profile", "--quick", "--cpu-workers", "1", "-o", profile]),
            Phase("cuda_tests", 90, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                     str(ROOT / "tests" / "test_runtime_cuda.py"), "-k", "standin"]),
            Phase("accuracy", 90, bench("accuracy") + common + [
                "--quick", "--only", "mlp/gpu-single,mlp/gpu-cpu-opt,mlp/cpu-gpu-dp-coarse",
                "--csv", str(out / "accuracy.csv"), "--cache-dir", str(work / "cache")]),
            Phase("plan_quality", 180, bench("plan_quality") + common + [
                "--quick", "--only", "mlp", "--csv", str(out / "plan_quality.csv"), "--out", str(work / "pq")]),
            Phase("capped", 180, bench("capped") + common + ["--smoke", "--out", str(work / "capped"),
                                                             "--time-limit", "10"],
                  ((str(work / "capped" / "capped.json"), "capped.json"),)),
        ]
    return [
        Phase("install", 30, install),
        Phase("profile", 90, [PY, "-m", "hetplan", "profile", "-o", profile]),
        Phase("cuda_tests", 100, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                                  str(ROOT / "tests")]),
        Phase("accuracy", 130, bench("accuracy") + common + [
            "--repeats", "1", "--csv", str(out / "accuracy.csv"), "--cache-dir", str(work / "cache")]),
        Phase("plan_quality", 100, bench("plan_quality") + common + [
            "--only", "gpt,mlp", "--csv", str(out / "plan_quality.csv"), "--out", str(work / "pq")]),
        Phase("capped", 150, bench("capped") + common + ["--out", str(work / "capped")],
              ((str(work / "capped" / "capped.json"), "capped.json"),)),
    ]


def run_phase(ph: Phase, left_s: float, env: dict, log) -> dict:
    """One phase as a child process, killed at min(its budget, `left_s`); its record."""
    limit = max(1.0, min(ph.budget_s, left_s))
    log.write(f"\n== {ph.name} (budget {limit:.0f} s): {' '.join(ph.command)}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(ph.command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit,
                              cwd=ROOT)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {limit:.0f} s"
    return {"name": ph.name, "status": status, "seconds": round(time.perf_counter() - t0, 1),
            "budget_s": limit, "command": ph.command}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the session's files go ($OUT on a lent device)")
    p.add_argument("--smoke", action="store_true", help="the CPU standing in for the GPU, small workloads")
    p.add_argument("--budget-s", type=float, default=600.0, help="the whole call's wall-clock cap")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if a.smoke:
        env["HETPLAN_STANDIN_GPUS"] = "1"
    session = {"mode": "smoke" if a.smoke else "gpu", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "phases": []}
    with tempfile.TemporaryDirectory(prefix="hetplan-gpu-session-") as tmp, open(out / "log.txt", "w") as log:
        work = Path(tmp)
        env["HETPLAN_CACHE_DIR"] = str(work / "cache")
        for ph in phases(out, work, a.smoke):
            left = deadline - time.monotonic()
            record = (run_phase(ph, left, env, log) if left > 5 else
                      {"name": ph.name, "status": "skipped: no time left", "seconds": 0.0, "command": ph.command})
            session["phases"].append(record)
            for src, name in ph.outputs:
                if Path(src).exists():
                    shutil.copyfile(src, out / name)
            (out / "session.json").write_text(json.dumps(session, indent=1))
            print(f"gpu_session: {ph.name}: {record['status']} ({record['seconds']:.0f} s)", file=sys.stderr)
    failed = [r["name"] for r in session["phases"] if r["status"] != "ok"]
    print(f"gpu_session: {len(session['phases']) - len(failed)} of {len(session['phases'])} phases ok"
          f"{'; not ok: ' + ', '.join(failed) if failed else ''}; files in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
