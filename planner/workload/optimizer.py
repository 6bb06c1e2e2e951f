"""The torch optimizer a plan's `optimizer.name` means: one rule for the runtime's steps, the
profile's optimizer timings and the convergence emulation, so that what is timed is what runs.

Adam is torch's fused implementation where the parameters' device and dtype support it (3-4.5x
faster than the default on a CPU: docs/tuning.md), else the default; SGD is the default.
"""
from __future__ import annotations


def make_optimizer(params, name: str, lr: float):
    import torch
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        try:
            return torch.optim.Adam(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):   # a device or dtype without the fused kernel
            return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; expected sgd or adam")
