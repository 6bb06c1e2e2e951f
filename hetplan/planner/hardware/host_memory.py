"""How a training process's host allocator treats freed memory.

glibc's malloc hands large freed blocks back to the OS (blocks above its mmap threshold are
unmapped; the heap's top is trimmed). A training iteration frees and re-allocates the same
gradients, activations and optimizer temporaries every time, so each iteration page-faults them
in again: on a VM a fault costs microseconds per 4 KiB page, a third of a small model's iteration
(docs/tuning.md, "Page faults"). `keep_freed_memory` makes malloc keep what it frees, as the
jemalloc/tcmalloc setups of CPU training recommend; the runtime's workers, the profile's workers
and layer timing all call it, so what is measured is what runs.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1       # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30        # blocks up to this size come from, and go back to, the heap


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; True when the C library took
    them (False elsewhere: another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
