"""The model side: a workload's operator graph, grouped into layers (types only; the capture
that fills them is hetplan.planner.workload.capture). A `ModelGraph` is captured at one batch
size (`batch`); every activation-like quantity (FLOPs, activation/saved bytes, bytes moved)
scales linearly with the batch, parameter quantities do not. Use `Layer.scaled(b / graph.batch)`
or `ModelGraph.cut_bytes_at(i, b)` to get figures at another (micro)batch size.
"""
from __future__ import annotations

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
    buffer_bytes: tuple[tuple[str, int], ...] = ()   # (dtype, bytes) of the model's buffers this
                               # layer is the first to use (BatchNorm statistics, rotary tables)
    saved_from: tuple[tuple[int, int], ...] = ()   # (layer, bytes): values this layer saves for
                               # backward that an earlier layer saved before it (one tensor, in
                               # saved_bytes there); a stage starting after that layer holds them too

    def scaled(self, ratio: float) -> "Layer":
        """The same layer at batch * ratio: activation-like fields scale, parameters do not."""
        return replace(self, fwd_flops=self.fwd_flops * ratio, bwd_flops=self.bwd_flops * ratio,
                       activation_bytes=int(self.activation_bytes * ratio),
                       saved_bytes=int(self.saved_bytes * ratio),
                       saved_from=tuple((j, int(b * ratio)) for j, b in self.saved_from),
                       fwd_bytes_moved=self.fwd_bytes_moved * ratio,
                       bwd_bytes_moved=self.bwd_bytes_moved * ratio)


@dataclass(frozen=True)
class TiedParam:
    """A parameter used by several layers (tied weights, e.g. GPT-2's embedding and output head).
    Its bytes count in the first layer's param_bytes; every other stage using it holds a copy,
    and the copies' gradients are summed each iteration (hetplan.planner.cost.buckets.tied_buckets)."""
    name: str
    bytes: int
    layers: tuple[int, ...]    # the layers using it, ascending


@dataclass(frozen=True)
class SplitPair:
    """A linear pair a tensor-split stage divides between its devices
    (hetplan.planner.workload.tensor_split): the column linear with the elementwise ops after it in layer
    `col_layer`, the row linear in `row_layer`; FLOPs and bytes at the graph batch."""
    col_layer: int
    row_layer: int
    col_fwd_flops: float       # the column linear and the ops between
    col_bwd_flops: float
    row_fwd_flops: float
    row_bwd_flops: float
    param_bytes: int           # split between the devices: both weights and the column bias
                               # (the row bias stays whole on the stage's first device)
    out_bytes: int             # the row linear's output: summed over the devices in forward
    in_grad_bytes: int         # the column linear's input gradient, summed in backward (0: none)
    col_weight: str            # the linears' weight names: a candidate's identity
    row_weight: str            # (hetplan.planner.workload.tensor_split.greedy)


@dataclass(frozen=True)
class ModelGraph:
    layers: tuple[Layer, ...]
    batch: int                             # the batch size the graph was captured at
    cut_bytes: tuple[int, ...]             # len L+1: bytes crossing the cut before layer i at the
                                           # graph batch (cut_bytes[0]: inputs; [L]: outputs); counts
                                           # every live value, so skip connections are included
    ops: nx.DiGraph = field(default_factory=nx.DiGraph, compare=False, repr=False)
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # capture method, warnings
    precision: str = "fp32"                # what the capture ran in (hetplan.planner.workload.precision): bytes
                                           # are of the dtypes autocast gives
    tied: tuple[TiedParam, ...] = ()       # parameters used by several layers
    pairs: tuple[SplitPair, ...] = ()      # candidate linear pairs of the whole model, in
                                           # execution order (split_pairs picks a stage's)
    cut_tensors: tuple[int, ...] = ()      # len L+1 (or empty: one each): tensors crossing the
                                           # cut before layer i (the runtime sends each on its own)
    cut_grad_tensors: tuple[int, ...] = () # those of them that carry a gradient back

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cut_bytes_at(self, i: int, batch: float) -> float:
        return self.cut_bytes[i] * batch / self.batch

    def message_tensors(self, i: int, back: bool = False) -> int:
        """Tensors in the message across the cut before layer i: the activations going ahead,
        or (`back`) the gradients of those that carry one. A graph without counts: one."""
        counts = self.cut_grad_tensors if back else self.cut_tensors
        return counts[i] if counts else 1

    @property
    def param_bytes(self) -> int:
        return sum(l.param_bytes for l in self.layers)

    def _sums(self, start: int, end: int) -> tuple[int, int, int, int]:
        """(stage_param_bytes, saved bytes, autocast's weight copies, parameter tensors) of layers [start, end):
        integers, kept per range (the simulator asks for the same stages plan after plan)."""
        memo = self.__dict__.get("_range_sums")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_range_sums", memo)   # a cache, not a field
        out = memo.get((start, end))
        if out is None:
            layers = self.layers[start:end]
            copies = sum(t.bytes for t in self.tied
                         if not start <= t.layers[0] < end and any(start <= l < end for l in t.layers))
            out = memo[(start, end)] = (sum(l.param_bytes for l in layers) + copies,
                                        sum(l.saved_bytes for l in layers)
                                        + sum(b for l in layers for j, b in l.saved_from if j < start),
                                        sum(l.cast_param_bytes for l in layers),
                                        sum(len(l.param_names) for l in layers))
        return out

    def stage_param_bytes(self, start: int, end: int) -> int:
        """Parameter bytes a stage of layers [start, end) holds: its layers' own, plus a copy of
        each tied parameter that one of them uses but whose first layer is elsewhere."""
        return self._sums(start, end)[0]

    def stage_param_tensors(self, start: int, end: int) -> int:
        """Parameter tensors of layers [start, end) (their `param_names`)."""
        return self._sums(start, end)[3]

    def device_param_bytes(self, ranges) -> int:
        """Parameter bytes a device holding the stages `ranges` ([(start, end), ...]; several
        under interleaved 1F1B) holds: their layers' own, plus one copy of each tied parameter
        one of them uses whose first layer none of them holds. One range: stage_param_bytes."""
        def held(l: int) -> bool:
            return any(a <= l < b for a, b in ranges)
        copies = sum(t.bytes for t in self.tied if not held(t.layers[0]) and any(map(held, t.layers)))
        return sum(l.param_bytes for a, b in ranges for l in self.layers[a:b]) + copies

    def saved_bytes_at(self, start: int, end: int, batch: float) -> float:
        """Bytes layers [start, end) save for backward at a microbatch of `batch` samples:
        saved_bytes scaled to it, plus autocast's weight copies (not scaled)."""
        _, saved, cast, _ = self._sums(start, end)
        return saved * batch / self.batch + cast

    def exchanged_param_bytes(self, i: int) -> int:
        """Layer i's parameter bytes exchanged in its gradient bucket: tied ones are exchanged
        on their own (hetplan.planner.cost.buckets.tied_buckets)."""
        return self.layers[i].param_bytes - sum(t.bytes for t in self.tied if t.layers[0] == i)

    def split_pairs(self, start: int, end: int) -> tuple[SplitPair, ...]:
        """The pairs a tensor-split stage of layers [start, end) divides: the candidates with
        both linears inside, taken greedily as the runtime takes them from the stage's graph."""
        from hetplan.planner.workload.tensor_split import greedy
        return tuple(greedy([p for p in self.pairs if start <= p.col_layer and p.row_layer < end]))

    def split_flops(self, i: int, start: int, end: int) -> tuple[float, float]:
        """(forward, backward) FLOPs of layer i, at the graph batch, that a tensor-split stage
        of layers [start, end) divides between its devices."""
        f = b = 0.0
        for p in self.split_pairs(start, end):
            if p.col_layer == i:
                f, b = f + p.col_fwd_flops, b + p.col_bwd_flops
            if p.row_layer == i:
                f, b = f + p.row_fwd_flops, b + p.row_bwd_flops
        return f, b
