"""A tensor-split stage (a plan stage's "devices"): Megatron's column/row parallel linear pairs
on one rank per device.

Every rank of the stage holds the whole stage (an fx graph, hetplan.planner.workload.partition) and, in
each linear pair (hetplan.planner.workload.tensor_split), only its slice of the hidden features: the
column linear's weight rows and bias, the row linear's weight columns; the row linear's bias
stays whole on the stage's first rank, so it is added once. Two autograd functions over the
stage's process group carry the exchange (Megatron's f and g): before the column linear,
identity forward and all-reduce (sum) of the input's gradient backward; after the row linear,
all-reduce of the partial outputs forward and identity backward. Every other operator runs
whole on every rank: its parameters get the same gradients everywhere (same inputs, same ops)
and need no exchange; each rank's optimizer steps what it holds.

Limits: on devices of different kinds the replicated parameters are computed by different
kernels and may drift apart by rounding over many iterations (not corrected); a dropout with
p > 0 in the replicated part draws its mask from each device's own generator (no shared RNG
state as Megatron keeps), so devices of different kinds disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.device import TorchDevice, standin_gpus
from hetplan.planner.hardware.topology import parse_device_name
from hetplan.planner.workload.tensor_split import LinearPair, find_pairs, split_bounds
from hetplan.runtime.instruments import BusyTimer, SavedTracker
from hetplan.runtime.offload import ActivationOffload
from hetplan.runtime.optim import StageOptimizer
from hetplan.runtime.pipeline import FanLink, StageRunner, stage_actions
from hetplan.runtime.rank import Built, check_model, peer_link, tied_layers
from hetplan.runtime.sync import BufferSync, Groups
from hetplan.runtime.sync_modes import NoGradSync


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


# --- a rank of a plan with tensor-split stages ---------------------------------------------------
@dataclass
class SplitBuilt(Built):
    """A rank of a plan with tensor-split stages (hetplan.runtime.tensor): one replica, no gradient
    exchange; of a split stage, the first rank records the loss."""
    split_index: int = 0                          # this rank's place in its stage's devices
    split_ranks: tuple[int, ...] = ()             # its stage's ranks
    pairs: list = field(default_factory=list)     # the linear pairs split (hetplan.runtime.tensor)

    def full_parameters(self) -> dict | None:
        """The stage's whole parameters on its first rank (a collective over a split stage)."""
        if len(self.split_ranks) < 2:
            return {n: p.detach().cpu() for n, p in self.module.named_parameters()}
        return full_parameters(self.module, self.pairs, self.split_index, self.groups.sync[self.split_ranks])


def build_rank(plan: Plan, names: list[str], rank: int, device: TorchDevice, timeout, marks,
               file: str, given=None) -> SplitBuilt:
    """Rank `rank` of a plan with tensor-split stages (validated: one replica): its stage, on a
    split stage with its slices of the linear pairs (hetplan.runtime.tensor); links to the neighbouring
    stages' ranks (pipeline.FanLink); no gradient exchange (one replica; a split stage's
    replicated parameters get equal gradients on every rank)."""
    from hetplan.planner.workload.layer_cache import plan_batch
    from hetplan.planner.workload.partition import build_stages, place_stages
    rep = plan.replicas[0]
    rank_of = {d: r for r, d in enumerate(names)}
    stage_ranks = [[rank_of[d] for d in st.devices] for st in rep.stages]     # first device first
    st_j = next(j for j, rs in enumerate(stage_ranks) if rank in rs)
    st = rep.stages[st_j]
    micro = plan.global_batch // rep.microbatches
    workload, found = check_model(plan, file, given, step=rank == 0)   # torch.manual_seed(0) inside
    if marks is not None:
        marks.mark("model")
    tied = tied_layers(found.params)
    crossing = [n for n, ls in tied.items() if len({j for j, s in enumerate(rep.stages)
                                                   for l in ls if s.start <= l < s.end}) > 1]
    if crossing:
        raise InputError(f"{file}: replicas[0].stages: weights tied across stages ({crossing[0]}) are "
                         "not supported beside a tensor-split stage in this version")
    pairs_p2p = [(min(a, b), max(a, b)) for A, B in zip(stage_ranks, stage_ranks[1:])
                 for a in A for b in B if a == A[0] or b == B[0]]
    split_sets = [tuple(sorted(rs)) for rs in stage_ranks if len(rs) > 1]
    groups = Groups([parse_device_name(d)[1] for d in names], pairs_p2p, split_sets, timeout,
                    nccl=standin_gpus() == 0)
    ranks = tuple(sorted(stage_ranks[st_j]))
    index = st.devices.index(names[rank])
    module = build_stages(workload, [s.layers for s in rep.stages], micro,
                          found.exported if micro == plan_batch(plan) else None)[st_j]
    pairs = (split_stage(module, index, [s.share for s in st.split], groups.sync[ranks],
                         groups.host_staged(ranks), frozenset(tied)) if st.split else [])
    module = place_stages([module], device.device)[0]
    params = list(module.parameters())

    def neighbour(j: int):
        peers, mine = stage_ranks[j], stage_ranks[st_j]
        first = peer_link(groups, rank, peers[0], device)
        if len(peers) == 1 and len(mine) == 1:
            return first
        sending = rank == mine[0]
        return FanLink(first, [peer_link(groups, rank, p, device) for p in peers[1:]] if sending else [], sending)

    timer = BusyTimer(device)
    runner = StageRunner(module, device.device, workload.loss_fn, neighbour(st_j - 1) if st_j > 0 else None,
                         neighbour(st_j + 1) if st_j + 1 < len(rep.stages) else None,
                         scale=1.0 / rep.microbatches, busy=timer.timer, precision=plan.precision)
    runner.saved_tracker = SavedTracker(params)
    if st.offload_activations:
        runner.offload = ActivationOffload(device, params)
    optimizer = StageOptimizer(params, plan.optimizer, device)
    actions = stage_actions(plan.schedule, st_j, len(rep.stages), rep.microbatches)
    return SplitBuilt(plan, workload, 0, st_j, len(rep.stages), 0, micro, module, runner, NoGradSync(), optimizer,
                      groups, timer, actions, BufferSync(groups, []), loss_weight=1.0 if index == 0 else 0.0,
                      split_index=index, split_ranks=ranks, pairs=pairs)


__all__ = ["split_stage", "full_parameters", "SplitExchange", "SplitBuilt", "build_rank"]
