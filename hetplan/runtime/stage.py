"""Build what one rank runs: its stage module, pipeline links, gradient sync and optimizer.

Every rank calls `build` with the same plan and rank->device list, so the collective group
creation in `sync.Groups` happens in the same order everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.planner.hardware.device import TorchDevice, standin_gpus
from hetplan.planner.files.plan import PIPEDREAM_MODES, Plan
from hetplan.planner.workload.weight_versions import WeightVersions
from hetplan.planner.hardware.topology import parse_device_name
from hetplan.runtime import ddp
from hetplan.runtime.sync_modes import (NoGradSync, ParameterExchange, ParameterServer, ServerClient,
                                ServerStepped, hogwild_parameters)
from hetplan.runtime.instruments import BusyTimer, SavedTracker
from hetplan.runtime.interleaved import InterleavedRunner, VirtualStages, device_actions, sent_messages
from hetplan.runtime.offload import ActivationOffload
from hetplan.runtime.optim import StageOptimizer
from hetplan.runtime.pipedream import PipeDreamRunner, Stashed, StreamData, stream_iterations
from hetplan.runtime.pipeline import PeerLink, StageRunner, WholeModel, stage_actions
from hetplan.runtime.rank import Built, check_model, peer_link, tied_layers
from hetplan.runtime.sync import BufferSync, GradSync, Groups, Tied, layer_ranks


def _buckets(plan: Plan, names_by_layer, named: dict) -> list[tuple[int, ...]]:
    """The simulator's gradient buckets (hetplan.planner.cost.buckets), as layer tuples.

    grad_buckets reads only the number of layers and each layer's parameter bytes, so the graph
    handed to it carries just those (no FLOPs: capturing them would cost a profile run here).
    """
    from hetplan.planner.cost.buckets import grad_buckets
    from hetplan.planner.workload.graph import Layer, ModelGraph
    layers = tuple(Layer(index=i, name=f"layer{i}", fwd_flops=0.0, bwd_flops=0.0,
                         param_bytes=sum(named[n].numel() * named[n].element_size() for n in names),
                         activation_bytes=0, saved_bytes=0, fwd_bytes_moved=0.0, bwd_bytes_moved=0.0,
                         n_ops=0, bwd_n_ops=0, param_names=names)
                   for i, names in enumerate(names_by_layer))
    graph = ModelGraph(layers=layers, batch=1, cut_bytes=(0,) * (len(layers) + 1))
    return [b.layers for b in grad_buckets(plan, graph)]


def _bucket_of(plan: Plan, layout: _Layout) -> dict[torch.nn.Parameter, int]:
    """Each parameter's gradient bucket: the layout's buckets, then a tied weight's own;
    coarse sync: one bucket."""
    out = {p: i for i, layers in enumerate(layout.buckets) for l in layers
           for p in layout.params_by_layer.get(l, [])}
    out.update({t.param: len(layout.buckets) + k for k, t in enumerate(layout.tied)})
    if plan.sync.granularity == "coarse":
        out = dict.fromkeys(out, 0)
    return out


def _param_buckets(plan: Plan, layout: _Layout, params: list[torch.nn.Parameter]) -> list[list[int]]:
    """`params`' indices by gradient bucket (`_bucket_of`), in bucket order; a parameter in no
    bucket a bucket of its own (ZeRO-2's buckets, ZeRO-3's units)."""
    of = _bucket_of(plan, layout)
    ids = sorted({of.get(p, -1 - i) for i, p in enumerate(params)})
    return [[i for i, p in enumerate(params) if of.get(p, -1 - i) == u] for u in ids]


def _check_ownership(named: dict, names_by_layer) -> None:
    """Every parameter of the stage must belong to a layer, or its gradient would be left out of
    the sync."""
    owned = {n for names in names_by_layer for n in names}
    missing = [n for n in named if n not in owned]
    if missing:
        raise ValueError(f"parameters {missing[:3]} belong to no layer of the partition")


@dataclass
class _Layout:
    """What this rank exchanges with which ranks: gradients by layer, tied weights, buffers."""
    params_by_layer: dict[int, list[torch.nn.Parameter]]
    ranks_of_layer: list[tuple[int, ...]]
    buckets: list[tuple[int, ...]]
    tied: list[Tied]
    buffers: list[tuple[tuple[int, ...], int, list[torch.Tensor]]]   # (ranks, source, tensors)

    @property
    def sync_sets(self) -> list[tuple[int, ...]]:
        return sorted(set(self.ranks_of_layer) | {t.ranks for t in self.tied})


def _layout(plan: Plan, workload, module, replica_ranks, ranks_of_layer, found, mine=()) -> _Layout:
    """`found`: the workload's hetplan.planner.workload.layer_cache.LayerMap; `mine`: this rank's stage
    layer ranges when it holds several (interleaved), for how many of them use a tied weight."""
    named = dict(module.named_parameters())
    if len(set(ranks_of_layer)) == 1 and plan.sync.granularity == "coarse":
        # every layer has the same ranks: one flat bucket; no need to know the layers
        buffers = [(ranks_of_layer[0], replica_ranks[0][0], [b for _, b in module.named_buffers()])]
        return _Layout({0: list(named.values())}, [ranks_of_layer[0]], [(0,)], [], buffers)
    names_by_layer, buffers_by_layer = found.params, found.buffers
    _check_ownership(named, names_by_layer)
    tied = tied_layers(names_by_layer)
    # a tied weight is exchanged on its own, in no layer's bucket (hetplan.planner.cost.buckets)
    owned = [tuple(n for n in ns if n not in tied) for ns in names_by_layer]
    params_by_layer = {l: [named[n] for n in ns if n in named and n not in tied]
                       for l, ns in enumerate(names_by_layer)}
    ties = [Tied(named.get(n), tuple(sorted({r for l in ls for r in ranks_of_layer[l]})), ls[0],
                 max(1, sum(any(a <= l < b for l in ls) for a, b in mine)))
            for n, ls in sorted(tied.items())]
    buckets = _buckets(plan, owned, dict(workload.model.named_parameters()))
    buffers = _buffer_sets(module, buffers_by_layer, replica_ranks, ranks_of_layer)
    return _Layout(params_by_layer, ranks_of_layer, buckets, ties, buffers)


def _buffer_sets(module, buffers_by_layer, replica_ranks, ranks_of_layer) -> list:
    """(ranks, first replica's rank, this rank's buffers) per rank set holding a layer's buffers;
    a buffer used by several layers goes with the first."""
    mine, seen = dict(module.named_buffers()), set()
    first = set(replica_ranks[0])
    out: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for layer, names in enumerate(buffers_by_layer):
        ranks = ranks_of_layer[layer]
        for n in names:
            if n not in seen:
                seen.add(n)
                out.setdefault(ranks, []).extend([mine[n]] if n in mine else [])
    return [(r, next(x for x in r if x in first), bufs) for r, bufs in sorted(out.items())]


def build(plan: Plan, names: list[str], rank: int, device: TorchDevice, timeout=None,
          marks=None, file: str = "<plan>", iterations: int = 1, given=None) -> Built:
    """What rank `rank` runs; `device` is its hetplan.planner.hardware.device.TorchDevice; `marks`
    (hetplan.runtime.startup.Marks) gets "model" once the workload is built and checked; `iterations`:
    how many the run trains (a PipeDream stream's length)."""
    from hetplan.runtime.shard import check_runs
    check_runs(plan, file)       # every entry point (`run` checks it before it starts workers too)
    kinds = [parse_device_name(d)[1] for d in names]
    if plan.sync.mode == "parameter-server" and names[rank] == plan.sync.server:
        return _server(plan, kinds, device, timeout, marks, file, given)
    where: dict[str, tuple[int, int]] = {}   # device -> (replica, its first stage)
    for i, r in enumerate(plan.replicas):
        for j, st in enumerate(r.stages):
            for d in st.devices:
                where.setdefault(d, (i, j))
    rep_i, st_j = where[names[rank]]
    if any(st.split for st in plan.replicas[rep_i].stages):      # validated: the plan's only replica
        from hetplan.runtime.tensor import build_rank
        return build_rank(plan, names, rank, device, timeout, marks, file, given)
    b = _StageBuild(plan, names, rank, device, rep_i, st_j, iterations)
    b.make_model(file, given, marks)
    b.make_groups(kinds, timeout)
    b.make_runner()
    return b.make_built(file)


class _StageBuild:
    """A pipeline rank's build, job by job (`build` calls them in order): the model and this
    rank's stage (or virtual stages: interleaved 1F1B), who exchanges what with whom (layout,
    process groups), the runner, then the sync and optimizer."""

    def __init__(self, plan: Plan, names: list[str], rank: int, device: TorchDevice, rep_i: int, st_j: int,
                 iterations: int):
        self.plan, self.names, self.rank, self.device = plan, names, rank, device
        self.rep_i, self.st_j, self.iterations = rep_i, st_j, iterations
        self.rep = plan.replicas[rep_i]
        batch = plan.replica_batches()[rep_i]
        self.micro = batch // self.rep.microbatches
        self.fraction = batch / plan.global_batch      # asynchronous: each replica's loss its own mean
        # interleaved-1f1b: this rank holds several virtual stages (hetplan.runtime.interleaved)
        self.mine = [j for j, st in enumerate(self.rep.stages) if st.device == names[rank]]
        self.interleaved = len(self.mine) > 1
        self.synchronous = plan.sync.mode == "sync"    # else: no gradient all-reduce (hetplan.runtime.sync_modes)

    def make_model(self, file: str, given, marks) -> None:
        """The workload (checked against the plan) and this rank's module on its device."""
        # torch.manual_seed(0) inside; rank 0 checks one training step for all
        self.workload, self.found = check_model(self.plan, file, given, step=self.rank == 0)
        if marks is not None:
            marks.mark("model")
        from hetplan.planner.workload.layer_cache import plan_batch
        # on a cold layer-map cache the map's export is at this batch when micro is the plan's batch
        exported = self.found.exported if self.micro == plan_batch(self.plan) else None
        self.module = (_virtual_stages(self.workload, self.rep, self.mine, self.micro, self.device, exported)
                       if self.interleaved else
                       _module(self.workload, self.rep, self.st_j, self.micro, self.device, exported,
                               graph=self.plan.shard == 3))

    def make_groups(self, kinds: list[str], timeout) -> None:
        """Who holds which layer (one rank per replica), what this rank exchanges, the groups."""
        plan, rank_of = self.plan, {d: r for r, d in enumerate(self.names)}
        replica_ranks = [[rank_of[st.device] for st in r.stages] for r in plan.replicas]
        self.ranks_of_layer = layer_ranks([[st.layers for st in r.stages] for r in plan.replicas],
                                          replica_ranks, plan.num_layers)
        self.layout = _layout(plan, self.workload, self.module, replica_ranks, self.ranks_of_layer, self.found,
                              [self.rep.stages[j].layers for j in self.mine] if self.interleaved else ())
        pairs = [(min(a, b), max(a, b)) for rr in replica_ranks for a, b in zip(rr, rr[1:])]
        self.groups = Groups(kinds, pairs, self.layout.sync_sets if self.synchronous else [], timeout,
                             nccl=standin_gpus() == 0)
        self.my_ranks = replica_ranks[self.rep_i]

    def link(self, peer: int) -> PeerLink:
        return peer_link(self.groups, self.rank, peer, self.device)

    def make_runner(self) -> None:
        """The runner of this rank's actions (DDP-wrapped where plain data parallel runs on DDP)."""
        plan, rep, device, st_j, my_ranks = self.plan, self.rep, self.device, self.st_j, self.my_ranks
        self.timer, self.sync_mb, self.wrapped = BusyTimer(device), None, self.module
        if self.interleaved:
            self.runner, self.actions = _interleaved_runner(plan, rep, self.module, my_ranks, self.rank, self.link,
                                                            device, self.workload, self.fraction / rep.microbatches,
                                                            self.timer)
            self.st_j = rep.pipeline_devices.index(self.names[self.rank])   # data: first/last
            self.n_stages = len(rep.pipeline_devices)
            return
        self.n_stages = len(rep.stages)
        prev = self.link(my_ranks[st_j - 1]) if st_j > 0 else None
        nxt = self.link(my_ranks[st_j + 1]) if st_j + 1 < len(my_ranks) else None
        self.actions = stage_actions(plan.schedule, st_j, len(rep.stages), rep.microbatches)
        self.sync_mb = ddp.sync_microbatch(self.actions) if ddp.uses_ddp(plan) else None
        if self.sync_mb is not None:
            self.wrapped = ddp.wrap(self.module, self.groups.sync[self.ranks_of_layer[0]], device.device,
                                    _bucket_of(plan, self.layout), find_unused=bool(self.found.unused),
                                    on_ready=self.timer.cut)
        self.runner = StageRunner(self.wrapped, device.device, self.workload.loss_fn, prev, nxt,
                                  scale=(self.fraction if self.synchronous else 1.0) / rep.microbatches,
                                  busy=self.timer.timer, recompute=plan.recompute, precision=plan.precision)
        self.runner.runs_left = self.iterations

    def make_built(self, file: str) -> Built:
        """The optimizer and the sync of the plan's sync mode, and what the rank runs."""
        plan, runner, layout, groups = self.plan, self.runner, self.layout, self.groups
        params = list(dict(self.module.named_parameters()).values())
        runner.saved_tracker = SavedTracker(params)
        if self.rep.stages[self.st_j].offload_activations:
            runner.offload = ActivationOffload(self.device, params)
        ranks = self.ranks_of_layer[self.rep.stages[self.st_j].start]   # validated: stage j of every
        shard_group = self.groups.sync[ranks] if plan.shard else None     # replica, the same layers
        staged = self.groups.host_staged(ranks)      # a CPU beside a GPU: through host memory
        shards = self._param_shards(params, shard_group, staged) if plan.shard == 3 else None
        optimizer = StageOptimizer(params, plan.optimizer, self.device, shard_group, shards, staged)
        if plan.sync.mode in PIPEDREAM_MODES:
            shared = [t for t in layout.tied if len(t.ranks) > 1]
            if shared:        # each stage would update its own copy: refused, not trained apart
                from hetplan.planner.files.io import InputError
                raise InputError(f"{file}: replicas[0].stages: sync.mode {plan.sync.mode!r} needs stages that "
                                 f"share no parameter in this version; the model ties a weight across stages "
                                 f"(layer {shared[0].first_layer} and later)")
            return _pipedream(plan, self.workload, self.module, runner, optimizer, groups, self.timer, self.st_j,
                              self.micro, self.iterations)
        head = (plan, self.workload, self.rep_i, self.st_j)
        tail = (plan.replica_offsets()[self.rep_i], self.micro, self.module, runner)
        if self.synchronous and plan.shard >= 2:   # ZeRO-2/3: reduce-scattered in backward (shard.check_runs)
            return Built(*head, self.n_stages, *tail, self._scatter(optimizer), optimizer, groups, self.timer,
                         self.actions, BufferSync(groups, layout.buffers))
        if self.synchronous:
            if self.sync_mb is None:
                sync = GradSync(groups, self.rank, layout.params_by_layer, layout.ranks_of_layer, layout.buckets,
                                plan.sync.granularity, self.rep.microbatches, self.device, layout.tied)
            else:   # plain data parallel: torch DDP syncs during backward (hetplan.runtime.ddp)
                sync = ddp.DDPSync()
                runner.forward_context = ddp.forward_context(self.wrapped, self.sync_mb)
            return Built(*head, self.n_stages, *tail, sync, optimizer, groups, self.timer, self.actions,
                         BufferSync(groups, layout.buffers))
        exchange, sync = None, NoGradSync()   # buffers stay each replica's own (hetplan.runtime.sync_modes)
        if plan.sync.mode == "parameter-server":
            server = self.names.index(plan.sync.server)
            sync, optimizer = ServerClient(params, server, groups.world), ServerStepped(params)
        elif plan.sync.period is not None:
            exchange = ParameterExchange(plan.sync, params, self.fraction, groups.world, len(self.names))
        else:                # hogwild: before the optimizer first touches the parameters' storage
            hogwild_parameters(params, self.rank, groups.world)
        return Built(*head, len(self.rep.stages), *tail, sync, optimizer, groups, self.timer, self.actions,
                     BufferSync(groups, []), exchange, loss_weight=self.fraction)


    def _param_shards(self, params, group, staged: bool):
        """ZeRO-3: the stage's parameters in units (its gradient buckets; coarse: one), gathered
        around the units' layers in the stage's graph (hetplan.runtime.shard)."""
        from hetplan.runtime.shard import ParamShards, wire
        trained = [p for p in params if p.requires_grad]
        units = _param_buckets(self.plan, self.layout, trained)
        shards = ParamShards(trained, group, units, staged)
        wire(self.module, shards, {id(trained[i]): u for u, idx in enumerate(units) for i in idx})
        self.runner.params_saved = shards
        return shards

    def _scatter(self, optimizer: StageOptimizer):
        """ZeRO-2's GradScatter (the gradient buckets; coarse: one, after backward), or ZeRO-3's
        ParamShards, the optimizer's own."""
        from hetplan.runtime.shard import GradScatter
        plan = self.plan
        last = [mb for kind, mb in self.actions if kind in ("B", "W")][-1]
        sync = optimizer.sharded if plan.shard == 3 else GradScatter(
            optimizer.sharded, _param_buckets(plan, self.layout, optimizer.sharded.params))
        self.runner.before_backward = sync.before_backward(last)
        return sync


@dataclass
class PipeDreamBuilt(Built):
    """A stage of a PipeDream / 2BW pipeline (hetplan.runtime.pipedream): each `step` runs the stream's
    next iteration; the stage updates its weights itself."""
    data: StreamData | None = None

    def microbatches(self, global_batch: int, iteration: int):
        return self.data.batches(global_batch, iteration, self._call_args)

    def begin(self) -> None:
        pass

    def step(self, batch) -> torch.Tensor | None:
        return self.runner.run(None, *batch)

    def held_peak_bytes(self) -> int:
        return self.runner.versions.peak_bytes


def _pipedream(plan: Plan, workload, module, runner: StageRunner, optimizer: StageOptimizer, groups: Groups,
               timer: BusyTimer, st_j: int, micro: int, iterations: int) -> PipeDreamBuilt:
    rep = plan.replicas[0]
    p, m = len(rep.stages), rep.microbatches
    versions = WeightVersions(list(module.named_parameters()), optimizer, plan.sync, m)
    pd = PipeDreamRunner(Stashed(module), runner.device, runner.loss_fn, runner.prev, runner.next, runner.scale,
                         runner.busy, precision=runner.precision, versions=versions,
                         iterations=stream_iterations(p, st_j, m, iterations))
    pd.saved_tracker = runner.saved_tracker
    data = StreamData(workload, m, micro, st_j == 0, st_j == p - 1, iterations)
    return PipeDreamBuilt(plan, workload, 0, st_j, p, 0, micro, module, pd, NoGradSync(), optimizer, groups,
                          timer, [], BufferSync(groups, []), data=data)


@dataclass
class ServerBuilt(Built):
    """A parameter server's rank: no batch, no compute of its own; each iteration it serves one
    gradient message per replica (hetplan.runtime.sync_modes.ParameterServer)."""
    server: ParameterServer | None = None

    def microbatches(self, global_batch: int, iteration: int):
        return None, None

    def step(self, batch) -> None:
        self.server.serve(len(self.plan.replicas))
        return None


def _server(plan: Plan, kinds: list[str], device: TorchDevice, timeout, marks, file: str,
            given=None) -> ServerBuilt:
    workload, _ = check_model(plan, file, given)         # torch.manual_seed(0) inside: the same weights
    if marks is not None:
        marks.mark("model")
    module = WholeModel(workload.model).to(device.device)
    params = list(module.parameters())
    groups = Groups(kinds, [], [], timeout, nccl=standin_gpus() == 0)
    timer = BusyTimer(device)
    runner = StageRunner(module, device.device, workload.loss_fn, None, None, scale=0.0, busy=timer.timer)
    runner.saved_tracker = SavedTracker(params)
    optimizer = StageOptimizer(params, plan.optimizer, device)
    return ServerBuilt(plan, workload, -1, 0, 1, 0, 0, module, runner, NoGradSync(), optimizer, groups,
                       timer, [], BufferSync(groups, []), loss_weight=0.0,
                       server=ParameterServer(params, optimizer, groups.world, timer.timer))


def _virtual_stages(workload, rep, mine: list[int], micro: int, device: TorchDevice, exported=None):
    """interleaved-1f1b: this rank's stages `mine` of the replica, on its device, as one module."""
    from hetplan.planner.workload.partition import build_stages, place_stages
    built = build_stages(workload, [st.layers for st in rep.stages], micro, exported)
    return VirtualStages(dict(zip(mine, place_stages([built[j] for j in mine], device.device))))


def _interleaved_runner(plan: Plan, rep, module: VirtualStages, my_ranks: list[int], rank: int, link,
                        device: TorchDevice, workload, scale: float, timer: BusyTimer):
    """The runner of a rank holding several virtual stages, and its actions: one link per
    neighbouring device, and each neighbour's send order (hetplan.runtime.interleaved)."""
    n, p = len(rep.stages), len(rep.pipeline_devices)
    row = rep.pipeline_devices.index(rep.stages[next(iter(module.by_stage))].device)
    order = [device_actions(plan.schedule, n, rep.microbatches, p, r) for r in range(p)]
    peers = sorted({my_ranks[j + d] for j in module.by_stage for d in (-1, 1) if 0 <= j + d < n})
    sends = {my_ranks[r]: [msg for msg in sent_messages(order[r], n) if my_ranks[msg[1]] == rank]
             for r in range(p) if my_ranks[r] in peers}
    runner = InterleavedRunner(module.by_stage, n, device.device, workload.loss_fn,
                               {q: link(q) for q in peers}, my_ranks, sends, scale, timer.timer,
                               recompute=plan.recompute, precision=plan.precision)
    return runner, order[row]


def _module(workload, rep, st_j: int, micro: int, device: TorchDevice, exported=None,
            graph: bool = False) -> torch.nn.Module:
    """The whole model (a one-stage replica, unless `graph`: ZeRO-3 wires its gathers into the
    stage's graph) or this rank's stage, on its device; `exported`: an export at `micro` already
    made, or None."""
    if len(rep.stages) == 1 and not graph:
        return WholeModel(workload.model).to(device.device)
    from hetplan.planner.workload.partition import build_stages, place_stages
    return place_stages([build_stages(workload, [st.layers for st in rep.stages], micro, exported)[st_j]],
                        device.device)[0]
