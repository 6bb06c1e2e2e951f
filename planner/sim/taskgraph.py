"""The task graph of one plan shape: tasks with resources, dependencies and duration recipes.

Built by `planner.sim.simulator.Simulator` once per plan shape (everything but batch sizes) and
run by `planner.sim.eventloop.run` with durations evaluated for each plan.
"""
from __future__ import annotations


class TaskGraph:
    """A plan shape's task graph without durations: parallel lists indexed by task id.

    A task's duration is `values[dkey[t]]`, where `values` are evaluated per plan from the
    few distinct `recipes` (see `Simulator._evaluate`): plans that differ only in batch sizes share the
    structure, so a search that moves batch fractions rebuilds nothing. `stat_seq` keeps, per
    (device, statistic), the value indices in the order they are added, so the per-device sums
    come out bit for bit as if accumulated while building.
    """

    def __init__(self, trace: bool):
        self.dkey: list[int] = []
        self.res: list[tuple[int, ...]] = []
        self.succ: list[list[int]] = []
        self.ndeps: list[int] = []
        self.meta: list[tuple[str, str, str]] | None = [] if trace else None  # (name, lane, kind)
        self.recipes: list[tuple] = []
        self._recipe_id: dict[tuple, int] = {}
        self.stat_seq: dict[tuple[str, str], list[int]] = {}
        self.devices: tuple[str, ...] = ()
        self.shared_res: tuple[int, ...] = ()   # resources of multi-resource tasks (all-reduces)
        # Per replica (see Simulator._like): its task ids; its structure, duration recipes
        # and each task's recipe as an index into them; the resources its tasks use.
        self.replica_tasks: list[list[int]] = []
        self.replica_shape: list[tuple] = []
        self.replica_recipes: list[list[int]] = []
        self.replica_pattern: list[tuple[int, ...]] = []
        self.replica_res: list[set[int]] = []
        self.sync_res: set[int] = set()          # resources of the gradient all-reduces
        self.memory_bound: set[int] = set()      # optimizer steps (Simulator._contend)
        self.collapsible = False
        self._ghost: list[int] | None = None

    def begin_replica(self, shape: tuple, like: list[int] | None) -> None:
        """Tasks added until `end_replica` are this replica's; with `like` (the task ids of an
        identical, independent replica) no task is created: `add` hands back like's ids in
        order, `wire` does nothing, and only the statistics are counted."""
        self._ghost, self._ghost_pos, self._first = like, 0, len(self.dkey)
        self.replica_shape.append(shape)

    def end_replica(self) -> None:
        if self._ghost is not None:
            self.replica_tasks.append(self._ghost)
            self._ghost = None
            return
        block = range(self._first, len(self.dkey))
        local: dict[int, int] = {}
        for t in block:
            local.setdefault(self.dkey[t], len(local))
        self.replica_tasks.append(list(block))
        self.replica_recipes.append(list(local))
        self.replica_pattern.append(tuple(local[self.dkey[t]] for t in block))
        self.replica_res.append({x for t in block for x in self.res[t]})

    def wire(self, t: int, v: int) -> None:
        """Task v also waits for task t."""
        if self._ghost is None:
            self.succ[t].append(v)
            self.ndeps[v] += 1

    def value(self, recipe: tuple) -> int:
        """Index of a duration recipe: ("const", s), ("fwd"|"bwd", replica, device, start, end),
        ("bwd+fwd", replica, device, lo, hi, start, end), ("hop", replica, cut, latency_s, bandwidth)."""
        k = self._recipe_id.get(recipe)
        if k is None:
            k = self._recipe_id[recipe] = len(self.recipes)
            self.recipes.append(recipe)
        return k

    def count(self, device: str, stat: str, k: int) -> None:
        self.stat_seq[(device, stat)].append(k)

    def add(self, k: int, res: tuple[int, ...], deps=(), meta=None) -> int:
        """k: value index of the duration; meta: (name parts, lane, kind), kept only when tracing."""
        if self._ghost is not None:
            self._ghost_pos += 1
            return self._ghost[self._ghost_pos - 1]
        t = len(self.dkey)
        self.dkey.append(k)
        self.res.append(res)
        self.succ.append([])
        self.ndeps.append(0)
        for d in deps:
            if d is not None:
                self.succ[d].append(t)
                self.ndeps[t] += 1
        if self.meta is not None:
            self.meta.append(meta)
        return t


__all__ = ["TaskGraph"]
