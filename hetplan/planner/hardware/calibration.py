"""Calibration: figures fitted on this machine, stored as the topology's optional `calibration`
object (SI units in the keys; fields: see `Calibration`). The cost model uses each figure that is
present and the contract's formula otherwise, so what-if files keep roofline semantics.

The fits themselves: hetplan.planner.hardware.fit. History and figures: docs/tuning.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetplan.planner.files.io import Reader


@dataclass(frozen=True)
class OptimizerFit:
    s_per_tensor: float      # Python/launch overhead per parameter tensor
    s_per_byte: float        # per parameter byte (memory traffic of the update)
    s_fixed: float = 0.0     # per step (an accelerator's: the host's work, its launches)

    def step_s(self, n_tensors: int, param_bytes: float) -> float:
        """s_fixed + n_tensors * s_per_tensor + param_bytes * s_per_byte."""
        return self.s_fixed + n_tensors * self.s_per_tensor + param_bytes * self.s_per_byte


@dataclass(frozen=True)
class Calibration:
    cpu_workers: int = 1                           # CPU worker processes the figures were measured with
    cpu_contention_factor: float = 1.0             # a step's time with all CPU workers busy / alone
    allreduce_latency_s: float | None = None       # gloo all-reduce over the CPU workers:
    allreduce_bytes_per_s: float | None = None     #   latency_s + bytes / bytes_per_s (fitted)
    allreduce_curve: tuple[tuple[float, float], ...] = ()   # ((bytes, s), ...) measured over the
                                                   #   CPU workers, lower envelope (fit.lower_envelope)
    allreduce_queued_s: float | None = None        # the latency of an all-reduce issued right behind
                                                   #   another of its group (None: as a lone one's)
    allgather_curve: tuple[tuple[float, float], ...] = ()   # ((bytes gathered, s), ...) over the CPU
                                                   #   workers, lower envelope (ZeRO's gathers)
    optimizer: dict[str, OptimizerFit] = field(default_factory=dict)   # per torch.optim name
    iteration_overhead_s: float = 0.0              # the runtime loop's own work per iteration
    multi_worker_overhead_s: float = 0.0           # older profiles only, not used (a per-iteration
                                                   #   barrier's exit skew; see hetplan.runtime.results)
    memory_contention_factor: float | None = None  # an optimizer step with all CPU workers stepping
                                                   #   / alone (None: cpu_contention_factor)
    wake_latency_s: float = 0.0                    # a CPU worker blocked in a receive for a while
                                                   #   resumes this much after the message lands
    cold_compute_s: float = 0.0                    # and its first compute after such a wait runs this
                                                   #   much longer than back to back (cold caches)
    send_issue_s: float = 0.0                      # a worker's thread issuing one isend (gloo)
    recv_post_s: float = 0.0                       # and posting one irecv
    action_overhead_s: float = 0.0                 # the runtime's own work per schedule action
                                                   #   (driver, timers, contexts), besides compute
    grad_accumulate_s_per_byte: float = 0.0        # a backward adding into existing gradients
                                                   #   (microbatches after the first), per param byte
    ddp_forward_s: float = 0.0                     # torch DDP's own work per forward (its Python
                                                   #   wrapper, the reducer's preparation)
    grad_copy_s_per_byte: float = 0.0              # copying fresh gradients into a flat bucket
                                                   #   buffer (or back), per byte
    held_send_curve: tuple[tuple[float, float], ...] = ()   # ((w, s), ...): how long a message
                                                   #   whose receive is posted while its sender
                                                   #   computes is held, expected, when the sender
                                                   #   waits after w seconds of compute

    def held_send_s(self, window_s: float) -> float:
        """The expected hold of such a message (held_send_curve: straight lines from (0, 0)
        through its points, flat beyond the last); 0 without a curve."""
        if not self.held_send_curve or window_s <= 0.0:
            return 0.0
        x0 = y0 = 0.0
        for x1, y1 in self.held_send_curve:
            if window_s <= x1:
                return y0 + (y1 - y0) * (window_s - x0) / (x1 - x0)
            x0, y0 = x1, y1
        return y0

    def contention(self, busy_workers: float) -> float:
        """Slowdown of a CPU worker's compute when `busy_workers` CPU workers of its host (itself
        included) compute at once (a mean over time, so fractional): 1 + (F - 1) * (k - 1) / (N - 1),
        linear between alone (1) and all N measured workers (F); capped at F beyond N."""
        return self._interpolate(self.cpu_contention_factor, busy_workers)

    def memory_contention(self, busy_workers: float) -> float:
        """Slowdown of a memory-bound step (the optimizer's) when `busy_workers` CPU workers run
        at once: as `contention` with memory_contention_factor (cpu_contention_factor when not
        measured)."""
        f = self.memory_contention_factor
        return self._interpolate(self.cpu_contention_factor if f is None else f, busy_workers)

    def _interpolate(self, factor: float, busy_workers: float) -> float:
        """1 + (factor - 1) * (k - 1) / (N - 1) for k busy of N measured workers, capped at k = N;
        1 alone (k <= 1) or when fitted with one worker."""
        n, k = self.cpu_workers, max(1.0, busy_workers)
        if n <= 1 or k <= 1:
            return 1.0
        return 1.0 + (factor - 1.0) * min(k - 1, n - 1) / (n - 1)

    def allreduce_s(self, k: int, n_bytes: float, queued: bool = False) -> float | None:
        """gloo all-reduce of n bytes over k CPU workers, scaled from N measured workers by the
        ring's step counts: l * s + (t_N(n) - l) * v with s = (k-1)/(N-1),
        v = [(k-1)/k] / [(N-1)/N]. t_N is the measured curve (straight lines between its sizes,
        the smallest size's time below it, the last segment's slope beyond) and l the fit's
        latency_s capped at the curve's first time; without a curve t_N = latency_s + n /
        bytes_per_s, l = latency_s. `queued` (issued right behind another all-reduce of its
        group): allreduce_queued_s, where measured, replaces the first l (lower where a lone call's
        wake-ups are saved, higher where the queued calls' threads share the workers' cores).
        None without a fit (the caller uses the ring formula)."""
        if k <= 1:
            return 0.0
        if self.allreduce_latency_s is None or self.allreduce_bytes_per_s is None:
            return None
        lat = self.allreduce_latency_s
        if self.allreduce_curve:
            lat = min(lat, self.allreduce_curve[0][1])      # no more than the smallest measured
        first = self.allreduce_queued_s if queued and self.allreduce_queued_s is not None else lat
        rest = (_on_curve(self.allreduce_curve, n_bytes) - lat if self.allreduce_curve
                else n_bytes / self.allreduce_bytes_per_s)
        return self._ring_scaled(k, first, rest)

    def allgather_s(self, k: int, n_bytes: float) -> float | None:
        """gloo all-gather of n bytes in all over k CPU workers, from N measured workers as
        `allreduce_s` scales its curve (l the curve's first time); None without a curve."""
        if k <= 1:
            return 0.0
        if not self.allgather_curve:
            return None
        lat = self.allgather_curve[0][1]
        return self._ring_scaled(k, lat, _on_curve(self.allgather_curve, n_bytes) - lat)

    def _ring_scaled(self, k: int, first: float, rest: float) -> float:
        """A collective measured over N workers, for k: `first` (its latency) by the ring's steps,
        `rest` (the time beyond it) by its volume (`allreduce_s`)."""
        n = max(2, self.cpu_workers)
        return first * ((k - 1) / (n - 1)) + rest * (((k - 1) / k) / ((n - 1) / n))


def _on_curve(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through the points; flat below the first, the last slope beyond."""
    if x <= curve[0][0] or len(curve) == 1:
        return curve[0][1] if x <= curve[0][0] else curve[-1][1] * x / curve[-1][0]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = curve[-2], curve[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


# --- file format ------------------------------------------------------------------------------
def calibration_from_dict(data: Any, file: str = "<topology>") -> Calibration:
    r = Reader(data, file, "calibration")
    pos = dict(check=lambda v: v > 0, expected="a positive number")
    nonneg = dict(check=lambda v: v >= 0, expected="a non-negative number")
    non_negative = lambda name, default=0.0: r.get(name, float, default=default, **nonneg)  # noqa: E731
    opt = {}
    for name, v in r.get("optimizer", dict, default={}).items():
        o = Reader(v, file, f"calibration.optimizer.{name}")
        opt[name] = OptimizerFit(o.get("s_per_tensor", float, **nonneg), o.get("s_per_byte", float, **nonneg))
    return Calibration(
        cpu_workers=r.get("cpu_workers", int, default=1, check=lambda v: v >= 1, expected="a positive integer"),
        cpu_contention_factor=r.get("cpu_contention_factor", float, default=1.0,
                                    check=lambda v: v >= 1, expected="a number >= 1"),
        allreduce_latency_s=non_negative("allreduce_latency_s", None),
        allreduce_bytes_per_s=r.get("allreduce_bytes_per_s", float, default=None, **pos),
        allreduce_curve=tuple((float(n), float(t)) for n, t in r.get(
            "allreduce_curve", list, default=[], check=_is_curve,
            expected="[[bytes, seconds], ...] with positive numbers, sizes increasing")),
        allreduce_queued_s=non_negative("allreduce_queued_s", None),
        allgather_curve=tuple((float(n), float(t)) for n, t in r.get(
            "allgather_curve", list, default=[], check=_is_curve,
            expected="[[bytes, seconds], ...] with positive numbers, sizes increasing")),
        optimizer=opt,
        iteration_overhead_s=non_negative("iteration_overhead_s"),
        multi_worker_overhead_s=non_negative("multi_worker_overhead_s"),
        memory_contention_factor=r.get("memory_contention_factor", float, default=None,
                                       check=lambda v: v >= 1, expected="a number >= 1"),
        wake_latency_s=non_negative("wake_latency_s"),
        cold_compute_s=non_negative("cold_compute_s"),
        send_issue_s=non_negative("send_issue_s"),
        recv_post_s=non_negative("recv_post_s"),
        action_overhead_s=non_negative("action_overhead_s"),
        grad_accumulate_s_per_byte=non_negative("grad_accumulate_s_per_byte"),
        ddp_forward_s=non_negative("ddp_forward_s"),
        grad_copy_s_per_byte=non_negative("grad_copy_s_per_byte"),
        held_send_curve=tuple((float(w), float(t)) for w, t in r.get(
            "held_send_curve", list, default=[], check=lambda v: _is_curve(v, zero_times=True),
            expected="[[window_seconds, seconds], ...] with windows positive and increasing, "
                     "seconds non-negative")))


def _is_curve(v: Any, zero_times: bool = False) -> bool:
    """[[x, y], ...] of numbers, x positive and increasing, y positive (or 0 with `zero_times`)."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    ok = all(isinstance(p, list) and len(p) == 2 and all(map(num, p)) and p[0] > 0
             and (p[1] >= 0 if zero_times else p[1] > 0) for p in v)
    return ok and all(a[0] < b[0] for a, b in zip(v, v[1:]))


def calibration_to_dict(c: Calibration) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_workers": c.cpu_workers, "cpu_contention_factor": c.cpu_contention_factor}
    if c.allreduce_latency_s is not None and c.allreduce_bytes_per_s is not None:
        out.update(allreduce_latency_s=c.allreduce_latency_s, allreduce_bytes_per_s=c.allreduce_bytes_per_s)
    if c.allreduce_curve:
        out["allreduce_curve"] = [list(p) for p in c.allreduce_curve]
    if c.allreduce_queued_s is not None:
        out["allreduce_queued_s"] = c.allreduce_queued_s
    if c.allgather_curve:
        out["allgather_curve"] = [list(p) for p in c.allgather_curve]
    if c.optimizer:
        out["optimizer"] = {k: {"s_per_tensor": v.s_per_tensor, "s_per_byte": v.s_per_byte}
                            for k, v in sorted(c.optimizer.items())}
    out["iteration_overhead_s"] = c.iteration_overhead_s
    if c.multi_worker_overhead_s:
        out["multi_worker_overhead_s"] = c.multi_worker_overhead_s
    if c.memory_contention_factor is not None:
        out["memory_contention_factor"] = c.memory_contention_factor
    out["wake_latency_s"] = c.wake_latency_s
    for name in ("cold_compute_s", "send_issue_s", "recv_post_s", "action_overhead_s",
                 "grad_accumulate_s_per_byte", "ddp_forward_s",
                 "grad_copy_s_per_byte"):   # absent in older profiles
        if getattr(c, name):
            out[name] = getattr(c, name)
    if c.held_send_curve:
        out["held_send_curve"] = [list(p) for p in c.held_send_curve]
    return out


def topology_calibration(topology) -> Calibration | None:
    """The topology's calibration (validated), or None for a what-if file without one."""
    data = topology.measured.get("calibration")
    if data is None:
        return None
    return topology.derived("calibration", lambda: calibration_from_dict(data, topology.name))


__all__ = ["Calibration", "OptimizerFit", "calibration_from_dict", "calibration_to_dict",
           "topology_calibration"]
