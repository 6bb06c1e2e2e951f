"""Tiny workloads for the runtime tests (importable as `tests.runtime_models:NAME`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.workload import Workload


class SkipNet(nn.Module):
    """Four layers; layer 0's output is also added after layer 2, so a cut after layer 1 or 2
    carries two tensors (a skip connection across stages)."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.mid1 = nn.Linear(width, width)
        self.mid2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h0 = torch.tanh(self.inp(x))
        h1 = torch.tanh(self.mid1(h0))
        h2 = torch.tanh(self.mid2(h1) + h0)
        return self.out(h2)


def skipnet(width: int = 16) -> Workload:
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)
    return Workload(model=SkipNet(width), make_batch=make_batch, loss_fn=F.cross_entropy)
