"""Per-layer times measured on this machine (FlexFlow-style): each layer is a one-layer stage on a
real batch, timed in training steps (every forward in order, then every backward in reverse, so a
layer meets the caches its neighbours leave, as in the runtime), median of `repeats` after
`warmup`; the loss is timed as a pseudo-layer added to the last layer; the first layer gets no
input gradient, the others one for the inputs that carry one (as in the runtime). Each layer
timed alone pays a backward call of its own where a stage pays one for all of its layers: on a
CPU, that call's own cost is measured in the same runs (the layers' separate backward calls
against one chained call, per call: `backward_call_s`) and a stage's backward is priced as its
layers' less their calls plus one (CostModel.bwd_s). On an accelerator, whose launches overlap
its work, the layers' times are scaled to their chained step's, synchronized only around
forward and backward (`_chained_once`). Cached in
`<cache>/layer_costs-v<N>.json` (hetplan.planner.files.cache) by machine fingerprint, signature, device kind, threads, batch and
precision. History and figures: docs/tuning.md.

Batch sizes: a cost curve. With `sizes` (`batch_grid(global_batch)` when planning or predicting a
plan) layers are timed at those microbatch sizes only, all before a search starts (`prepare`); a
microbatch in between costs the straight line through the two measured sizes around it (beyond the
largest, the line through the last two). Without `sizes`, each size is timed as asked.

Split backward (zb-h1): with `split` (`prepare(..., split=True)`, or asked by bwd_input_s /
bwd_weight_s), each layer after the first is also timed through the runtime's I and W passes
(hetplan.planner.workload.split_backward), in the same runs as its fused backward; the passes are cached
as shares of that backward (`SPLIT` entries) and priced as share * the fused entry.

Each layer's forward (and the loss's) runs under hetplan.planner.workload.precision.autocast in the
graph's precision, its backward outside it, as in training. When several CPU workers of a host
compute at once, the times are multiplied by the topology's contention factor
(hetplan.planner.hardware.calibration); without a calibration they are used as measured, alone.
`cost_model` picks this model on a topology profiled on this host, else the roofline.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from hetplan.planner.cost.model import CostModel, RooflineCost
from hetplan.planner.files.io import write_json_atomic
from hetplan.planner.files.progress import Progress
from hetplan.planner.workload.precision import autocast
from hetplan.planner.files.cache import cache_dir
from hetplan.planner.hardware.lookup import measured_here
from hetplan.planner.hardware.machine import this_machine
from hetplan.planner.hardware.topology import Device, Topology, parse_device_name


# Bumped when the way layers are timed or keyed changes, so that older figures are not reused
# (each version's reason: docs/tuning.md, "Layer cost cache versions").
CACHE_VERSION = 7
# The last layer's entry: [fwd, bwd, loss fwd, loss bwd, one backward call's own seconds].
ENTRY = 5
# Suffix of a layer's split-backward entry (layers after the first): [I pass, W pass] as shares
# of the fused backward timed in the same runs (back to back, so a change of the machine's load
# between two measurements does not show as a cost of the split); times = share * fused entry.
SPLIT = "|split"


def cache_path() -> Path:
    return cache_dir() / f"layer_costs-v{CACHE_VERSION}.json"


def interpolate(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """y0 + (y1 - y0) * (x - x0) / (x1 - x0); y0 when x0 == x1."""
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# A layer whose forward + backward takes this long is timed SLOW_LAYER_REPEATS times after a
# single warm-up (relative noise is small there), so that a cost curve up to large batches is
# measured in seconds; faster layers get `warmup` + `repeats` runs.
SLOW_LAYER_S = 0.02
SLOW_LAYER_REPEATS = 3
# A size whose whole-model step lies this far above the line through its two neighbours on the
# curve is timed again with them (`_out_of_line`).
KINK = 0.25


def batch_grid(global_batch: int) -> tuple[int, ...]:
    """The microbatch sizes layers are timed at for a workload of `global_batch` samples: the
    powers of two below it and the batch itself (every microbatch of a plan is in [1, batch])."""
    if global_batch < 1:
        raise ValueError(f"global batch must be positive, got {global_batch}")
    return tuple(sorted({1 << k for k in range(global_batch.bit_length())} | {global_batch}))


def _neighbours(sizes: tuple[int, ...], batch: float) -> tuple[int, int]:
    """The two sizes whose line prices `batch`: around it, else the two nearest ends."""
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    i = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)
    return sizes[i - 1], sizes[i]


class MeasuredCost(CostModel):
    def __init__(self, graph, topology: Topology, workload, sizes: tuple[int, ...] | None = None,
                 warmup: int = 2, repeats: int = 5):
        super().__init__(graph, topology)
        self.workload, self.warmup, self.repeats = workload, warmup, repeats
        self.sizes = tuple(sorted(set(sizes))) if sizes else None   # None: time what is asked
        self._roofline = RooflineCost(graph, topology)
        self._disk: dict[str, list[float]] | None = None

    def contention(self, device: str, busy: float) -> float:
        """calibration.contention(busy) on CPU devices of a calibrated topology, else 1."""
        if self.calibration is None or self.topology.device(device).kind != "cpu":
            return 1.0
        return self.calibration.contention(busy)

    # --- disk cache ----------------------------------------------------------------------
    def _key(self, i: int, device: Device, batch: int) -> str:
        layer = self.graph.layers[i]
        sig = layer.signature or f"{layer.name}/{layer.param_bytes}/{layer.fwd_flops / self.graph.batch:.6g}"
        # The first layer is timed without the gradient of its input (the model's data), so it
        # never shares an entry with an identical later layer.
        first = "|first" if i == 0 else ""
        from hetplan.planner.hardware.device import standin_gpus
        kind = device.kind + ("-standin" if device.kind != "cpu" and standin_gpus() else "")
        p = device.matmul_precision(self.precision)   # tf32 on a CPU is fp32
        prec = "" if p == "fp32" else f"|{p}"                # fp32 keys as before precision existed
        return f"{this_machine()}|{sig}|{kind}|{device.threads}|{batch}|loss{first}{prec}"

    def _load_disk(self) -> dict[str, list[float]]:
        if self._disk is None:
            try:
                self._disk = json.loads(cache_path().read_text())
            except (OSError, ValueError):
                self._disk = {}
        return self._disk

    def _save_disk(self, new: dict[str, list[float]]) -> None:
        self._disk = None
        merged = self._load_disk()   # re-read: another process may have added entries
        merged.update(new)
        write_json_atomic(cache_path(), merged)

    def _needs(self, device: Device, batch: int, split: bool) -> tuple[bool, bool]:
        """(the fused timings, the split backward's) at `batch` missing from the cache; the last
        layer's entry also holds the loss's times and the backward call's (ENTRY)."""
        disk = self._load_disk()
        keys = [self._key(i, device, batch) for i in range(self.graph.num_layers)]
        fused = not (all(k in disk for k in keys) and len(disk[keys[-1]]) == ENTRY)
        return fused, split and not all(k + SPLIT in disk for k in keys[1:])

    # --- measuring -----------------------------------------------------------------------
    def _measure(self, device: Device, batch: int, split: bool = False,
                 again: bool = False, announce: bool = True) -> tuple[list[float], list[float]]:
        """Per-layer (fwd, bwd) at `batch`, from the cache or timed now; with `split`, each
        layer's split backward (I and W passes, entries `key + SPLIT`) is also cached or timed.
        A size timed out of line with the curve's neighbours on record (`_out_of_line`) is timed
        again with them (`again`: timed although cached, each entry keeping the faster)."""
        disk = self._load_disk()
        keys = [self._key(i, device, batch) for i in range(self.graph.num_layers)]
        fused, split = self._needs(device, batch, split)
        fused, split = fused or again, split and not again
        if not (fused or split):
            return _from_entries(keys, disk)
        import torch
        from hetplan.planner.workload.partition import build_stages, place_stages, stage_inputs

        L = self.graph.num_layers
        what = "layers" if fused else "split backward of layers"
        if announce:   # else a Progress (prepare) says it
            print(f"measuring {what} ({L}) on {device.name} at batch {batch}", file=sys.stderr)
        from hetplan.planner.hardware.device import torch_device
        from hetplan.planner.hardware.cores import bound_to_first
        from hetplan.planner.hardware.host_memory import keep_freed_memory
        keep_freed_memory()      # as in the runtime's workers
        dev = torch_device(device.name)
        workload = _model_copy_for(self.workload, dev)
        stages = build_stages(workload, [(i, i + 1) for i in range(L)], batch)
        if dev.accelerator:
            place_stages(stages, dev.device)
        old_threads = torch.get_num_threads()
        if device.kind == "cpu" and device.threads:
            torch.set_num_threads(device.threads)
        chained = dev.accelerator   # its launches overlap its work: totals timed unsynchronized
        sync, dev = dev.synchronize, dev.device
        in_precision = lambda: autocast(dev.type, self.precision)  # noqa: E731
        fwd, bwd, passes = [], [], []
        # on its own cores, as a bound runtime worker (hetplan.planner.hardware.cores)
        binding = bound_to_first(device.threads or 1) if device.kind == "cpu" else contextlib.nullcontext()
        with binding:
            try:
                inputs, target = self.workload.make_batch(batch, 0)
                x = tuple(t.to(dev) for t in stage_inputs(stages[0], inputs))
                layers = stages + [_Loss(self.workload.loss_fn, target.to(dev))]

                if fused:
                    fwd, bwd, call = self._time_windows(device, batch, layers, x, sync, in_precision, chained)
                for i, stage in enumerate(layers if split else ()):
                    # the model's input is data: as in the runtime, no gradient is computed for it
                    x = _leaf_inputs(x, grad=i > 0)
                    # the first layer's I is nothing, the loss has no W: neither is timed split; the
                    # split is timed with the fused backward in the same runs, which its shares are of
                    if 0 < i < L:
                        times = self._time_layer(stage, x, sync, in_precision, True, True)
                        passes.append(tuple(t / times[1] if times[1] > 0 else 0.0 for t in times[2:]))
                    x = _next_inputs([stage], x, in_precision)
            finally:
                torch.set_num_threads(old_threads)
        entries = {}
        if fused:
            entries = _shared(keys, list(zip(fwd, bwd)))
            entries[keys[-1]] = entries[keys[-1]][:2] + [fwd[-1], bwd[-1], call]
        if split:
            entries.update(_shared([k + SPLIT for k in keys[1:]], passes))
        if again:   # the faster of the two timings (a passing slowdown only adds time)
            entries = {k: list(map(min, v, disk[k])) if len(disk.get(k, ())) == len(v) else v
                       for k, v in entries.items()}
        self._save_disk(entries)
        if fused and not again:
            out = self._out_of_line(device, batch, sum(fwd) + sum(bwd))
            if out:
                # more samples never take less time: a passing slowdown of the machine made one
                # of these sizes slow (measured: a whole size 50 % slow), so they are timed again
                for b in (batch, *out):
                    self._measure(device, b, again=True)
        return _from_entries(keys, self._load_disk())

    def _time_windows(self, device: Device, batch: int, layers: list, x: tuple, sync, in_precision,
                      chained: bool) -> tuple[list[float], list[float], float]:
        """Per-layer (fwd, bwd) of `layers` (the loss last) timed window by window from inputs
        `x`, and the backward call's own time (0 where chained: an accelerator's totals)."""
        L = self.graph.num_layers
        fs, bs, y, saved, calls = [], [], x, 0.0, 0
        for a, b in self._windows(device, batch):
            seq = layers[a:b + (b == L)]
            f, bw, s = self._time_sequence(seq, y, sync, in_precision, data=a == 0, calls=not chained)
            if chained:
                f, bw = _scaled(f, bw, *self._repeat(lambda: _chained_once(seq, y, sync, in_precision, data=a == 0)))
            else:
                saved, calls = saved + s, calls + max(0, sum(t > 0 for t in bw) - 1)
            fs += f
            bs += bw
            y = _next_inputs(layers[a:b], y, in_precision)   # the next window's
        return fs, bs, max(0.0, saved) / calls if calls > 0 else 0.0

    def _out_of_line(self, device: Device, batch: int, total: float) -> tuple[int, ...]:
        """The curve's sizes on record that a step of the whole model taking `total` seconds at
        `batch` contradicts: the nearest smaller size if it took longer, the nearest larger one
        if it took less; and of three neighbouring sizes, `batch` among them, where the middle
        one lies more than KINK above the straight line through the other two, those of the
        three other than `batch` (a slow spell that made one size slow without passing the
        next size's time)."""
        disk, L = self._load_disk(), self.graph.num_layers
        on_record = {batch: total}
        for b in self.sizes or ():
            keys = [self._key(i, device, b) for i in range(L)]
            if b == batch or not (all(k in disk for k in keys) and len(disk[keys[-1]]) == ENTRY):
                continue
            f, bw = _from_entries(keys, disk)
            on_record[b] = sum(f) + sum(bw)
        sizes = sorted(on_record)
        i = sizes.index(batch)
        out = set()
        if i > 0 and on_record[sizes[i - 1]] > total:
            out.add(sizes[i - 1])
        if i + 1 < len(sizes) and on_record[sizes[i + 1]] < total:
            out.add(sizes[i + 1])
        for j in range(max(1, i - 1), min(len(sizes) - 1, i + 2)):   # triples holding batch
            a, m, c = sizes[j - 1], sizes[j], sizes[j + 1]
            line = interpolate(m, a, on_record[a], c, on_record[c])
            if on_record[m] > (1 + KINK) * line:
                out.update(x for x in (a, m, c) if x != batch)
        return tuple(sorted(out))

    def _repeat(self, once) -> list[float]:
        """The median of each of once()'s times over `repeats` runs after `warmup`; a slow layer
        (its times summing to SLOW_LAYER_S or more) SLOW_LAYER_REPEATS runs after one warm-up."""
        samples, runs, rep = [], self.warmup + self.repeats, 0
        while rep < runs:
            times = once()
            if rep >= self.warmup:
                samples.append(times)
            elif sum(times) >= SLOW_LAYER_S:   # slow: timer noise is small, one warm-up will do
                runs = self.warmup + min(self.repeats, SLOW_LAYER_REPEATS)
                rep = self.warmup - 1
            rep += 1
        return [statistics.median(s) for s in zip(*samples)]

    def _windows(self, device: Device, batch: int) -> list[tuple[int, int]]:
        """Consecutive layer ranges [a, b), each timed as one training step (`_time_sequence`):
        as many layers as save at most half of the device's memory for backward at `batch`
        (a model that a pipeline spreads over devices need not fit one at the whole batch)."""
        budget, L = 0.5 * device.memory_bytes, self.graph.num_layers
        out, a = [], 0
        for i in range(1, L):
            if self.graph.saved_bytes_at(a, i + 1, batch) > budget:
                out.append((a, i))
                a = i
        return out + [(a, L)]

    def _time_sequence(self, layers, x, sync, in_precision, data: bool = True,
                       calls: bool = False) -> tuple[list[float], list[float], float]:
        """Median seconds of each layer's forward and backward when they run as in a training
        step: every forward in order (each on its predecessor's output), then every backward in
        reverse, so each layer finds the caches as the others left them (`_sequence_once`);
        `data`: x is the model's input (no gradient for it). With `calls`, each run also runs
        the layers as one stage does (`_chained_once`), and the third figure is the median of
        how much longer the layers' own backward calls took than the one chained call (else 0)."""
        k = len(layers)

        def once() -> tuple[float, ...]:
            times = _sequence_once(layers, x, sync, in_precision, data)
            if not calls:
                return times
            return times + (sum(times[k:]) - _chained_once(layers, x, sync, in_precision, data)[1],)
        times = self._repeat(once)
        return times[:k], times[k:2 * k], times[2 * k] if calls else 0.0

    def _time_layer(self, stage, x, sync, in_precision=contextlib.nullcontext, fused: bool = True,
                    split: bool = False) -> tuple[float, ...]:
        """Median seconds of the layer's forward and backward (`fused`), then of its backward split
        as a zero-bubble stage runs it (`split`: the I pass, its inputs' gradient, and the W pass,
        its weights' gradients; hetplan.planner.workload.split_backward), timed in the same runs so that
        both see the same machine (`_layer_once`); forwards run in `in_precision()`."""
        return tuple(self._repeat(lambda: _layer_once(stage, x, sync, in_precision, fused, split)))

    def layer_times(self, device: Device, batch: float) -> tuple[list[float], list[float]]:
        if not self.present(device):
            return self._roofline.layer_times(device, batch)
        if self.sizes is None:
            return self._measure(device, int(batch))
        lo, hi = _neighbours(self.sizes, batch)
        f0, b0 = self._measure(device, lo)
        f1, b1 = self._measure(device, hi)
        return ([interpolate(batch, lo, a, hi, b) for a, b in zip(f0, f1)],
                [interpolate(batch, lo, a, hi, b) for a, b in zip(b0, b1)])

    def backward_call_s(self, device: Device, batch: float) -> float:
        """On a CPU, what one layer's own backward call took beyond its share of one chained call
        over the model (timed in the same runs; a curve over `sizes` as layer_times); 0 on an
        accelerator (its layers are scaled to their chained step) or priced by the roofline."""
        if device.kind != "cpu":
            return 0.0
        if self.sizes is None:
            return self._call_at(device, int(batch))
        lo, hi = _neighbours(self.sizes, batch)
        return max(0.0, interpolate(batch, lo, self._call_at(device, lo), hi, self._call_at(device, hi)))

    def _call_at(self, device: Device, batch: int) -> float:
        self._measure(device, batch)
        return self._load_disk()[self._key(self.graph.num_layers - 1, device, batch)][4]

    def split_times(self, device: Device, batch: float) -> tuple[list[float], list[float]] | None:
        """Per-layer (I pass, W pass) seconds measured on this machine (a curve over `sizes` as
        layer_times); None for a device priced by the roofline."""
        if not self.present(device):
            return None
        if self.sizes is None:
            return self._split_at(device, int(batch))
        lo, hi = _neighbours(self.sizes, batch)
        (i0, w0), (i1, w1) = self._split_at(device, lo), self._split_at(device, hi)
        return ([interpolate(batch, lo, a, hi, b) for a, b in zip(i0, i1)],
                [interpolate(batch, lo, a, hi, b) for a, b in zip(w0, w1)])

    def _split_at(self, device: Device, batch: int) -> tuple[list[float], list[float]]:
        """Per-layer (I, W) seconds at `batch`, each split entry's share times its fused
        backward: the first layer's input needs no gradient (I = 0, W = its whole backward, as a
        first stage runs it); the loss, holding no weights, is all I (its backward, added to the
        last layer's)."""
        _, bwd = self._measure(device, batch, split=True)
        disk, L = self._load_disk(), self.graph.num_layers
        keys = [self._key(i, device, batch) for i in range(L)]
        inp = [0.0] + [disk[k + SPLIT][0] * disk[k][1] for k in keys[1:]]
        wgt = [bwd[0]] + [disk[k + SPLIT][1] * disk[k][1] for k in keys[1:]]
        if L > 1:
            inp[-1] += disk[keys[-1]][3]
        return inp, wgt

    def present(self, device: Device) -> bool:
        """`_present`, asked once per device (`prepare` asks before a search: its chains, forked
        processes, never ask CUDA, which a forked process cannot use once its parent has)."""
        here = self.__dict__.setdefault("_here", {})
        if device.name not in here:
            here[device.name] = _present(device)
        return here[device.name]

    def prepare(self, devices, split: bool = False) -> None:
        """Time every layer at every size of the curve on each of `devices` (names) now, so that a
        search over them never times anything (devices of one kind and thread count share); with
        `split`, also each layer's split backward (what a zb-h1 plan runs)."""
        todo = [(self.topology.device(n), b) for n in devices if self.present(self.topology.device(n))
                for b in self.sizes or ()]
        alike = {self._key(0, d, b): (d, b) for d, b in todo}   # devices with one key share their timings
        left = [(d, b) for d, b in alike.values() if any(self._needs(d, b, split))]
        with Progress(len(left), f"timing {self.graph.num_layers} layers", unit="size") as bar:
            for d, b in left:
                self._measure(d, b, split, announce=False)
                bar.update(note=f"on {d.name} at batch {b}")
        for d, b in todo:   # the rest from the cache (and each size's neighbours checked)
            self._measure(d, b, split)

    def fit_report(self, device: str) -> dict[str, float] | None:
        """The curve of one device's whole model (forward + backward, every layer): its least-squares
        line `fixed_s + per_sample_s * batch` and the largest relative distance of a measured
        size from it (`residual_pct`); None for a device priced by the roofline or no curve."""
        dev = self.topology.device(device)
        if self.sizes is None or len(self.sizes) < 2 or not self.present(dev):
            return None
        xs = [float(b) for b in self.sizes]
        ys = [sum(f) + sum(b) for f, b in (self._measure(dev, int(x)) for x in xs)]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        worst = max(abs(fixed + slope * x - y) / y for x, y in zip(xs, ys))
        return {"fixed_s": fixed, "per_sample_s": slope, "residual_pct": 100 * worst,
                "sizes": list(self.sizes)}


def _present(device: Device) -> bool:
    """A CPU, or an accelerator this process can use (a profiled GPU absent now is priced by
    the roofline)."""
    if device.kind == "cpu":
        return True
    from hetplan.planner.hardware.device import gpu_count
    return parse_device_name(device.name)[2] < gpu_count()


def cost_model(graph, topology: Topology, workload, global_batch: int) -> CostModel:
    """On a topology profiled on this machine, the measured model with its cost curve over
    `batch_grid(global_batch)` (so `plan` and `simulate` price a plan alike); else the roofline."""
    if measured_here(topology):
        return MeasuredCost(graph, topology, workload, sizes=batch_grid(global_batch))
    return RooflineCost(graph, topology)


def _leaf_inputs(x: tuple, grad: bool) -> tuple:
    """A layer's inputs as fresh leaves (tensors anywhere in tuples or dicts, as a stage passes
    them on): those that carry a gradient in training (a predecessor's floating-point outputs
    that require grad) require one when `grad` (not for the model's data), as the runtime's
    received activations do (hetplan.runtime.pipeline's headers)."""
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.detach().requires_grad_(grad and t.requires_grad and t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, x)


def _next_inputs(layers, x: tuple, in_precision) -> tuple:
    """The outputs of `layers` run in order on `x` (fresh leaves as `_leaf_inputs` makes them),
    with autograd on so that each output says whether it carries a gradient; the graph is
    dropped."""
    import torch

    from hetplan.planner.workload.inputs import as_tuple
    with torch.enable_grad(), in_precision():
        for stage in layers:
            x = as_tuple(stage(*_leaf_inputs(x, grad=True)))
    return _leaf_inputs(x, grad=True)


def _model_copy_for(workload, dev):
    """The workload with a copy of its model when `dev` is an accelerator: its stages are then
    exported from the copy and moved (`place_stages`), and the user's model stays where it is.
    (An exported stage itself cannot be deep-copied: its FakeTensor metadata has no data pointer.)"""
    if not dev.accelerator:
        return workload
    import copy
    from dataclasses import replace
    return replace(workload, model=copy.deepcopy(workload.model))


class _Loss:
    """The loss as a last pseudo-layer: (loss_fn(output, target),). The runtime computes it in
    the last stage's forward and starts backward from it; its times are added to the last layer."""

    def __init__(self, loss_fn, target):
        self.loss_fn, self.target = loss_fn, target

    def __call__(self, out, *rest):
        return (self.loss_fn(out, self.target),)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _layer_once(stage, x, sync, in_precision, fused: bool, split: bool) -> tuple[float, ...]:
    """One run of a layer: (forward, backward) seconds when `fused`; then (I pass, W pass) when
    `split`, by the runtime's own passes (hetplan.planner.workload.split_backward), on the same forward's
    graph (kept by the fused backward for it: one forward per run)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from hetplan.planner.workload.inputs import as_tuple
    from hetplan.planner.workload.split_backward import input_pass
    stage.zero_grad(set_to_none=True)
    with in_precision():
        f_s, out = _timed(sync, lambda: as_tuple(stage(*x)))
    out = _needing_grad(out)
    if not out:
        return (f_s, 0.0)[:2 * fused] + (0.0, 0.0)[:2 * split]
    grads = [torch.ones_like(o) for o in out]
    times: tuple[float, ...] = ()
    if fused:
        b_s, _ = _timed(sync, lambda: torch.autograd.backward(out, grads, retain_graph=split))
        times = (f_s, b_s)
        stage.zero_grad(set_to_none=True)
    if split:
        need = [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad]
        i_s, (_, wp) = _timed(sync, lambda: input_pass(out, grads, need, list(stage.parameters())))
        w_s, _ = _timed(sync, wp.run)
        times += (i_s, w_s)
    return times


def _sequence_once(layers, x, sync, in_precision, data: bool = True) -> tuple[float, ...]:
    """One training step through `layers` (one-layer stages, the loss last where it is in), each
    layer's inputs fresh leaves as a stage receives them (`data`: the first's are the model's
    input, which gets no gradient): (forward seconds per layer, then backward seconds per layer);
    a layer whose output needs no gradient has no backward (0)."""
    import torch

    from hetplan.planner.workload.inputs import as_tuple
    fwd, outs = [], []
    for i, stage in enumerate(layers):
        stage.zero_grad(set_to_none=True)
        x = _leaf_inputs(x, grad=i > 0 or not data)
        with in_precision():
            f_s, out = _timed(sync, lambda: as_tuple(stage(*x)))
        fwd.append(f_s)
        outs.append(_needing_grad(out))
        x = out
    bwd = [0.0] * len(layers)
    for i in reversed(range(len(layers))):
        if outs[i]:
            grads = [torch.ones_like(o) for o in outs[i]]
            bwd[i], _ = _timed(sync, lambda: torch.autograd.backward(outs[i], grads))
    return tuple(fwd) + tuple(bwd)


def _chained_once(layers, x, sync, in_precision, data: bool = True) -> tuple[float, float]:
    """One training step through `layers` as one stage runs them: each forward on its
    predecessor's output, one backward from the last outputs, the device synchronized only before,
    between and after (on an accelerator, launches then overlap the device's work, as in the
    runtime): (forward seconds, backward seconds)."""
    import torch

    from hetplan.planner.workload.inputs import as_tuple
    for stage in layers:
        stage.zero_grad(set_to_none=True)
    x = _leaf_inputs(x, grad=not data)

    def forward():
        y = x
        with in_precision():
            for stage in layers:
                y = as_tuple(stage(*y))
        return y
    f_s, out = _timed(sync, forward)
    out = _needing_grad(out)
    if not out:
        return f_s, 0.0
    grads = [torch.ones_like(o) for o in out]
    b_s, _ = _timed(sync, lambda: torch.autograd.backward(out, grads))
    return f_s, b_s


def _scaled(fwd: list[float], bwd: list[float], fwd_total: float,
            bwd_total: float) -> tuple[list[float], list[float]]:
    """Per-layer times, each layer synchronized on its own, scaled to the totals of the same
    layers run as one chained step (`_chained_once`): the layers keep their shares."""
    def scale(times, total):
        return [t * total / sum(times) for t in times] if sum(times) > 0 else times
    return scale(fwd, fwd_total), scale(bwd, bwd_total)


def _timed(sync, fn) -> tuple[float, object]:
    """(seconds, fn()) with the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _needing_grad(out) -> list:
    """The tensors of a layer's output (anywhere in it) that backward starts from."""
    import torch
    from torch.utils._pytree import tree_leaves
    return [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]


def _shared(keys: list[str], values: list[tuple[float, ...]]) -> dict[str, list[float]]:
    """Cache entries: layers with the same key (the same signature) share one entry, the median
    of their times, so every device of the same kind and threads gets the same figures (the
    search's ties stay ties)."""
    shared: dict[str, list[tuple[float, ...]]] = {}
    for k, v in zip(keys, values):
        shared.setdefault(k, []).append(v)
    return {k: [statistics.median(x) for x in zip(*v)] for k, v in shared.items()}


def _from_entries(keys: list[str], entries: dict) -> tuple[list[float], list[float]]:
    """Per-layer (fwd, bwd) from cache entries; the last layer's entry also holds the loss's
    times ([fwd, bwd, loss fwd, loss bwd, call]), added to the last layer."""
    last = entries[keys[-1]]
    return ([entries[k][0] for k in keys[:-1]] + [last[0] + last[2]],
            [entries[k][1] for k in keys[:-1]] + [last[1] + last[3]])


__all__ = ["MeasuredCost", "cost_model", "cache_path", "interpolate", "batch_grid"]
