"""What one rank runs (`Built`: its stage, links, sync and optimizer, and its training step) and
what every way of building it shares (hetplan.runtime.stage for pipeline stages, hetplan.runtime.tensor for a
tensor-split stage): the model checked against the plan, the pipeline link to a peer, the tied
weights."""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Any

import torch

from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.device import TorchDevice
from hetplan.planner.workload.inputs import call_args, slice_inputs
from hetplan.runtime import ddp
from hetplan.runtime.instruments import BusyTimer
from hetplan.runtime.optim import StageOptimizer
from hetplan.runtime.pipeline import PeerLink, StageRunner, WholeModel
from hetplan.runtime.sync import BufferSync, GradSync, Groups
from hetplan.runtime.sync_modes import NoGradSync, ParameterExchange


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
                                                # (hetplan.runtime.train: clipping by the global norm)

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.module.named_parameters())

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    def microbatches(self, global_batch: int, iteration: int, at: tuple[int, int] | None = None):
        """This replica's slice of make_batch(global_batch, seed=iteration), in microbatches;
        inputs only on the first stage, targets only on the last. `at`: (offset, samples per
        microbatch) instead of the built ones (hetplan.runtime.rebalance)."""
        first, last = self.stage == 0, self.stage == self.n_stages - 1
        offset, micro = at if at is not None else (self.offset, self.micro)
        if not (first or last):
            return None, None
        m = self.plan.replicas[self.replica].microbatches
        read = getattr(self.workload.make_batch, "read", None)
        if read is not None:          # a hetplan.runtime.data.DataFeed: only this replica's samples
            x, y = read(iteration, offset, offset + m * micro)
            base = 0
        else:
            x, y = self.workload.make_batch(global_batch, iteration)
            base = offset
        bounds = [(base + k * micro, base + (k + 1) * micro) for k in range(m)]
        ins = [self._call_args(slice_inputs(x, a, b)) for a, b in bounds] if first else None
        tgts = [slice_inputs(y, a, b) for a, b in bounds] if last else None
        return ins, tgts

    def _call_args(self, inputs) -> tuple[tuple, dict]:
        """(args, kwargs) for this rank's module: the model's own call for a whole model, the
        flat leaves (hetplan.planner.workload.partition.stage_inputs) for a first stage."""
        if isinstance(self.module, WholeModel):
            return call_args(inputs)
        return self.module.flat_inputs(inputs), {}

    def begin(self) -> None:
        self.optimizer.zero_grad()
        self.sync.begin()

    def whole_parameters(self):
        """A context in which every parameter of this rank is whole (ZeRO-3 gathers them: every
        rank of its group must enter it too)."""
        sharded = getattr(self.optimizer, "sharded", None)
        return sharded.unsharded() if sharded is not None and sharded.own else contextlib.nullcontext()

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


def check_model(plan: Plan, file: str, given=None, step: bool = True):
    """(the plan's workload, built; its layer map): the model must load, keep one training step's
    contract (with `step`: hetplan.planner.workload.step_check, one rank checks it for all) and have the
    layers the plan's stages cover, else InputError naming `file` (the launcher turns it into
    exit 2). The layer map comes from the layer-map cache (hetplan.planner.workload.layer_cache); a miss
    costs one export. `given`: the workload itself (hetplan.train), a Workload or a factory of
    one, instead of the plan's model.spec."""
    from hetplan.planner.files.plan import validate_plan
    from hetplan.planner.workload.layer_cache import layer_map, plan_batch
    from hetplan.planner.workload.load import load_plan_workload
    from hetplan.planner.workload.step_check import check_step
    if given is None:
        workload = load_plan_workload(plan.model, file)     # torch.manual_seed(0) inside
    else:
        from hetplan.planner.workload.load import given_workload
        workload = given_workload(given, plan.model.spec, plan.model.args)
    if step:
        check_step(workload, plan.global_batch, f"{file}: model.spec", plan.model.spec)
    found = layer_map(workload, plan.model.spec, plan.model.args, plan_batch(plan))
    validate_plan(plan, file, num_layers=found.num_layers)
    return workload, found


def tied_layers(names_by_layer) -> dict[str, tuple[int, ...]]:
    """Parameters used by several layers (tied weights) -> those layers."""
    layers: dict[str, list[int]] = {}
    for layer, names in enumerate(names_by_layer):
        for n in names:
            layers.setdefault(n, []).append(layer)
    return {n: tuple(ls) for n, ls in layers.items() if len(ls) > 1}


def peer_link(groups: Groups, rank: int, peer: int, device: TorchDevice) -> PeerLink:
    """The pipeline link between this rank and `peer` over the run's groups."""
    send, recv = groups.p2p[(rank, peer)], groups.p2p[(peer, rank)]
    return PeerLink(peer=peer, send_group=send, recv_group=recv, device=device,
                    host_staged=device.accelerator and send is groups.world)


__all__ = ["Built", "check_model", "tied_layers", "peer_link"]
