"""The model side: workloads and built-in models, layers, graph capture, FLOPs, stages.

`from hetplan.planner.workload import Workload` is the documented way to write a `--model pkg.mod:fn`
factory (see docs/contract.md); the class lives here, and this file imports nothing from
planner, so `load` and `builtin` can both import it without a circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Workload"]


@dataclass
class Workload:
    model: Any                                   # torch.nn.Module
    make_batch: Callable[[int, int], tuple]      # (batch_size, seed) -> (inputs, target)
    loss_fn: Callable[[Any, Any], Any]           # (output, target) -> scalar (mean over batch)
    optimizer: str = "adam"                      # the workload's usual optimizer ("sgd"/"adam")
    lr: float = 1e-3                             # and its learning rate
    layers: str | None = None                    # layer pattern, e.g. "llm.model.layers.*" (None:
                                                 # the automatic rule of hetplan.planner.workload.layers)
    # training on data (`hetplan run --steps`, hetplan.train): map-style datasets whose item i is
    # one sample's (inputs, target); None: make_batch's synthetic batches
    train_data: Any = None
    eval_data: Any = None
    collate_fn: Callable[[list], tuple] | None = None   # samples -> (inputs, target); None: default_collate
    metrics: Callable[[Any, Any], dict] | None = None   # (output, target) -> {name: mean over the batch}
