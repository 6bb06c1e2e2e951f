"""Benchmarks run from any directory: importing this puts the repository's root on the path of
the commands a benchmark starts (`hetplan run` of a plan whose model is `benchmarks.*`), as each
benchmark puts it on its own."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def benchmark_profile(cpu_workers: int = 2) -> Path:
    """The benchmarks' own profile of this machine, named (not `hetplan profile`'s default, which
    may have another worker count): <cache>/profiles/<fingerprint>-<N>cpu.json."""
    from hetplan.planner.hardware.lookup import profiles_dir
    from hetplan.planner.hardware.machine import this_machine
    return profiles_dir() / f"{this_machine()}-{cpu_workers}cpu.json"

if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
