"""The simulator's event loop (engine EVENT_LOOP): hetplan.planner.sim.reference's rules, the same times
bit for bit, faster in the same order: a queue's entries are ints `rank * n + t` (rank: distinct
event times so far), ordered as (ready time, task id); a task whose resource is free, unshared and
has an empty queue starts at once, the newly ready tasks taken in id order.
"""
from __future__ import annotations

import heapq

from hetplan.planner.sim.deadlock import Deadlock


def shared_resources(res) -> tuple[int, ...]:
    """The resources of multi-resource tasks (`run`'s `shared_res`), in id order."""
    return tuple(sorted({x for r in res if len(r) > 1 for x in r}))


def _fresh(n: int, n_res: int, shared_res: tuple[int, ...]) -> tuple:
    """`run`'s state before the first instant: per task its start (None: not started) and end;
    per resource whether busy, when it was last freed, whether only single-resource tasks hold
    it (solo), and its queue (a heap)."""
    solo = [True] * n_res
    for x in shared_res:
        solo[x] = False
    return [None] * n, [0.0] * n, [False] * n_res, [0.0] * n_res, solo, [[] for _ in range(n_res)]


def run(dur: list[float], res: list[tuple[int, ...]], succ: list[list[int]], ndeps: list[int],
        shared_res: tuple[int, ...], n_res: int, wake: dict[int, float] | None = None) -> tuple[list, list]:
    """(start, end) of every task by hetplan.planner.sim.reference's rules (the module docstring says how
    faster); `ndeps` is consumed, `shared_res` are the resources of multi-resource tasks."""
    n, wake = len(dur), wake or {}
    start, end, busy, free_at, solo, waiting = _fresh(n, n_res, shared_res)
    ends: dict[float, list[int]] = {}   # end time -> the tasks ending then (in any order)
    times: list[float] = []             # a heap of the keys of `ends`
    push, pop = heapq.heappush, heapq.heappop
    newly = [t for t in range(n) if ndeps[t] == 0]
    now, base, touched = 0.0, 0, []
    while True:
        newly.sort()
        for t in newly:                     # tasks that became ready at `now`
            r = res[t]
            x = r[0] if len(r) == 1 else -1
            if x >= 0 and solo[x] and not busy[x] and not waiting[x]:
                busy[x] = True
                e = now + dur[t] + (wake.get(t, 0.0) if free_at[x] < now else 0.0)
            elif not r:                     # a pure join completes at once
                e = now
            else:
                for x in r:
                    push(waiting[x], base + t)
                    touched.append(x)
                continue
            start[t], end[t] = now, e
            if e in ends:
                ends[e].append(t)
            else:
                ends[e] = [t]
                push(times, e)
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
        touched, newly = [], []
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
        raise Deadlock(start, res)
    return start, end


__all__ = ["run", "shared_resources"]
