"""The torch optimizer a plan's `optimizer` means: one rule for the runtime's steps, the
profile's optimizer timings and the convergence emulation, so that what is timed is what runs.

`name` is how the step is priced ("sgd": one read-modify-write of the parameters, "adam": two
moments besides); `torch_class` any torch.optim class (AdamW with weight decay, SGD with momentum,
...), given its `args`. Adam and AdamW use torch's fused implementation where the parameters'
device and dtype support it (3-4.5x faster than the default on a CPU: docs/tuning.md).
"""
from __future__ import annotations

from typing import Any

from hetplan.planner.files.optimizer_spec import DEFAULT_CLASS, torch_class


def make_optimizer(params, name: str, lr: float, cls_name: str | None = None,
                   args: dict[str, Any] | None = None):
    import torch
    params = list(params)
    cls = torch_class(cls_name or DEFAULT_CLASS.get(name, ""))
    if cls is None:
        raise ValueError(f"unknown optimizer {cls_name or name!r}; expected sgd, adam or a torch.optim class")
    args = dict(args or {})
    if cls.__name__ in ("Adam", "AdamW") and "fused" not in args and "foreach" not in args:
        try:
            return cls(params, lr=lr, fused=True, **args)
        except (RuntimeError, ValueError):   # a device or dtype without the fused kernel
            pass
    return cls(params, lr=lr, **args)
