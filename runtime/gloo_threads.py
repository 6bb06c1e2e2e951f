"""gloo's event-loop thread yields the cores to the worker's own thread.

gloo's TCP transport reads every socket in one thread per process (`gloo_tcp_loop`, epoll,
level-triggered). Its handler only try-locks a pair's mutex: while the worker's thread holds it
(inside an isend or irecv on that pair) the handler returns and epoll reports the same socket at
once, so the loop thread spins. On a host with more runnable threads than cores (two CPU workers,
their loop threads, anything else) the spinner can take the core of the very thread it waits
for, which then resumes a scheduler slice later: isend/irecv calls of 2-5 ms instead of 30 µs,
a few per iteration, and the loop threads burned more CPU than the two stages computed
(docs/tuning.md, "Small pipelines"). At the lowest priority (nice 19) the loop thread still runs
on any idle core at once, but no longer preempts a worker's thread.
"""
from __future__ import annotations

import os

LOOP_THREAD = "gloo_tcp_loop"   # the thread name gloo gives its TCP event loop
NICE = 19


def lower_gloo_loop_priority() -> list[int]:
    """Set gloo's event-loop threads of this process to nice 19 (an unprivileged change);
    return their thread ids. Call it after the process groups exist: a group created later may
    start a loop thread of its own. Nothing where there is no /proc (not Linux) or no such
    thread."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    done = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith(LOOP_THREAD):
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), NICE)
        except OSError:          # the thread ended meanwhile
            continue
        done.append(int(tid))
    return done
