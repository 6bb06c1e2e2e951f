"""Data-parallel gradient sync across replicas, and the object that owns the process groups.

Every layer is held by one rank in each replica; in a hybrid plan (replicas of different
pipeline depth) different layers are held by different sets of ranks. Gradients of a layer are
summed over the ranks holding it (`SUM` all-reduce): each replica already scaled its loss by its
share of the global batch (see pipeline.StageRunner), so the sum is the global-batch gradient.

- coarse: after all backward work, one flat all-reduce per rank set.
- fine: the simulator's buckets (hetplan.planner.cost.buckets); a bucket's async all-reduce is launched from a
  `register_post_accumulate_grad_hook` as soon as its gradients are final (accumulated for every
  microbatch). Within one group, buckets launch in a fixed order (reverse layer order), as torch
  DDP does, so collectives match on every rank whatever order autograd finishes them in.

Tied weights (a parameter used by several layers, GPT-2's embedding and output head): every
stage using one holds it, and its gradient is summed over every rank holding any of those layers
(Megatron's embedding all-reduce), in a bucket of its own that is final once the earliest of
those layers' backward is done (`Tied`).

Buffers (`BufferSync`): DDP's semantics. Before each iteration's first forward, the buffers of
every layer held by several replicas are broadcast from the rank of the first replica holding it
(one flat broadcast per rank set and dtype); within a pipeline each buffer stays with its layer.

Groups whose ranks are all CUDA use NCCL; any group with a CPU rank uses gloo and the gradients
are staged through host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetplan.planner.hardware.device import TorchDevice


def layer_ranks(replica_ranges: list[list[tuple[int, int]]], replica_ranks: list[list[int]],
                num_layers: int) -> list[tuple[int, ...]]:
    """For each layer, the sorted ranks holding it (one per replica)."""
    out: list[list[int]] = [[] for _ in range(num_layers)]
    for ranges, ranks in zip(replica_ranges, replica_ranks):
        for (start, end), rank in zip(ranges, ranks):
            for layer in range(start, end):
                out[layer].append(rank)
    return [tuple(sorted(r)) for r in out]


class Groups:
    """Owns every process group of a run (no singletons): world, pipeline pairs, sync sets.

    Build it on every rank with the same arguments: `new_group` is collective and is called for
    each group in the same order everywhere.
    """

    def __init__(self, kinds: list[str], pairs: list[tuple[int, int]], sync_sets: list[tuple[int, ...]],
                 timeout=None, nccl: bool = True):
        self.kinds = kinds                                  # rank -> "cpu" / "cuda"
        # nccl=False (CPU stand-ins for GPUs, hetplan.planner.hardware.device): every group is gloo, and CUDA
        # ranks' tensors are staged through host buffers as beside a CPU rank
        self.nccl = nccl
        self.world = dist.group.WORLD                       # gloo: barriers, result gathering
        self.sync: dict[tuple[int, ...], Any] = {}
        # pipeline traffic per direction (src, dst). Two CUDA ranks get one NCCL communicator
        # per direction: NCCL serializes the p2p ops of one communicator on one stream, so a
        # pending activation send could otherwise block the gradient coming back (1F1B).
        self.p2p: dict[tuple[int, int], Any] = {}
        for a, b in sorted(set(pairs)):
            for src, dst in ((a, b), (b, a)):
                cuda = nccl and kinds[src] == kinds[dst] == "cuda"
                self.p2p[(src, dst)] = (dist.new_group([a, b], backend="nccl", timeout=timeout)
                                        if cuda else self.world)
        for ranks in sorted(set(sync_sets)):
            if len(ranks) < 2:
                continue
            if nccl and all(kinds[r] == "cuda" for r in ranks):
                self.sync[ranks] = dist.new_group(list(ranks), backend="nccl", timeout=timeout)
            elif len(ranks) == len(kinds):
                self.sync[ranks] = self.world
            else:
                self.sync[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=timeout)

    def barrier(self) -> None:
        dist.barrier(group=self.world)

    def host_staged(self, ranks) -> bool:
        """True when a group of these ranks runs on gloo but some rank's tensors are on CUDA."""
        kinds = {self.kinds[r] for r in ranks}
        return "cuda" in kinds and (kinds != {"cuda"} or not self.nccl)


@dataclass(frozen=True)
class Tied:
    """A parameter used by several layers: summed over `ranks`, every rank holding one of them."""
    param: torch.nn.Parameter | None  # None where this rank holds none of its layers
    ranks: tuple[int, ...]
    first_layer: int                  # its gradient is final after this layer's backward
    uses: int = 1                     # backward passes per microbatch accumulating into it on this
                                      # rank: its stage modules using it (interleaved: up to v)


@dataclass
class _Bucket:
    ranks: tuple[int, ...]
    params: list[torch.nn.Parameter]
    needed: int                       # accumulations until final: len(params) * microbatches
    order: int = 0                    # launch order within a group: highest first (backward order)
    seen: int = 0
    work: Any = None
    flat: torch.Tensor | None = None  # persistent flat buffer (host memory when staged)


class GradSync:
    """Sums gradients over the ranks holding each layer; `finish()` after the last backward."""

    def __init__(self, groups: Groups, rank: int, params_by_layer: dict[int, list[torch.nn.Parameter]],
                 ranks_of_layer: list[tuple[int, ...]], buckets: list[tuple[int, ...]],
                 granularity: str, microbatches: int, device: TorchDevice, tied: list[Tied] = ()):
        self.groups, self.fine, self.device = groups, granularity == "fine", device
        if not self.fine:   # coarse: one bucket per rank set, all of its layers
            by_set: dict[tuple[int, ...], list[int]] = {}
            for layer in range(len(ranks_of_layer)):
                by_set.setdefault(ranks_of_layer[layer], []).append(layer)
            buckets = [tuple(v) for _, v in sorted(by_set.items())]
        self.buckets: list[_Bucket] = []
        for layers in _split_by_ranks(buckets, ranks_of_layer):
            ranks = ranks_of_layer[layers[0]]
            if rank not in ranks or len(ranks) < 2:
                continue
            params = [p for l in layers for p in params_by_layer.get(l, []) if p.requires_grad]
            if params:
                self.buckets.append(_Bucket(ranks, params, len(params) * microbatches, max(layers)))
        for t in tied:
            if t.param is not None and rank in t.ranks and len(t.ranks) > 1 and t.param.requires_grad:
                self.buckets.append(_Bucket(t.ranks, [t.param], microbatches * t.uses, t.first_layer))
        self.buckets.sort(key=lambda b: -b.order)    # stable: the same order on every rank
        if self.fine:
            self._owner = {}
            for b in self.buckets:
                for p in b.params:
                    self._owner[p] = b
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def begin(self) -> None:
        for b in self.buckets:
            b.seen, b.work = 0, None

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        self._owner[p].seen += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, per group, every bucket whose turn has come and whose gradients are final."""
        blocked: set[tuple[int, ...]] = set()
        for b in self.buckets:
            if b.work is not None or b.ranks in blocked:
                continue
            if b.seen < b.needed:
                blocked.add(b.ranks)          # later buckets of this group wait their turn
                continue
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        """Copy the bucket's gradients into its persistent flat buffer and all-reduce it.
        The buffer is allocated once: a fresh multi-MB tensor every iteration costs page faults
        (like DDP's bucket buffers); staged through the host, it is pinned host memory filled by
        non-blocking copies, waited for before gloo reads it."""
        staged = self.groups.host_staged(b.ranks)
        if b.flat is None:
            ref, n = b.params[0], sum(p.numel() for p in b.params)
            b.flat = (self.device.host_buffer((n,), ref.dtype) if staged
                      else torch.empty(n, dtype=ref.dtype, device=ref.device))
        off = 0
        for p in b.params:
            n = p.numel()
            if p.grad is None:        # unused in this iteration: contributes zeros
                b.flat[off:off + n].zero_()
            else:
                b.flat[off:off + n].copy_(p.grad.reshape(-1), non_blocking=staged)
            off += n
        if staged:
            self.device.wait_queued()
        b.work = dist.all_reduce(b.flat, group=self.groups.sync[b.ranks], async_op=True)

    def finish(self) -> None:
        """Launch what is left (all of it for coarse), wait, and write the sums back."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            off = 0
            for p in b.params:
                n = p.numel()
                g = b.flat[off:off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.to(p.device, copy=True, non_blocking=True)
                else:
                    p.grad.copy_(g, non_blocking=True)
                off += n


class BufferSync:
    """Broadcast buffers from the first replica before each iteration (DDP's broadcast_buffers).

    `sets`: (ranks, source rank, this rank's buffers of the layers those ranks hold), in the same
    order on every rank."""

    def __init__(self, groups: Groups, sets: list[tuple[tuple[int, ...], int, list[torch.Tensor]]]):
        self.groups = groups
        self.sets = [(r, src, bufs) for r, src, bufs in sets if len(r) > 1 and bufs]

    def broadcast(self) -> None:
        for ranks, src, bufs in self.sets:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for b in bufs:
                by_dtype.setdefault(b.dtype, []).append(b)
            for dtype in sorted(by_dtype, key=str):
                self._one(ranks, src, by_dtype[dtype])

    def _one(self, ranks, src: int, bufs: list[torch.Tensor]) -> None:
        flat = torch.cat([b.detach().reshape(-1) for b in bufs])
        staged = self.groups.host_staged(ranks)
        if staged:
            flat = flat.cpu()
        dist.broadcast(flat, src=src, group=self.groups.sync[ranks])
        off = 0
        with torch.no_grad():
            for b in bufs:
                b.copy_(flat[off:off + b.numel()].view_as(b))
                off += b.numel()


def _split_by_ranks(buckets: list[tuple[int, ...]], ranks_of_layer) -> list[tuple[int, ...]]:
    """Split buckets so each holds layers of one rank set; order: last layer first."""
    out = []
    for layers in buckets:
        cur: list[int] = []
        for layer in sorted(layers, reverse=True):
            if cur and ranks_of_layer[layer] != ranks_of_layer[cur[-1]]:
                out.append(tuple(cur))
                cur = []
            cur.append(layer)
        if cur:
            out.append(tuple(cur))
    return sorted(out, key=lambda ls: -max(ls))
