"""`hetplan profile`: measure this machine's devices and links for real.

One worker process per device: CPU worker groups `cpu:0..cpu:N-1` share the cores left after
keeping one core per GPU to drive it (`torch.set_num_threads`), and every CUDA GPU gets its own
process. All workers run the device benchmarks at the same time, as they will run during
training: CPU workers compete for memory bandwidth and caches, so a figure measured alone would
be too optimistic. Pairs of workers are then measured one pair at a time (uncontended links),
then an all-reduce over all of them. Workers talk over gloo on 127.0.0.1.

This module is the launcher and the assembly: `profile_machine` spawns the workers
(hetplan.runtime.profile_worker, an env:// function that also runs under `torchrun`) with
torch.multiprocessing and turns their raw tables into a Topology (`assemble`).

Each worker is bound to its own cores, as `run`'s workers are (hetplan.planner.hardware.cores). Not
modelled: NUMA placement, NCCL between GPUs (GPU workers exchange data through pinned host
buffers over gloo, the path of a CPU+GPU runtime). A GPU's host copies are measured both pageable and pinned (`host_copy`).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from hetplan.planner.hardware.cores import binding_enabled, usable_cores as usable_core_ids
from hetplan.planner.hardware.device import gpu_count
from hetplan.planner.files.io import InputError
from hetplan.planner.hardware.fit import fit_latency_bandwidth
from hetplan.planner.hardware.machine import cpu_model, facts as machine_facts, this_machine
from hetplan.planner.hardware.topology import Device, Link, Topology
from hetplan.runtime.profile_worker import (FAIL_ENV, Settings, WorkerSpec,  # noqa: F401 - FAIL_ENV: tests
                                    available_ram_bytes, log, profile_worker)
from hetplan.runtime.host_load import ForeignCPU, busy_fraction, busy_warning
from hetplan.runtime.rendezvous import env_vars, free_port


def usable_cores() -> int:
    return len(usable_core_ids())


def plan_workers(cpu_workers: int, cores: int, gpus: int) -> list[WorkerSpec]:
    """cpu:0..N-1 split the cores left after one per GPU (the first ones get the remainder);
    each GPU worker gets one thread. Raises InputError when N does not fit."""
    cpu_cores = max(1, cores - gpus)
    if not 1 <= cpu_workers <= cpu_cores:
        kept = f", {gpus} kept to drive GPUs" if gpus else ""
        raise InputError(f"--cpu-workers: expected an integer from 1 to {cpu_cores} "
                         f"(this machine has {cores} cores{kept}), got {cpu_workers}")
    base, extra = divmod(cpu_cores, cpu_workers)
    specs = [WorkerSpec(f"cpu:{i}", "cpu", i, base + (i < extra)) for i in range(cpu_workers)]
    specs += [WorkerSpec(f"cuda:{g}", "cuda", g, 1) for g in range(gpus)]
    return specs


def calibration(workers: list[WorkerSpec], results: list[dict], allreduce: list[dict]) -> dict:
    """The topology's "calibration" object (hetplan.planner.hardware.calibration) from the workers' raw results."""
    from hetplan.planner.hardware.calibration import Calibration, calibration_to_dict
    from hetplan.planner.hardware.fit import contention_factor, fit_optimizer, lower_envelope, memory_contention_factor
    cpus = [(w, r.get("calibration", {})) for w, r in zip(workers, results) if w.kind == "cpu"]
    timed = [c for _, c in cpus if "reference_alone_s" in c and "reference_together_s" in c]
    factor = 1.0
    if len(cpus) > 1 and all(c.get("reference_ratios") for _, c in cpus):
        # the mean over rounds spread across the profile: a slowdown that comes and goes
        # counts in proportion to the time it holds (hetplan.runtime.profile_worker._reference_rounds)
        factor = max(1.0, statistics.median(statistics.fmean(c["reference_ratios"]) for _, c in cpus))
    elif len(cpus) > 1 and timed:
        factor = contention_factor([c["reference_alone_s"] for c in timed],
                                   [c["reference_together_s"] for c in timed])
    lat = bw = None
    curve = ()
    if allreduce and all(w.kind == "cpu" for w in workers):
        lat, bw = fit_latency_bandwidth(allreduce)
        curve = lower_envelope(allreduce)
    rank0 = results[0].get("calibration", {})   # what rank 0 alone measures
    opt_rows = rank0.get("optimizer", {})
    together_rows = rank0.get("optimizer_together", {})
    mem = memory_contention_factor(opt_rows.get("adam", []), together_rows.get("adam", []))
    single = ("wake_latency_s", "cold_compute_s", "send_issue_s", "recv_post_s", "action_overhead_s",
              "iteration_overhead_s", "grad_accumulate_s_per_byte", "ddp_forward_s", "grad_copy_s_per_byte")
    gathered = results[0].get("allgather") or []
    c = Calibration(cpu_workers=len(cpus), cpu_contention_factor=factor, allreduce_latency_s=lat,
                    allreduce_bytes_per_s=bw, allreduce_curve=curve,
                    allgather_curve=lower_envelope(gathered) if curve and gathered else (),
                    allreduce_queued_s=rank0.get("allreduce_queued_s") if curve else None,
                    **{k: rank0.get(k) or 0.0 for k in single},
                    memory_contention_factor=mem,
                    held_send_curve=tuple(map(tuple, rank0.get("held_send_curve") or ())),
                    optimizer={k: fit_optimizer(v) for k, v in opt_rows.items() if len(v) >= 2})
    tables = ("optimizer", "optimizer_together")
    raw = {"reference": [{"device": w.name, **{k: v for k, v in r.items() if k not in tables}}
                         for w, r in cpus],
           "optimizer": opt_rows, "optimizer_together": together_rows}
    return {**calibration_to_dict(c), "raw": raw}


def _spawn_entry(local_rank: int, workers: list[WorkerSpec], settings: Settings, out_dir: str,
                 port: int) -> None:
    os.environ.update(env_vars(local_rank, len(workers), "127.0.0.1", port))
    profile_worker(workers, settings, out_dir)
    # Results are on disk: skip interpreter teardown (a torch static destructor can abort, SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the launcher ---------------------------------------------------------------------------
class ProfileError(RuntimeError):
    """A worker failed; the message is one line naming the worker and its error."""


def _root_cause(e: ProcessException, workers: list[WorkerSpec], out_dir: Path) -> str:
    """One line: the earliest error a worker recorded, else what spawn saw (e.g. a signal)."""
    errors = [(json.loads(p.read_text()), int(p.stem[4:])) for p in out_dir.glob("rank*.error")]
    if errors:
        (first, rank) = min(errors, key=lambda x: x[0]["time"])
        return f"worker {rank} ({workers[rank].name}) failed: {first['error']}"
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return f"worker {e.error_index} ({workers[e.error_index].name}) failed: {lines[-1]}"


def _cpu_bf16_native() -> bool:
    """Whether the CPU has native bf16 matmul instructions (x86 flags avx512_bf16 / amx_bf16)."""
    try:
        flags = next((l.split(":", 1)[1].split() for l in Path("/proc/cpuinfo").read_text().splitlines()
                      if l.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def profile_machine(cpu_workers: int, quick: bool = False) -> Topology:
    """Spawn the workers, collect their results, return the measured topology."""
    t0 = time.perf_counter()
    settings = Settings.quick() if quick else Settings.full()
    binding_enabled()        # HETPLAN_BIND_CORES is 0 or 1: the workers bind (profile_worker)
    cores, gpus = usable_cores(), gpu_count()
    workers = plan_workers(cpu_workers, cores, gpus)
    ram_bytes = available_ram_bytes()
    busy = busy_fraction(0.5)
    log(f"{len(workers)} worker(s): " + ", ".join(f"{w.name} ({w.threads} thr)" for w in workers)
        + (" [quick]" if quick else ""))
    with tempfile.TemporaryDirectory(prefix="hetplan-profile-") as out_dir:
        try:
            with ForeignCPU() as foreign:      # other work while the workers measure
                mp.spawn(_spawn_entry, args=(workers, settings, out_dir, free_port()),
                         nprocs=len(workers), join=True)
        except ProcessException as e:
            raise ProfileError(_root_cause(e, workers, Path(out_dir))) from None
        results = [json.loads((Path(out_dir) / f"rank{r}.json").read_text())
                   for r in range(len(workers))]
    host = {"hostname": socket.gethostname(), "fingerprint": this_machine(), "machine": machine_facts(),
            "cpu_model": cpu_model(), "cores": cores,
            "cpu_bf16_native": _cpu_bf16_native(),
            "torch": torch.__version__, "python": platform.python_version(),
            "profiled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quick": quick, "duration_s": round(time.perf_counter() - t0, 2),
            "busy_before": busy, "busy_during": round(foreign.fraction(), 3)}
    warning = busy_warning(max(busy or 0.0, host["busy_during"]))
    if warning:
        log(f"warning: {warning}")
    return assemble(workers, results, settings, host, ram_bytes)


def assemble(workers: list[WorkerSpec], results: list[dict], settings: Settings, host: dict,
             ram_bytes: int) -> Topology:
    """Workers' raw results -> Topology. Scalars: matmul_flops_per_s = the median at the
    largest size (sustained), matmul_flops_per_s_by_precision as the worker measured it (same
    rule per precision), memory_bytes_per_s = the copy (read + write), op_overhead_s =
    the tiny-op time, memory_bytes = the worker's share of available RAM (CPU) or the GPU's
    total memory; each link's latency and bandwidth are fitted to its ping-pong table."""
    n_cpu = sum(w.kind == "cpu" for w in workers)
    devices, links = [], []
    for w, res in zip(workers, results):
        d = res["device"]
        extra = {k: v for k, v in d.items() if k not in ("memory_bytes", "matmul_flops_per_s_by_precision")}
        if w.kind == "cpu":
            extra["measured_concurrently_with"] = [x.name for x in workers if x is not w]
        devices.append(Device(
            name=w.name, kind=w.kind,
            memory_bytes=float(d["memory_bytes"] if w.kind == "cuda" else ram_bytes // n_cpu),
            matmul_flops_per_s=d["matmul_table"][-1]["flops_per_s"],
            memory_bytes_per_s=d["memory_copy"]["bytes_per_s"],
            op_overhead_s=d["op_overhead"]["s"],
            threads=w.threads, measured=extra,
            matmul_flops_per_s_by_precision=d.get("matmul_flops_per_s_by_precision")))
        for peer, rows in res["links"].items():
            latency_s, bandwidth = fit_latency_bandwidth(rows)
            links.append(Link(a=w.name, b=peer, bandwidth_bytes_per_s=bandwidth, latency_s=latency_s,
                              measured={"p2p_table": rows,
                                        "method": "gloo ping-pong, one-way = round trip / 2; "
                                                  "fit latency + bytes/bandwidth, weights 1/time"}))
    extra = {
        "host": host,
        "collectives": {"allreduce": results[0]["allreduce"], "allgather": results[0].get("allgather", []),
                        "allreduce_devices": [w.name for w in workers]},
        "calibration": calibration(workers, results, results[0]["allreduce"]),
        "settings": asdict(settings),
        "notes": ["all workers measured their device concurrently, as during training",
                  "spread = (p75 - p25) / median over `samples` repeats",
                  "memory bandwidth: a large tensor copy counted as read + write"],
    }
    return Topology(name=host["hostname"], devices=tuple(devices), links=tuple(links), measured=extra)


def max_spread(t: Topology) -> float:
    """The largest spread of any measurement in a measured topology (a noise summary)."""
    spreads = []
    for d in t.devices:
        spreads += [r["spread"] for r in d.measured.get("matmul_table", [])]
        spreads += [d.measured[k]["spread"] for k in ("memory_copy", "op_overhead") if k in d.measured]
    for l in t.links:
        spreads += [r["spread"] for r in l.measured.get("p2p_table", [])]
    spreads += [r["spread"] for r in t.measured.get("collectives", {}).get("allreduce", [])]
    return max(spreads, default=0.0)
