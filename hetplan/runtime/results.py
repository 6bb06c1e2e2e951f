"""The measured file (`hetplan.measured/1`) built from every rank's record.

- Iteration time: the ranks pass one barrier, then train without another, as under torchrun
  (a barrier per iteration would add its exit skew, milliseconds on a busy host, to every
  iteration). Each rank times from the end of its previous iteration (the barrier for the first)
  to the end of this one (CUDA: after a synchronize), less the time spent making its batch (data
  loading is not part of an iteration, as in the simulator). Iteration 0, which starts from the
  barrier, is the MAX over ranks; a later one is the MEAN over ranks: in steady state every rank
  goes round in the same time (the collectives and messages couple them), and the mean does not
  add each rank's jitter the way the max does. `iteration_s` is the median after the warm-up.
- Busy time, timeline and peak memory per device: as the rank measured them (hetplan.runtime.instruments).
"""
from __future__ import annotations

import os
import platform
import socket
import statistics
from typing import Any

import torch


def host_info() -> dict[str, Any]:
    from hetplan.planner.hardware.cores import node_cores
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "usable_cores": len(node_cores())}     # the node's, not the worker's bound cores


def iteration_times(iter_s: list[list[float]]) -> list[float]:
    """Each iteration's time from every rank's own times (iter_s[rank][i]): iteration 0 (from
    the common barrier) the max over ranks, a later one the mean (see the module docstring)."""
    n = len(iter_s[0])
    return [max(r[i] for r in iter_s) if i == 0 else statistics.fmean(r[i] for r in iter_s)
            for i in range(n)]


def build_measured(plan_sha256: str, per_rank: list[dict[str, Any]], warmup: int,
                   extra: dict[str, Any]) -> dict[str, Any]:
    """Combine every rank's record into the measured file's fields.

    per_rank[r]: {"device", "iter_s": [...], "busy_s": [...], "loss": [...] (weighted, last
    stages only, else zeros), "peak_memory_bytes", ...}. Iteration 0's time is the max over ranks,
    a later one's the mean;
    its loss is the sum over replicas' last stages of (b_r / G) * loss_r.
    """
    n = len(per_rank[0]["iter_s"])
    iterations = iteration_times([r["iter_s"] for r in per_rank])
    losses = [sum(r["loss"][i] for r in per_rank) for i in range(n)]
    kept = iterations[warmup:] or iterations
    per_device = {}
    for r in per_rank:
        busy = r["busy_s"][warmup:] or r["busy_s"]
        per_device[r["device"]] = {
            "busy_s": statistics.median(busy), "peak_memory_bytes": r["peak_memory_bytes"],
            "rank": r["rank"], "threads": r.get("threads"), "param_bytes": r["param_bytes"],
            "optimizer_state_bytes": r["optimizer_state_bytes"], "busy_per_iteration_s": r["busy_s"],
            "iterations_s": r["iter_s"]}      # this rank's own, which its events fall within
        if r.get("page_faults"):
            per_device[r["device"]]["page_faults_per_iteration"] = statistics.median(
                r["page_faults"][warmup:] or r["page_faults"])
        for k in ("saved_activation_peak_bytes", "rss_growth_bytes", "cores", "affinity", "slices_ns"):
            if r.get(k) is not None:
                per_device[r["device"]][k] = r[k]
        if r.get("events") is not None:   # one iteration's spans on this device (compare --plot)
            per_device[r["device"]]["events"] = r["events"]
            per_device[r["device"]]["events_iteration"] = r["events_iteration"]
    return {"plan_sha256": plan_sha256, "iterations_s": iterations,
            "iteration_s": statistics.median(kept), "losses": losses, "per_device": per_device,
            "host": host_info(), "torch": torch.__version__, **extra}
