"""Activation offload (a stage's `offload_activations`): saved activations in host memory.

While a microbatch's forward runs under `ActivationOffload.hooks()` (autograd's
saved_tensors_hooks), every tensor autograd saves for backward, except the stage's parameters,
is copied into a host buffer (pinned on a real accelerator) and the device's copy is dropped;
backward copies each back when it unpacks it. On a real GPU the copies out run on a side
stream, beside the forward's kernels (the caching allocator keeps a tensor's memory until its
copy is done); the copies back run on the compute stream as backward needs them (not
prefetched). A CPU stand-in copies host to host: the same code path, no streams.
"""
from __future__ import annotations

import weakref

import torch

from hetplan.planner.hardware.device import TorchDevice


class ActivationOffload:
    """Pack and unpack hooks moving a stage's saved activations to host memory and back."""

    def __init__(self, device: TorchDevice, params):
        self.device = device
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.stream = device.new_stream() if device.native else None
        self.bytes_out = 0    # bytes copied out (a statistic for tests and runs)

    def hooks(self):
        """The hooks of one microbatch's forward: a tensor saved twice (the same tensor, still
        alive, same version) is copied once."""
        seen: dict[tuple, tuple] = {}

        def pack(t: torch.Tensor):
            try:
                key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
            except (RuntimeError, NotImplementedError):
                return t
            hit = seen.get(key)
            if hit is not None and hit[0]() is t:   # a freed tensor's address may be reused
                return hit[1]
            packed = self._pack(t)
            seen[key] = (weakref.ref(t), packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        try:
            if t.untyped_storage().data_ptr() in self.param_ptrs:
                return t                       # parameters stay where they are
        except (RuntimeError, NotImplementedError):   # tensors without a plain storage
            return t
        host = self.device.host_buffer(t.shape, t.dtype)
        self.bytes_out += t.numel() * t.element_size()
        if self.stream is None:
            host.copy_(t)
            return (t.device, host, None)
        self.stream.wait_stream(self.device.current_stream())
        with self.device.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = self.device.event()
            done.record()
        t.record_stream(self.stream)
        return (t.device, host, done)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is not None:
            self.device.current_stream().wait_event(done)
        return host.to(device, non_blocking=True)


__all__ = ["ActivationOffload"]
