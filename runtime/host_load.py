"""How busy this machine is with other work: measurements taken beside it come out slow."""
from __future__ import annotations

import time

BUSY_WARNING = 0.25       # CPU fraction used by others above which a profile warns


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)   # idle + iowait, total


def busy_fraction(window_s: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time used by anything during `window_s` (from /proc/stat);
    None where there is no /proc/stat."""
    try:
        i0, t0 = _cpu_times()
        time.sleep(window_s)
        i1, t1 = _cpu_times()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0


def busy_warning(busy: float | None) -> str | None:
    """The warning a measurement taken at this load deserves, or None."""
    if busy is None or busy <= BUSY_WARNING:
        return None
    return (f"other processes used {busy:.0%} of the CPU when profiling started: latencies, "
            f"all-reduce times and contention come out too slow on a busy machine; profile a quiet one")
