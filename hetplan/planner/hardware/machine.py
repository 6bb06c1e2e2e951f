"""This machine: the facts that make a profile its own (its fingerprint).

A profile belongs to the machine whose fingerprint it records, not to a hostname or a working
directory: every VM here is named `vm`, and a profile carried along with a folder or a shared home
must not stand in for another machine's. The fingerprint is a hash of the CPU model, the core
count, the physical memory, the GPUs and the torch version: what the measured figures depend on.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from hetplan.planner.files.cache import CACHE_ENV, cache_dir  # noqa: F401 - re-exported

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gpus() -> list[str]:
    import torch
    from hetplan.planner.hardware.device import standin_gpus
    n = standin_gpus()
    if n:
        return [f"stand-in {i}" for i in range(n)]
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).name for i in range(torch.cuda.device_count())]


def facts() -> dict:
    """{"cpu_model", "cores", "memory_bytes", "gpus", "torch"} of this machine."""
    import torch
    return {"cpu_model": cpu_model(), "cores": os.cpu_count() or 1, "memory_bytes": _memory_bytes(),
            "gpus": _gpus(), "torch": torch.__version__}


def fingerprint(of: dict | None = None) -> str:
    """16 hex digits of the sha256 of `of` (default this machine's facts) as sorted JSON."""
    text = json.dumps(of if of is not None else facts(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_HERE: dict[int, str] = {}   # by the number of stand-in GPUs in force (tests switch them on)


def this_machine() -> str:
    """This machine's fingerprint (computed once per process and stand-in setting)."""
    from hetplan.planner.hardware.device import standin_gpus
    n = standin_gpus()
    if n not in _HERE:
        _HERE[n] = fingerprint()
    return _HERE[n]


__all__ = ["CACHE_ENV", "cache_dir", "cpu_model", "facts", "fingerprint", "this_machine"]
