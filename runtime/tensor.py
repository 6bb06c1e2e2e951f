"""A tensor-split stage (a plan stage's "devices"): Megatron's column/row parallel linear pairs
on one rank per device.

Every rank of the stage holds the whole stage (an fx graph, planner.workload.partition) and, in
each linear pair (planner.workload.tensor_split), only its slice of the hidden features: the
column linear's weight rows and bias, the row linear's weight columns; the row linear's bias
stays whole on the stage's first rank, so it is added once. Two autograd functions over the
stage's process group carry the exchange (Megatron's f and g): before the column linear,
identity forward and all-reduce (sum) of the input's gradient backward; after the row linear,
all-reduce of the partial outputs forward and identity backward. Every other operator runs
whole on every rank: its parameters get the same gradients everywhere (same inputs, same ops)
and need no exchange; each rank's optimizer steps what it holds.

Limit: on devices of different kinds the replicated parameters are computed by different
kernels and may drift apart by rounding over many iterations (not corrected).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from planner.workload.tensor_split import LinearPair, find_pairs, split_bounds


def _all_reduce(t: torch.Tensor, group: Any, staged: bool) -> torch.Tensor:
    """Sum of `t` over the group, in a new tensor; through host memory when `staged` (gloo
    beside an accelerator)."""
    buf = t.detach().to("cpu", copy=True) if staged else t.detach().clone()
    dist.all_reduce(buf, group=group)
    return buf.to(t.device, non_blocking=True) if staged else buf


class _CopyToSplit(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over the ranks."""

    @staticmethod
    def forward(ctx, x, group, staged):
        ctx.group, ctx.staged = group, staged
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group, ctx.staged), None, None


class _ReduceFromSplit(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx, x, group, staged):
        return _all_reduce(x.contiguous(), group, staged)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class SplitExchange(nn.Module):
    """f ("copy") or g ("reduce") as a module the stage's graph calls."""

    def __init__(self, kind: str, group: Any, staged: bool):
        super().__init__()
        self.fn = _CopyToSplit if kind == "copy" else _ReduceFromSplit
        self.group, self.staged = group, staged

    def forward(self, x):
        return self.fn.apply(x, self.group, self.staged)


def _set_param(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Replace parameter `name` of `module` by a new one holding `value` (None: remove it)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = getattr(owner, leaf)
    delattr(owner, leaf)
    if value is not None:
        owner.register_parameter(leaf, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))


def split_stage(module: fx.GraphModule, index: int, shares, group: Any, staged: bool,
                exclude: frozenset[str] = frozenset()) -> list[LinearPair]:
    """Make `module` rank `index`'s part of a stage split with `shares` (in the stage's device
    order) over `group`; returns the pairs split (`exclude`: weights never split, those tied
    to other stages). Call before placing the module on its device: the slices are copies of
    the whole stage's (identically initialised) parameters."""
    graph = module.graph
    params = dict(module.named_parameters())
    pairs = find_pairs(graph, params, exclude)
    nodes = {n.name: n for n in graph.nodes}
    module.add_submodule("tensor_copy", SplitExchange("copy", group, staged))
    module.add_submodule("tensor_reduce", SplitExchange("reduce", group, staged))
    for p in pairs:
        lo, hi = split_bounds(p.hidden, shares)[index]
        _set_param(module, p.col_weight, params[p.col_weight][lo:hi])
        if p.col_bias:
            _set_param(module, p.col_bias, params[p.col_bias][lo:hi])
        _set_param(module, p.row_weight, params[p.row_weight][:, lo:hi])
        col, row = nodes[p.col], nodes[p.row]
        with graph.inserting_before(col):
            f = graph.call_module("tensor_copy", (col.args[0],))
        col.args = (f, *col.args[1:])
        if p.row_bias and index > 0:        # added once, by the first rank
            bias = row.args[2]
            row.args = (row.args[0], row.args[1], None)
            if not bias.users:
                graph.erase_node(bias)
            _set_param(module, p.row_bias, None)
        with graph.inserting_after(row):
            g = graph.call_module("tensor_reduce", (row,))
        row.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    graph.lint()
    module.recompile()
    return pairs


def full_parameters(module: nn.Module, pairs: list[LinearPair], index: int, group: Any) -> dict | None:
    """The whole stage's parameters (CPU copies) rebuilt from every rank's slices, on the
    stage's first rank (None elsewhere). Collective over the stage's group."""
    mine = (index, {n: p.detach().cpu() for n, p in module.named_parameters()})
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    if index != 0:
        return None
    parts = [d for _, d in sorted(out, key=lambda x: x[0])]
    full = dict(parts[0])
    for p in pairs:
        full[p.col_weight] = torch.cat([d[p.col_weight] for d in parts], 0)
        if p.col_bias:
            full[p.col_bias] = torch.cat([d[p.col_bias] for d in parts], 0)
        full[p.row_weight] = torch.cat([d[p.row_weight] for d in parts], 1)
    return full


__all__ = ["split_stage", "full_parameters", "SplitExchange"]
