"""Gradient buckets: which layers' gradients are all-reduced together, among which devices.

The simulator and the runtime both call `grad_buckets`, so the buckets that are predicted are
the buckets that are run (hetplan.runtime.sync.GradSync; plain data parallel runs torch DDP with these
buckets as its per-bucket caps, hetplan.runtime.ddp). Formation follows torch DDP (`bucket_cap_mb`):

* Walk the layers in reverse order (the order their gradients become final in backward).
* A layer's *group* is the tuple of devices holding it, one per replica (replica order). Data
  parallel replicas may cut the model differently, so the group can change at any layer.
* Consecutive layers of the same group go into the same bucket until adding the next layer
  would make the bucket exceed `plan.sync.bucket_bytes`; then a new bucket starts. A layer
  larger than the cap is a bucket on its own. A change of group always starts a new bucket.
* Layers without parameters have no gradient and belong to no bucket.

* A tied parameter (hetplan.planner.workload.graph.TiedParam) is not in its layer's bucket: it is
  exchanged on its own among every device holding one of the layers using it (`tied_buckets`).

A single-replica plan still has buckets (groups of one device); they need no exchange.
Coarse sync merges the buckets of each device set into one (`coarse_buckets`).
"""
from __future__ import annotations

from dataclasses import dataclass

from hetplan.planner.workload.graph import ModelGraph
from hetplan.planner.files.plan import Plan


@dataclass(frozen=True)
class Bucket:
    layers: tuple[int, ...]    # layer indices in the order they are added (descending)
    devices: tuple[str, ...]   # one per replica: the device holding these layers there
    bytes: int                 # gradient bytes = parameter bytes of the layers


def layer_groups(plan: Plan, num_layers: int) -> list[tuple[str, ...]]:
    """For each layer, the devices holding it, one per replica (a replica's stages cover the
    layers once each)."""
    rows = []
    for rep in plan.replicas:
        row = [""] * num_layers
        for st in rep.stages:
            row[st.start:st.end] = [st.device] * (st.end - st.start)
        rows.append(row)
    return list(zip(*rows)) if rows else [() for _ in range(num_layers)]


def grad_buckets(plan: Plan, graph: ModelGraph) -> list[Bucket]:
    """DDP-style buckets in the order they become ready (see the module docstring)."""
    cap = plan.sync.bucket_bytes
    groups = layer_groups(plan, graph.num_layers)
    out: list[Bucket] = []
    cur_layers: list[int] = []
    cur_group: tuple[str, ...] | None = None
    cur_bytes = 0
    for i, n in reversed(list(enumerate(exchanged_bytes(graph)))):
        if n <= 0:
            continue
        if cur_layers and (groups[i] != cur_group or cur_bytes + n > cap):
            out.append(Bucket(tuple(cur_layers), cur_group, cur_bytes))
            cur_layers, cur_bytes = [], 0
        cur_layers.append(i)
        cur_group = groups[i]
        cur_bytes += n
    if cur_layers:
        out.append(Bucket(tuple(cur_layers), cur_group, cur_bytes))
    return out


def exchanged_bytes(graph: ModelGraph) -> tuple[int, ...]:
    """Each layer's ModelGraph.exchanged_param_bytes, kept on the (frozen) graph."""
    out = graph.__dict__.get("_exchanged_bytes")
    if out is None:
        out = tuple(graph.exchanged_param_bytes(i) for i in range(graph.num_layers))
        object.__setattr__(graph, "_exchanged_bytes", out)   # a cache, not a field
    return out


def tied_buckets(plan: Plan, graph: ModelGraph) -> list[Bucket]:
    """One bucket per tied parameter held by more than one device: its gradient is summed over
    every device holding a layer that uses it (Megatron's embedding all-reduce)."""
    groups = layer_groups(plan, graph.num_layers)
    out = []
    for t in graph.tied:
        devices = tuple(dict.fromkeys(d for l in t.layers for d in groups[l]))
        if len(devices) > 1:
            out.append(Bucket(t.layers, devices, t.bytes))
    return out


def coarse_buckets(buckets: list[Bucket]) -> list[Bucket]:
    """Coarse sync exchanges each set of devices' gradients in one flat all-reduce, whatever
    the bucket cap (as hetplan/runtime/sync.py does): buckets merged per device set, in first-ready order."""
    merged: dict[tuple[str, ...], list[Bucket]] = {}
    for b in buckets:
        merged.setdefault(tuple(sorted(b.devices)), []).append(b)
    return [Bucket(tuple(l for b in bs for l in b.layers), bs[0].devices, sum(b.bytes for b in bs))
            for bs in merged.values()]


def exchanged_buckets(plan: Plan, graph: ModelGraph) -> tuple[list[Bucket], list[Bucket]]:
    """(buckets, tied) that a synchronous plan all-reduces: the gradient buckets held by more
    than one device and, under fine sync, the tied parameters' apart (exchanged after their
    devices' last backward); under coarse sync both merged per device set, tied empty. Other
    sync modes exchange no gradient: ([], [])."""
    if plan.sync.mode != "sync":
        return [], []
    # a bucket's devices are one per replica: one replica shares none
    shared = [b for b in grad_buckets(plan, graph) if len(b.devices) > 1] if len(plan.replicas) > 1 else []
    tied = tied_buckets(plan, graph)
    if plan.sync.granularity != "fine":
        return coarse_buckets(shared + tied), []
    return shared, tied


def buffer_broadcasts(plan: Plan, graph: ModelGraph) -> list[Bucket]:
    """The buffers (BatchNorm statistics, rotary tables) a synchronous plan broadcasts from its
    first replica before each iteration, as hetplan.runtime.sync.BufferSync does (DDP's
    broadcast_buffers): one broadcast per set of devices holding a layer with buffers, more than
    one device, and per dtype, in that order; `layers` holds the set's layers with buffers."""
    if plan.sync.mode != "sync" or not any(l.buffer_bytes for l in graph.layers):
        return []
    groups = layer_groups(plan, graph.num_layers)
    sets: dict[tuple[str, ...], tuple[list[int], dict[str, int]]] = {}
    for layer in graph.layers:
        devices = tuple(sorted(set(groups[layer.index])))
        if len(devices) > 1 and layer.buffer_bytes:
            layers, by_dtype = sets.setdefault(devices, ([], {}))
            layers.append(layer.index)
            for dtype, n in layer.buffer_bytes:
                by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return [Bucket(tuple(layers), devices, n) for devices, (layers, by_dtype) in sorted(sets.items())
            for _, n in sorted(by_dtype.items())]


__all__ = ["Bucket", "buffer_broadcasts", "coarse_buckets", "exchanged_buckets", "grad_buckets",
           "layer_groups", "tied_buckets"]
