"""The optimizer step of one stage: SGD or Adam (torch.optim), on the device, on the CPU, or split.

Placement "cpu" is ZeRO-Offload style: the stage keeps fp32 master copies of its parameters in
host memory (pinned on a real accelerator, like the gradient buffers); each step copies the
gradients to the host with non-blocking copies, waits for them once, runs the update there and
copies the parameters back without blocking. Placement "split" (CoTrain) does this for the last
tensors of the stage (hetplan.planner.cost.model.split_host_count: cpu_fraction of the bytes, whole
tensors) while the device updates the others: the device's update is queued after the gradient
copies and runs while the host CPU updates its part. For a stage on a CPU device both are the
same as "device" (nothing to move).
Sharded (plan `shard`, ZeRO stage 1: `ShardedStep`): each of the N replicas of a stage steps an
equal 1/N slice of every parameter tensor (views into the parameters) and keeps only that
slice's optimizer state; one all-gather per step gives every replica the whole update. Exact for
element-wise optimizers (`ELEMENTWISE`), which the plan's validation asks for.
Not modelled: ZeRO's overlap of the copies with backward.
"""
from __future__ import annotations

import torch

from hetplan.planner.cost.model import split_host_count
from hetplan.planner.hardware.device import TorchDevice
from hetplan.planner.files.plan import Optimizer
from hetplan.planner.workload.optimizer import make_optimizer


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
                 shard_group=None):
        """`shard_group`: the process group of the replicas holding these parameters; each rank
        steps and keeps the state of 1/N of them (`ShardedStep`)."""
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        k = host_count(self.params, spec, device)
        self.on_device, self.on_host = self.params[:len(self.params) - k], self.params[len(self.params) - k:]
        self.master = [self._host_copy(p).requires_grad_(True) for p in self.on_host]
        self.host_grads = [device.host_buffer(p.shape, torch.float32) for p in self.on_host]
        self.sharded = ShardedStep(self.on_device, shard_group) if shard_group is not None else None
        self.device_opt = _make(self.sharded.slices if self.sharded else self.on_device, spec)
        self.host_opt = _make(self.master, spec)

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        h = self.device.host_buffer(p.shape, torch.float32)
        h.copy_(p.detach())
        return h

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m, g in zip(self.on_host, self.master, self.host_grads):   # gradients to host
            if p.grad is None:
                m.grad = None
            else:
                m.grad = g.copy_(p.grad, non_blocking=True)
        copied = self.device.event()
        copied.record()
        if self.sharded is not None:                        # every rank gathers, even one with no slice
            self.sharded.take_grads()
            if self.device_opt is not None:
                self.device_opt.step()
            self.sharded.gather()
        elif self.device_opt is not None:
            self.device_opt.step()                          # queued on the device
        if self.host_opt is None:
            return
        copied.synchronize()
        self.host_opt.step()                                # meanwhile on the CPU
        for p, m in zip(self.on_host, self.master):         # parameters back
            p.copy_(m, non_blocking=True)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments; master copies of the host's part)."""
        n = 0
        for opt in (self.device_opt, self.host_opt):
            for st in (opt.state.values() if opt is not None else ()):
                n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return n + sum(m.numel() * m.element_size() for m in self.master)


class ShardedStep:
    """ZeRO stage 1 over `group`'s N ranks: rank k steps elements [k·c, (k+1)·c) of every
    parameter tensor (c = ceil(numel / N), the last slices shorter or empty), through views that
    share the parameters' storage; `gather()` all-gathers every rank's slices (one collective)."""

    def __init__(self, params: list[torch.nn.Parameter], group):
        import torch.distributed as dist
        self.params, self.group = params, group
        self.n, self.k = dist.get_world_size(group), dist.get_rank(group)
        self.chunk = [-(-p.numel() // self.n) for p in params]
        self.spans = [(min(self.k * c, p.numel()), min((self.k + 1) * c, p.numel()))
                      for p, c in zip(params, self.chunk)]
        self.mine = [i for i, (a, b) in enumerate(self.spans) if b > a]
        # leaves (no autograd history) sharing the parameters' storage: the optimizer's params
        self.slices = [params[i].detach().view(-1)[slice(*self.spans[i])] for i in self.mine]
        self.send = torch.empty(sum(self.chunk), dtype=params[0].dtype if params else torch.float32,
                                device=params[0].device if params else "cpu")

    def take_grads(self) -> None:
        """Each slice's gradient: the same elements of its parameter's (synced) gradient."""
        for s, i in zip(self.slices, self.mine):
            g = self.params[i].grad
            s.grad = None if g is None else g.view(-1)[slice(*self.spans[i])]

    @torch.no_grad()
    def gather(self) -> None:
        import torch.distributed as dist
        at = 0
        for p, c, (a, b) in zip(self.params, self.chunk, self.spans):
            self.send[at:at + b - a].copy_(p.view(-1)[a:b])
            at += c
        recv = [torch.empty_like(self.send) for _ in range(self.n)]
        dist.all_gather(recv, self.send, group=self.group)
        for r, buf in enumerate(recv):
            if r == self.k:
                continue
            at = 0
            for p, c in zip(self.params, self.chunk):
                a, b = min(r * c, p.numel()), min((r + 1) * c, p.numel())
                p.view(-1)[a:b].copy_(buf[at:at + b - a])
                at += c

