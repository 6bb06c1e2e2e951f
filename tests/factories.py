"""Small user factories for tests, loaded by spec (`tests.factories:NAME`) like a user's own."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.planner.workload import Workload


def _batch(shape, classes=None):
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn((batch_size, *shape), generator=g)
        y = (torch.randint(0, classes, (batch_size,), generator=g) if classes
             else torch.randn((batch_size, *shape), generator=g))
        return x, y
    return make_batch


class SquareMLP(nn.Module):
    """`depth` bias-free n x n Linear layers: forward 2*B*n^2 FLOPs each."""
    def __init__(self, n: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(n, n, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def square(n: int = 16, depth: int = 3) -> Workload:
    return Workload(model=SquareMLP(n, depth), make_batch=_batch((n,)), loss_fn=F.mse_loss)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class ResCNN(nn.Module):
    """stem -> a -> b, with a skip connection from the stem output over a and b to the head."""
    def __init__(self, c: int = 4, hw: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.a = ResBlock(c)
        self.b = ResBlock(c)
        self.head = nn.Linear(c * hw * hw, 10)

    def forward(self, x):
        s = self.stem(x)
        y = self.b(self.a(s)) + s          # skip across the a|b and b|head cuts
        return self.head(y.flatten(1))


def rescnn(c: int = 4, hw: int = 8) -> Workload:
    return Workload(model=ResCNN(c, hw), make_batch=_batch((1, hw, hw), classes=10),
                    loss_fn=F.cross_entropy, optimizer="sgd", lr=0.01)


class ShapeDependent(nn.Module):
    """Python control flow on a shape: torch.fx.symbolic_trace cannot trace this."""
    def __init__(self, n: int):
        super().__init__()
        self.wide = nn.Linear(n, n, bias=False)
        self.narrow = nn.Linear(n, 2, bias=False)
        self.out = nn.Linear(n, n, bias=False)

    def forward(self, x):
        if x.shape[1] > 4:
            x = self.wide(x)
        else:
            x = torch.cat([self.narrow(x)] * (x.shape[1] // 2), dim=1)
        return self.out(x)


def shape_dependent(n: int = 8) -> Workload:
    return Workload(model=ShapeDependent(n), make_batch=_batch((n,)), loss_fn=F.mse_loss)


class TwoOutputs(nn.Module):
    def __init__(self, n: int = 8):
        super().__init__()
        self.enc = nn.Linear(n, n)
        self.dec = nn.Linear(n, n)

    def forward(self, x):
        h = self.enc(x)
        return {"y": self.dec(h), "h": h}


def two_outputs(n: int = 8) -> Workload:
    return Workload(model=TwoOutputs(n), make_batch=_batch((n,)),
                    loss_fn=lambda out, t: F.mse_loss(out["y"], t) + out["h"].pow(2).mean())


def tiny(width: int = 8) -> Workload:
    """The user-factory example: two bias-free square layers."""
    return square(n=width, depth=2)


class NoFormula(nn.Module):
    """A Linear followed by cumprod, an operator with no FLOP formula (and not memory-bound)."""
    def __init__(self, n: int = 8):
        super().__init__()
        self.fc = nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.fc(x).cumprod(dim=1)


def no_formula(n: int = 8) -> Workload:
    return Workload(model=NoFormula(n), make_batch=_batch((n,)), loss_fn=F.mse_loss)


def not_a_workload():
    return object()


class Gate(nn.Module):
    """Python control flow on a tensor's value: neither torch.export nor symbolic_trace can
    capture it."""
    def __init__(self, n: int):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -x


class Gated(nn.Module):
    def __init__(self, n: int = 8):
        super().__init__()
        self.inp = nn.Linear(n, n)
        self.gate = Gate(n)

    def forward(self, x):
        return self.gate(self.inp(x))


def data_dependent(n: int = 8) -> Workload:
    return Workload(model=Gated(n), make_batch=_batch((n,)), loss_fn=F.mse_loss)


class _FromValues(nn.Module):
    """Reads a value while built: the meta device has none to give."""

    def __init__(self, n: int):
        super().__init__()
        width = int(torch.ones(1).sum().item()) * n
        self.fc = nn.Linear(n, width)

    def forward(self, x):
        return self.fc(x)


def built_from_values(n: int = 8) -> Workload:
    return Workload(model=_FromValues(n), make_batch=_batch((n,), classes=n), loss_fn=F.cross_entropy)


def data_made_in_the_factory(n: int = 8) -> Workload:
    data = torch.randn(64, n)

    def make_batch(batch_size: int, seed: int):
        return data[:batch_size], torch.zeros(batch_size, dtype=torch.long)
    return Workload(model=nn.Sequential(nn.Linear(n, n), nn.ReLU(), nn.Linear(n, 3)), make_batch=make_batch,
                    loss_fn=F.cross_entropy)
