"""The model side: a workload's operator graph, grouped into layers.

Types only in this file's head; capture lives below. A `ModelGraph` is captured at one batch
size (`batch`); every activation-like quantity (FLOPs, activation/saved bytes, bytes moved)
scales linearly with the batch, parameter quantities do not. Use `Layer.scaled(b / graph.batch)`
or `ModelGraph.cut_bytes_at(i, b)` to get figures at another (micro)batch size.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx


@dataclass(frozen=True)
class Layer:
    index: int                 # 0..L-1 in execution order
    name: str                  # module path of the group, e.g. "blocks.3", "fc1"
    fwd_flops: float           # forward FLOPs at the graph batch (multiply-add = 2)
    bwd_flops: float           # backward FLOPs at the graph batch
    param_bytes: int           # bytes of parameters owned by the layer
    activation_bytes: int      # bytes of this layer's outputs (all ops), at the graph batch
    saved_bytes: int           # bytes saved for backward by this layer's ops, at the graph batch
    fwd_bytes_moved: float     # activation bytes read + written by forward ops (parameters excluded)
    bwd_bytes_moved: float     # same for backward
    n_ops: int                 # forward operator count
    bwd_n_ops: int             # backward operator count
    param_names: tuple[str, ...] = ()   # fully qualified parameter names owned by the layer
    signature: str = ""        # stable key of the layer's ops and shapes (cost cache key)
    cast_param_bytes: int = 0  # autocast's low-precision copies of parameters, per forward
                               # (held for backward; parameter-like: do not scale with batch)

    def scaled(self, ratio: float) -> "Layer":
        """The same layer at batch * ratio: activation-like fields scale, parameters do not."""
        return replace(self, fwd_flops=self.fwd_flops * ratio, bwd_flops=self.bwd_flops * ratio,
                       activation_bytes=int(self.activation_bytes * ratio),
                       saved_bytes=int(self.saved_bytes * ratio),
                       fwd_bytes_moved=self.fwd_bytes_moved * ratio,
                       bwd_bytes_moved=self.bwd_bytes_moved * ratio)


@dataclass(frozen=True)
class ModelGraph:
    layers: tuple[Layer, ...]
    batch: int                             # the batch size the graph was captured at
    cut_bytes: tuple[int, ...]             # len L+1: bytes crossing the cut before layer i at the
                                           # graph batch (cut_bytes[0]: inputs; [L]: outputs); counts
                                           # every live value, so skip connections are included
    ops: nx.DiGraph = field(default_factory=nx.DiGraph, compare=False, repr=False)
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # capture method, warnings
    precision: str = "fp32"                # what the capture ran in (planner.workload.precision): bytes
                                           # are of the dtypes autocast gives

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cut_bytes_at(self, i: int, batch: float) -> float:
        return self.cut_bytes[i] * batch / self.batch

    @property
    def param_bytes(self) -> int:
        return sum(l.param_bytes for l in self.layers)


# --- capture ---------------------------------------------------------------------------------
# How: the model is exported to a flat ATen graph and cut into one stage per layer
# (planner.workload.partition, the same grouping `build_stages` uses). Each stage runs forward and then
# backward on its own, its inputs detached leaves that require grad (except the model inputs),
# so every layer's backward FLOPs are its own: a layer pays for its input gradient unless it is
# the first. A dispatch mode sees every ATen call: forward calls are charged to the graph node
# being interpreted, backward calls to the node whose autograd function is running.
# Not modelled: parameters are left out of bytes moved (weights are read from fast memory in
# the roofline), so bytes moved scale with the batch; the optimizer step is not part of a layer.
# Precision: the forward runs under planner.workload.precision.autocast (backward outside it, as in
# training), so a bf16 graph's activation, saved and cut bytes are of the dtypes autocast really
# gives. autocast's bf16 copies of parameters are parameter-like (they do not scale with the
# batch): they are left out of saved bytes and bytes moved and counted in Layer.cast_param_bytes.

_PRINTED_WARNINGS: set[str] = set()


def capture_graph(workload, batch: int, precision: str = "fp32") -> ModelGraph:
    """Capture `workload.model` at `batch` samples (inputs from `make_batch(batch, 0)`), its
    forward run in `precision` (planner.workload.precision.autocast on the CPU).

    The model's state is left as it was: RNG, buffers (BatchNorm statistics) and gradients are
    restored after the measuring run.
    """
    from planner.files.io import InputError
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputError(f"--batch: expected a positive integer, got {batch!r}")
    import torch

    from planner.workload import partition
    from planner.workload.capture import Recorder, preserved
    from planner.workload.precision import autocast

    model = workload.model
    tr, stages = partition.traced_stages(workload, None, batch)
    inputs = partition.example_inputs(workload, batch)
    rec = Recorder(list(model.parameters()), forward_context=lambda: autocast("cpu", precision))
    with preserved(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cut_bytes = [rec.bytes_of(inputs)]
        h = inputs
        for k, stage in enumerate(stages):
            h = rec.run_stage(stage, h, first=(k == 0))
            cut_bytes.append(rec.bytes_of(h))
    layers = _layers(tr, stages, rec)
    g = _op_graph(tr, rec)
    warnings = sorted(rec.warnings)
    for w in warnings:
        if w not in _PRINTED_WARNINGS:
            _PRINTED_WARNINGS.add(w)
            print(f"hetplan: warning: {w}", file=sys.stderr)
    info = {"method": tr.method, "dynamic_batch": tr.dynamic_batch, "warnings": warnings,
            "unattributed_bwd_flops": rec.unattributed_bwd_flops}
    return ModelGraph(layers=tuple(layers), batch=batch, cut_bytes=tuple(cut_bytes), ops=g, info=info,
                      precision=precision)


def _layers(tr, stages, rec) -> list[Layer]:
    out, owned = [], set()
    for k, stage in enumerate(stages):
        names = [n for n in tr.compute_nodes() if tr.layer_of[n] == k]
        params = [(nm, p) for nm, p in stage.named_parameters() if id(p) not in owned]
        owned.update(id(p) for _, p in params)

        def tot(field: str, nodes=names) -> float:
            return sum(rec.ops[n.name][field] for n in nodes if n.name in rec.ops)

        out.append(Layer(
            index=k, name=tr.names[k],
            fwd_flops=tot("fwd_flops"), bwd_flops=tot("bwd_flops") + rec.stage_extra[k]["bwd_flops"],
            param_bytes=sum(p.numel() * p.element_size() for _, p in params),
            activation_bytes=int(tot("output_bytes")), saved_bytes=int(tot("saved_bytes")),
            fwd_bytes_moved=tot("fwd_bytes_moved"),
            bwd_bytes_moved=tot("bwd_bytes_moved") + rec.stage_extra[k]["bwd_bytes_moved"],
            n_ops=int(tot("fwd_n_ops")), bwd_n_ops=int(tot("bwd_n_ops") + rec.stage_extra[k]["bwd_n_ops"]),
            param_names=tuple(nm for nm, _ in params),
            signature=_signature(names, rec), cast_param_bytes=int(tot("cast_param_bytes"))))
    return out


def _signature(nodes, rec) -> str:
    """sha1 of the layer's (target, output shapes, dtypes) in order: equal layers share costs."""
    h = hashlib.sha1()
    for n in nodes:
        h.update(f"{n.target}|{rec.ops.get(n.name, {}).get('shapes')}\n".encode())
    return h.hexdigest()[:16]


def _op_graph(tr, rec) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in tr.gm.graph.nodes:
        if n.op == "placeholder":
            g.add_node(n.name, kind="input", target="input", layer=-1,
                       shapes=rec.ops.get(n.name, {}).get("shapes", ()))
    for n in tr.compute_nodes():
        g.add_node(n.name, kind="op", target=str(n.target), layer=tr.layer_of[n],
                   **rec.ops.get(n.name, rec.empty()))
        for a in n.all_input_nodes:
            if a.name in g:
                g.add_edge(a.name, n.name)
    return g
