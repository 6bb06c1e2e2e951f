"""Build what one rank runs: its stage module, pipeline links, gradient sync and optimizer.

Every rank calls `build` with the same plan and rank->device list, so the collective group
creation in `sync.Groups` happens in the same order everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from planner.hardware.device import TorchDevice, standin_gpus
from planner.files.plan import PIPEDREAM_MODES, Plan
from planner.workload.weight_versions import WeightVersions
from planner.hardware.topology import parse_device_name
from planner.workload.inputs import call_args, slice_inputs
from runtime import ddp
from runtime.sync_modes import (NoGradSync, ParameterExchange, ParameterServer, ServerClient,
                                ServerStepped, hogwild_parameters)
from runtime.instruments import BusyTimer, SavedTracker
from runtime.interleaved import InterleavedRunner, VirtualStages, device_actions, sent_messages
from runtime.offload import ActivationOffload
from runtime.optim import StageOptimizer
from runtime.pipedream import PipeDreamRunner, Stashed, StreamData, stream_iterations
from runtime.pipeline import PeerLink, StageRunner, WholeModel, stage_actions
from runtime.sync import BufferSync, GradSync, Groups, Tied, layer_ranks


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
    sync: GradSync | ddp.DDPSync | NoGradSync
    optimizer: StageOptimizer
    groups: Groups
    timer: BusyTimer
    actions: list
    buffers: BufferSync
    exchange: ParameterExchange | None = None   # sync.mode local-sgd / easgd
    loss_weight: float = 1.0                    # the recorded loss's weight: the batch fraction
                                                # where a replica's loss is its own mean
    before_optimizer: Any = None                # called between the gradient sync and the step
                                                # (runtime.train: clipping by the global norm)

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
        m = self.plan.replicas[self.replica].microbatches
        read = getattr(self.workload.make_batch, "read", None)
        if read is not None:          # a runtime.data.DataFeed: only this replica's samples
            x, y = read(iteration, self.offset, self.offset + m * self.micro)
            base = 0
        else:
            x, y = self.workload.make_batch(global_batch, iteration)
            base = self.offset
        bounds = [(base + k * self.micro, base + (k + 1) * self.micro) for k in range(m)]
        ins = [self._call_args(slice_inputs(x, a, b)) for a, b in bounds] if first else None
        tgts = [slice_inputs(y, a, b) for a, b in bounds] if last else None
        return ins, tgts

    def _call_args(self, inputs) -> tuple[tuple, dict]:
        """(args, kwargs) for this rank's module: the model's own call for a whole model, the
        flat leaves (planner.workload.partition.stage_inputs) for a first stage."""
        if isinstance(self.module, WholeModel):
            return call_args(inputs)
        return self.module.flat_inputs(inputs), {}

    def begin(self) -> None:
        self.optimizer.zero_grad()
        self.sync.begin()

    def held_peak_bytes(self) -> int:
        """The most bytes held at once besides parameters, gradients, optimizer state and saved
        activations (a PipeDream stage's stashed weight versions)."""
        return 0

    def step(self, batch) -> torch.Tensor | None:
        with self.timer.timer("buffer broadcast", "allreduce", busy=False):
            self.buffers.broadcast()
        loss = self.runner.run(self.actions, *batch)
        with self.timer.timer("grad sync wait", "allreduce", busy=False):
            self.sync.finish()
        if self.before_optimizer is not None:
            self.before_optimizer()
        with self.timer.timer("optimizer", "optimizer"):
            self.optimizer.step()
        if self.exchange is not None:
            with self.timer.timer("parameter exchange", "allreduce", busy=False):
                self.exchange.after_step()
        if loss is not None and self.loss_weight != 1.0:
            loss = loss * self.loss_weight
        return loss


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


def _bucket_of(plan: Plan, layout: _Layout) -> dict[torch.nn.Parameter, int]:
    """Each parameter's gradient bucket: the layout's buckets, then a tied weight's own;
    coarse sync: one bucket."""
    out = {p: i for i, layers in enumerate(layout.buckets) for l in layers
           for p in layout.params_by_layer.get(l, [])}
    out.update({t.param: len(layout.buckets) + k for k, t in enumerate(layout.tied)})
    if plan.sync.granularity == "coarse":
        out = dict.fromkeys(out, 0)
    return out


def tied_layers(names_by_layer) -> dict[str, tuple[int, ...]]:
    """Parameters used by several layers (tied weights) -> those layers."""
    layers: dict[str, list[int]] = {}
    for layer, names in enumerate(names_by_layer):
        for n in names:
            layers.setdefault(n, []).append(layer)
    return {n: tuple(ls) for n, ls in layers.items() if len(ls) > 1}


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
    """`found`: the workload's planner.workload.layer_cache.LayerMap; `mine`: this rank's stage
    layer ranges when it holds several (interleaved), for how many of them use a tied weight."""
    named = dict(module.named_parameters())
    if len(set(ranks_of_layer)) == 1 and plan.sync.granularity == "coarse":
        # every layer has the same ranks: one flat bucket; no need to know the layers
        buffers = [(ranks_of_layer[0], replica_ranks[0][0], [b for _, b in module.named_buffers()])]
        return _Layout({0: list(named.values())}, [ranks_of_layer[0]], [(0,)], [], buffers)
    names_by_layer, buffers_by_layer = found.params, found.buffers
    _check_ownership(named, names_by_layer)
    tied = tied_layers(names_by_layer)
    # a tied weight is exchanged on its own, in no layer's bucket (planner.cost.buckets)
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


def check_model(plan: Plan, file: str, given=None, step: bool = True):
    """(the plan's workload, built; its layer map): the model must load, keep one training step's
    contract (with `step`: planner.workload.step_check, one rank checks it for all) and have the
    layers the plan's stages cover, else InputError naming `file` (the launcher turns it into
    exit 2). The layer map comes from the layer-map cache (planner.workload.layer_cache); a miss
    costs one export. `given`: the workload itself (hetplan.train), a Workload or a factory of
    one, instead of the plan's model.spec."""
    from planner.files.plan import validate_plan
    from planner.workload.layer_cache import layer_map, plan_batch
    from planner.workload.load import load_plan_workload
    from planner.workload.step_check import check_step
    if given is None:
        workload = load_plan_workload(plan.model, file)     # torch.manual_seed(0) inside
    else:
        from planner.workload.load import given_workload
        workload = given_workload(given, plan.model.spec, plan.model.args)
    if step:
        check_step(workload, plan.global_batch, f"{file}: model.spec", plan.model.spec)
    found = layer_map(workload, plan.model.spec, plan.model.args, plan_batch(plan))
    validate_plan(plan, file, num_layers=found.num_layers)
    return workload, found


def build(plan: Plan, names: list[str], rank: int, device: TorchDevice, timeout=None,
          marks=None, file: str = "<plan>", iterations: int = 1, given=None) -> Built:
    """What rank `rank` runs; `device` is its planner.hardware.device.TorchDevice; `marks`
    (runtime.startup.Marks) gets "model" once the workload is built and checked; `iterations`:
    how many the run trains (a PipeDream stream's length)."""

    rank_of = {d: r for r, d in enumerate(names)}
    kinds = [parse_device_name(d)[1] for d in names]
    if plan.sync.mode == "parameter-server" and names[rank] == plan.sync.server:
        return _server(plan, kinds, device, timeout, marks, file, given)
    where: dict[str, tuple[int, int]] = {}   # device -> (replica, its first stage)
    for i, r in enumerate(plan.replicas):
        for j, st in enumerate(r.stages):
            for d in st.devices:
                where.setdefault(d, (i, j))
    rep_i, st_j = where[names[rank]]
    rep = plan.replicas[rep_i]
    if any(st.split for st in rep.stages):      # validated: the plan's only replica
        from runtime.tensor import build_rank
        return build_rank(plan, names, rank, device, timeout, marks, file, given)
    batch = plan.replica_batches()[rep_i]
    micro = batch // rep.microbatches
    workload, found = check_model(plan, file, given, step=rank == 0)   # torch.manual_seed(0) inside
    if marks is not None:
        marks.mark("model")
    from planner.workload.layer_cache import plan_batch
    # on a cold layer-map cache the map's export is at this batch when micro is the plan's batch
    exported = found.exported if micro == plan_batch(plan) else None
    # interleaved-1f1b: this rank holds several virtual stages (runtime.interleaved)
    mine = [j for j, st in enumerate(rep.stages) if st.device == names[rank]]
    interleaved = len(mine) > 1
    module = (_virtual_stages(workload, rep, mine, micro, device, exported) if interleaved
              else _module(workload, rep, st_j, micro, device, exported))

    # who holds which layer: one rank per replica
    replica_ranks = [[rank_of[st.device] for st in r.stages] for r in plan.replicas]
    ranks_of_layer = layer_ranks([[st.layers for st in r.stages] for r in plan.replicas],
                                 replica_ranks, plan.num_layers)
    layout = _layout(plan, workload, module, replica_ranks, ranks_of_layer, found,
                     [rep.stages[j].layers for j in mine] if interleaved else ())
    named = dict(module.named_parameters())

    pairs = [(min(a, b), max(a, b)) for rr in replica_ranks for a, b in zip(rr, rr[1:])]
    synchronous = plan.sync.mode == "sync"    # else: no gradient all-reduce (runtime.sync_modes)
    groups = Groups(kinds, pairs, layout.sync_sets if synchronous else [], timeout, nccl=standin_gpus() == 0)
    my_ranks = replica_ranks[rep_i]

    def link(peer: int) -> PeerLink:
        return peer_link(groups, rank, peer, device)

    timer = BusyTimer(device)
    fraction = batch / plan.global_batch      # asynchronous: each replica's loss its own mean
    if interleaved:
        runner, actions = _interleaved_runner(plan, rep, module, my_ranks, rank, link, device, workload,
                                              fraction / rep.microbatches, timer)
        sync_mb = None
        st_j, n_stages = rep.pipeline_devices.index(names[rank]), len(rep.pipeline_devices)   # data: first/last
    else:
        n_stages = len(rep.stages)
        prev = link(my_ranks[st_j - 1]) if st_j > 0 else None
        nxt = link(my_ranks[st_j + 1]) if st_j + 1 < len(my_ranks) else None
        actions = stage_actions(plan.schedule, st_j, len(rep.stages), rep.microbatches)
        sync_mb = ddp.sync_microbatch(actions) if ddp.uses_ddp(plan) else None
        wrapped = module if sync_mb is None else ddp.wrap(module, groups.sync[ranks_of_layer[0]],
                                                          device.device, _bucket_of(plan, layout),
                                                          find_unused=bool(found.unused))
        runner = StageRunner(wrapped, device.device, workload.loss_fn, prev, nxt,
                             scale=(fraction if synchronous else 1.0) / rep.microbatches, busy=timer.timer,
                             recompute=plan.recompute, precision=plan.precision)
        runner.runs_left = iterations
    runner.saved_tracker = SavedTracker(named.values())
    if rep.stages[st_j].offload_activations:
        runner.offload = ActivationOffload(device, named.values())
    optimizer = StageOptimizer(list(named.values()), plan.optimizer, device)
    if plan.sync.mode in PIPEDREAM_MODES:
        shared = [t for t in layout.tied if len(t.ranks) > 1]
        if shared:        # each stage would update its own copy: refused, not trained apart
            from planner.files.io import InputError
            raise InputError(f"{file}: replicas[0].stages: sync.mode {plan.sync.mode!r} needs stages that share "
                             f"no parameter in this version; the model ties a weight across stages "
                             f"(layer {shared[0].first_layer} and later)")
        return _pipedream(plan, workload, module, runner, optimizer, groups, timer, st_j, micro, iterations)
    if synchronous:
        if sync_mb is None:
            sync = GradSync(groups, rank, layout.params_by_layer, layout.ranks_of_layer, layout.buckets,
                            plan.sync.granularity, rep.microbatches, device, layout.tied)
        else:   # plain data parallel: torch DDP syncs during backward (runtime.ddp)
            sync = ddp.DDPSync()
            runner.forward_context = ddp.forward_context(wrapped, sync_mb)
        return Built(plan, workload, rep_i, st_j, n_stages, plan.replica_offsets()[rep_i], micro,
                     module, runner, sync, optimizer, groups, timer, actions,
                     BufferSync(groups, layout.buffers))
    params = list(named.values())
    exchange, sync = None, NoGradSync()   # buffers stay each replica's own (runtime.sync_modes)
    if plan.sync.mode == "parameter-server":
        sync, optimizer = ServerClient(params, rank_of[plan.sync.server], groups.world), ServerStepped(params)
    elif plan.sync.period is not None:
        exchange = ParameterExchange(plan.sync, params, fraction, groups.world, len(names))
    else:                # hogwild: before the optimizer first touches the parameters' storage
        hogwild_parameters(params, rank, groups.world)
    return Built(plan, workload, rep_i, st_j, len(rep.stages), plan.replica_offsets()[rep_i], micro,
                 module, runner, sync, optimizer, groups, timer, actions, BufferSync(groups, []),
                 exchange, loss_weight=fraction)


def peer_link(groups: Groups, rank: int, peer: int, device: TorchDevice) -> PeerLink:
    """The pipeline link between this rank and `peer` over the run's groups."""
    send, recv = groups.p2p[(rank, peer)], groups.p2p[(peer, rank)]
    return PeerLink(peer=peer, send_group=send, recv_group=recv, device=device,
                    host_staged=device.accelerator and send is groups.world)


@dataclass
class PipeDreamBuilt(Built):
    """A stage of a PipeDream / 2BW pipeline (runtime.pipedream): each `step` runs the stream's
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
    gradient message per replica (runtime.sync_modes.ParameterServer)."""
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
    from planner.workload.partition import build_stages, place_stages
    built = build_stages(workload, [st.layers for st in rep.stages], micro, exported)
    return VirtualStages(dict(zip(mine, place_stages([built[j] for j in mine], device.device))))


def _interleaved_runner(plan: Plan, rep, module: VirtualStages, my_ranks: list[int], rank: int, link,
                        device: TorchDevice, workload, scale: float, timer: BusyTimer):
    """The runner of a rank holding several virtual stages, and its actions: one link per
    neighbouring device, and each neighbour's send order (runtime.interleaved)."""
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


def _module(workload, rep, st_j: int, micro: int, device: TorchDevice, exported=None) -> torch.nn.Module:
    """The whole model (a one-stage replica) or this rank's stage, on its device; `exported`: an
    export at `micro` already made, or None."""
    if len(rep.stages) == 1:
        return WholeModel(workload.model).to(device.device)
    from planner.workload.partition import build_stages, place_stages
    return place_stages([build_stages(workload, [st.layers for st in rep.stages], micro, exported)[st_j]],
                        device.device)[0]
