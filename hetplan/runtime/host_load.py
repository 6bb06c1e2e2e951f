"""How busy this machine is with other work: measurements taken beside it come out slow."""
from __future__ import annotations

import os
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


class ForeignCPU:
    """Samples /proc every `period_s` in a thread and sums the CPU time used by processes other
    than this one, its children and those carrying its `tag` in their environment (a command
    started with `env()`): other work on this machine, during a measurement. (A foreign process
    that lives less than one period is missed.)"""

    TAG = "HETPLAN_MEASURE_TAG"

    def __init__(self, period_s: float = 0.2):
        import threading
        import uuid
        self.period_s, self.first, self.last, self.mine = period_s, {}, {}, {}
        self.tag = f"{self.TAG}={uuid.uuid4().hex}".encode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _procs() -> dict[int, tuple[int, float]]:
        if not os.path.isdir("/proc"):        # not Linux: nothing to see
            return {}
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        rest = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                out[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)  # ppid, cpu
        return out

    def env(self) -> dict:
        """The environment to start the measured command with."""
        k, v = self.tag.decode().split("=")
        return {**os.environ, k: v}

    def _is_mine(self, pid: int, ppid: int) -> bool | None:
        """True: this process or one carrying the tag or a child of one of ours; False: not;
        None: undecided (its environment is not readable yet, e.g. in the middle of exec)."""
        if os.getpid() in (pid, ppid) or self.mine.get(ppid):
            return True
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            return None
        return (self.tag in env.split(b"\0")) if env else None

    def _sample(self) -> None:
        procs = self._procs()
        for pid in sorted(procs, key=lambda p: (procs[p][0] != os.getpid(), p)):
            ppid, cpu = procs[pid]
            if self.mine.get(pid) is None:
                self.mine[pid] = self._is_mine(pid, ppid)
            if self.mine[pid] is False:
                self.first.setdefault(pid, cpu)
                self.last[pid] = cpu

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._sample()
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall_s = time.perf_counter() - self._t0

    def fraction(self) -> float:
        """Foreign CPU seconds / (wall seconds x cores)."""
        used = sum(self.last[p] - self.first[p] for p in self.last)
        return used / (self.wall_s * (os.cpu_count() or 1))


def busy_warning(busy: float | None) -> str | None:
    """The warning a measurement taken at this load deserves, or None."""
    if busy is None or busy <= BUSY_WARNING:
        return None
    return (f"other processes used {busy:.0%} of the CPU while profiling: latencies, all-reduce "
            f"times and contention come out too slow on a busy machine; profile a quiet one")
