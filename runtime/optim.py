"""The optimizer step of one stage: SGD or Adam (torch.optim), on the device or on the CPU.

Placement "cpu" is ZeRO-Offload style: the stage keeps fp32 master copies of its parameters in
host memory; each step copies the gradients to the host, runs the update there and copies the
parameters back. For a stage on a CPU device this is the same as "device" (nothing to move).
Not modelled: ZeRO's overlap of the copies with backward, and partitioning of optimizer state.
"""
from __future__ import annotations

import torch

from planner.plan import Optimizer


def _make(params, spec: Optimizer) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    raise ValueError(f"unknown optimizer {spec.name!r}")


class StageOptimizer:
    """`zero_grad()` before an iteration, `step()` after the gradients are synced."""

    def __init__(self, params: list[torch.nn.Parameter], spec: Optimizer, device: torch.device):
        self.params = [p for p in params if p.requires_grad]
        self.offload = spec.placement == "cpu" and device.type != "cpu"
        if self.offload:
            self.master = [p.detach().to("cpu", torch.float32).clone().requires_grad_(True)
                           for p in self.params]
            self.opt = _make(self.master, spec)
        else:
            self.opt = _make(self.params, spec)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if not self.offload:
            self.opt.step()
            return
        for p, m in zip(self.params, self.master):          # gradients to host
            m.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        self.opt.step()                                     # update on the CPU
        for p, m in zip(self.params, self.master):          # parameters back
            p.copy_(m.to(p.device, p.dtype, non_blocking=True))

    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments; master copies when offloaded)."""
        n = 0
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        if self.offload:
            n += sum(m.numel() * m.element_size() for m in self.master)
        return n
