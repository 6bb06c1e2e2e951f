"""The measured file (`hetplan.measured/1`): what `run` observed, read by `compare`.

`iteration_s` is the median of `iterations_s` after the warm-up iterations; `per_device` holds
each device's compute-only busy time per iteration (`busy_s`) and peak memory, plus whatever else
the runtime records (for example a timeline of one iteration under `events`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.files.io import Reader, read_json, write_json_atomic

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


def measured_from_dict(data: Any, file: str = "<measured>") -> Measured:
    r = Reader(data, file)
    schema = r.get("schema", str)
    if schema != SCHEMA:
        raise r.error("schema", f"expected {SCHEMA!r}, got {schema!r}")
    its = r.items("iterations_s")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in its):
        raise r.error("iterations_s", "expected a list of non-negative numbers")
    losses = r.items("losses", allow_empty=True) if r.has("losses") else []
    per_device = r.get("per_device", dict, default={})
    for dev, v in per_device.items():
        d = Reader(v, file, f"per_device.{dev}")
        d.get("busy_s", float, default=0.0, check=lambda x: x >= 0, expected="a non-negative number")
    host = r.get("host", dict, default={})
    known = {"schema", "plan_sha256", "iterations_s", "iteration_s", "losses", "per_device", "host", "torch"}
    return Measured(plan_sha256=r.get("plan_sha256", str), iterations_s=tuple(float(x) for x in its),
                    iteration_s=r.get("iteration_s", float, check=lambda x: x > 0, expected="a positive number"),
                    losses=tuple(float(x) for x in losses), per_device=per_device, host=host,
                    torch=r.get("torch", str, default=""),
                    extra={k: v for k, v in r.data.items() if k not in known})


def measured_to_dict(m: Measured) -> dict[str, Any]:
    return {"schema": SCHEMA, "plan_sha256": m.plan_sha256, "iterations_s": list(m.iterations_s),
            "iteration_s": m.iteration_s, "losses": list(m.losses), "per_device": m.per_device,
            "host": m.host, "torch": m.torch, **m.extra}


def load_measured(path: str | Path) -> Measured:
    return measured_from_dict(read_json(path, "measured file"), str(path))


def save_measured(m: Measured, path: str | Path) -> None:
    write_json_atomic(path, measured_to_dict(m))
