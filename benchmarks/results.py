"""The benchmark results file, `benchmarks/results/<hostname>.json` (docs/formats.md, "Benchmark
results"): this host's facts and the last run of each benchmark, one section each.

    {"host": {"hostname", "gpu" (absent without a GPU), "cpu_cores", "torch"},
     "accuracy": {"mape_pct", "worst_pct", "kendall_tau",
                  "plans": [{"name", "devices", "predicted_s", "measured_s", "error_pct", ...}]},
     "plan_quality": {"workloads": [{"name", "chosen_s", "best_baseline", "best_baseline_s",
                                     "speedup", ...}]}}

A benchmark replaces only its own section (and the host block) and keeps the other one. An
existing file that is not valid JSON, has the wrong shape, or belongs to another host is
refused (InputError) and left as it is: it may hold an hour of measurements, so it is never
overwritten by a guess. Keys beyond the contract's are allowed.
"""
from __future__ import annotations

import math
import os
import socket
import sys
from pathlib import Path

from benchmarks.plan_sets import plan_class, plan_devices
from hetplan.planner.files.io import InputError, Reader, read_json, write_json_atomic

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTIONS = ("accuracy", "plan_quality", "capped")


def default_results_path() -> Path:
    return RESULTS_DIR / f"{socket.gethostname()}.json"


def host_facts() -> dict:
    """hostname, cpu_cores, torch and, with a CUDA GPU, gpu (its torch.cuda name)."""
    import torch
    facts = {"hostname": socket.gethostname(), "cpu_cores": os.cpu_count() or 1,
             "torch": torch.__version__}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


# --- the file ---------------------------------------------------------------------------------
def read_results(path: str | os.PathLike) -> dict:
    """The results already at `path` ({} when there is no file). InputError when the file is not
    valid JSON, has the wrong shape, or holds another host's results."""
    p = Path(path)
    if not p.exists():
        return {}
    data = read_json(p, "results file")
    validate_results(data, str(p))
    here, there = socket.gethostname(), data["host"]["hostname"]
    if there != here:
        raise InputError(f"{p}: host.hostname: holds results of {there!r}, this host is {here!r}; "
                         f"expected this host's file (pass --results with another path)")
    return data


def update_results(section: str, payload: dict, path: str | os.PathLike | None = None) -> Path:
    """Replace `section` and the host block of the results file at `path` (default: this host's),
    keep the other section; validate; write atomically. Returns the path written."""
    if section not in SECTIONS:
        raise ValueError(f"section: expected one of {', '.join(SECTIONS)}, got {section!r}")
    p = Path(path) if path is not None else default_results_path()
    data = read_results(p)
    data = {"host": host_facts(), **{k: v for k, v in data.items() if k != "host"},
            section: payload}
    validate_results(data, f"{p} (new {section})")
    write_json_atomic(p, data)
    return p


# --- shape ------------------------------------------------------------------------------------
def _require(r: Reader, keys: tuple[str, ...]) -> None:
    for k in keys:
        if not r.has(k):
            raise r.error(k, "missing")


def _validate_accuracy(r: Reader) -> None:
    r.get("mape_pct", float)
    r.get("worst_pct", float)
    _require(r, ("kendall_tau",))
    r.get("kendall_tau", float, default=None)      # null: undefined (every time tied)
    for pr in r.readers("plans"):
        pr.get("name", str)
        pr.get("devices", list, check=lambda v: v and all(isinstance(d, str) for d in v),
               expected="a non-empty list of device names")
        for k in ("predicted_s", "measured_s", "error_pct"):
            pr.get(k, float)


def _validate_plan_quality(r: Reader) -> None:
    for wr in r.readers("workloads"):
        wr.get("name", str)
        wr.get("chosen_s", float)
        _require(wr, ("best_baseline", "best_baseline_s", "speedup"))
        # null together: no feasible baseline distinct from the chosen plan
        if wr.get("best_baseline", str, default=None) is not None:
            wr.get("best_baseline_s", float)
            wr.get("speedup", float)


def validate_results(data, file: str) -> None:
    """InputError naming the file and field when `data` is not a results file."""
    r = Reader(data, file)
    h = r.sub("host")
    h.get("hostname", str)
    h.get("cpu_cores", int)
    h.get("torch", str)
    if h.has("gpu"):
        h.get("gpu", str)
    if r.has("accuracy"):
        _validate_accuracy(r.sub("accuracy"))
    if r.has("plan_quality"):
        _validate_plan_quality(r.sub("plan_quality"))
    if r.has("capped"):
        _validate_capped(r.sub("capped"))


def _validate_capped(r: Reader) -> None:
    r.get("parameters", int, check=lambda v: v > 0, expected="a positive integer")
    r.get("cap_bytes", int, check=lambda v: v > 0, expected="a positive integer")
    for pr in r.readers("plans", allow_empty=True):
        pr.get("name", str)
        if pr.has("measured_s"):
            pr.get("measured_s", float, check=lambda v: v > 0, expected="a positive number")
    for k in ("speedup_over_zero_offload", "predicted_speedup"):
        r.get(k, float, default=None)


# --- the benchmarks' sections -------------------------------------------------------------------
def _number_or_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def accuracy_payload(rows: list[dict], summary: dict, plans: dict[str, dict],
                     run: dict | None = None) -> dict:
    """The accuracy section from the benchmark's rows, summary and plan dicts (name -> plan);
    `run`: how they were measured (iterations, quick), kept as the section's "run"."""
    out = []
    for row in rows:
        plan = plans[row["plan"]]
        entry = {"name": row["plan"], "devices": plan_devices(plan), "predicted_s": row["predicted_s"],
                 "measured_s": row["measured_s"], "error_pct": row["error_pct"],
                 "workload": row["workload"], "class": plan_class(plan)}
        entry.update({k: row[k] for k in ("spread_pct", "run_spread_pct", "foreign_cpu") if k in row})
        if "lo_s" in row:
            entry["iteration_s_interval"] = [row["lo_s"], row["hi_s"]]
        entry["size_classes"] = {k[len("class_"):]: v for k, v in row.items() if k.startswith("class_")}
        out.append(entry)
    classes = {dim: {value: {"plans": c["plans"], "mape_pct": c["mape_pct"], "worst_pct": c["worst_pct"],
                             "kendall_tau": _number_or_none(c["tau"]),
                             "run_spread_pct": c["run_spread_pct"],
                             "spread_exceeds_error": c["spread_exceeds_error"],
                             **{k: c[k] for k in ("coverage_pct", "width_pct") if k in c}}
                     for value, c in by_value.items()}
               for dim, by_value in summary.get("per_class", {}).items()}
    return {"mape_pct": summary["mape_pct"], "worst_pct": summary["worst_pct"],
            "kendall_tau": _number_or_none(summary["tau"]), "plans": out, "classes": classes,
            **{k: summary[k] for k in ("coverage_pct", "width_pct") if k in summary},
            "run": run or {}}


def plan_quality_payload(summary: dict[str, dict], rows: list[dict], run: dict | None = None) -> dict:
    """The plan_quality section from the per-workload judgement and the measured rows; `run` as
    in accuracy_payload."""
    out = []
    for w, s in summary.items():
        mine = [r for r in rows if r["workload"] == w]
        out.append({"name": w, "chosen_s": s["chosen_s"], "best_baseline": s["best_baseline"],
                    "best_baseline_s": s["best_baseline_s"], "speedup": s["speedup"],
                    "chosen_predicted_s": next(r["predicted_s"] for r in mine if r["plan"] == "chosen"),
                    "baselines_s": {r["plan"]: r["measured_s"] for r in mine if r["plan"] != "chosen"},
                    "kendall_tau": _number_or_none(s["tau"]),
                    **{k: s[k] for k in ("kept", "confirmed", "probability_beats_best_baseline") if k in s}})
    return {"workloads": out, "run": run or {}}


def save_section(prog: str, section: str, payload: dict, path: Path) -> bool:
    """`update_results` for a benchmark's main: says on stderr what it wrote, or prints the one
    line of a bad results file; False then (the caller exits 2)."""
    try:
        update_results(section, payload, path)
    except InputError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    print(f"{prog}: wrote the {section} section of {path}", file=sys.stderr)
    return True


def check_results_file(prog: str, path: Path | None) -> bool:
    """Before a long run: False (with one line on stderr) when the results file at `path` could
    not be updated afterwards (not JSON, wrong shape, another host's)."""
    try:
        if path is not None:
            read_results(path)
    except InputError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    return True


# --- command-line flags -------------------------------------------------------------------------
def add_results_arguments(p) -> None:
    p.add_argument("--results", metavar="PATH", default=None,
                   help="results file to update (default benchmarks/results/<hostname>.json)")
    p.add_argument("--no-results", action="store_true", help="do not write the results file")


def results_target(args) -> Path | None:
    """The results file the flags name; None with --no-results."""
    if args.no_results:
        return None
    return Path(args.results) if args.results else default_results_path()
