"""Build what one rank runs: its stage module, pipeline links, gradient sync and optimizer.

Every rank calls `build` with the same plan and rank->device list, so the collective group
creation in `sync.Groups` happens in the same order everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from planner.hardware.device import TorchDevice, standin_gpus
from planner.files.plan import Plan
from planner.hardware.topology import parse_device_name
from planner.workload.inputs import as_tuple
from runtime.instruments import BusyTimer, SavedTracker
from runtime.optim import StageOptimizer
from runtime.pipeline import PeerLink, StageRunner, WholeModel, stage_actions
from runtime.sync import GradSync, Groups, layer_ranks


def _slice(x, a: int, b: int):
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(v, a, b) for v in x)
    return x[a:b]


@dataclass
class Built:
    plan: Plan
    workload: Any
    replica: int
    stage: int
    n_stages: int
    offset: int                    # first sample of this replica in the global batch
    micro: int                     # samples per microbatch
    module: torch.nn.Module
    runner: StageRunner
    sync: GradSync
    optimizer: StageOptimizer
    groups: Groups
    timer: BusyTimer
    actions: list

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.module.named_parameters())

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    def microbatches(self, global_batch: int, iteration: int):
        """This replica's slice of make_batch(global_batch, seed=iteration), in microbatches;
        inputs only on the first stage, targets only on the last."""
        first, last = self.stage == 0, self.stage == self.n_stages - 1
        if not (first or last):
            return None, None
        x, y = self.workload.make_batch(global_batch, iteration)
        m = self.plan.replicas[self.replica].microbatches
        bounds = [(self.offset + k * self.micro, self.offset + (k + 1) * self.micro) for k in range(m)]
        ins = [as_tuple(_slice(x, a, b)) for a, b in bounds] if first else None
        tgts = [_slice(y, a, b) for a, b in bounds] if last else None
        return ins, tgts

    def begin(self) -> None:
        self.optimizer.zero_grad()
        self.sync.begin()

    def step(self, batch) -> torch.Tensor | None:
        loss = self.runner.run(self.actions, *batch)
        with self.timer.timer("grad sync wait", "allreduce", busy=False):
            self.sync.finish()
        with self.timer.timer("optimizer", "optimizer"):
            self.optimizer.step()
        return loss


def _layer_params(workload, num_layers: int, micro: int) -> list[tuple[str, ...]]:
    """Parameter names of each layer (the partitioner's grouping, one-layer stages)."""
    from planner.workload.partition import build_stages
    stages = build_stages(workload, [(l, l + 1) for l in range(num_layers)], batch=micro)
    return [tuple(n for n, _ in s.named_parameters()) for s in stages]


def _buckets(plan: Plan, names_by_layer, named: dict) -> list[tuple[int, ...]]:
    """The simulator's gradient buckets (planner.cost.buckets), as layer tuples.

    grad_buckets reads only the number of layers and each layer's parameter bytes, so the graph
    handed to it carries just those (no FLOPs: capturing them would cost a profile run here).
    """
    from planner.cost.buckets import grad_buckets
    from planner.workload.graph import Layer, ModelGraph
    layers = tuple(Layer(index=i, name=f"layer{i}", fwd_flops=0.0, bwd_flops=0.0,
                         param_bytes=sum(named[n].numel() * named[n].element_size() for n in names),
                         activation_bytes=0, saved_bytes=0, fwd_bytes_moved=0.0, bwd_bytes_moved=0.0,
                         n_ops=0, bwd_n_ops=0, param_names=names)
                   for i, names in enumerate(names_by_layer))
    graph = ModelGraph(layers=layers, batch=1, cut_bytes=(0,) * (len(layers) + 1))
    return [b.layers for b in grad_buckets(plan, graph)]


def _check_ownership(named: dict, names_by_layer) -> None:
    """Every parameter of the stage must belong to exactly one layer, or its gradient would be
    left out of (or counted twice in) the sync. Weight tying across layers is not supported."""
    owners: dict[str, int] = {}
    for layer, names in enumerate(names_by_layer):
        for n in names:
            if n in owners:
                raise ValueError(f"parameter {n!r} is used by layers {owners[n]} and {layer}; "
                                 "tied weights across layers are not supported by the runtime")
            owners[n] = layer
    missing = [n for n in named if n not in owners]
    if missing:
        raise ValueError(f"parameters {missing[:3]} belong to no layer of the partition")


def build(plan: Plan, names: list[str], rank: int, device: TorchDevice, timeout=None) -> Built:
    """What rank `rank` runs; `device` is its planner.hardware.device.TorchDevice."""
    from planner.workload.load import load_workload

    rank_of = {d: r for r, d in enumerate(names)}
    where = {st.device: (i, j) for i, rep in enumerate(plan.replicas) for j, st in enumerate(rep.stages)}
    rep_i, st_j = where[names[rank]]
    rep = plan.replicas[rep_i]
    batch = plan.replica_batches()[rep_i]
    micro = batch // rep.microbatches
    workload = load_workload(plan.model.spec, plan.model.args)   # torch.manual_seed(0) inside

    if len(rep.stages) == 1:
        module = WholeModel(workload.model).to(device.device)
    else:
        from planner.workload.partition import build_stages, place_stages
        module = build_stages(workload, [st.layers for st in rep.stages], batch=micro)[st_j]
        place_stages([module], device.device)

    # who holds which layer: one rank per replica
    replica_ranks = [[rank_of[st.device] for st in r.stages] for r in plan.replicas]
    ranks_of_layer = layer_ranks([[st.layers for st in r.stages] for r in plan.replicas],
                                 replica_ranks, plan.num_layers)
    named = dict(module.named_parameters())
    if len(set(ranks_of_layer)) == 1 and plan.sync.granularity == "coarse":
        # every layer has the same ranks: one flat bucket; no need to know the layers
        params_by_layer, ranks_by_bucket_layer, buckets = {0: list(named.values())}, [ranks_of_layer[0]], [(0,)]
    else:
        full = dict(workload.model.named_parameters())
        names_by_layer = _layer_params(workload, plan.num_layers, micro)
        params_by_layer = {l: [named[n] for n in ns if n in named] for l, ns in enumerate(names_by_layer)}
        _check_ownership(named, names_by_layer)
        ranks_by_bucket_layer = ranks_of_layer
        buckets = _buckets(plan, names_by_layer, full)

    kinds = [parse_device_name(d)[1] for d in names]
    pairs = [(min(a, b), max(a, b)) for rr in replica_ranks for a, b in zip(rr, rr[1:])]
    groups = Groups(kinds, pairs, list(set(ranks_of_layer)), timeout, nccl=standin_gpus() == 0)
    my_ranks = replica_ranks[rep_i]

    def link(peer: int) -> PeerLink:
        send, recv = groups.p2p[(rank, peer)], groups.p2p[(peer, rank)]
        return PeerLink(peer=peer, send_group=send, recv_group=recv, device=device,
                    host_staged=device.accelerator and send is groups.world)

    prev = link(my_ranks[st_j - 1]) if st_j > 0 else None
    nxt = link(my_ranks[st_j + 1]) if st_j + 1 < len(my_ranks) else None
    timer = BusyTimer(device)
    runner = StageRunner(module, device.device, workload.loss_fn, prev, nxt,
                         scale=batch / plan.global_batch / rep.microbatches, busy=timer.timer,
                         recompute=plan.recompute, precision=plan.precision)
    runner.saved_tracker = SavedTracker(named.values())
    sync = GradSync(groups, rank, params_by_layer, ranks_by_bucket_layer, buckets,
                    plan.sync.granularity, rep.microbatches, device)
    optimizer = StageOptimizer(list(named.values()), plan.optimizer, device)
    actions = stage_actions(plan.schedule, st_j, len(rep.stages), rep.microbatches)
    return Built(plan, workload, rep_i, st_j, len(rep.stages), plan.replica_offsets()[rep_i], micro,
                 module, runner, sync, optimizer, groups, timer, actions)
