"""Chrome trace export (chrome://tracing, https://ui.perfetto.dev) of a simulated iteration.

One process ("hetplan simulate"); one thread lane per device compute queue, per link direction
("cpu:0->cuda:0") and per all-reduce ring ("cuda:0+cuda:1"). Times are microseconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hetplan.planner.files.io import write_json_atomic
from hetplan.planner.sim.simulator import SimResult


def chrome_trace(result: SimResult) -> dict[str, Any]:
    if result.tasks is None:
        raise ValueError("chrome_trace needs a result simulated with trace=True")
    lanes: dict[str, int] = {}
    for t in sorted(result.tasks, key=lambda t: ("->" in t["lane"] or "+" in t["lane"], t["lane"])):
        lanes.setdefault(t["lane"], len(lanes) + 1)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                                     "args": {"name": "hetplan simulate"}}]
    for lane, tid in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
    for t in result.tasks:
        events.append({"name": t["name"], "cat": t["kind"], "ph": "X", "pid": 1, "tid": lanes[t["lane"]],
                       "ts": t["start_s"] * 1e6, "dur": (t["end_s"] - t["start_s"]) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"iteration_s": result.iteration_s, "feasible": result.feasible}}


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    write_json_atomic(path, chrome_trace(result))


__all__ = ["chrome_trace", "write_chrome_trace"]
