"""How the runtime exchanges a plan's gradients, as far as its own costs on the worker's thread go.

Plain data parallel (`runs_on_ddp`) runs on torch's DistributedDataParallel (hetplan.runtime.ddp): every
forward pays DDP's own work, and the reducer copies each gradient into its bucket during the
backward (the runtime sets gradients to None before an iteration, so they are fresh tensors;
with gradient_as_bucket_view the reduced bucket is the gradient: no copy back). Every other plan
that exchanges gradients runs on hetplan.runtime.sync.GradSync: it copies a bucket's gradients into a
flat buffer when the bucket is final, and the sums back after the all-reduce.
The runtime decides with these functions too, so the simulator and the runtime cannot disagree.
"""
from __future__ import annotations

import functools
import inspect

from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.topology import parse_device_name


def is_plain_dp(plan: Plan) -> bool:
    """True when every replica is one whole-model stage on one device kind that one collective
    backend serves, and the optimizer stays on the device, training synchronously."""
    if len(plan.replicas) < 2 or plan.optimizer.placement != "device" or plan.sync.mode != "sync":
        return False
    if any(len(rep.stages) != 1 for rep in plan.replicas):
        return False
    # all CUDA: NCCL, or gloo over stand-in GPUs, which are host memory (hetplan.runtime.sync.Groups)
    return len({parse_device_name(rep.stages[0].device)[1] for rep in plan.replicas}) == 1


def sync_microbatch(actions) -> int | None:
    """The microbatch whose forward may prepare DDP's reduction (actions: (kind, microbatch)
    pairs): its backward is the last action and every other backward comes before its forward.
    None when the order allows no such one."""
    if not actions or actions[-1][0] != "B":
        return None
    last = actions[-1][1]
    f_at = actions.index(("F", last))
    if any(kind == "B" for kind, _ in actions[f_at + 1:-1]):
        return None
    return last


@functools.cache
def ddp_parameters() -> frozenset[str]:
    """The keyword arguments of the installed torch's DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel
    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


def runs_on_ddp(plan: Plan) -> bool:
    """Plain data parallel whose every replica's schedule allows a no_sync() microbatch, on a
    torch whose DDP takes per-bucket caps (`bucket_cap_mb_list`: 2.13 has it, 2.11 not; without
    it the plan's buckets cannot be given to DDP): decided from the plan and the installed torch,
    so every rank decides the same (a DDP rank beside a GradSync rank would hang in mismatched
    collectives). Not ZeRO stage 2, whose gradients are reduce-scattered (hetplan.runtime.shard)."""
    from hetplan.planner.files.schedule import make_schedule
    return is_plain_dp(plan) and plan.shard < 2 and "bucket_cap_mb_list" in ddp_parameters() and all(
        sync_microbatch([(a.kind, a.microbatch) for a in make_schedule(plan.schedule, 1, rep.microbatches)[0]])
        is not None for rep in plan.replicas)


__all__ = ["is_plain_dp", "sync_microbatch", "runs_on_ddp", "ddp_parameters"]
