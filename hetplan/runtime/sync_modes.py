"""The asynchronous sync modes (plan field sync.mode): replicas step on their own gradients; local
SGD and EASGD exchange parameters every `sync.period` iterations, Hogwild's replicas update one
copy of the parameters in shared memory, a parameter server steps on each worker's gradients.

- local-sgd: the parameters become their average weighted by batch fraction,
  x <- sum_r f_r x_r (one SUM all-reduce of f_r x_r). With period 1 and plain SGD this is
  synchronous data parallel exactly: sum_r f_r (x - lr g_r) = x - lr sum_r f_r g_r.
- easgd (Zhang, Choromanska, LeCun 2015, synchronous form): every worker keeps the center
  variable c (the initial parameters at first); at an exchange d_r = alpha (x_r - c),
  x_r <- x_r - d_r and c <- c + sum_r d_r (one SUM all-reduce of d_r). With alpha 0 the
  workers never move towards each other: each trains on its own slice alone.

- hogwild (Recht et al. 2011): the CPU workers of one host map the same file of parameters
  (`share_parameters`); each steps into it without locks, so each sees the others' updates.
- parameter-server (asynchronous, as in DistBelief's Downpour SGD): after its backward a worker
  sends its gradients to the server and waits for the parameters back (`ServerClient`); the
  server (`ParameterServer`) takes the workers' gradients in arrival order and steps on each.

Each replica's loss is its own mean (hetplan.runtime.stage scales by 1/microbatches, not by the batch
fraction), its optimizer state stays its own, and buffers are not broadcast. The exchange runs
over the world group (gloo), through host memory for accelerator parameters.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from hetplan.planner.files.plan import Sync


class NoGradSync:
    """No gradient exchange: a replica steps on its own gradients."""

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors) -> None:
    i = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[i:i + n].view_as(t))
            i += n


class ParameterExchange:
    """Every `sync.period` optimizer steps, the mode's parameter exchange among the replicas."""

    def __init__(self, sync: Sync, params: list[torch.nn.Parameter], fraction: float, group, world: int):
        self.sync, self.params, self.fraction = sync, params, fraction
        self.group, self.world = group, world
        self.steps = 0
        self.center = _flat(params) if sync.mode == "easgd" else None

    def after_step(self) -> None:
        self.steps += 1
        if self.world < 2 or self.steps % self.sync.period:
            return
        x = _flat(self.params)
        if self.center is None:                     # local SGD: the weighted average
            x.mul_(self.fraction)
            dist.all_reduce(x, group=self.group)
            _unflatten_into(x, self.params)
            return
        d = (x - self.center).mul_(self.sync.alpha)  # EASGD: the elastic differences
        _unflatten_into(x - d, self.params)
        dist.all_reduce(d, group=self.group)
        self.center.add_(d)


def share_parameters(params: list[torch.nn.Parameter], path: str, create: bool) -> None:
    """Back `params` by one float32 file mapped shared (tmpfs where there is one): the process
    that `create`s it writes its values there first; every process that maps the same file sees
    every other's writes."""
    numel = sum(p.numel() for p in params)
    flat = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    i = 0
    for p in params:
        n = p.numel()
        view = flat[i:i + n].view_as(p)
        if create:
            view.copy_(p.detach())
        p.data = view
        i += n


def hogwild_parameters(params: list[torch.nn.Parameter], rank: int, group) -> None:
    """Every rank's `params` share one mapping, made by rank 0 and unlinked once all hold it."""
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("hogwild shares float32 parameters only")
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = [tempfile.mktemp(prefix="hetplan-hogwild-", dir=where) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0, group=group)
    if rank == 0:
        share_parameters(params, path[0], create=True)
    dist.barrier(group=group)
    if rank != 0:
        share_parameters(params, path[0], create=False)
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path[0])          # the mappings stay; no file outlives the run



class ServerClient:
    """A worker's side of the parameter server, in place of the gradient sync: its gradients
    to the server, the server's parameters back."""

    def __init__(self, params: list[torch.nn.Parameter], server: int, group):
        self.params, self.server, self.group = params, server, group

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        dist.send(_flat(grads), self.server, group=self.group)
        back = torch.empty(sum(p.numel() for p in self.params))
        dist.recv(back, self.server, group=self.group)
        _unflatten_into(back, self.params)


class ServerStepped:
    """A worker's optimizer under a parameter server: the server steps, the worker only clears
    its gradients."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        pass

    def state_bytes(self) -> int:
        return 0


class ParameterServer:
    """The server's side: `serve(n)` takes n gradient messages from any worker, in arrival order,
    steps on each with `optimizer` (hetplan.runtime.optim.StageOptimizer over `params`) and sends the
    parameters back to its sender."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer, group, busy):
        self.params, self.optimizer, self.group, self.busy = params, optimizer, group, busy
        self.buffer = torch.empty(sum(p.numel() for p in params))

    def serve(self, n: int) -> None:
        for _ in range(n):
            with self.busy("receive gradients", "transfer", busy=False):
                src = dist.recv(self.buffer, group=self.group)
            with self.busy("optimizer", "optimizer"):
                for p in self.params:
                    p.grad = torch.empty_like(p)
                _unflatten_into(self.buffer, [p.grad for p in self.params])
                self.optimizer.step()
            dist.send(_flat(self.params), src, group=self.group)
