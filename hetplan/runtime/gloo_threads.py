"""How a worker's threads share its cores: gloo's event-loop thread yields them to the worker's
own thread (`lower_gloo_loop_priority`), and every thread runs in short scheduler slices
(`short_slices`).

gloo's TCP transport reads every socket in one thread per process (`gloo_tcp_loop`, epoll,
level-triggered). Its handler only try-locks a pair's mutex: while the worker's thread holds it
(inside an isend or irecv on that pair) the handler returns and epoll reports the same socket at
once, so the loop thread spins. On a host with more runnable threads than cores (two CPU workers,
their loop threads, anything else) the spinner can take the core of the very thread it waits
for, which then resumes a scheduler slice later: isend/irecv calls of 2-5 ms instead of 30 µs,
a few per iteration, and the loop threads burned more CPU than the two stages computed
(docs/tuning.md, "Small pipelines"). At the lowest priority (nice 19) the loop thread still runs
on any idle core at once, but no longer preempts a worker's thread.

gloo runs an async collective (DDP's buckets) on its work threads, which sleep between the
steps of the ring. A bound one-core worker's compute thread keeps the core for its scheduler
slice (1.4 ms by default on a 2-core Linux 6.18 guest), so a work thread woken by its peer's
data waits up to that long, step after step: fine data parallel ran iterations of 2.4 ms and of
5 or 8 ms in one run (docs/tuning.md, "Short scheduler slices"). With a 100 µs slice for every
thread of the worker (Linux >= 6.12, EEVDF's per-thread slice through sched_setattr) the woken
thread runs within one; older kernels and other systems ignore it.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

LOOP_THREAD = "gloo_tcp_loop"   # the thread name gloo gives its TCP event loop
NICE = 19
SLICE_NS = 100_000              # every worker thread's scheduler slice (short_slices)
# sched_setattr and sched_getattr per architecture; elsewhere short_slices does nothing
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_ATTR = "IIQiIQQQII"   # struct sched_attr: size, policy, flags, nice, priority, runtime (the slice), ...


def thread_ids() -> list[int] | None:
    """This process's thread ids, None where there is no /proc (not Linux)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None


def lower_gloo_loop_priority(nice: int = NICE) -> list[int]:
    """Set gloo's event-loop threads of this process to `nice` (19; an unprivileged change);
    return their thread ids. Call it after the process groups exist: a group created later may
    start a loop thread of its own. Nothing where there is no /proc (not Linux) or no such
    thread."""
    done = []
    for tid in thread_ids() or ():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith(LOOP_THREAD):
                    continue
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:          # the thread ended meanwhile
            continue
        done.append(tid)
    return done


def thread_slice_ns(tid: int = 0) -> int | None:
    """A thread's scheduler slice as the kernel reports it (0: the calling thread), or None
    where sched_getattr is unknown or fails."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return None
    buf = ctypes.create_string_buffer(struct.calcsize(_ATTR))
    if ctypes.CDLL(None, use_errno=True).syscall(calls[1], tid, buf, len(buf), 0) != 0:
        return None
    return struct.unpack(_ATTR, buf.raw)[5]


def short_slices(slice_ns: int = SLICE_NS) -> list[int]:
    """Give every thread of this process a scheduler slice of `slice_ns`, each keeping its nice
    (threads started later inherit it); return the thread ids set. Nothing where there is no
    /proc, no sched_setattr for this architecture, or the kernel refuses."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:   # no sched_setattr known for this architecture
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    done = []
    for tid in thread_ids() or ():
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:          # the thread ended meanwhile
            continue
        attr = ctypes.create_string_buffer(struct.pack(_ATTR, struct.calcsize(_ATTR), 0, 0, nice, 0,
                                                       slice_ns, 0, 0, 0, 0))
        if libc.syscall(calls[0], tid, attr, 0) == 0:
            done.append(tid)
    return done


def threads_slices() -> list[int] | None:
    """The distinct scheduler slices of this process's threads, in ns (the measured file's
    per-device `slices_ns`); None where they cannot be read."""
    tids = thread_ids()
    if tids is None:
        return None
    out = {thread_slice_ns(t) for t in tids}
    out.discard(None)           # a thread that ended meanwhile
    return sorted(out) or None
