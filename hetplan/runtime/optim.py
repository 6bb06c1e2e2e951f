"""The optimizer step of one stage: SGD or Adam (torch.optim), on the device, on the CPU, or split.

Placement "cpu" is ZeRO-Offload style: the stage keeps fp32 master copies of its parameters in
host memory (pinned on a real accelerator, like the gradient buffers); each step copies the
gradients to the host with non-blocking copies, waits for them once, runs the update there and
copies the parameters back without blocking. Placement "split" (CoTrain) does this for the last
tensors of the stage (hetplan.planner.cost.model.split_host_count: cpu_fraction of the bytes, whole
tensors) while the device updates the others: the device's update is queued after the gradient
copies and runs while the host CPU updates its part. For a stage on a CPU device both are the
same as "device" (nothing to move).
Sharded (plan `shard`): each of the N replicas of a stage steps and keeps the optimizer state of
an equal 1/N slice of every tensor (hetplan.runtime.shard); under placement "cpu" its host does,
over those slices (ZeRO-Offload over shards).
Not modelled: ZeRO's overlap of the copies with backward.
"""
from __future__ import annotations

import torch

from hetplan.planner.cost.model import split_host_count
from hetplan.planner.hardware.device import TorchDevice
from hetplan.planner.files.plan import Optimizer
from hetplan.planner.workload.optimizer import make_optimizer
from hetplan.runtime.shard import ShardedStep


def _make(params, spec: Optimizer) -> torch.optim.Optimizer | None:
    return make_optimizer(params, spec.name, spec.lr, spec.torch_class, spec.kwargs) if params else None


def host_count(params: list[torch.Tensor], spec: Optimizer, device: TorchDevice) -> int:
    """How many of the stage's last parameters its host CPU updates (0: all on the device)."""
    if not device.accelerator or spec.placement == "device":
        return 0
    if spec.placement == "cpu":
        return len(params)
    return split_host_count([p.numel() * p.element_size() for p in params], spec.cpu_fraction)


class StageOptimizer:
    """`zero_grad()` before an iteration, `step()` after the gradients are synced."""

    def __init__(self, params: list[torch.nn.Parameter], spec: Optimizer, device: TorchDevice,
                 shard_group=None, shards=None, staged: bool = False):
        """`shard_group`: the process group of the replicas holding these parameters; each rank
        steps and keeps the state of 1/N of them (`ShardedStep`; ZeRO-3: `shards`, the
        stage's hetplan.runtime.shard.ParamShards), on its host CPU under placement "cpu";
        `staged`: the group's collectives go through host memory (a CPU beside a GPU)."""
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.sharded = None if shard_group is None else shards or ShardedStep(self.params, shard_group, staged)
        stepped = self.sharded.slices if self.sharded else self.params   # what the optimizer steps
        k = host_count(stepped, spec, device)
        self.on_device, self.on_host = stepped[:len(stepped) - k], stepped[len(stepped) - k:]
        self.master = [self._host_copy(p).requires_grad_(True) for p in self.on_host]
        self.host_grads = [device.host_buffer(p.shape, torch.float32) for p in self.on_host]
        self.device_opt = _make(self.on_device, spec)
        self.host_opt = _make(self.master, spec)

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        h = self.device.host_buffer(p.shape, torch.float32)
        h.copy_(p.detach())
        return h

    def state_of(self, t: torch.Tensor) -> dict:
        """The optimizer state of stepped tensor `t` (a parameter or a slice; its host master's
        where the host steps it)."""
        for opt, ts, keys in ((self.device_opt, self.on_device, self.on_device),
                              (self.host_opt, self.on_host, self.master)):
            for x, key in zip(ts, keys):
                if x is t:
                    return opt.state.get(key, {})
        return {}

    def refresh_masters(self) -> None:
        """The host's master copies from what they stand for (after a checkpoint's load)."""
        with torch.no_grad():
            for t, m in zip(self.on_host, self.master):
                m.copy_(t)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.sharded is not None and self.sharded.scattered is not None:
            self.sharded.scattered = [None] * len(self.sharded.scattered)

    @torch.no_grad()
    def step(self) -> None:
        if self.sharded is not None:
            self.sharded.take_grads()                       # the slices' gradients
        for p, m, g in zip(self.on_host, self.master, self.host_grads):   # gradients to host
            if p.grad is None:
                m.grad = None
            else:
                m.grad = g.copy_(p.grad, non_blocking=True)
        copied = self.device.event()
        copied.record()
        if self.device_opt is not None:
            self.device_opt.step()                          # queued on the device
        if self.host_opt is not None:
            copied.synchronize()
            self.host_opt.step()                            # meanwhile on the CPU
            for p, m in zip(self.on_host, self.master):     # parameters (or slices) back
                p.copy_(m, non_blocking=True)
        if self.sharded is not None and not self.sharded.own:   # every rank gathers, even one with
            self.sharded.gather()                           # no slice; ZeRO-3 a unit when it runs

    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments; master copies of the host's part)."""
        n = 0
        for opt in (self.device_opt, self.host_opt):
            for st in (opt.state.values() if opt is not None else ()):
                n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return n + sum(m.numel() * m.element_size() for m in self.master)
