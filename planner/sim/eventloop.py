"""The simulator's deterministic event loop: list scheduling of a task graph over FIFO resources.

A resource is a device's compute queue or one direction of a link; an all-reduce holds every
resource of its ring at once. See `run` for the order rules (and planner.sim.simulator for what
the tasks are).
"""
from __future__ import annotations

import heapq


def shared_resources(res) -> tuple[int, ...]:
    """The resources of multi-resource tasks (`run`'s `shared_res`), in id order."""
    return tuple(sorted({x for r in res if len(r) > 1 for x in r}))


def run(dur: list[float], res: list[tuple[int, ...]], succ: list[list[int]], ndeps: list[int],
         shared_res: tuple[int, ...], n_res: int,
         wake: dict[int, float] | None = None) -> tuple[list[float], list[float]]:
    """Deterministic list scheduling over FIFO resources; returns start and end times.

    All events (task ends) at one time are applied before any task starts. A queue serves
    its waiting tasks by (ready time, task id); a task holding several resources (an
    all-reduce) starts when all of them are free; queues are served in resource id order,
    so such a task may take a free resource before a single-resource task of a later id.
    `ndeps` is consumed; `shared_res` are the resources of multi-resource tasks.
    `wake` (task -> seconds) lengthens such a single-resource task by its wake-up when it
    starts on a resource that sat idle before it (its worker was blocked waiting for it).

    Speed without changing the order: a waiting entry is the int `rank * n + t` (rank
    counts distinct event times), which orders exactly as (ready time, task id); the tasks
    ending at one time are a list under that time (the order among them does not matter);
    a task whose resource is free, unshared and has an empty queue starts at once, taking
    the newly ready tasks in id order."""
    n = len(dur)
    start: list[float | None] = [None] * n
    end = [0.0] * n
    busy = [False] * n_res
    free_at = [0.0] * n_res             # when each resource last became free
    wake = wake or {}
    solo = [True] * n_res
    for x in shared_res:
        solo[x] = False
    waiting: list[list[int]] = [[] for _ in range(n_res)]
    ends: dict[float, list[int]] = {}   # end time -> tasks ending then
    times: list[float] = []             # heap of the keys of `ends`
    push, pop = heapq.heappush, heapq.heappop
    touched: list[int] = []
    newly = [t for t in range(n) if ndeps[t] == 0]
    now, base = 0.0, 0
    while True:
        if len(newly) > 1:
            newly.sort()
        for t in newly:                     # tasks that became ready at `now`
            r = res[t]
            if len(r) == 1:
                x = r[0]
                if solo[x] and not busy[x] and not waiting[x]:
                    busy[x] = True
                    start[t] = now
                    e = end[t] = now + dur[t] + (wake.get(t, 0.0) if free_at[x] < now else 0.0)
                    if e in ends:
                        ends[e].append(t)
                    else:
                        ends[e] = [t]
                        push(times, e)
                    continue
            elif not r:                     # a pure join completes at once
                start[t] = end[t] = now
                if now in ends:
                    ends[now].append(t)
                else:
                    ends[now] = [t]
                    push(times, now)
                continue
            for x in r:
                push(waiting[x], base + t)
                touched.append(x)
        if len(touched) > 1:
            touched = sorted(set(touched))
        for x in touched:                   # start what can start, lowest resource first
            if busy[x]:
                continue
            w = waiting[x]
            while w and start[w[0] % n] is not None:   # started through another resource
                pop(w)
            if not w:
                continue
            t = w[0] % n
            r = res[t]
            if len(r) > 1:
                if any(busy[y] for y in r):
                    continue
                for y in r:
                    busy[y] = True
                e = end[t] = now + dur[t]
            else:
                pop(w)
                busy[x] = True
                e = end[t] = now + dur[t] + (wake.get(t, 0.0) if free_at[x] < now else 0.0)
            start[t] = now
            if e in ends:
                ends[e].append(t)
            else:
                ends[e] = [t]
                push(times, e)
        touched = []
        newly = []
        if not times:
            break
        e = pop(times)
        if e != now:
            now = e
            base += n
        for t in ends.pop(e):
            for x in res[t]:
                busy[x] = False
                free_at[x] = e
                if waiting[x]:
                    touched.append(x)
            for v in succ[t]:
                ndeps[v] -= 1
                if ndeps[v] == 0:
                    newly.append(v)
    if None in start:
        raise RuntimeError("simulator deadlock: some tasks never became ready")
    return start, end


__all__ = ["run", "shared_resources"]
