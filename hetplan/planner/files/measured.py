"""The measured file (`hetplan.measured/1`): what `run` observed, read by `compare`.

`iteration_s` is the median of `iterations_s` after the warm-up iterations; `per_device` holds
each device's compute-only busy time per iteration (`busy_s`) and peak memory, plus whatever else
the runtime records (for example a timeline of one iteration under `events`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetplan.planner.files.io import InputError, Reader, read_json, write_json_atomic

SCHEMA = "hetplan.measured/1"


@dataclass(frozen=True)
class Measured:
    plan_sha256: str
    iterations_s: tuple[float, ...]
    iteration_s: float
    losses: tuple[float, ...] = ()
    per_device: dict[str, dict[str, Any]] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    torch: str = ""
    extra: dict[str, Any] = field(default_factory=dict)   # warmup, iters, world size, ...


# top-level fields: the contract's, then what `run` adds (kept in Measured.extra) and what the
# benchmarks add (`baseline`); `per_device.*` is free-form besides the fields checked below
_FIELDS = ("schema", "plan_sha256", "iterations_s", "iteration_s", "losses", "per_device", "host", "torch")
_EXTRA = ("iters", "warmup", "world_size", "timing", "topology", "startup_s", "baseline",
          # a training run's (`run --steps`): its logged rows, steps [first, total), checkpoint
          # times and the batch shares in force from each step on ({"step", "shares"}, rebalancing)
          "rows", "steps", "checkpoint_save_s", "checkpoint_load_s", "shares")


def measured_from_dict(data: Any, file: str = "<measured>") -> Measured:
    r = Reader(data, file)
    r.only(_FIELDS, free=_EXTRA)
    schema = r.get("schema", str)
    if schema != SCHEMA:
        raise r.error("schema", f"expected {SCHEMA!r}, got {schema!r}")
    its = _numbers(r, "iterations_s", allow_empty=False)
    losses = _numbers(r, "losses", allow_empty=True, nonnegative=False) if r.has("losses") else []
    per_device = r.get("per_device", dict, default={})
    for dev, v in per_device.items():
        _check_device(Reader(v, file, f"per_device.{dev}"))
    host = r.get("host", dict, default={})
    return Measured(plan_sha256=r.get("plan_sha256", str), iterations_s=tuple(its),
                    iteration_s=r.get("iteration_s", float, check=lambda x: x > 0, expected="a positive number"),
                    losses=tuple(losses), per_device=per_device, host=host,
                    torch=r.get("torch", str, default=""),
                    extra={k: v for k, v in r.data.items() if k not in _FIELDS})


def _numbers(r: Reader, key: str, allow_empty: bool, nonnegative: bool = True) -> list[float]:
    """A list of (non-negative) numbers as floats; the first bad one is named by its index."""
    out = []
    for i, x in enumerate(r.items(key, allow_empty)):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or (nonnegative and x < 0):
            raise InputError(f"{r.file}: {r.where(key)}[{i}]: expected a {'non-negative ' if nonnegative else ''}number, got {x!r:.60}")
        out.append(float(x))
    return out


def _check_device(d: Reader) -> None:
    """What `compare` reads of a device: busy time and peak memory as non-negative numbers, and
    the timeline `events` as spans {"name", "kind", "start_s", "end_s"} with end_s >= start_s."""
    for key in ("busy_s", "peak_memory_bytes"):
        d.get(key, float, default=None, check=lambda x: x >= 0, expected="a non-negative number")
    d.get("events_iteration", int, default=None, check=lambda x: x >= 0, expected="a non-negative integer")
    for e in d.readers("events", allow_empty=True) if d.has("events") else []:
        e.get("name", str)
        e.get("kind", str)
        start = e.get("start_s", float)
        e.get("end_s", float, check=lambda x: x >= start, expected=f"a number >= start_s ({start:g})")


def measured_to_dict(m: Measured) -> dict[str, Any]:
    return {"schema": SCHEMA, "plan_sha256": m.plan_sha256, "iterations_s": list(m.iterations_s),
            "iteration_s": m.iteration_s, "losses": list(m.losses), "per_device": m.per_device,
            "host": m.host, "torch": m.torch, **m.extra}


def load_measured(path: str | Path) -> Measured:
    return measured_from_dict(read_json(path, "measured file"), str(path))


def save_measured(m: Measured, path: str | Path) -> None:
    write_json_atomic(path, measured_to_dict(m))
