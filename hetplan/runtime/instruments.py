"""What a rank measures while it trains (the measured file is assembled in hetplan.runtime.results).

- Busy time per device: compute only — forward, loss, backward and optimizer calls (not sends,
  receives or waits for the gradient all-reduce), timed with the device's timing events (CUDA
  events on a GPU, the host clock otherwise; BusyTimer). Reported as the median per iteration.
- Timeline: the spans of the last iteration on each device (forward / backward per microbatch,
  optimizer; and, not counted as busy, waits for received tensors and for the gradient sync),
  start and end in seconds from that rank's iteration start, under `per_device[dev]["events"]`.
- Page faults per iteration (minor: memory the allocator took fresh from the OS), a cost the
  simulator does not price: near zero once the allocator keeps freed memory
  (hetplan.planner.hardware.host_memory).
- Peak memory: CUDA: torch.cuda.max_memory_allocated. CPU: a tracked-tensor estimate —
  parameters + gradients + optimizer state + the peak of saved activations in flight, counted
  with saved_tensors_hooks in the recorded (last) iteration (SavedTracker); the measured peak
  RSS growth (MemoryTracker) is reported beside it as `rss_growth_bytes`: allocator caching
  and library state make it much larger than the tensors for small models.
"""
from __future__ import annotations

import contextlib
import resource
from typing import Any, NamedTuple

import torch

from hetplan.planner.hardware.device import TorchDevice


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def minor_faults() -> int:
    """Page faults this process has taken so far that needed no disk (fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) of this process; Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Span(NamedTuple):
    """One wrapped call of the recorded iteration; start and end are the device's timing events."""
    name: str      # "F3", "B3", "optimizer", "recv act 3", ...
    kind: str      # "forward", "backward", "optimizer", "transfer", "allreduce"
    start: Any
    end: Any


class BusyTimer:
    """Sums compute time of the calls wrapped in `timer()` over one iteration.

    Times come from the device's timing events (hetplan.planner.hardware.device: CUDA events on a GPU, the host
    clock otherwise), read after a synchronize. While recording (one iteration after
    `start_recording()`), it also keeps each wrapped call as a span (name, kind, start_s, end_s
    relative to the iteration start) for `compare --plot`; spans with busy=False (waits for
    receives and for the gradient sync) are kept but not summed.
    """

    def __init__(self, device: TorchDevice):
        self.device = device
        self._events: list[tuple[str, Any, Any]] = []
        self._recording = False
        self._origin: Any = None
        self._spans: list[Span] = []
        self._cut: Any = None

    def cut(self) -> None:
        """The wrapped call now in progress is done computing; what follows is a wait."""
        self._cut = self.device.timing_event()
        self._cut.record()

    def start_recording(self) -> None:
        """Record spans from now (the iteration start) until `take_spans()`."""
        self._recording, self._spans = True, []
        self._origin = self.device.timing_event()
        self._origin.record()

    @contextlib.contextmanager
    def timer(self, name: str = "compute", kind: str = "compute", busy: bool = True):
        start, end = self.device.timing_event(), self.device.timing_event()
        self._cut = None
        start.record()
        yield
        end.record()
        if busy:
            self._events.append((kind, start, self._cut or end))
        self._cut = None
        if self._recording:
            self._spans.append(Span(name, kind, start, end))

    def take(self) -> float:
        """Busy seconds since the last take."""
        return sum(self.take_by_kind().values())

    def take_by_kind(self) -> dict[str, float]:
        """Busy seconds since the last take, by span kind ("compute", "optimizer", ...)."""
        self.device.synchronize()
        out: dict[str, float] = {}
        for kind, s, e in self._events:
            out[kind] = out.get(kind, 0.0) + s.elapsed_time(e) / 1e3
        self._events.clear()
        return out

    def take_spans(self) -> list[dict[str, Any]]:
        """The recorded spans as {"name", "kind", "start_s", "end_s"}; stops recording."""
        self.device.synchronize()
        rel = self._origin.elapsed_time
        out = [{"name": sp.name, "kind": sp.kind, "start_s": rel(sp.start) / 1e3,
                "end_s": rel(sp.end) / 1e3} for sp in self._spans]
        self._recording, self._spans = False, []
        return out


class MemoryTracker:
    """Peak memory of one device over the training loop.

    CUDA: torch.cuda.max_memory_allocated (stage weights included: they are on the GPU).
    CPU: the stage's parameter bytes plus the growth of the process's peak RSS during training
    over its RSS when training started (peak reset through /proc/self/clear_refs, so tracing and
    model building before do not count). Every worker builds the whole model before cutting its
    stage, so RSS itself would count other stages' weights; hence params + growth. Allocator
    caching makes the growth an upper bound of live tensors. Without /proc: ru_maxrss growth.
    """

    def __init__(self, device: torch.device, stage_param_bytes: int):
        self.device, self.param_bytes = device, stage_param_bytes
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        self.hwm = _reset_peak_rss() and _status_kib("VmHWM") is not None
        self.base_kib = _status_kib("VmRSS") if self.hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = _status_kib("VmHWM") if self.hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self.param_bytes + max(0, peak - self.base_kib) * 1024


class SavedTracker:
    """Bytes autograd saves for backward per in-flight microbatch (a tracked-tensor estimate).

    While a microbatch's forward runs under `hooks(mb)`, every saved tensor is counted once by
    its own bytes (parameters and views of them are not counted); `release(mb)` after its
    backward. `peak_bytes` is the most held at once: the memory model's "saved activations in
    flight". Not counted: temporaries inside an op, gradients of activations during backward.
    """

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, int] = {}
        self.peak_bytes = 0

    def reset(self) -> None:
        self.live.clear()
        self.peak_bytes = 0

    def hooks(self, mb: int, first=None):
        """`first`: a hetplan.runtime.shard.ParamShards, whose handles for the parameters are kept
        uncounted."""
        seen: set[int] = set()

        def pack(t):
            if first is not None:
                handle = first.pack(t)
                if handle is not None:
                    return handle
            # a view counts its own elements, once: microbatches are slices of one batch
            # tensor, so counting whole storages would count the batch in every microbatch
            try:
                key = (t.data_ptr(), t.numel())
                st_ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):   # tensors without a plain storage
                return t
            if st_ptr not in self.param_ptrs and key not in seen:
                seen.add(key)
                self.add_bytes(mb, t.numel() * t.element_size())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, first.unpack if first is not None else lambda t: t)

    def add_bytes(self, mb: int, n: int) -> None:
        self.live[mb] = self.live.get(mb, 0) + n
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))

    def release(self, mb: int) -> None:
        self.live.pop(mb, None)
