"""Tiny workloads for the runtime tests (importable as `tests.runtime_models:NAME`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.planner.workload import Workload


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


class RunningCenter(nn.Module):
    """Subtracts a running mean of its inputs, kept in a buffer and updated in place by every
    forward: unlike BatchNorm's running statistics in training, the buffer changes the output,
    so replicas that do not share it (DDP's broadcast from the first replica) train differently."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x):
        y = x - self.mean
        with torch.no_grad():
            self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return y


class CenteredNet(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.center = RunningCenter(width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.center(self.inp(x)))))


def centered(width: int = 16) -> Workload:
    """Four layers (inp, center, mid, out); `center` holds a buffer that its forward uses."""
    w = skipnet(width)
    return Workload(model=CenteredNet(width), make_batch=w.make_batch, loss_fn=F.cross_entropy)


def learnable(width: int = 16) -> Workload:
    """SkipNet on a task it can learn: each sample's class is the argmax of a fixed linear map
    of its input (the other workloads draw random labels, so their loss cannot fall)."""
    teacher = torch.Generator().manual_seed(1234)
    w_true = torch.randn(8, 3, generator=teacher)

    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn(batch_size, 8, generator=g)
        return x, (x @ w_true).argmax(1)
    return Workload(model=SkipNet(width), make_batch=make_batch, loss_fn=F.cross_entropy)


def scalars() -> Workload:
    """Three layers of one weight each, y = b * (c * (a * x)), with a squared error: small
    enough to compute a PipeDream run by hand (tests/test_pipedream.py)."""
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        return torch.randn(batch_size, 1, generator=g), torch.randn(batch_size, 1, generator=g)
    model = nn.Sequential(*(nn.Linear(1, 1, bias=False) for _ in range(3)))
    return Workload(model=model, make_batch=make_batch, loss_fn=F.mse_loss)


class TiedNet(nn.Module):
    """Five layers; layers 1 and 3 use one weight (a tied parameter held by two stages)."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.a = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.b(torch.tanh(self.mid(torch.tanh(self.a(h))))))
        return self.out(h)


def tiednet(width: int = 16) -> Workload:
    w = skipnet(width)
    return Workload(model=TiedNet(width), make_batch=w.make_batch, loss_fn=F.cross_entropy)


class Inner(nn.Module):
    """Returns its hidden state and a pooled summary, as a Hugging Face encoder does."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Linear(8, width)
        self.pool = nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return h, torch.tanh(self.pool(h))


class Pooled(nn.Module):
    """A user's wrapper that reads only the hidden state: the pooler's parameters get no gradient."""

    def __init__(self, width: int):
        super().__init__()
        self.inner = Inner(width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(self.inner(x)[0])


def pooled(width: int = 16) -> Workload:
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)
    return Workload(model=Pooled(width), make_batch=make_batch, loss_fn=F.cross_entropy)


class Samples(torch.utils.data.Dataset):
    """`n` samples of 784 features and a class in 0..9 (the built-in mlp's shape), item i fixed by i;
    `reads` counts each index read (tests: every sample once an epoch)."""

    def __init__(self, n: int, seed: int = 0, features: int = 784):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, features, generator=g), torch.randint(0, 10, (n,), generator=g)
        self.log = None            # a file to append each read index to (set by a test)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.log:
            import os
            with open(self.log, "a") as f:
                f.write(f"{os.environ.get('RANK', '-')} {i}\n")
        return self.x[i], self.y[i]


def accuracy(output, target) -> dict:
    return {"accuracy": float((output.argmax(-1) == target).float().mean())}


def mlp_data(hidden: int = 16, depth: int = 3, n: int = 60, n_eval: int = 25, log: str = "",
             features: int = 784) -> Workload:
    """The built-in mlp (4 layers at depth 3) on a dataset of `n` samples, `n_eval` to evaluate
    (`features` other than 784: items that do not fit the model)."""
    from hetplan.planner.workload.builtin import mlp
    w = mlp(hidden=hidden, depth=depth)
    w.train_data, w.eval_data, w.metrics = Samples(n, features=features), Samples(n_eval, seed=1), accuracy
    w.train_data.log = log or None
    return w
