"""Plain data parallel on torch's own DistributedDataParallel.

A plan is *plain data parallel* when it has several replicas, each one stage holding the whole
model, all on one kind of device (all CPU, or all CUDA on NCCL), with the optimizer on the device
and synchronous training (sync.mode "sync").
Such replicas run on `DistributedDataParallel` (gradients as bucket views, all-reduce launched by
the reducer's autograd hooks during backward) instead of runtime.sync.GradSync; hybrid plans,
pipelines, CPU+GPU sets and the offloaded optimizer keep GradSync.

- Weighted shares: each replica's loss is already scaled by its share of the global batch
  (pipeline.StageRunner), so the comm hook all-reduces with SUM and does not divide by the world
  size (DDP's default hook would).
- Buckets: the simulator's (planner.cost.buckets, as GradSync runs them), given to DDP as
  per-bucket caps (`bucket_caps`); DDP's own rule (reverse parameter order, 1 MiB first bucket,
  rebuilt by ready order) is not used. Coarse sync is one bucket holding every gradient: its
  all-reduce starts when the last gradient is final, after backward.
- Microbatches: every forward but the one of the microbatch whose backward comes last runs under
  `no_sync()`; that needs every other backward before that forward (true of a one-stage replica's
  schedules), else GradSync is used.
- Buffers are broadcast by runtime.sync.BufferSync once per iteration (`forward_sync_buffers=False`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from planner.files.plan import Plan
from planner.hardware.topology import parse_device_name

MiB = 1024 * 1024


def is_plain_dp(plan: Plan) -> bool:
    """True when every replica is one whole-model stage on one device kind that one
    collective backend serves, and the optimizer stays on the device (module docstring)."""
    if len(plan.replicas) < 2 or plan.optimizer.placement != "device" or plan.sync.mode != "sync":
        return False
    if any(len(rep.stages) != 1 for rep in plan.replicas):
        return False
    # all CUDA: NCCL, or gloo over stand-in GPUs, which are host memory (sync.Groups)
    return len({parse_device_name(rep.stages[0].device)[1] for rep in plan.replicas}) == 1


def uses_ddp(plan: Plan) -> bool:
    """Plain data parallel whose every replica's schedule allows a no_sync() microbatch: decided
    from the plan alone, so every rank decides the same (a DDP rank beside a GradSync rank would
    hang in mismatched collectives)."""
    from runtime.pipeline import stage_actions
    return is_plain_dp(plan) and all(
        sync_microbatch(stage_actions(plan.schedule, 0, 1, rep.microbatches)) is not None
        for rep in plan.replicas)


def sync_microbatch(actions: list[tuple[str, int]]) -> int | None:
    """The microbatch whose forward may prepare DDP's reduction: its backward is the last action
    and every other backward comes before its forward. None when the order allows no such one."""
    if not actions or actions[-1][0] != "B":
        return None
    last = actions[-1][1]
    f_at = actions.index(("F", last))
    if any(kind == "B" for kind, _ in actions[f_at + 1:-1]):
        return None
    return last


def _sum_hook(group, bucket):
    """All-reduce a bucket (a dist.GradBucket) with SUM: the losses are already weighted by the
    replicas' shares. Unannotated: DDP checks the annotation object, which
    `from __future__ import annotations` would turn into a string."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap(module: torch.nn.Module, group, device: torch.device,
         bucket_of: dict[torch.nn.Parameter, int]) -> torch.nn.Module:
    """`module` in DistributedDataParallel over `group`; `bucket_of`: each parameter's bucket
    (planner.cost.buckets), which `bucket_caps` turns into DDP's per-bucket caps."""
    from torch.nn.parallel import DistributedDataParallel
    params = [p for p in module.parameters() if p.requires_grad]
    ddp = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group, bucket_cap_mb_list=[c / MiB for c in bucket_caps(params, bucket_of)],
        gradient_as_bucket_view=True, forward_sync_buffers=False)
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def bucket_caps(params: list[torch.nn.Parameter], bucket_of: dict) -> list[int]:
    """Byte sizes of the runs of consecutive parameters (DDP's order, the module's) in one bucket.

    DDP closes a bucket once its bytes reach that bucket's cap, walking the parameters in module
    order, then reverses the list; these caps make its buckets exactly the simulator's wherever a
    simulator bucket's parameters are consecutive in module order (a bucket that is not is split)."""
    caps: list[int] = []
    last = object()
    for p in params:
        b = bucket_of.get(p, -1)
        if b != last:
            caps.append(0)
            last = b
        caps[-1] += p.numel() * p.element_size()
    return caps


def forward_context(ddp, sync_mb: int):
    """Per microbatch: `no_sync()` except for the microbatch that prepares the reduction."""
    return lambda mb: contextlib.nullcontext() if mb == sync_mb else ddp.no_sync()


class DDPSync:
    """GradSync's interface where DDP does the work during backward: nothing left to do."""

    buckets: list = []

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass
