"""The benchmarks' workloads and the accuracy benchmark's plans, as data, chosen by the devices
of the measured topology.

- CPU-only host (two or more CPU workers): `CPU_WORKLOADS`, `cpu_plan_set`.
- Host with a GPU (a `cpu:*` and a `cuda:*` device): `GPU_WORKLOADS`, `gpu_plan_set`, which
  adds the three ways of using the CPU and the GPU together: the batch split across a CPU
  replica and a GPU replica, a CPU stage in a pipeline with a GPU stage, and the optimizer of
  a GPU stage on the CPU (`"optimizer": {"placement": "cpu"}`), or a quarter of it there beside
  the GPU's part (`"placement": "split", "cpu_fraction": 0.25`); and the mlp's linear pairs
  split between the CPU and the GPU (a stage's `"devices"`).

A plan here is a plan-file dict (`hetplan.plan/1`) without `topology` and `predicted`.
"""
from __future__ import annotations

from pathlib import Path

# Sized like training steps: iterations of ~50-200 ms on one core (history: docs/tuning.md).
CPU_WORKLOADS = {
    "mlp": {"spec": "mlp", "args": {"hidden": 1024, "depth": 4}, "batch": 512},
    "gpt": {"spec": "gpt", "args": {"layers": 4, "d_model": 128, "heads": 4, "vocab": 2048,
                                    "context": 64}, "batch": 16},
    "cnn": {"spec": "cnn", "args": {}, "batch": 512},
}
# What users also run: small microbatches and short iterations (a few ms per microbatch, where
# per-op, per-message and per-microbatch costs weigh), and models we did not write (Hugging Face
# transformers, random init; skipped where `transformers` is not installed).
SMALL_WORKLOADS = {
    "mlp-small": {"spec": "mlp", "args": {"hidden": 256, "depth": 4}, "batch": 32},
    "llama": {"spec": "benchmarks.hf_models:llama", "args": {}, "batch": 16, "needs": "transformers"},
    "resnet": {"spec": "benchmarks.hf_models:resnet", "args": {}, "batch": 32, "needs": "transformers"},
}

# Sized for one datacenter GPU beside the host's CPU worker: the GPU part takes ~10-30 ms
# (estimated from FLOPs at fp32, not yet measured). `cpu_share` is the CPU replica's batch
# fraction when the batch is split: a CPU worker computes ~1/50-1/100 as fast as the GPU, so
# it gets a few samples. `cpu_stage`: which end of the model a CPU pipeline stage takes, the
# cheap one (gpt's embedding lookup; the mlp's and cnn's small output layers).
GPU_WORKLOADS = {
    "mlp": {"spec": "mlp", "args": {"hidden": 4096, "depth": 4}, "batch": 4096,
            "cpu_share": 1 / 128, "cpu_stage": "last"},
    "gpt": {"spec": "gpt", "args": {"layers": 4, "d_model": 512, "heads": 8, "vocab": 8192,
                                    "context": 256}, "batch": 32,
            "cpu_share": 1 / 32, "cpu_stage": "first"},
    "cnn": {"spec": "cnn", "args": {}, "batch": 4096, "cpu_share": 1 / 128, "cpu_stage": "last"},
}

# The same workloads sized for a CPU standing in for the GPU (HETPLAN_STANDIN_GPUS: gpu_session --smoke).
STANDIN_GPU_WORKLOADS = {
    "mlp": {"spec": "mlp", "args": {"hidden": 128, "depth": 4}, "batch": 128,
            "cpu_share": 1 / 4, "cpu_stage": "last"},
    "gpt": {"spec": "gpt", "args": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 512,
                                    "context": 32}, "batch": 8,
            "cpu_share": 1 / 4, "cpu_stage": "first"},
    "cnn": {"spec": "cnn", "args": {}, "batch": 64, "cpu_share": 1 / 4, "cpu_stage": "last"},
}


def gpu_workloads() -> dict[str, dict]:
    """GPU_WORKLOADS, or STANDIN_GPU_WORKLOADS where the CPU stands in for the GPU."""
    from hetplan.planner.hardware.device import standin_gpus
    return STANDIN_GPU_WORKLOADS if standin_gpus() else GPU_WORKLOADS


# Top-level plan keys added to every GPU transformer plan (`gpu_transformer_plans`): transformers
# are trained in bf16 on GPUs, so the GPU set's gpt plans are.
GPU_TRANSFORMER_PLAN_FIELDS: dict = {"precision": "bf16"}


def has_gpu(topology) -> bool:
    return any(d.kind == "cuda" for d in topology.devices)


def workloads_for(topology) -> dict[str, dict]:
    """The workloads sized for this topology's devices (those whose package is installed)."""
    if has_gpu(topology):
        return gpu_workloads()
    return {**CPU_WORKLOADS, **{w: s for w, s in SMALL_WORKLOADS.items() if _installed(s)}}


def _installed(workload: dict) -> bool:
    import importlib.util
    return "needs" not in workload or importlib.util.find_spec(workload["needs"]) is not None


def plans_for(topology, num_layers: dict[str, int]) -> dict[str, dict]:
    """name -> plan dict for the topology: the GPU set when it has a CUDA device and a CPU,
    else the CPU set (two CPU workers or more). ValueError when neither fits."""
    cpus = [d.name for d in topology.devices if d.kind == "cpu"]
    gpus = [d.name for d in topology.devices if d.kind == "cuda"]
    if gpus and cpus:
        return gpu_plan_set(num_layers, cpus[0], gpus[0])
    if not gpus and len(cpus) >= 2:
        return cpu_plan_set(num_layers, cpus)
    raise ValueError("needs at least two CPU workers (hetplan profile --cpu-workers 2), "
                     "or a CPU worker and a GPU")


def plan_with_hetplan(workload: dict, topology: Path, out: Path, *flags: str) -> Path:
    """`hetplan plan` of a workload dict (spec, args, batch) on `topology`, written to `out`
    with `flags` added; RuntimeError with the end of its stderr when it fails."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "hetplan", "plan", "--model", workload["spec"], "--batch", str(workload["batch"]),
           "--topology", str(topology), "-o", str(out), *flags]
    for k, v in workload["args"].items():
        cmd += ["--model-arg", f"{k}={v}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hetplan plan {workload['spec']} failed: {proc.stderr.strip()[-400:]}")
    return out


def make_plan(workload: dict, replicas, schedule="1f1b", sync="coarse", opt="adam",
              placement="device", bucket_bytes=1 << 20, lr=1e-3, cpu_fraction=None, **fields) -> dict:
    """A plan dict; `replicas` is [(batch_fraction, microbatches, [(device, (start, end)[, offload])])]
    (offload: the stage's offload_activations; device: a name, or [(name, share), ...] for a
    tensor-split stage); `fields` are extra top-level plan keys."""
    return {"schema": "hetplan.plan/1",
            "model": {"spec": workload["spec"], "args": workload["args"]},
            "global_batch": workload["batch"],
            "replicas": [{"batch_fraction": f, "microbatches": m,
                          "stages": [{**_where(d), "layers": list(r), **({"offload_activations": True} if off else {})}
                                     for d, r, *off in stages]}
                         for f, m, stages in replicas],
            "schedule": schedule, "sync": {"granularity": sync, "bucket_bytes": bucket_bytes},
            "optimizer": {"name": opt, "lr": lr, "placement": placement,
                          **({"cpu_fraction": cpu_fraction} if cpu_fraction is not None else {})},
            "recompute": False,
            **fields}


def _where(device) -> dict:
    if isinstance(device, str):
        return {"device": device}
    return {"devices": [{"device": d, "share": x} for d, x in device]}


def cpu_plan_set(num_layers: dict[str, int], devices: list[str]) -> dict[str, dict]:
    """Covers single device, even/uneven DP, coarse/fine sync, GPipe, 1F1B, interleaved 1F1B,
    ZB-H1 and Hippie, CPU optimizer placement, ZeRO stages 1 and 2, SGD and Adam; a hybrid when
    there are three devices."""
    a, b = devices[0], devices[1]
    W = CPU_WORKLOADS
    out = {}
    for w, L in num_layers.items():
        if w in SMALL_WORKLOADS:
            out.update(_small_plans(w, SMALL_WORKLOADS[w], L, a, b))
            continue
        half = L // 2
        full = [(a, (0, L))]
        pipe = [(a, (0, half)), (b, (half, L))]
        out[f"{w}/single"] = make_plan(W[w], [(1.0, 1, full)])
        out[f"{w}/dp-even-coarse"] = make_plan(W[w], [(0.5, 1, full), (0.5, 1, [(b, (0, L))])])
        out[f"{w}/dp-even-fine"] = make_plan(W[w], [(0.5, 1, full), (0.5, 1, [(b, (0, L))])],
                                             sync="fine", bucket_bytes=256 << 10)
        out[f"{w}/dp-uneven-sgd"] = make_plan(W[w], [(0.75, 1, full), (0.25, 1, [(b, (0, L))])],
                                              opt="sgd", lr=0.01)
        out[f"{w}/gpipe-4mb"] = make_plan(W[w], [(1.0, 4, pipe)], schedule="gpipe")
        out[f"{w}/1f1b-4mb"] = make_plan(W[w], [(1.0, 4, pipe)], schedule="1f1b")
        out[f"{w}/zb-h1-4mb"] = make_plan(W[w], [(1.0, 4, pipe)], schedule="zb-h1")
        if w in ("mlp", "gpt") and L >= 4:   # each device's half in two virtual stages
            q = [round(k * L / 4) for k in range(5)]
            virtual = [(d, (q[k], q[k + 1])) for k, d in enumerate((a, b, a, b))]
            out[f"{w}/interleaved-4mb"] = make_plan(W[w], [(1.0, 4, virtual)], schedule="interleaved-1f1b")
            out[f"{w}/hippie-4mb"] = make_plan(W[w], [(1.0, 4, pipe)], schedule="hippie")
    out["mlp/single-2mb"] = make_plan(W["mlp"], [(1.0, 2, [(a, (0, num_layers["mlp"]))])])
    out["mlp/tensor-40-60"] = make_plan(W["mlp"], [(1.0, 1, [([(a, 0.4), (b, 0.6)], (0, num_layers["mlp"]))])])
    # asynchronous modes (their iteration time; hetplan/planner/search/time_to_loss ranks them by loss)
    for w, sync in (("mlp", {"mode": "local-sgd", "period": 4}), ("gpt", {"mode": "hogwild"})):
        if w in num_layers:
            L = num_layers[w]
            out[f"{w}/{sync['mode']}"] = plan = make_plan(W[w], [(0.5, 1, [(a, (0, L))]), (0.5, 1, [(b, (0, L))])])
            plan["sync"].update(sync)
    for w in ("mlp", "gpt"):      # ZeRO: each replica steps (2: and keeps the gradients, 3: and the parameters of) a half
        if w in num_layers:
            both = [(0.5, 1, [(a, (0, num_layers[w]))]), (0.5, 1, [(b, (0, num_layers[w]))])]
            out[f"{w}/dp-zero1"] = make_plan(W[w], both, sync="fine", bucket_bytes=256 << 10, shard={"stage": 1})
            out[f"{w}/dp-zero2"] = make_plan(W[w], both, sync="fine", bucket_bytes=256 << 10, shard={"stage": 2})
            out[f"{w}/dp-zero3"] = make_plan(W[w], both, sync="fine", bucket_bytes=256 << 10, shard={"stage": 3})
    out["gpt/dp-even-cpu-opt"] = make_plan(W["gpt"], [(0.5, 1, [(a, (0, num_layers["gpt"]))]),
                                                      (0.5, 1, [(b, (0, num_layers["gpt"]))])],
                                           placement="cpu", sync="fine", bucket_bytes=256 << 10)
    if len(devices) >= 3:
        c, L = devices[2], num_layers["mlp"]
        out["mlp/hybrid"] = make_plan(W["mlp"], [(0.5, 1, [(a, (0, L))]),
                                                 (0.5, 2, [(b, (0, L // 2)), (c, (L // 2, L))])],
                                      sync="fine", bucket_bytes=256 << 10)
    return out


def _small_plans(w: str, spec: dict, L: int, a: str, b: str) -> dict[str, dict]:
    """Single device, even DP (coarse, fine), a 30/70 split, and two-stage pipelines of small
    microbatches (GPipe with 2 and with 4, 1F1B with 4)."""
    full, other = [(a, (0, L))], [(b, (0, L))]
    pipe = [(a, (0, L // 2)), (b, (L // 2, L))]
    plan = lambda replicas, **kw: make_plan(spec, replicas, **kw)  # noqa: E731
    return {
        f"{w}/single": plan([(1.0, 1, full)]),
        f"{w}/dp-even-coarse": plan([(0.5, 1, full), (0.5, 1, other)]),
        f"{w}/dp-even-fine": plan([(0.5, 1, full), (0.5, 1, other)], sync="fine", bucket_bytes=64 << 10),
        f"{w}/dp-30-70": plan([(0.25, 1, full), (0.75, 1, other)]),
        f"{w}/gpipe-2mb": plan([(1.0, 2, pipe)], schedule="gpipe"),
        f"{w}/gpipe-4mb": plan([(1.0, 4, pipe)], schedule="gpipe"),
        f"{w}/1f1b-4mb": plan([(1.0, 4, pipe)], schedule="1f1b"),
    }


def size_classes(plan: dict, measured_s: float) -> dict[str, str]:
    """The classes a plan belongs to, by what dominates its cost: the microbatch (largest, in
    samples: <= 8, >= 64, or between), the measured iteration (< 20 ms, > 100 ms, or between),
    the pipeline depth (1 stage, 2+), and the gradient sync of a multi-replica plan (coarse,
    fine, or async for an asynchronous sync.mode)."""
    G = plan["global_batch"]
    micro = max(round(r["batch_fraction"] * G) / r["microbatches"] for r in plan["replicas"])
    out = {"microbatch": "<=8" if micro <= 8 else ">=64" if micro >= 64 else "9-63",
           "iteration": "<20ms" if measured_s < 0.02 else ">100ms" if measured_s > 0.1 else "20-100ms",
           "stages": "1" if max(len(r["stages"]) for r in plan["replicas"]) == 1 else "2+"}
    if len(plan["replicas"]) > 1:       # an asynchronous mode exchanges no gradients: its own class
        mode = plan["sync"].get("mode", "sync")
        out["sync"] = plan["sync"]["granularity"] if mode == "sync" else "async"
    return out


def gpu_plan_set(num_layers: dict[str, int], cpu: str, gpu: str) -> dict[str, dict]:
    """Per workload: the GPU alone (one and four microbatches), then the three CPU+GPU kinds
    (`cpu-gpu-dp` coarse and fine, `cpu-gpu-pipe`, `gpu-cpu-opt`, `gpu-split-opt`), and the GPU
    alone with its activations offloaded to host memory (`gpu-offload-gpipe-4mb`). The transformer's plans
    come from `gpu_transformer_plans`."""
    out = {}
    for w, L in num_layers.items():
        if w == "gpt":
            out.update(gpu_transformer_plans(L, cpu, gpu))
        else:
            out.update(_gpu_workload_plans(w, gpu_workloads()[w], L, cpu, gpu))
    return out


def gpu_transformer_plans(L: int, cpu: str, gpu: str,
                          fields: dict = GPU_TRANSFORMER_PLAN_FIELDS) -> dict[str, dict]:
    """The GPU set's gpt plans, each carrying the top-level plan keys `fields`."""
    return _gpu_workload_plans("gpt", gpu_workloads()["gpt"], L, cpu, gpu, **fields)


def _gpu_workload_plans(w: str, spec: dict, L: int, cpu: str, gpu: str, **fields) -> dict[str, dict]:
    share = spec["cpu_share"]
    k = 1 if spec["cpu_stage"] == "first" else L - 1    # the CPU stage holds one end layer
    pipe = ([(cpu, (0, k)), (gpu, (k, L))] if spec["cpu_stage"] == "first"
            else [(gpu, (0, k)), (cpu, (k, L))])
    split = [(share, 1, [(cpu, (0, L))]), (1 - share, 1, [(gpu, (0, L))])]
    gpu_only = [(gpu, (0, L))]
    plan = lambda replicas, **kw: make_plan(spec, replicas, **kw, **fields)  # noqa: E731
    return {
        f"{w}/gpu-single": plan([(1.0, 1, gpu_only)]),
        f"{w}/gpu-4mb": plan([(1.0, 4, gpu_only)]),
        f"{w}/cpu-gpu-dp-coarse": plan(split),
        f"{w}/cpu-gpu-dp-fine": plan(split, sync="fine", bucket_bytes=4 << 20),
        f"{w}/cpu-gpu-pipe-1f1b": plan([(1.0, 4, pipe)]),
        f"{w}/cpu-gpu-pipe-zb-h1": plan([(1.0, 4, pipe)], schedule="zb-h1"),
        **({f"{w}/cpu-gpu-pipe-hippie": plan([(1.0, 4, pipe)], schedule="hippie")} if w == "gpt" else {}),
        f"{w}/gpu-cpu-opt": plan([(1.0, 1, gpu_only)], placement="cpu"),
        f"{w}/gpu-split-opt": plan([(1.0, 1, gpu_only)], placement="split", cpu_fraction=0.25),
        f"{w}/gpu-offload-gpipe-4mb": plan([(1.0, 4, [(gpu, (0, L), True)])], schedule="gpipe"),
        **({f"{w}/cpu-gpu-tensor": plan([(1.0, 1, [([(gpu, 1 - share), (cpu, share)], (0, L))])])}
           if w == "mlp" else {}),
    }


def _kind(device: str) -> str:
    return device.split("/")[-1].split(":")[0]      # "node1/cuda:3" -> "cuda"


def _stage_devices(stage: dict) -> list[str]:
    """A plan dict stage's devices: its "device", or those of its tensor split."""
    return [x["device"] for x in stage["devices"]] if "devices" in stage else [stage["device"]]


def plan_class(plan: dict) -> str:
    """'cpu', 'gpu' or 'cpu+gpu': the kinds of device a plan computes on (a GPU stage whose
    optimizer step runs on the host uses both)."""
    kinds = {_kind(d) for r in plan["replicas"] for s in r["stages"] for d in _stage_devices(s)}
    if plan["optimizer"]["placement"] in ("cpu", "split"):
        kinds.add("cpu")
    return "+".join(name for kind, name in (("cpu", "cpu"), ("cuda", "gpu")) if kind in kinds)


def hybrid_kinds(plan: dict) -> set[str]:
    """How a plan uses the CPU and a GPU together: 'batch-split' (a CPU replica beside a GPU
    replica), 'pipeline' (a CPU stage and a GPU stage in one replica), 'cpu-optimizer' (a GPU
    stage's optimizer step on the host), 'split-optimizer' (part of it on the host),
    'tensor-split' (a stage's linear pairs split between a CPU and a GPU)."""
    per_replica = [{_kind(d) for s in r["stages"] for d in _stage_devices(s)} for r in plan["replicas"]]
    everywhere = set().union(*per_replica)
    out = set()
    if {"cpu"} in per_replica and {"cuda"} in per_replica:
        out.add("batch-split")
    if any({_kind(s["device"]) for s in r["stages"] if "device" in s} == {"cpu", "cuda"}
           for r in plan["replicas"]):
        out.add("pipeline")
    if any({_kind(d) for d in _stage_devices(s)} == {"cpu", "cuda"} for r in plan["replicas"] for s in r["stages"]):
        out.add("tensor-split")
    if plan["optimizer"]["placement"] == "cpu" and "cuda" in everywhere:
        out.add("cpu-optimizer")
    if plan["optimizer"]["placement"] == "split" and "cuda" in everywhere:
        out.add("split-optimizer")
    return out


def plan_devices(plan: dict) -> list[str]:
    """The plan's devices, in order of first use."""
    return list(dict.fromkeys(d for r in plan["replicas"] for s in r["stages"] for d in _stage_devices(s)))
