"""The ZeRO-Offload / CoTrain case: a GPU too small for the model's training state, beside a CPU
with memory to spare.

The GPU's memory is capped (HETPLAN_GPU_MEMORY_CAP in every worker, the topology's memory_bytes
saying so) halfway between the predicted peaks of a GPT trained on the GPU alone and trained with
its optimizer on the CPU (`cap_between`): the parameters, gradients and Adam state do not fit
there, with the optimizer state on the host they do. Each plan is predicted (with its interval) and run; the planner's choice (`hetplan plan`
on the capped topology) is measured against the ZeRO-Offload-style plan (the optimizer on the
CPU). Rows are written to `--out`/capped.json as they finish, so a run cut short keeps them.

    python benchmarks/capped.py --topology PROFILE [--out DIR] [--smoke] [--time-limit S]
                                [--results PATH | --no-results]

Plans: zero-offload (the update on the CPU), cotrain (the update split, half the bytes on the
CPU), offload (activations in host memory, optimizer on the CPU), recompute (optimizer on the
CPU), cpu-stage (the embedding on the CPU, the rest on the GPU, optimizer on the CPU), and the
planner's choice. With --smoke: a small GPT on a stand-in GPU (HETPLAN_STANDIN_GPUS=1).
CoTrain reports +30 % over ZeRO-Offload.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)
from benchmarks.accuracy import prediction, run_window  # noqa: E402
from benchmarks.plan_sets import make_plan, plan_with_hetplan  # noqa: E402
from benchmarks.results import add_results_arguments, check_results_file, results_target, save_section  # noqa: E402

# 1.5 B parameters: on an H200 capped near 19 GiB; a short context so that timing its layers on
# the CPU (for a CPU stage) fits the session
MODEL = {"spec": "gpt", "args": {"layers": 30, "d_model": 2048, "heads": 16, "vocab": 8192, "context": 128},
         "batch": 4}
SMOKE_MODEL = {"spec": "gpt", "args": {"layers": 4, "d_model": 64, "heads": 4, "vocab": 512, "context": 32},
               "batch": 8}


def parameters(model: dict) -> int:
    from hetplan.planner.workload.load import load_workload
    w = load_workload(model["spec"], model["args"])
    return sum(p.numel() for p in w.model.parameters())


def cap_between(model: dict, L: int, profile: Path, gpu: str, out: Path) -> tuple[int, dict]:
    """Halfway between the predicted peak GPU memory of the model on the GPU alone (its Adam state
    there) and with its optimizer on the CPU, and both peaks."""
    from hetplan.planner.hardware.topology import load_topology
    topo = load_topology(profile)
    peaks = {}
    for name, placement in (("gpu-alone", "device"), ("zero-offload", "cpu")):
        path = out / f"uncapped-{name}.json"
        path.write_text(json.dumps({**make_plan(model, [(1.0, 1, [(gpu, (0, L))])], placement=placement,
                                                precision="bf16"),
                                    "topology": {"name": topo.name, "sha256": topo.sha256}}))
        peaks[name] = prediction(path, topo).result.per_device[gpu]["peak_memory_bytes"]
    if not peaks["zero-offload"] < peaks["gpu-alone"]:
        raise SystemExit(f"capped: the optimizer on the CPU does not lower {gpu}'s predicted peak: {peaks}")
    return int((peaks["zero-offload"] + peaks["gpu-alone"]) / 2), peaks


def capped_topology(profile: Path, cap: int, out: Path) -> Path:
    """The profile with each GPU's memory_bytes set to `cap`."""
    topo = json.loads(profile.read_text())
    for d in topo["devices"]:
        if d["kind"] == "cuda":
            d["memory_bytes"] = cap
    path = out / "capped-topology.json"
    path.write_text(json.dumps(topo, indent=1))
    return path


def hand_plans(model: dict, L: int, cpu: str, gpu: str) -> dict[str, dict]:
    """The plans a user of ZeRO-Offload, CoTrain or activation offload would try."""
    whole = [(gpu, (0, L))]
    bf16 = {"precision": "bf16"}
    return {
        "zero-offload": make_plan(model, [(1.0, 1, whole)], placement="cpu", **bf16),
        "cotrain": make_plan(model, [(1.0, 1, whole)], placement="split", cpu_fraction=0.5, **bf16),
        "offload": make_plan(model, [(1.0, 4, [(gpu, (0, L), True)])], schedule="gpipe", placement="cpu", **bf16),
        "recompute": {**make_plan(model, [(1.0, 1, whole)], placement="cpu", **bf16), "recompute": True},
        "cpu-stage": make_plan(model, [(1.0, 4, [(cpu, (0, 1)), (gpu, (1, L))])], placement="cpu", **bf16),
    }


def measure(name: str, path: Path, topo, out: Path) -> dict:
    """Predict and run one plan file (through this process's launcher: hetplan.runtime.launch); a run
    that fails is a row with its error."""
    from hetplan.confirm import run_here
    from hetplan.planner.files.plan import load_plan
    t0 = time.perf_counter()
    row = {"name": name}
    try:
        got = prediction(path, topo)
        row.update(predicted_s=got.iteration_s, iteration_s_interval=list(got.interval),
                   feasible=bool(got.result.feasible))
        iters, warmup = run_window(got.iteration_s, 6, 2)
        row["measured_s"] = run_here(path, load_plan(path), topo, iters, warmup, out)
    except Exception as e:   # noqa: BLE001 - an OOM or a refused plan is a finding, kept as a row
        row["error"] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    row["seconds"] = time.perf_counter() - t0
    print(f"capped: {name}: {json.dumps({k: v for k, v in row.items() if k != 'name'})}", file=sys.stderr)
    return row


def planner_choice(model: dict, topo_path: Path, out: Path, time_limit: float) -> Path:
    return plan_with_hetplan(model, topo_path, out / "capped-plan.json", "--precision", "bf16",
                             "--time-limit", str(time_limit), "--no-confirm")


def summary(rows: list[dict], chosen: str | None) -> dict:
    """The chosen plan's measured and predicted speedup over the ZeRO-Offload-style plan."""
    by = {r["name"]: r for r in rows}
    base, mine = by.get("zero-offload", {}), by.get(chosen or "", {})
    both = "measured_s" in base and "measured_s" in mine
    return {"chosen": chosen,
            "speedup_over_zero_offload": base["measured_s"] / mine["measured_s"] if both else None,
            "predicted_speedup": (base["predicted_s"] / mine["predicted_s"]
                                  if "predicted_s" in base and "predicted_s" in mine else None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="this machine's profile (with a GPU)")
    p.add_argument("--out", default="out/capped")
    p.add_argument("--smoke", action="store_true", help="a small GPT on a stand-in GPU")
    p.add_argument("--time-limit", type=float, default=40.0, help="the planner's search cap (s)")
    add_results_arguments(p)
    a = p.parse_args(argv)
    results_path = results_target(a)
    if not check_results_file("capped", results_path):
        return 2
    from hetplan.planner.hardware.device import MEMORY_CAP_ENV
    from hetplan.planner.hardware.topology import load_topology
    from hetplan.planner.workload.layers import num_layers
    from hetplan.planner.workload.load import load_workload

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from hetplan.runtime.launch import prestart
    prestart()              # the workers' server starts while the model is counted
    model = SMOKE_MODEL if a.smoke else MODEL
    n = parameters(model)
    profile = load_topology(a.topology)
    cpu = next(d.name for d in profile.devices if d.kind == "cpu")
    gpu = next(d.name for d in profile.devices if d.kind == "cuda")
    L = num_layers(load_workload(model["spec"], model["args"]), 1)
    cap, peaks = cap_between(model, L, Path(a.topology), gpu, out)
    os.environ[MEMORY_CAP_ENV] = str(cap)          # every worker started from here
    topo_path = capped_topology(Path(a.topology), cap, out)
    topo = load_topology(topo_path)
    print(f"capped: {model['spec']} {n / 1e9:.3f} B parameters, {gpu} capped to {cap / 2**30:.2f} GiB "
          f"(predicted peaks: {peaks['gpu-alone'] / 2**30:.2f} GiB alone, {peaks['zero-offload'] / 2**30:.2f} "
          f"with the optimizer on the CPU)", file=sys.stderr)
    record = {"model": model, "parameters": n, "cap_bytes": cap, "predicted_peaks_bytes": peaks, "plans": []}
    rows, chosen = record["plans"], None

    def save() -> None:
        (out / "capped.json").write_text(json.dumps({**record, **summary(rows, chosen)}, indent=1))

    plans = hand_plans(model, L, cpu, gpu)
    order = ["zero-offload", "chosen", "cotrain", "offload", "recompute", "cpu-stage"]
    for name in order:
        if name == "chosen":
            try:
                path = planner_choice(model, topo_path, out, a.time_limit)
            except RuntimeError as e:
                rows.append({"name": "chosen", "error": str(e)})
                save()
                continue
            chosen = "chosen"
        else:
            path = out / f"{name}.json"
            path.write_text(json.dumps({**plans[name], "topology": {"name": topo.name, "sha256": topo.sha256}}))
        rows.append(measure(name, path, topo, out))
        save()
    payload = {**record, **summary(rows, chosen)}
    if results_path and not save_section("capped", "capped", payload, results_path):
        return 2
    s = summary(rows, chosen)
    sp = f"{s['speedup_over_zero_offload']:.2f}x" if s["speedup_over_zero_offload"] else "n/a"
    ps = f"{s['predicted_speedup']:.2f}x" if s["predicted_speedup"] else "n/a"
    print(f"capped: the planner's choice against ZeRO-Offload: measured {sp}, predicted {ps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
