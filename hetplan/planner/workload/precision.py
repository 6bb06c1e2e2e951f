"""Training precision: the one rule for what "fp32", "tf32" and "bf16" mean when a layer runs.

- fp32: plain float32.
- tf32: float32 tensors; on CUDA, matmuls and convolutions may use TensorFloat-32
  (`allow_tf32`); on a CPU there is no TF32, so it is fp32.
- bf16: `torch.autocast(device_type, dtype=torch.bfloat16)` around the forward and the loss
  (backward runs outside it, as torch recommends); parameters, gradients and optimizer state
  stay float32 (master weights), so only activations and the casts autocast makes are bf16.

Used by the capture (hetplan.planner.workload.capture), layer timing (hetplan.planner.cost.timing) and the runtime
(hetplan.runtime.pipeline), so that what is measured, priced and run is the same computation.
"""
from __future__ import annotations

import contextlib

from hetplan.planner.files.plan import PRECISIONS


@contextlib.contextmanager
def _tf32_on_cuda():
    import torch
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def autocast(device_type: str, precision: str):
    """The context a forward pass runs in at `precision` on a device of `device_type`
    ("cpu" or "cuda"); see the module docstring. Raises ValueError on an unknown precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        import torch
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "tf32" and device_type == "cuda":
        return _tf32_on_cuda()
    return contextlib.nullcontext()


__all__ = ["PRECISIONS", "autocast"]
