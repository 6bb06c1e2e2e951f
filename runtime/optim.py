"""The optimizer step of one stage: SGD or Adam (torch.optim), on the device or on the CPU.

Placement "cpu" is ZeRO-Offload style: the stage keeps fp32 master copies of its parameters in
host memory (pinned on a real accelerator, like the gradient buffers); each step copies the
gradients to the host with non-blocking copies, waits for them once, runs the update there and
copies the parameters back without blocking. For a stage on a CPU device this is the same as
"device" (nothing to move).
Not modelled: ZeRO's overlap of the copies with backward, and partitioning of optimizer state.
"""
from __future__ import annotations

import torch

from planner.hardware.device import TorchDevice
from planner.files.plan import Optimizer


def _make(params, spec: Optimizer) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    raise ValueError(f"unknown optimizer {spec.name!r}")


class StageOptimizer:
    """`zero_grad()` before an iteration, `step()` after the gradients are synced."""

    def __init__(self, params: list[torch.nn.Parameter], spec: Optimizer, device: TorchDevice):
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.offload = spec.placement == "cpu" and device.accelerator
        if self.offload:
            self.master = [self._host_copy(p).requires_grad_(True) for p in self.params]
            self.host_grads = [device.host_buffer(p.shape, torch.float32) for p in self.params]
            self.opt = _make(self.master, spec)
        else:
            self.opt = _make(self.params, spec)

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        h = self.device.host_buffer(p.shape, torch.float32)
        h.copy_(p.detach())
        return h

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if not self.offload:
            self.opt.step()
            return
        for p, m, g in zip(self.params, self.master, self.host_grads):   # gradients to host
            if p.grad is None:
                m.grad = None
            else:
                m.grad = g.copy_(p.grad, non_blocking=True)
        self.device.wait_queued()
        self.opt.step()                                     # update on the CPU
        for p, m in zip(self.params, self.master):          # parameters back
            p.copy_(m, non_blocking=True)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments; master copies when offloaded)."""
        n = 0
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        if self.offload:
            n += sum(m.numel() * m.element_size() for m in self.master)
        return n
