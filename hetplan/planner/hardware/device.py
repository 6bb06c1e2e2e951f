"""The torch device behind a plan device, and the operations that differ by hardware.

Code that behaves differently on an accelerator (host staging, pinned buffers, side streams,
events, synchronisation, backend choice) asks a `TorchDevice` instead of testing
`device.type == "cuda"`, so every such path also runs with the CPU standing in for the GPU:
with `HETPLAN_STANDIN_GPUS=N` in the environment, `cuda:0..N-1` are accelerators whose tensors
live in host memory (torch.cpu's no-op streams and events; plain, unpinned host buffers; gloo
instead of NCCL). Tests and CI use it; a user never needs it. With `HETPLAN_GPU_MEMORY_CAP=BYTES`,
each worker's allocations on its GPU are capped there, standing for a smaller card
(benchmarks/capped.py); on a stand-in there is nothing to cap.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

STANDIN_ENV = "HETPLAN_STANDIN_GPUS"
MEMORY_CAP_ENV = "HETPLAN_GPU_MEMORY_CAP"


def memory_cap() -> int | None:
    """The bytes each worker's GPU is capped to (MEMORY_CAP_ENV), None when not set."""
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{MEMORY_CAP_ENV}: expected a positive number of bytes, got {raw!r}")
    return int(raw)


def cap_fraction(cap_bytes: int, total_bytes: int) -> float:
    """The share of a device of `total_bytes` that leaves `cap_bytes` to allocate (at most 1)."""
    return min(1.0, cap_bytes / total_bytes)


def standin_gpus() -> int:
    """How many `cuda:N` devices the CPU stands in for (0: none, the real GPUs are used)."""
    raw = os.environ.get(STANDIN_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"{STANDIN_ENV}: expected a non-negative integer, got {raw!r}")
    return int(raw)


def gpu_count() -> int:
    """CUDA devices this process can use: the stand-ins when set, else the real GPUs."""
    n = standin_gpus()
    if n:
        return n
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class _ClockEvent:
    """A timing event for devices without device events: the host clock at `record()`."""

    def __init__(self):
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_ClockEvent") -> float:
        """Milliseconds to `end`, as torch.cuda.Event.elapsed_time."""
        return (end.t - self.t) * 1e3


@dataclass(frozen=True)
class TorchDevice:
    name: str                 # the plan device, e.g. "cuda:0" or "node1/cpu:0"
    kind: str                 # "cpu" or "cuda"
    device: torch.device      # where its tensors live (the CPU for a stand-in)

    @property
    def accelerator(self) -> bool:
        """Not the host CPU: tensors cross to the host to meet gloo or a CPU worker."""
        return self.kind != "cpu"

    @property
    def native(self) -> bool:
        """A real accelerator (not a CPU stand-in): device streams, events, pinned memory, NCCL."""
        return self.device.type != "cpu"

    @property
    def module(self):
        """torch.cuda for a real GPU, torch.cpu (no-op streams and events) otherwise."""
        return torch.get_device_module(self.device)

    def set_current(self) -> None:
        if self.native:
            self.module.set_device(self.device)

    def cap_memory(self, cap_bytes: int) -> float | None:
        """Cap this process's allocations on the device to `cap_bytes` (a smaller card); the
        share set, None on the host or a stand-in (nothing to cap)."""
        if not self.native:
            return None
        share = cap_fraction(cap_bytes, self.module.get_device_properties(self.device).total_memory)
        self.module.set_per_process_memory_fraction(share, self.device)
        return share

    def synchronize(self) -> None:
        if self.native:
            self.module.synchronize(self.device)

    def new_stream(self):
        return self.module.Stream(device=self.device) if self.native else self.module.Stream()

    def stream(self, s):
        """Context manager making `s` the current stream."""
        return self.module.stream(s)

    def current_stream(self):
        return self.module.current_stream(self.device) if self.native else self.module.current_stream()

    def event(self):
        """An event to record on a stream and wait for (query / synchronize)."""
        return self.module.Event()

    def wait_queued(self) -> None:
        """Block until the work queued so far on the current stream is done (a non-blocking copy
        into a host buffer, before gloo or the CPU reads the buffer); no-op on the host."""
        done = self.event()
        done.record()
        done.synchronize()

    def timing_event(self):
        """An event with `elapsed_time(other)` in ms: device events on a GPU, the clock else."""
        return self.module.Event(enable_timing=True) if self.native else _ClockEvent()

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for copies to and from this device: pinned on a real accelerator (so
        non-blocking copies are truly asynchronous), plain host memory otherwise."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.native)


def torch_device(name: str) -> TorchDevice:
    """The TorchDevice of plan device `name` ("cpu:N", "cuda:N", optionally "node/" first)."""
    local = name.split("/", 1)[-1]
    kind, _, index = local.partition(":")
    if kind == "cpu":
        return TorchDevice(name, "cpu", torch.device("cpu"))
    n = standin_gpus()
    if n:
        if int(index) >= n:
            raise ValueError(f"{name}: only {n} stand-in GPU(s) ({STANDIN_ENV}={n})")
        return TorchDevice(name, kind, torch.device("cpu"))
    return TorchDevice(name, kind, torch.device(local))


__all__ = ["STANDIN_ENV", "TorchDevice", "torch_device", "standin_gpus", "gpu_count"]
