"""The cost model: how long a layer, a transfer, an all-reduce and an optimizer step take.

Pure functions carry the formulas (each docstring states its formula); `CostModel` wraps
them in precomputed tables so the simulator's hot path is a dictionary lookup and a
subtraction of prefix sums. `RooflineCost` is the contract's what-if model; the measured
model (`hetplan.planner.cost.timing.MeasuredCost`) replaces the per-layer times by timings taken on
this machine and keeps everything else.

Calibration (hetplan.planner.hardware.calibration): when the topology carries a `calibration` object (written by
`hetplan profile`), the optimizer step and the all-reduce of CPU groups use the figures fitted on
this machine, and the measured model slows CPU compute by the measured contention factor when
several CPU workers of a host compute at once. Without one (what-if files) every figure is the
contract's formula.

Precision: a cost model prices the precision its graph was captured in (`graph.precision`):
the roofline divides FLOPs by `Device.matmul_flops_per_s_at(precision)` and the bytes are those
of the capture's dtypes; the measured model times the layers in that precision. A search over
several precisions holds one graph and cost model per precision (hetplan.planner.search.mcmc).

Not modelled: kernel fusion across layers, cache effects between consecutive layers, overlap
of compute and communication on the same device (a transfer does not slow the compute queue).
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable

from hetplan.planner.hardware.calibration import topology_calibration
from hetplan.planner.workload.graph import Layer, ModelGraph
from hetplan.planner.hardware.topology import Device, Topology, parse_device_name

# Bytes touched per parameter byte by one optimizer step (memory-bound, foreach-style kernels):
# SGD (no momentum): read param, read grad, write param = 3.
# Adam: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq = 7.
OPTIMIZER_BYTES_PER_PARAM_BYTE = {"sgd": 3.0, "adam": 7.0}
# Optimizer state held per parameter byte: Adam's two moments; plain SGD holds none.
OPTIMIZER_STATE_PER_PARAM_BYTE = {"sgd": 0.0, "adam": 2.0}


def roofline_s(flops: float, bytes_moved: float, n_ops: int, device: Device,
               precision: str = "fp32") -> float:
    """max(flops / matmul_flops_per_s_at(precision), bytes_moved / memory_bytes_per_s)
    + n_ops * op_overhead_s."""
    return (max(flops / device.matmul_flops_per_s_at(precision), bytes_moved / device.memory_bytes_per_s)
            + n_ops * device.op_overhead_s)


def layer_fwd_s(layer: Layer, device: Device, precision: str = "fp32") -> float:
    """Forward time of `layer` (already scaled to the microbatch) on a what-if device.

    roofline_s(fwd_flops, fwd_bytes_moved + param_bytes, n_ops): the activations the ops read
    and write plus one read of the parameters."""
    return roofline_s(layer.fwd_flops, layer.fwd_bytes_moved + layer.param_bytes, layer.n_ops, device,
                      precision)


def layer_bwd_s(layer: Layer, device: Device, precision: str = "fp32") -> float:
    """Backward time of `layer` (scaled to the microbatch) on a what-if device.

    roofline_s(bwd_flops, bwd_bytes_moved + 2 * param_bytes, bwd_n_ops): activation traffic
    plus reading the parameters and writing (accumulating) their gradients."""
    return roofline_s(layer.bwd_flops, layer.bwd_bytes_moved + 2 * layer.param_bytes,
                      layer.bwd_n_ops, device, precision)


def weight_grad_share(layer: Layer, tied: bool = False) -> float:
    """The share of a layer's backward that computes its weights' gradients (a zero-bubble
    schedule's W pass; the rest is its I pass, the gradient of its input), by FLOPs: a matmul's
    input gradient dX = dY W^T and weight gradient dW = X^T dY cost the same 2*b*i*o FLOPs, so a
    layer holding weights (its own, or a tied weight: `tied`) splits 1/2 : 1/2, a layer without
    any 0 : 1. Used where the passes are not measured (the roofline, a what-if device; the
    measured model times them: CostModel.split_times). Not modelled here: a layer's
    parameterless ops (attention's score matmuls, activations) count on both sides, and the
    split's own overhead (graph walk, one autograd call per pass and weight group)."""
    return 0.5 if layer.param_bytes > 0 or tied else 0.0


def optimizer_s(param_bytes: float, optimizer: str, device: Device) -> float:
    """One optimizer step over `param_bytes` of parameters, memory-bound:
    OPTIMIZER_BYTES_PER_PARAM_BYTE[optimizer] * param_bytes / memory_bytes_per_s
    (SGD 3x, Adam 7x; per-tensor launch overhead not modelled)."""
    return OPTIMIZER_BYTES_PER_PARAM_BYTE[optimizer] * param_bytes / device.memory_bytes_per_s


def tensor_part_s(layer_s: float, flops: float, split_flops: float, share: float) -> float:
    """One device's time for a layer of a tensor-split stage: layer_s * (1 - phi + share * phi),
    phi = split_flops / flops: the split linear pairs take their share of the layer's FLOPs in
    its time, the device computes `share` of them, the rest of the layer runs whole."""
    phi = split_flops / flops if flops > 0 else 0.0
    return layer_s * (1.0 - phi + share * phi)


def host_cpu(topology: Topology, device: str) -> str:
    """The CPU that runs `device`'s optimizer under placement "cpu" (ZeRO-Offload) or its host
    part under "split" (CoTrain): a CPU
    device on the same node, preferring one with a direct link, then the lowest name.
    A CPU device is its own host. Raises ValueError when the node has no CPU device."""
    node, kind, _ = parse_device_name(device)
    if kind == "cpu":
        return device
    cpus = [d.name for d in topology.devices if d.kind == "cpu" and d.node == node]
    if not cpus:
        raise ValueError(f"optimizer placement 'cpu' or 'split' needs a CPU device on the node of {device}")
    linked = {l.a if l.b == device else l.b for l in topology.links if device in (l.a, l.b)}
    return min(cpus, key=lambda c: (c not in linked, c))


def split_host_count(sizes: list[int], cpu_fraction: float) -> int:
    """How many of a stage's parameter tensors (`sizes` in bytes, in parameter order) the host
    CPU updates under placement "split": the last k, k the smallest count whose bytes reach
    cpu_fraction of the total, less one when that brings the bytes nearer the target (whole
    tensors; the simulator prices exactly cpu_fraction of the bytes)."""
    target, acc = cpu_fraction * sum(sizes), 0
    for k, n in enumerate(reversed(sizes), 1):
        if acc + n >= target:
            return k if acc + n - target <= target - acc else k - 1
        acc += n
    return len(sizes)


class CostModel:
    """Precomputed layer costs for one graph on one topology, in the graph's precision.

    Subclasses provide `layer_times(device, batch) -> (fwd_s list, bwd_s list)` per layer at a
    microbatch of `batch` samples; this class caches prefix sums so that the time of any layer
    range is `prefix[end] - prefix[start]`.
    """

    def __init__(self, graph: ModelGraph, topology: Topology):
        self.graph, self.topology = graph, topology
        self.precision = graph.precision
        self.calibration = topology_calibration(topology)
        self._prefix: dict[tuple[str, float], tuple[list[float], list[float]]] = {}
        self._layer: dict[tuple[str, float], tuple[list[float], list[float]]] = {}
        self._opt: dict[tuple[str, str, float], float] = {}
        self._device_opt_fit: dict[tuple[str, str], object] = {}
        # a split backward's (I pass, W pass) prefix sums (bwd_input_s, bwd_weight_s)
        self._split: dict[tuple[str, float], tuple[list[float], list[float]]] = {}
        self._twins: dict[tuple, Any] = {}     # (table, _twin, batch) -> a table devices share (_shared)
        self._records: dict[str, str] = {}     # RooflineCost._twin
        tied = {l for t in graph.tied for l in t.layers}
        self._wshare = [weight_grad_share(l, l.index in tied) for l in graph.layers]
        self._scale: dict[str, float] = {}     # drawn: each device's layer times multiplied by
        self._collective = 1.0                 # drawn: calibrated all-reduces multiplied by

    def drawn(self, topology: Topology, compute: dict[str, float], collective: float = 1.0) -> "CostModel":
        """A copy pricing on `topology` with each device's layer times (forward, backward, a split
        backward's passes) multiplied by compute[device] (1 where absent) and the calibrated
        all-reduces by `collective`: one draw of the measured inputs (hetplan.planner.sim.interval)."""
        out = copy.copy(self)
        out.topology, out._scale, out._collective = topology, dict(compute), collective
        out._prefix, out._layer, out._opt, out._device_opt_fit = {}, {}, {}, {}
        out._split, out._twins, out._records = {}, {}, {}
        return out

    def layer_times(self, device: Device, batch: float) -> tuple[list[float], list[float]]:
        raise NotImplementedError

    def backward_call_s(self, device: Device, batch: float) -> float:
        """The own cost of one backward call that each layer's time in `layer_times` includes
        (layers timed one at a time) where a stage's backward pays one for all its layers; 0
        where layer times are of the model's chained step or formulas."""
        return 0.0

    def split_times(self, device: Device, batch: float) -> tuple[list[float], list[float]] | None:
        """Per-layer (I pass, W pass) seconds of a split backward where measured, else None:
        weight_grad_share of the fused backward prices them (`_split_tables`)."""
        return None

    def prepare(self, devices, split: bool = False) -> None:
        """Measure now whatever pricing `devices` will need, with `split` the split backward's
        passes too (formulas need nothing)."""

    def fit_report(self, device: str) -> dict | None:
        """How a measured cost curve fits its measurements (formulas: None)."""
        return None

    def _tables(self, device: str, batch: float):
        """(forward prefix sums, prefix sums of the backward less each layer's own backward
        calls (`backward_call_s`: one per layer with a backward, a second for the last layer's
        loss), prefix counts of the layers with a backward, one call's seconds)."""
        key = (device, batch)
        if key not in self._prefix:
            self._layer[key], self._prefix[key] = self._shared("layers", device, batch, self._make_tables)
        return self._prefix[key]

    def _make_tables(self, device: str, batch: float) -> tuple[tuple[list[float], list[float]], tuple]:
        dev = self.topology.device(device)
        fwd, bwd = self.layer_times(dev, batch)
        call = self.backward_call_s(dev, batch)
        k = self._scale.get(device, 1.0)
        if k != 1.0:
            fwd, bwd, call = [f * k for f in fwd], [b * k for b in bwd], call * k
        pf, pb, pn = [0.0], [0.0], [0]
        for i, (f, b) in enumerate(zip(fwd, bwd)):
            calls = (b > 0) + (b > 0 and i == len(bwd) - 1)
            pf.append(pf[-1] + f)
            pb.append(pb[-1] + b - calls * call)
            pn.append(pn[-1] + (b > 0))
        return (list(fwd), list(bwd)), (pf, pb, pn, call)

    def _shared(self, table: str, device: str, batch: float, make: Callable[[str, float], Any]) -> Any:
        """make(device, batch), kept per (table, `_twin`, batch) where devices share tables."""
        twin = self._twin(device)
        if twin is None:
            return make(device, batch)
        key = (table, twin, self._scale.get(device, 1.0), batch)
        out = self._twins.get(key)
        if out is None:
            out = self._twins[key] = make(device, batch)
        return out

    def _twin(self, device: str):
        """What the layer tables of `device` depend on beside the batch, where devices share
        them: RooflineCost's formulas read the device's record, not its name (a cluster's
        GPUs of one kind share one table); None where each device has its own."""
        return None

    def contention(self, device: str, busy: float) -> float:
        """Slowdown of `device`'s compute when `busy` CPU workers of its host (itself included)
        compute at once. 1 here; the measured model uses the calibration (its layer times are
        taken alone, while the roofline's scalars were profiled with all workers busy)."""
        return 1.0

    def memory_contention(self, device: str, busy: float) -> float:
        """Slowdown of `device`'s optimizer step when `busy` CPU workers of its host run at once:
        the calibration's memory_contention on a CPU device of a calibrated topology whose
        compute the model slows (contention != 1), else contention(device, busy)."""
        c = self.calibration
        if c is None or c.memory_contention_factor is None or self.contention(device, 2) == 1.0:
            return self.contention(device, busy)
        return c.memory_contention(busy)

    def fwd_s(self, device: str, start: int, end: int, batch: float, busy: float = 1) -> float:
        """Forward time of layers [start, end) on `device` at a microbatch of `batch` samples,
        times `contention(device, busy)`."""
        pf = self._tables(device, batch)[0]
        t = pf[end] - pf[start]
        return t if busy <= 1 else t * self.contention(device, busy)

    def bwd_s(self, device: str, start: int, end: int, batch: float, busy: float = 1,
              call: bool = True) -> float:
        """Backward time of layers [start, end) on `device` at a microbatch of `batch` samples in
        one backward call (`call`; else a later part of a call, e.g. a bucket's layers after the
        first), times `contention(device, busy)`."""
        _, pb, pn, c = self._tables(device, batch)
        t = pb[end] - pb[start] + c if call and pn[end] > pn[start] else max(0.0, pb[end] - pb[start])
        return t if busy <= 1 else t * self.contention(device, busy)

    def _split_tables(self, device: str, batch: float) -> tuple[list[float], list[float]]:
        """Prefix sums of each layer's I and W pass: split_times where measured (a split backward
        costs more than the fused one on CPU workers: its graph walk, one autograd call per pass
        and weight group); else the fused backward times weight_grad_share (W) and the rest (I)."""
        key = (device, batch)
        if key not in self._split:
            self._split[key] = self._shared("split", device, batch, self._make_split)
        return self._split[key]

    def _make_split(self, device: str, batch: float) -> tuple[list[float], list[float]]:
        measured = self.split_times(self.topology.device(device), batch)
        k = self._scale.get(device, 1.0)
        if measured is not None and k != 1.0:
            measured = ([t * k for t in measured[0]], [t * k for t in measured[1]])
        if measured is None:
            self._tables(device, batch)
            bwd = self._layer[(device, batch)][1]
            measured = ([b * (1.0 - s) for b, s in zip(bwd, self._wshare)],
                        [b * s for b, s in zip(bwd, self._wshare)])
        pi, pw = [0.0], [0.0]
        for i, w in zip(*measured):
            pi.append(pi[-1] + i)
            pw.append(pw[-1] + w)
        return pi, pw

    def bwd_input_s(self, device: str, start: int, end: int, batch: float) -> float:
        """The input-gradient pass (I) of a split backward over layers [start, end)."""
        pi = self._split_tables(device, batch)[0]
        return pi[end] - pi[start]

    def bwd_weight_s(self, device: str, start: int, end: int, batch: float) -> float:
        """The weight-gradient pass (W) of a split backward over layers [start, end)."""
        pw = self._split_tables(device, batch)[1]
        return pw[end] - pw[start]

    def layer_s(self, device: str, index: int, batch: float) -> tuple[float, float]:
        self._tables(device, batch)
        fwd, bwd = self._layer[(device, batch)]
        return fwd[index], bwd[index]

    # --- a tensor-split stage (hetplan.planner.workload.tensor_split) ---------------------------------
    def tensor_part_s(self, phase: str, device: str, share: float, start: int, end: int,
                      batch: float, i: int | None = None) -> float:
        """`device`'s own forward ("fwd") or backward ("bwd") compute of a tensor-split stage of
        layers [start, end) at `batch` samples (layer i alone if given): per layer
        `tensor_part_s(layer_s, flops, split_flops, share)`."""
        graph, k = self.graph, (0 if phase == "fwd" else 1)
        total = 0.0
        for j in (range(start, end) if i is None else (i,)):
            layer = graph.layers[j]
            flops = layer.fwd_flops if k == 0 else layer.bwd_flops
            total += tensor_part_s(self.layer_s(device, j, batch)[k], flops,
                                   graph.split_flops(j, start, end)[k], share)
        return total

    def tensor_sync_s(self, phase: str, devices: tuple[str, ...], start: int, end: int, batch: float) -> float:
        """The all-reduces of a tensor-split stage's forward (each pair's output) or backward
        (each pair's input gradient, where it has one) at `batch` samples:
        sum over pairs of allreduce_s(devices, bytes * batch / graph.batch)."""
        scale = batch / self.graph.batch
        sizes = [(p.out_bytes if phase == "fwd" else p.in_grad_bytes) * scale
                 for p in self.graph.split_pairs(start, end)]
        return sum(self.allreduce_s(devices, n) for n in sizes if n > 0)

    def tensor_device_s(self, phase: str, split, device: str, start: int, end: int, batch: float,
                        i: int | None = None) -> float:
        """`device`'s part of a tensor-split stage (`split`: (device, share) pairs) computed
        beside the others: tensor_part_s times contention(device, k), k the split's CPU devices
        on its node when it is a CPU (they compute at once, in lock step), else 1."""
        share = dict(split)[device]
        t = self.tensor_part_s(phase, device, share, start, end, batch, i)
        dev = self.topology.device(device)
        if dev.kind != "cpu":
            return t
        k = sum(1 for d, _ in split if (x := self.topology.device(d)).kind == "cpu" and x.node == dev.node)
        return t if k <= 1 else t * self.contention(device, k)

    def tensor_stage_s(self, phase: str, split, start: int, end: int, batch: float) -> float:
        """A tensor-split stage's forward or backward (`split`: (device, share) pairs): the
        devices wait for each other at every pair's all-reduce, approximated per layer, so
        sum over layers of max over devices of tensor_device_s, plus tensor_sync_s."""
        devices = tuple(d for d, _ in split)
        compute = sum(max(self.tensor_device_s(phase, split, d, start, end, batch, i) for d in devices)
                      for i in range(start, end))
        return compute + self.tensor_sync_s(phase, devices, start, end, batch)

    def optimizer_s(self, device: str, param_bytes: float, optimizer: str, n_tensors: int = 0,
                    busy: int = 1) -> float:
        """One optimizer step on `device`: with a calibration fit for `optimizer` on a CPU device,
        (n_tensors * s_per_tensor + param_bytes * s_per_byte) * contention(device, busy); on an
        accelerator whose profile timed the optimizer (`optimizer_table`), that table's fit with
        a fixed cost per step; else the memory-bound formula `optimizer_s` (the contract's
        what-if semantics)."""
        key = (device, optimizer, param_bytes, n_tensors, busy)
        if key not in self._opt:
            dev = self.topology.device(device)
            fit = self.calibration.optimizer.get(optimizer) if self.calibration else None
            if fit is not None and dev.kind == "cpu":
                self._opt[key] = fit.step_s(n_tensors, param_bytes) * self.contention(device, busy)
            elif dev.kind != "cpu" and (fit := self._device_optimizer_fit(dev, optimizer)):
                self._opt[key] = fit.step_s(n_tensors, param_bytes)
            else:
                self._opt[key] = optimizer_s(param_bytes, optimizer, dev)
        return self._opt[key]

    def clip_s(self, device: str, grad_bytes: float, devices: tuple[str, ...]) -> float:
        """Clipping by the global norm (hetplan.runtime.train.GlobalNormClip) on `device`: its gradients
        read for the squares and read and written for the scale, 3 * grad_bytes / memory
        bandwidth, plus the norm's all-reduce of one number over every device of the plan. Not
        modelled: that all-reduce is a barrier (each device's step waits for the slowest)."""
        dev = self.topology.device(device)
        return 3.0 * grad_bytes / dev.memory_bytes_per_s + self.allreduce_s(tuple(devices), 8.0)

    def optimizer_launch_s(self, device: str, optimizer: str, n_tensors: int) -> float:
        """The host's share of an accelerator's step whose profile timed it: its fixed and
        per-tensor cost (the launches; the per-byte rest runs on the device). 0 otherwise."""
        dev = self.topology.device(device)
        fit = self._device_optimizer_fit(dev, optimizer) if dev.kind != "cpu" else None
        return fit.s_fixed + n_tensors * fit.s_per_tensor if fit else 0.0

    def _device_optimizer_fit(self, dev: Device, optimizer: str):
        """The fit (with a fixed cost per step) of `dev`'s measured `optimizer_table` rows for
        `optimizer`; None without them."""
        rows = dev.measured.get("optimizer_table", {}).get(optimizer)
        if not rows or len(rows) < 3:
            return None
        if (dev.name, optimizer) not in self._device_opt_fit:
            from hetplan.planner.hardware.fit import fit_optimizer
            self._device_opt_fit[(dev.name, optimizer)] = fit_optimizer(rows, fixed=True)
        return self._device_opt_fit[(dev.name, optimizer)]

    def host_copy_s(self, device: str, n_bytes: float, direction: str) -> float | None:
        """A copy of n bytes between `device` and its host's memory in one process ("h2d" or
        "d2h"), as the runtime makes it (pinned buffers): latency_s + n / bytes_per_s of the
        device's measured `host_copy` fit; None without one (the caller prices the link)."""
        fit = self.host_copy_fit(device, direction)
        return None if fit is None else fit[0] + n_bytes / fit[1]

    def data_copy_s(self, device: str, start: int, end: int, batch: float) -> float:
        """The runtime's copies of a microbatch's data from the host's (pageable) memory to an
        accelerator stage holding layers [start, end): the model's inputs on the first stage
        (cut_bytes[0]), the targets on the last (by latency alone: their bytes are not in the
        graph); by the device's measured pageable fit, 0 on a CPU or without one."""
        dev = self.topology.device(device)
        fit = dev.measured.get("host_copy", {}).get("pageable", {}).get("h2d")
        if fit is None or dev.kind == "cpu":
            return 0.0
        t = fit["latency_s"] + self.graph.cut_bytes_at(0, batch) / fit["bytes_per_s"] if start == 0 else 0.0
        return t + (fit["latency_s"] if end == self.graph.num_layers else 0.0)

    def host_copy_fit(self, device: str, direction: str) -> tuple[float, float] | None:
        """(latency_s, bytes_per_s) of `device`'s measured pinned host copy in `direction`; None
        without one."""
        fit = self.topology.device(device).measured.get("host_copy", {}).get("pinned", {}).get(direction)
        return (fit["latency_s"], fit["bytes_per_s"]) if fit else None

    def allreduce_s(self, devices: tuple[str, ...], n_bytes: float, queued: bool = False) -> float:
        """All-reduce of n bytes over `devices`: the calibrated gloo fit when every device is a
        CPU worker of one host and the topology has a fit (Calibration.allreduce_s; `queued`:
        issued right behind another of its group); else the contract's ring formula
        (Topology.allreduce_s)."""
        c = self._gloo_calibration(devices)
        t = c.allreduce_s(len(devices), n_bytes, queued) if c is not None else None
        return t * self._collective if t is not None else self.topology.allreduce_s(devices, n_bytes)

    def allgather_s(self, devices: tuple[str, ...], n_bytes: float) -> float:
        """All-gather of n bytes in all over `devices` (ZeRO's gathers): the calibrated gloo
        curve when every device is a CPU worker of one host and the profile timed it
        (Calibration.allgather_s); else half the all-reduce of n (a ring all-gather is the
        second half of a ring all-reduce)."""
        c = self._gloo_calibration(devices)
        t = c.allgather_s(len(devices), n_bytes) if c is not None else None
        return t * self._collective if t is not None else self.allreduce_s(devices, n_bytes) / 2

    def _gloo_calibration(self, devices: tuple[str, ...]):
        """The topology's calibration where `devices` are two or more CPU workers of one host
        (its collectives were measured over them), else None."""
        c = self.calibration
        if c is None or len(devices) < 2:
            return None
        parsed = [parse_device_name(d) for d in devices]
        one_host = all(kind == "cpu" for _, kind, _ in parsed) and len({n for n, _, _ in parsed}) == 1
        return c if one_host else None

    def _cpu_calibration(self, device: str):
        """The topology's calibration where `device` is a CPU worker of it, else None."""
        c = self.calibration
        return c if c is not None and self.topology.device(device).kind == "cpu" else None

    def wake_latency_s(self, device: str) -> float:
        """How much later than its message a CPU worker blocked in a receive resumes
        (calibration's wake_latency_s); 0 for other devices and without calibration."""
        c = self._cpu_calibration(device)
        return c.wake_latency_s if c else 0.0

    def message_issue_s(self, device: str) -> tuple[float, float]:
        """(isend issue, irecv post) seconds a CPU worker's thread spends per pipeline message
        (calibration's send_issue_s, recv_post_s); (0, 0) for other devices and without one."""
        c = self._cpu_calibration(device)
        return (c.send_issue_s, c.recv_post_s) if c else (0.0, 0.0)

    def action_overhead_s(self, device: str) -> float:
        """The runtime's own work per schedule action on a CPU worker's thread, besides the
        compute and the messages (calibration's action_overhead_s); 0 for other devices and
        without calibration."""
        c = self._cpu_calibration(device)
        return c.action_overhead_s if c else 0.0

    def grad_accumulate_s(self, device: str, start: int, end: int) -> float:
        """How much longer a CPU worker's backward of layers [start, end) takes when it adds into
        gradients an earlier microbatch of the iteration left (layer timing times it with fresh
        ones): their parameter bytes x calibration's grad_accumulate_s_per_byte; 0 for other
        devices and without calibration."""
        c = self._cpu_calibration(device)
        if not c or not c.grad_accumulate_s_per_byte:
            return 0.0
        return c.grad_accumulate_s_per_byte * sum(l.param_bytes for l in self.graph.layers[start:end])

    def ddp_forward_s(self, device: str) -> float:
        """torch DDP's own work per forward on a CPU worker (calibration's ddp_forward_s); 0 for
        other devices and without calibration."""
        c = self._cpu_calibration(device)
        return c.ddp_forward_s if c else 0.0

    def grad_copy_s(self, device: str, n_bytes: float) -> float:
        """Copying n bytes of gradients into a flat bucket buffer, or back, on a CPU worker's
        thread: n x calibration's grad_copy_s_per_byte; 0 for other devices and without
        calibration."""
        c = self._cpu_calibration(device)
        return c.grad_copy_s_per_byte * n_bytes if c else 0.0

    def held_send_s(self, device: str, window_s: float) -> float:
        """The expected hold of a pipeline message whose receive is posted while its sender, a
        CPU worker, computes and goes on computing `window_s` before it next waits
        (Calibration.held_send_s); 0 for other devices and without calibration."""
        c = self._cpu_calibration(device)
        return c.held_send_s(window_s) if c else 0.0

    def holds_sends(self, device: str) -> bool:
        """Whether `device`'s sends can be held (held_send_s is not 0 for every window)."""
        c = self._cpu_calibration(device)
        return bool(c and any(s > 0 for _, s in c.held_send_curve))

    def cold_compute_s(self, device: str) -> float:
        """How much longer a CPU worker's first compute after a blocking wait takes than back to
        back (calibration's cold_compute_s); 0 for other devices and without calibration."""
        c = self._cpu_calibration(device)
        return c.cold_compute_s if c else 0.0

    def iteration_overhead_s(self, n_devices: int = 1) -> float:
        """Fixed cost per iteration: calibration's iteration_overhead_s; 0 without calibration.
        (multi_worker_overhead_s of older profiles is not added: it was the exit skew of a
        barrier per iteration, which the runtime no longer has.)"""
        c = self.calibration
        return 0.0 if c is None else c.iteration_overhead_s


class RooflineCost(CostModel):
    """The contract's what-if model: every layer by `layer_fwd_s` / `layer_bwd_s` at the
    graph's precision."""

    def layer_times(self, device: Device, batch: float) -> tuple[list[float], list[float]]:
        ratio, p = batch / self.graph.batch, self.precision
        scaled = [l.scaled(ratio) for l in self.graph.layers]
        return [layer_fwd_s(l, device, p) for l in scaled], [layer_bwd_s(l, device, p) for l in scaled]

    def _twin(self, device: str):
        cls = type(self)
        if not (cls.layer_times is RooflineCost.layer_times and cls.backward_call_s is CostModel.backward_call_s
                and cls.split_times is CostModel.split_times):
            return None   # a subclass that prices layers otherwise
        out = self._records.get(device)
        if out is None:
            out = self._records[device] = device_record(self.topology.device(device))
        return out


def device_record(device: Device) -> str:
    """A device's record without its name: what the roofline prices it by."""
    return repr(replace(device, name=""))


__all__ = ["roofline_s", "layer_fwd_s", "layer_bwd_s", "weight_grad_share", "optimizer_s", "tensor_part_s", "host_cpu", "split_host_count", "CostModel",
           "RooflineCost", "device_record", "OPTIMIZER_BYTES_PER_PARAM_BYTE", "OPTIMIZER_STATE_PER_PARAM_BYTE"]
