"""The learning rate of each step, the same on every rank: a function of the step alone, so a
resumed run (under any plan) continues the schedule where it stopped.

Built-in shapes (`warmup_steps` of linear warm-up, lr * (s + 1) / warmup, first):
  constant  lr after the warm-up
  cosine    lr * (m + (1 - m) * (1 + cos(pi * t)) / 2), t = (s - warmup) / (total - warmup), m = min_lr_ratio
  linear    lr * (1 - (1 - m) * t)
Any other name is a torch.optim.lr_scheduler class, built on each of the rank's optimizers with
its arguments and stepped once per step (fast-forwarded on resume).
"""
from __future__ import annotations

import math
from typing import Any

from hetplan.planner.files.io import InputError

BUILTIN = ("constant", "cosine", "linear")


def factor(step: int, total: int, shape: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The multiplier of the base lr at 0-based `step` of `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if shape == "constant":
        return 1.0
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    if shape == "cosine":
        return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * t)) / 2
    return 1.0 - (1.0 - min_ratio) * t


def check(shape: str, args: dict[str, Any], warmup: int, min_ratio: float) -> None:
    """InputError naming the flag for a schedule torch or this module would refuse."""
    if warmup < 0:
        raise InputError(f"--warmup-steps: expected a non-negative integer, got {warmup}")
    if not 0 <= min_ratio <= 1:
        raise InputError(f"--min-lr-ratio: expected a number in [0, 1], got {min_ratio}")
    if shape in BUILTIN:
        if args:
            raise InputError(f"--lr-schedule-arg: the built-in {shape!r} schedule takes none; expected "
                             "--warmup-steps and --min-lr-ratio")
        return
    if _scheduler_class(shape) is None:
        raise InputError(f"--lr-schedule: expected {', '.join(BUILTIN)} or a torch.optim.lr_scheduler class "
                         f"such as StepLR, got {shape!r}")
    if warmup:
        raise InputError(f"--warmup-steps: expected 0 with the torch scheduler {shape}; put the warm-up in "
                         "its arguments (e.g. LinearLR)")


def _scheduler_class(name: str):
    import torch.optim.lr_scheduler as sched
    cls = getattr(sched, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, sched.LRScheduler) else None


class LRSchedule:
    """Sets the lr of `optimizers` (torch optimizers) before each step."""

    def __init__(self, optimizers: list, base_lr: float, total: int, shape: str = "constant",
                 args: dict[str, Any] | None = None, warmup: int = 0, min_ratio: float = 0.0):
        self.optimizers = [o for o in optimizers if o is not None]
        self.base_lr, self.total, self.shape = base_lr, total, shape
        self.warmup, self.min_ratio = warmup, min_ratio
        self.lr = base_lr
        self._torch = []
        if shape not in BUILTIN:
            cls = _scheduler_class(shape)
            try:
                self._torch = [cls(o, **(args or {})) for o in self.optimizers]
            except (TypeError, ValueError) as e:
                raise InputError(f"--lr-schedule-arg: {shape} rejected its arguments {args}: {e}") from None
        self._at = 0

    def apply(self, step: int) -> float:
        """Set the lr for 0-based `step` (steps come in order; a first call may skip ahead)."""
        if self._torch:
            import warnings
            with warnings.catch_warnings():     # stepped before the optimizer when fast-forwarding
                warnings.simplefilter("ignore", UserWarning)
                while self._at < step:
                    for s in self._torch:
                        s.step()
                    self._at += 1
            self.lr = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else self.base_lr
            return self.lr
        self.lr = self.base_lr * factor(step, self.total, self.shape, self.warmup, self.min_ratio)
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = self.lr
        self._at = step
        return self.lr
