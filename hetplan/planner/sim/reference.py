"""The reference event loop: what a simulated iteration means, written plainly (SimPy's
`Environment.step` is the model). Every engine (hetplan.planner.sim.engines) gives its times bit for bit
or declines; tests/test_engines.py holds them to it.

A task holds one or more resources (a device's compute queue, a link direction; an all-reduce
holds every resource of its ring at once) for its duration, after all its predecessors end.
The rules, applied instant by instant:
1. every task ending at the instant ends (its resources free, its successors one dependency
   closer) before anything starts;
2. a task whose last dependency ended joins the queue of each of its resources, ordered by the
   tuple (ready time, task id): that tuple alone breaks ties; a task holding no resource (a
   join) ends at once, in the next round of the same instant;
3. resources are visited in id order; a free one starts the head of its queue when all of
   that task's resources are free (so an all-reduce may wait while a later single task on
   another resource starts);
4. a task on one resource that sat idle before the instant (its worker blocked waiting for
   it) lasts its wake-up longer (`wake`).
"""
from __future__ import annotations

import heapq

from hetplan.planner.sim.deadlock import Deadlock


def run(dur, res, succ, ndeps, n_res: int, wake: dict[int, float] | None = None) -> tuple[list[float], list[float]]:
    """(start, end) of every task; `dur`, `res` (resource ids), `succ` and `ndeps` (number of
    predecessors) per task id, `wake` per task that wakes up. Raises hetplan.planner.sim.deadlock.Deadlock
    where some task never becomes ready."""
    wake, waiting = wake or {}, list(ndeps)
    n = len(dur)
    start: list[float | None] = [None] * n
    end = [0.0] * n
    busy, free_at = [False] * n_res, [0.0] * n_res      # free_at: when each resource last became free
    queue: list[list[tuple[float, int]]] = [[] for _ in range(n_res)]   # heaps of (ready time, task)
    events: list[tuple[float, int]] = []                 # heap of (end time, task)
    now, ready, touched = 0.0, [t for t in range(n) if waiting[t] == 0], set()
    while True:
        for t in ready:                                   # rule 2
            if not res[t]:
                start[t] = end[t] = now
                heapq.heappush(events, (now, t))
            for x in res[t]:
                heapq.heappush(queue[x], (now, t))
                touched.add(x)
        for x in sorted(touched):                         # rule 3
            q = queue[x]
            while q and start[q[0][1]] is not None:       # started through another resource
                heapq.heappop(q)
            if busy[x] or not q:
                continue
            t = q[0][1]
            if any(busy[y] for y in res[t]):
                continue
            for y in res[t]:
                busy[y] = True
            woken = len(res[t]) == 1 and free_at[x] < now   # rule 4
            start[t], end[t] = now, now + dur[t] + (wake.get(t, 0.0) if woken else 0.0)
            heapq.heappush(events, (end[t], t))
        ready, touched = [], set()
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:             # rule 1
            t = heapq.heappop(events)[1]
            for x in res[t]:
                busy[x], free_at[x] = False, now
                touched.add(x)
            for v in succ[t]:
                waiting[v] -= 1
                if waiting[v] == 0:
                    ready.append(v)
    if None in start:
        raise Deadlock(start, res)
    return start, end


__all__ = ["run"]
