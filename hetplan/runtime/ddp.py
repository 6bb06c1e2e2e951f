"""Plain data parallel on torch's own DistributedDataParallel.

A plan is *plain data parallel* when it has several replicas, each one stage holding the whole
model, all on one kind of device (all CPU, or all CUDA on NCCL), with the optimizer on the device
and synchronous training (sync.mode "sync").
Such replicas run on `DistributedDataParallel` (gradients as bucket views, all-reduce launched by
the reducer's autograd hooks during backward) instead of hetplan.runtime.sync.GradSync; hybrid plans,
pipelines, CPU+GPU sets and the offloaded optimizer keep GradSync, and so does a torch whose DDP
takes no per-bucket caps (`bucket_cap_mb_list`; hetplan.planner.cost.grad_sync.runs_on_ddp).

- Weighted shares: each replica's loss is already scaled by its share of the global batch
  (pipeline.StageRunner), so the comm hook all-reduces with SUM and does not divide by the world
  size (DDP's default hook would).
- Buckets: the simulator's (hetplan.planner.cost.buckets, as GradSync runs them), given to DDP as
  per-bucket caps in the order DDP's rebuild after the first iteration applies them
  (`bucket_caps`); DDP's own rule (1 MiB first bucket, 25 MiB caps) is not used. Coarse sync is
  one bucket holding every gradient: its all-reduce starts when the last gradient is final,
  after backward.
- Microbatches: every forward but the one of the microbatch whose backward comes last runs under
  `no_sync()`; that needs every other backward before that forward (true of a one-stage replica's
  schedules), else GradSync is used.
- Buffers are broadcast by hetplan.runtime.sync.BufferSync once per iteration (`forward_sync_buffers=False`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# which plans run on DDP: decided where the simulator prices it too
from hetplan.planner.cost.grad_sync import ddp_parameters, is_plain_dp, runs_on_ddp as uses_ddp, sync_microbatch  # noqa: F401

MiB = 1024 * 1024


class _HookState:
    def __init__(self, group, on_ready):
        self.group, self.on_ready = group, on_ready


def _sum_hook(state, bucket):
    """All-reduce a bucket (a dist.GradBucket) with SUM: the losses are already weighted by the
    replicas' shares. `state.on_ready()` first: the bucket's gradients are computed (the last
    call of a backward ends its compute). Unannotated: DDP checks the annotation object, which
    `from __future__ import annotations` would turn into a string."""
    if state.on_ready is not None:
        state.on_ready()
    fut = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap(module: torch.nn.Module, group, device: torch.device,
         bucket_of: dict[torch.nn.Parameter, int], find_unused: bool = False,
         on_ready=None) -> torch.nn.Module:
    """`module` in DistributedDataParallel over `group`; `bucket_of`: each parameter's bucket
    (hetplan.planner.cost.buckets), which `bucket_caps` turns into DDP's per-bucket caps; `find_unused`:
    some parameters get no gradient (hetplan.planner.workload.layer_cache.LayerMap.unused), which DDP
    refuses unless it looks for them after each forward; `on_ready`: called as each bucket's
    all-reduce starts (BusyTimer.cut)."""
    from torch.nn.parallel import DistributedDataParallel
    params = [p for p in module.parameters() if p.requires_grad]
    ddp = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group, bucket_cap_mb_list=[c / MiB for c in bucket_caps(params, bucket_of)],
        gradient_as_bucket_view=True, find_unused_parameters=find_unused,
        **no_forward_buffer_sync(ddp_parameters()))
    ddp.register_comm_hook(_HookState(group, on_ready), _sum_hook)
    return ddp


def no_forward_buffer_sync(accepted) -> dict[str, bool]:
    """DDP's switch for broadcasting buffers before each forward, off, under the name the
    installed torch takes (`accepted`: DDP's keyword arguments): `forward_sync_buffers` where it
    exists, else `broadcast_buffers` (torch 2.11 and before)."""
    return {"forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers": False}


def bucket_caps(params: list[torch.nn.Parameter], bucket_of: dict) -> list[int]:
    """DDP's per-bucket caps for the plan's buckets: each bucket's bytes, bucket 0 first.

    DDP closes a bucket once its bytes reach that bucket's cap. After the first iteration it
    rebuilds its buckets walking the parameters in the order their gradients became ready, which
    is the order of the plan's buckets (hetplan.planner.cost.buckets: layers in reverse), so from the
    second iteration on it all-reduces exactly these buckets. The first iteration walks the same
    caps in module order (DDP's initial assignment) and may group differently. Parameters of no
    bucket come last, one cap for them all."""
    sizes: dict[int, int] = {}
    for p in params:
        b = bucket_of.get(p, -1)
        sizes[b] = sizes.get(b, 0) + p.numel() * p.element_size()
    return [sizes[b] for b in sorted(sizes, key=lambda b: (b < 0, b))]


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
