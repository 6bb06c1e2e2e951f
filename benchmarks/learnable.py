"""Workloads whose loss can fall (the built-ins draw random labels), for benchmarks/time_to_loss.py:
the built-in models on tasks a teacher defines.

- `mlp`: the built-in mlp; each image's class is the argmax of a fixed random linear map of its
  7 x 7 average-pooled pixels.
- `gpt`: the built-in gpt; each sequence counts up by a step drawn per sequence, so the next
  token is the last one plus that step (mod vocab): learnable from the context.
"""
from __future__ import annotations

import torch

from hetplan.planner.workload import Workload
from hetplan.planner.workload.builtin import gpt as builtin_gpt, mlp as builtin_mlp


def mlp(hidden: int = 256, depth: int = 2) -> Workload:
    w = builtin_mlp(hidden, depth)
    teacher = torch.randn(7 * 7, 10, generator=torch.Generator().manual_seed(1234))

    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn(batch_size, 1, 28, 28, generator=g)
        pooled = torch.nn.functional.avg_pool2d(x, 4).reshape(batch_size, -1)
        return x, (pooled @ teacher).argmax(1)
    return Workload(model=w.model, make_batch=make_batch, loss_fn=w.loss_fn, optimizer="adam", lr=1e-3)


def gpt(layers: int = 2, d_model: int = 64, heads: int = 4, vocab: int = 64, context: int = 16) -> Workload:
    w = builtin_gpt(layers=layers, heads=heads, d_model=d_model, vocab=vocab, context=context)

    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        start = torch.randint(0, vocab, (batch_size, 1), generator=g)
        step = torch.randint(1, 4, (batch_size, 1), generator=g)
        tokens = (start + step * torch.arange(context + 1)) % vocab
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return Workload(model=w.model, make_batch=make_batch, loss_fn=w.loss_fn, optimizer="adam", lr=3e-3)
