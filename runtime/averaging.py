"""Local SGD and EASGD (plan field sync.mode "local-sgd" / "easgd"): replicas step on their own
gradients and exchange parameters every `sync.period` iterations.

- local-sgd: the parameters become their average weighted by batch fraction,
  x <- sum_r f_r x_r (one SUM all-reduce of f_r x_r). With period 1 and plain SGD this is
  synchronous data parallel exactly: sum_r f_r (x - lr g_r) = x - lr sum_r f_r g_r.
- easgd (Zhang, Choromanska, LeCun 2015, synchronous form): every worker keeps the center
  variable c (the initial parameters at first); at an exchange d_r = alpha (x_r - c),
  x_r <- x_r - d_r and c <- c + sum_r d_r (one SUM all-reduce of d_r). With alpha 0 the
  workers never move towards each other: each trains on its own slice alone.

Each replica's loss is its own mean (runtime.stage scales by 1/microbatches, not by the batch
fraction), its optimizer state stays its own, and buffers are not broadcast. The exchange runs
over the world group (gloo), through host memory for accelerator parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from planner.files.plan import Sync


class NoGradSync:
    """No gradient exchange: a replica steps on its own gradients."""

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass


class ParameterExchange:
    """Every `sync.period` optimizer steps, the mode's parameter exchange among the replicas."""

    def __init__(self, sync: Sync, params: list[torch.nn.Parameter], fraction: float, group, world: int):
        self.sync, self.params, self.fraction = sync, params, fraction
        self.group, self.world = group, world
        self.steps = 0
        self.center = self._flat() if sync.mode == "easgd" else None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _write(self, flat: torch.Tensor) -> None:
        i = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[i:i + n].view_as(p))
                i += n

    def after_step(self) -> None:
        self.steps += 1
        if self.world < 2 or self.steps % self.sync.period:
            return
        x = self._flat()
        if self.center is None:                     # local SGD: the weighted average
            x.mul_(self.fraction)
            dist.all_reduce(x, group=self.group)
            self._write(x)
            return
        d = (x - self.center).mul_(self.sync.alpha)  # EASGD: the elastic differences
        self._write(x - d)
        dist.all_reduce(d, group=self.group)
        self.center.add_(d)
