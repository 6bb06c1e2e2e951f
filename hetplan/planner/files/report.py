"""Predicted vs measured: the comparison behind `hetplan compare` (pure; no I/O, no torch).

Error in percent is `100 * (predicted - measured) / measured`: positive when the model predicts
too slow (or too much memory), negative when it is optimistic; None when nothing was measured.

What is compared, and what the two sides mean:
- iteration: the plan's recorded prediction (`predicted.iteration_s`, what the planner chose on)
  when present, else the simulator's time now; measured is the median after warm-up.
- busy per device: the simulator's compute time (forward, backward, optimizer) vs the runtime's
  compute-only time (CPU perf_counter / CUDA events around the same calls).
- peak memory per device: the memory model vs torch.cuda.max_memory_allocated (CUDA) or the
  growth of peak RSS over training (CPU; an upper bound, allocator caching included).
- phases (when the measured file has a timeline): forward / backward / optimizer seconds of one
  iteration, summed over microbatches, predicted vs measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PHASES = ("forward", "backward", "optimizer")
_SIM_PHASE = {"forward": "fwd_s", "backward": "bwd_s", "optimizer": "optimizer_s"}


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """100 * (predicted - measured) / measured; None if either is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


@dataclass(frozen=True)
class DeviceComparison:
    device: str
    predicted_busy_s: float | None
    measured_busy_s: float | None
    predicted_peak_memory_bytes: float | None
    measured_peak_memory_bytes: float | None
    phases: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # name -> (pred, meas)

    @property
    def busy_error_pct(self) -> float | None:
        return error_pct(self.predicted_busy_s, self.measured_busy_s)

    @property
    def memory_error_pct(self) -> float | None:
        return error_pct(self.predicted_peak_memory_bytes, self.measured_peak_memory_bytes)

    def to_json(self) -> dict[str, Any]:
        out = {"predicted_busy_s": self.predicted_busy_s, "measured_busy_s": self.measured_busy_s,
               "busy_error_pct": self.busy_error_pct,
               "predicted_peak_memory_bytes": self.predicted_peak_memory_bytes,
               "measured_peak_memory_bytes": self.measured_peak_memory_bytes,
               "memory_error_pct": self.memory_error_pct}
        if self.phases:
            out["phases"] = {k: {"predicted_s": p, "measured_s": m, "error_pct": error_pct(p, m)}
                             for k, (p, m) in self.phases.items()}
        return out


@dataclass(frozen=True)
class Comparison:
    predicted_s: float
    measured_s: float
    simulated_s: float                 # the simulator's time now (= predicted_s unless recorded)
    prediction_source: str             # "plan" (predicted.iteration_s) or "simulator"
    plan_matches: bool                 # measured.plan_sha256 == sha256 of the plan file
    per_device: tuple[DeviceComparison, ...]
    interval: tuple[float, float] | None = None   # the prediction's (the plan's recorded one, or drawn)
    interval_probability: float | None = None
    at_shares: dict | None = None      # a rebalanced run priced with the shares in force (compare.priced_at_shares)

    @property
    def error_pct(self) -> float | None:
        return error_pct(self.predicted_s, self.measured_s)

    @property
    def inside(self) -> bool | None:
        """Whether the measured median lies in the interval (None without one)."""
        return None if self.interval is None else self.interval[0] <= self.measured_s <= self.interval[1]

    def to_json(self) -> dict[str, Any]:
        return {"predicted_s": self.predicted_s, "measured_s": self.measured_s,
                "error_pct": self.error_pct, "simulated_s": self.simulated_s,
                "simulated_error_pct": error_pct(self.simulated_s, self.measured_s),
                "prediction_source": self.prediction_source, "plan_matches": self.plan_matches,
                "iteration_s_interval": list(self.interval) if self.interval else None,
                "interval_probability": self.interval_probability, "inside_interval": self.inside,
                "per_device": {d.device: d.to_json() for d in self.per_device},
                **({"at_shares": self.at_shares} if self.at_shares else {})}


def measured_phases(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per phase in one iteration's timeline (spans summed by kind)."""
    out = dict.fromkeys(PHASES, 0.0)
    for e in events:
        if e.get("kind") in out:
            out[e["kind"]] += float(e["end_s"]) - float(e["start_s"])
    return out


def compare(predicted_iteration_s: float | None, simulated: dict[str, Any], measured,
            plan_matches: bool, interval: tuple[float, float] | None = None,
            interval_probability: float | None = None) -> Comparison:
    """Build the comparison.

    predicted_iteration_s: the plan's `predicted.iteration_s` or None; simulated: a
    SimResult.to_json() dict; measured: a hetplan.planner.files.measured.Measured; interval: the
    prediction's, with its probability. Devices are those of the
    simulation in its order, then any only the measurement has."""
    sim_dev = simulated["per_device"]
    devices = list(sim_dev) + [d for d in measured.per_device if d not in sim_dev]
    rows = []
    for d in devices:
        s, m = sim_dev.get(d, {}), measured.per_device.get(d, {})
        phases = {}
        if m.get("events"):
            got = measured_phases(m["events"])
            phases = {k: (s.get(_SIM_PHASE[k]), got[k]) for k in PHASES}
        rows.append(DeviceComparison(
            device=d, predicted_busy_s=s.get("busy_s"), measured_busy_s=_num(m.get("busy_s")),
            predicted_peak_memory_bytes=s.get("peak_memory_bytes"),
            measured_peak_memory_bytes=_num(m.get("peak_memory_bytes")), phases=phases))
    sim_s = float(simulated["iteration_s"])
    source = "plan" if predicted_iteration_s is not None else "simulator"
    pred = float(predicted_iteration_s) if predicted_iteration_s is not None else sim_s
    return Comparison(predicted_s=pred, measured_s=measured.iteration_s, simulated_s=sim_s,
                      prediction_source=source, plan_matches=plan_matches, per_device=tuple(rows),
                      interval=interval, interval_probability=interval_probability)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def table_rows(c: Comparison) -> list[dict[str, Any]]:
    """One row per compared quantity: what, device, predicted, measured, unit, error %."""
    rows = [{"quantity": "iteration", "device": "all", "predicted": c.predicted_s * 1e3,
             "measured": c.measured_s * 1e3, "unit": "ms", "error %": c.error_pct}]
    if c.prediction_source == "plan" and c.simulated_s != c.predicted_s:
        rows.append({"quantity": "iteration (simulated now)", "device": "all",
                     "predicted": c.simulated_s * 1e3, "measured": c.measured_s * 1e3, "unit": "ms",
                     "error %": error_pct(c.simulated_s, c.measured_s)})
    for d in c.per_device:
        rows.append({"quantity": "busy", "device": d.device, "predicted": _scaled(d.predicted_busy_s, 1e3),
                     "measured": _scaled(d.measured_busy_s, 1e3), "unit": "ms", "error %": d.busy_error_pct})
        for k, (p, m) in d.phases.items():
            rows.append({"quantity": f"  {k}", "device": d.device, "predicted": _scaled(p, 1e3),
                         "measured": _scaled(m, 1e3), "unit": "ms", "error %": error_pct(p, m)})
        rows.append({"quantity": "peak memory", "device": d.device,
                     "predicted": _scaled(d.predicted_peak_memory_bytes, 1e-6),
                     "measured": _scaled(d.measured_peak_memory_bytes, 1e-6), "unit": "MB",
                     "error %": d.memory_error_pct})
    return rows


def _scaled(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


__all__ = ["error_pct", "DeviceComparison", "Comparison", "compare", "measured_phases", "table_rows"]
