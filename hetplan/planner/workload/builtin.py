"""Built-in workloads from the project's source documents: mlp, gpt, cnn.

Each factory takes its arguments as keywords and returns a `Workload`. Batches are made from a
`torch.Generator` seeded with `seed`, so `make_batch(b, i)` is the same on every worker.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.planner.files.io import InputError
from hetplan.planner.workload import Workload


def _positive(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InputError(f"--model-arg {name}: expected a positive integer, got {v!r}")
    return v


# --- mlp: MNIST-shaped 784 -> hidden x depth -> 10 (source report: Adam lr 1e-3, batch 100) --
class _Dense(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return F.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, hidden: int, depth: int):
        super().__init__()
        dims = [784] + [hidden] * depth
        self.layers = nn.ModuleList(_Dense(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(dims[-1], 10)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _classify_batch(shape: tuple[int, ...]):
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn((batch_size, *shape), generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        return x, y
    return make_batch


def mlp(hidden: int = 1024, depth: int = 4) -> Workload:
    model = MLP(_positive("hidden", hidden), _positive("depth", depth))
    return Workload(model=model, make_batch=_classify_batch((1, 28, 28)), loss_fn=F.cross_entropy,
                    optimizer="adam", lr=1e-3)


# --- cnn: the torch.distributed tutorial net --------------------------------------------------
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def cnn() -> Workload:
    return Workload(model=CNN(), make_batch=_classify_batch((1, 28, 28)), loss_fn=F.cross_entropy,
                    optimizer="sgd", lr=0.01)


# --- gpt: decoder-only transformer --------------------------------------------------------
class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, context: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, d_model: int, vocab: int, context: int, dropout: float):
        super().__init__()
        self.emb = Embedding(vocab, d_model, context, dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.head = Head(d_model, vocab)
        for name, p in self.named_parameters():  # GPT-2 style init
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gpt(layers: int = 4, heads: int = 4, d_model: int = 256, vocab: int = 4096, context: int = 128,
        dropout: float = 0.0) -> Workload:
    """Defaults sized for a CPU: 4 x 256-wide blocks, 128-token context, 4k vocabulary.
    dropout defaults to 0 so distributed runs match single-device training exactly."""
    for name, v in (("layers", layers), ("heads", heads), ("d_model", d_model), ("vocab", vocab),
                    ("context", context)):
        _positive(name, v)
    if d_model % heads:
        raise InputError(f"--model-arg heads: expected a divisor of d_model {d_model}, got {heads}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise InputError(f"--model-arg dropout: expected a number in [0, 1), got {dropout!r}")
    model = GPT(layers, heads, d_model, vocab, context, float(dropout))

    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        tokens = torch.randint(0, vocab, (batch_size, context + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, optimizer="adam", lr=3e-4)


BUILTINS = {"mlp": mlp, "gpt": gpt, "cnn": cnn}
