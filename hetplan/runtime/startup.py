"""Where the start-up of `hetplan run` goes: named wall-clock marks, turned into phases.

Every process records `time.time()` marks (wall clock, so marks of different processes on one
machine compare). A rank's phases (`RANK_PHASES`) are the differences of consecutive marks:

    process_start  launcher asks for the process -> the child runs its first line
    imports        -> the worker's modules are imported (torch is preloaded by the forkserver)
    rendezvous     -> init_process_group and the device exchange are done
    model_build    -> the workload is built (load_workload, torch.manual_seed(0))
    stage_build    -> its stage, layer map, process groups, sync and optimizer exist
    first_iteration-> the first training iteration (data, barrier, step) is done
    training       -> the remaining iterations are done (not start-up; for the total)
    teardown       -> results gathered and written, process groups destroyed, process exited

The launcher's own phases: `imports` (its process start -> `run` begins), `checks` (plan, model,
devices), `spawn` (starting every worker process). Kept in the measured file under `startup_s`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

RANK_MARKS = ("spawn", "entered", "imported", "rendezvous", "model", "stages", "first_iteration",
              "trained", "exited")
RANK_PHASES = ("process_start", "imports", "rendezvous", "model_build", "stage_build",
               "first_iteration", "training", "teardown")
# test only: "RANK:ITERATION:exit|raise|hang" fails that rank (hetplan.runtime.worker), "RANK:STEP:kill|kill-in-save"
# SIGKILLs it after that step or inside that step's checkpoint save (hetplan.runtime.train)
FAULT_ENV = "HETPLAN_TEST_FAULT"


class Marks:
    """Named wall-clock timestamps of one process, in the order they were taken."""

    def __init__(self, **initial: float):
        self.at: dict[str, float] = dict(initial)

    def mark(self, name: str) -> None:
        self.at[name] = time.time()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.at))

    @staticmethod
    def load(path: str | Path) -> "Marks":
        return Marks(**json.loads(Path(path).read_text()))


def process_start_time() -> float | None:
    """This process's start (wall clock) from /proc (Linux); None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])           # field 22 of proc(5): starttime, clock ticks after boot
        boot = next(float(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines()
                    if l.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def phases(marks: dict[str, float], names: tuple[str, ...], order: tuple[str, ...]) -> dict[str, float]:
    """Seconds between consecutive marks of `order`, named by `names`; a missing mark skips."""
    out = {}
    for name, (a, b) in zip(names, zip(order, order[1:])):
        if a in marks and b in marks:
            out[name] = round(marks[b] - marks[a], 4)
    return out


def rank_phases(marks: dict[str, float]) -> dict[str, float]:
    return phases(marks, RANK_PHASES, RANK_MARKS)


def launcher_phases(marks: dict[str, float]) -> dict[str, float]:
    return phases(marks, ("imports", "checks", "spawn", "workers"),
                  ("process", "main", "checked", "spawned", "exited"))


def format_lines(startup: dict[str, dict[str, float]]) -> list[str]:
    """One line per process (launcher, then devices): its phases in order, then their sum."""
    lines = ["start-up breakdown (s):"]
    for who, row in startup.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row.items())
        lines.append(f"  {who}: {parts} (sum {sum(row.values()):.2f})")
    return lines
