"""The event loop's result without its queues, where the order on every resource is fixed.

`hetplan.planner.sim.eventloop.run` serves each queue by (ready time, task id). In most plans a
resource's tasks become ready in id order whatever the durations (a device's actions are
chained; a link carries its microbatches in order), so each task simply starts at
max(its dependencies' ends, its resource's previous task's end): one pass in topological
order, no heap. `Static.run` does that pass and checks, on this plan's times, that the order
it assumed is the one the event loop would take; where it is not, it returns None and the
caller runs the event loop. Results are identical bit for bit (tests/test_listsched.py).

Why the check suffices: a resource group (resources whose tasks all hold exactly that set of
resources; the pass needs every resource in one group) is free at the end of its previous task;
the tasks waiting then are those ready by then; when ready times never decrease along the id
order, the first of them in id order is also the first by (ready time, id), so the event loop
starts the same task at the same time. The loop applies all events at one time before starting
anything, except that a zero-length task started at time e ends in a later round at e: where
some task takes no time, `Static.run_rounds` compares moments (time, round) instead of times.
"""
from __future__ import annotations

from operator import eq

from hetplan.planner.sim.taskgraph import TaskGraph


class Static:
    """A task graph's pass order: per task (in a topological order of the dependencies plus
    each group's id order) its dependencies and, where it is not among them, the group's
    previous task. Build with `Static.of(g)`: None where some resource is shared by tasks
    holding different resource sets (all-reduces beside other work) or where a group's id
    order contradicts the dependencies (two streams over one link)."""

    __slots__ = ("steps", "prev", "joins", "n")

    def __init__(self, steps: list[tuple[int, tuple[int, ...], int]], prev: list[int], joins: frozenset[int]):
        self.steps, self.prev, self.joins, self.n = steps, prev, joins, len(prev)

    @staticmethod
    def of(g: TaskGraph) -> "Static | None":
        res, succ = g.res, g.succ
        n = len(res)
        owner: dict[int, tuple[int, ...]] = {}
        for r in set(res):
            for x in r:
                if owner.setdefault(x, r) != r:
                    return None
        preds: list[list[int]] = [[] for _ in range(n)]
        for t, vs in enumerate(succ):
            for v in vs:
                preds[v].append(t)
        prev = [-1] * n   # the previous task of t's group, in id order
        nxt = [-1] * n
        last: dict[tuple[int, ...], int] = {}
        for t, r in enumerate(res):
            if r:
                q = prev[t] = last.get(r, -1)
                if q >= 0:
                    nxt[q] = t
                last[r] = t
        indeg = [len(p) + (q >= 0) for p, q in zip(preds, prev)]
        stack = [t for t in range(n - 1, -1, -1) if indeg[t] == 0]
        steps = []
        while stack:
            t = stack.pop()
            q = prev[t]
            steps.append((t, tuple(preds[t]), -1 if q < 0 or q in preds[t] else q))
            for v in succ[t] + ((nxt[t],) if nxt[t] >= 0 else ()):
                indeg[v] -= 1
                if indeg[v] == 0:
                    stack.append(v)
        if len(steps) < n:
            return None   # the id order contradicts the dependencies
        return Static(steps, prev, frozenset(t for t, r in enumerate(res) if not r))

    def run(self, dur: list[float], wake: dict[int, float]) -> tuple[list[float], list[float]] | None:
        """(start, end) as hetplan.planner.sim.eventloop.run gives them, or None where this plan's times
        break the fixed order (see the module docstring)."""
        if self.joins:
            return self.run_rounds(dur, wake)
        n, prev = self.n, self.prev
        start = [0.0] * n
        end = [0.0] * n
        ready = [0.0] * n
        for t, ps, q in self.steps:
            r = 0.0
            for p in ps:
                e = end[p]
                if e > r:
                    r = e
            ready[t] = r
            s = r
            if q >= 0:
                if ready[q] > r:
                    return None
                e = end[q]
                if e > s:
                    s = e
            start[t] = s
            e = s + dur[t]
            if t in wake and (end[prev[t]] if prev[t] >= 0 else 0.0) < s:   # its worker sat idle
                e += wake[t]
            end[t] = e
        if any(map(eq, start, end)):   # a zero-length task: the loop's rounds matter
            return self.run_rounds(dur, wake)
        return start, end

    def run_rounds(self, dur: list[float], wake: dict[int, float]) -> tuple[list[float], list[float]] | None:
        """`run` where some task lasts no time: each moment is (time, round), the round counting
        the event loop's passes at that time (a zero-length task started in round k ends in
        round k + 1; a task that takes time ends in round 0 of its end time)."""
        n, prev, joins = self.n, self.prev, self.joins
        start = [0.0] * n
        end = [0.0] * n
        ready: list[tuple[float, int]] = [(0.0, 0)] * n
        done: list[tuple[float, int]] = [(0.0, 0)] * n   # the moment each task's end is applied
        for t, ps, q in self.steps:
            r = (0.0, 0)
            for p in ps:
                if done[p] > r:
                    r = done[p]
            ready[t] = r
            at = r
            if q >= 0:
                if ready[q] > r:
                    return None
                if done[q] > at:
                    at = done[q]
            s = start[t] = at[0]
            if t in joins:   # a join completes at once, whatever its duration
                e = s
            else:
                e = s + dur[t]
                if t in wake and (end[prev[t]] if prev[t] >= 0 else 0.0) < s:
                    e += wake[t]
            end[t] = e
            done[t] = (e, 0) if e > s else (s, at[1] + 1)
        return start, end

__all__ = ["Static"]
