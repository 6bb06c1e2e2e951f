"""Delta simulation: a plan of independent replicas run replica by replica, then the coupling.

Where a plan's replicas hold pairwise-disjoint resources (devices, link directions) and no task
outside them (all-reduces, optimizer steps, parameter exchange: the *coupling*) can delay one of
their tasks, each replica's tasks run in the whole event loop exactly as they run alone: the
loop serves each resource by (ready time, task id) and nothing else queues there. So each
*distinct* replica is simulated alone, once, and its times are kept across plans under what
determines them (`Structure`: its tasks' dependencies, resources renumbered in their order,
recipe pattern and wake-ups; and its duration values); then only the coupling tasks run, each
replica task they wait for replaced by a *release* task that ends at that task's end.

The simulator uses `Delta.of_parts` on a *delta build* (hetplan.planner.sim.build.Builder.releases): its
replicas are parts (template core, values, resources), never stamped as tasks, so a plan that
changes one replica builds and runs that replica's structure only; a one-replica plan (the
search's solve_batches) takes the same path. A replica runs by the pass over its schedule
(hetplan.planner.sim.pipeline_pass.PipelineRun; `Linked` where its routes share link directions) where it
applies, else by the event loop over its graph
(`GraphRun`, or its template's `Structure` for held sends and wake-ups). Replicas that share a
device or link direction form a group, run together (their tasks one block after another, in
the whole graph's relative order: `Linked` where they share link directions only, else
`GraphRun`). `Delta.of` takes a whole task graph whose
replicas are blocks of ids (hand-made graphs).

The conditions (`Delta.of` / `Delta.of_parts`, per graph; `Delta.run`, per plan), each needed
for identity:
- every replica's tasks form one block of ids; no dependency enters a replica from outside
  it (another replica or the coupling);
- groups' resources are pairwise disjoint (a group: the replicas sharing resources,
  transitively; all their tasks from the graph, `GraphRun.fits`); a coupling task holding several
  resources holds no replica's device (gloo all-reduces holding the compute queues of a saturated host); a
  coupling task on a replica's resource (an optimizer step on its device; in a delta build, an
  all-reduce over a link direction a pipeline uses) becomes ready no earlier than that
  replica's last task there ends (checked on each plan's times);
- no coupling task wakes up (it follows no transfer: the wake-up depends on when its
  resource was last busy); no replica task that the coupling waits for takes no time, and
  none ends on a coupling task's resource when that task becomes ready (the loop ends such a
  task in a later round of the same instant, which a release task would not reproduce);
- not a trace, not a PipeDream stream, no contention (its durations depend on the timeline).
The per-device statistics do not depend on times, so `Delta.run` gives only the last end;
the caller adds the iteration's fixed overhead as for a whole run.
"""
from __future__ import annotations

from array import array
from typing import NamedTuple

import numpy as np

from hetplan.planner.sim import fastloop
from hetplan.planner.sim.engines import DEFAULT_ENGINES, EngineState, run_graph
from hetplan.planner.sim.eventloop import shared_resources
from hetplan.planner.sim.pipeline_pass import LinkedRun, ReplicaRun, graph as pipeline_graph, graph_fits
from hetplan.planner.sim.taskgraph import TaskGraph
from hetplan.planner.sim.template import replica_template

RUN_CACHE_SIZE = 4096   # replica runs kept (structure, duration values) -> times


class Structure:
    """A replica's tasks alone, ids from 0 and resources renumbered in their order (the loop's
    result depends only on that order): what its times depend on besides its durations."""

    __slots__ = ("res", "_succ", "ndeps", "pattern", "wake", "n_res", "shared", "template", "flat", "woken",
                 "by_res", "state", "engines", "pattern_array")

    def __init__(self, res, succ, ndeps, pattern, wake, n_res, template=None, flat=None, woken=None,
                 engines=DEFAULT_ENGINES):
        self.res, self._succ, self.ndeps, self.pattern, self.wake = res, succ, ndeps, pattern, wake
        self.n_res = n_res
        self.state, self.engines = EngineState(), engines   # hetplan.planner.sim.engines
        self.pattern_array = np.asarray(pattern, np.int64)
        self.template = template   # the ReplicaTemplate it was made from (kept: its id is in the key)
        if flat is None and template is None and all(len(r) == 1 for r in res):
            flat = np.fromiter((r[0] for r in res), np.int64, len(res))
        self.flat = flat   # each task's one resource as an array (None where some task holds several or none)
        self.shared = () if self.flat is not None else shared_resources(res)
        self.woken = woken   # (tasks, wake-ups) as arrays: `wake` from a template
        self.by_res: ByResource | None = None   # `flat`'s tasks per resource, once a result is made

    @property
    def succ(self):
        """Each task's successors (a template's, made when first asked: the compiled loop
        takes the template's arrays)."""
        if self._succ is None:
            self._succ = self.template.succ
        return self._succ

    def prepare_compiled(self) -> "fastloop.Prepared":
        """The compiled loop's arrays: from the template's where each task holds one resource."""
        t = self.template
        if t is None or self.flat is None:
            return fastloop.prepare(self.res, self.succ, self.ndeps, self.shared, self.n_res, self.wake)
        n = len(self.res)
        wake = np.zeros(n)
        wake[self.woken[0]] = self.woken[1]   # a template's structure has them as arrays
        return fastloop.from_arrays(np.arange(n + 1, dtype=np.int64), self.flat, t.succ_ptr, t.edge_dst,
                                    t.ndeps_array, self.shared, self.n_res, wake)

    @staticmethod
    def of_template(t, canon: tuple, res: tuple, wake_at: dict, links: set, engines=DEFAULT_ENGINES) -> "Structure":
        """The tasks of template t with its resource slots `res` (resources of the plan),
        renumbered as `canon`; a task after a hop (a link) wakes up by wake_at of its resource
        (hetplan.planner.sim.simulator.Simulator._wakes). Over the template's arrays: per slot whether
        it is a link and its wake-up, then per edge out of a link's task."""
        slots, n = t.res_array, len(res)
        link = np.fromiter((r in links for r in res), bool, n)
        wake_of = np.fromiter((wake_at.get(r, np.nan) for r in res), float, n)
        dst = t.edge_dst
        after = dst[link[slots[t.edge_src]]]   # tasks that follow a hop, in the order they are wired
        w = wake_of[slots[after]]
        woken = ~np.isnan(w)
        wake = dict(zip(after[woken].tolist(), w[woken].tolist()))
        per_slot = np.empty(n, object)
        for x, r in enumerate(canon):
            per_slot[x] = r
        flat = (np.array([r[0] for r in canon], np.int64)[slots]
                if all(len(r) == 1 for r in canon) else None)
        return Structure(tuple(per_slot[slots].tolist()), None, t.ndeps, t.value, wake,
                         1 + max((y for r in canon for y in r), default=-1), t, flat,
                         (after[woken], w[woken]), engines)

    def run(self, values: tuple[float, ...]) -> "ReplicaRun":
        return self._result(*run_graph(self, np.asarray(values, np.float64)[self.pattern_array], self.engines))

    def _result(self, start, end, engine: str) -> "ReplicaRun":
        """The replica's times from its tasks' (start, end): lists, or arrays (compiled)."""
        if self.flat is not None:   # the same maxima and zero-length tasks, over arrays
            if self.by_res is None:
                self.by_res = ByResource.of(self.flat, self.n_res)
            return _flat_result(start, end, self.flat, self.by_res, engine)
        last = [0.0] * self.n_res   # per local resource, its last end
        for r, e in zip(self.res, end):
            for x in r:
                if e > last[x]:
                    last[x] = e
        zeros = frozenset(t for t, (s, e) in enumerate(zip(start, end)) if s == e)
        last_zero = [False] * self.n_res
        for t in zeros:
            for x in self.res[t]:
                last_zero[x] |= end[t] == last[x]
        if isinstance(end, np.ndarray):
            return ReplicaRun(float(end.max()) if len(end) else 0.0, end, tuple(last), tuple(last_zero), zeros, engine)
        return ReplicaRun(max(end) if end else 0.0, array("d", end), tuple(last), tuple(last_zero), zeros, engine)


class ByResource(NamedTuple):
    """Tasks that each hold one resource (`flat`) grouped by it: their order sorted by resource,
    the resources held and where each one's tasks begin in that order (for
    `np.maximum.reduceat`, not the slower `np.maximum.at`: docs/tuning.md)."""
    order: np.ndarray
    held: np.ndarray
    cuts: np.ndarray
    n_res: int

    @staticmethod
    def of(flat: np.ndarray, n_res: int) -> "ByResource":
        count = np.bincount(flat, minlength=n_res)
        held = np.flatnonzero(count)
        return ByResource(np.argsort(flat, kind="stable"), held, np.append(0, np.cumsum(count[held]))[:-1], n_res)

    def last(self, ends: np.ndarray) -> np.ndarray:
        """Per resource, the last of its tasks' ends (0 where none; ends are not negative)."""
        at = np.zeros(self.n_res)
        if len(self.held):
            at[self.held] = np.maximum(np.maximum.reduceat(ends[self.order], self.cuts), 0.0)
        return at


def _flat_result(start, end, flat: np.ndarray, by_res: ByResource, engine: str) -> "ReplicaRun":
    """`Structure._result` where each task holds one resource (`flat`), over arrays."""
    ends = np.asarray(end)
    last = by_res.last(ends)
    zero = np.flatnonzero(np.asarray(start) == ends)
    held = flat[zero]
    last_zero = np.zeros(by_res.n_res, bool)
    last_zero[held[ends[zero] == last[held]]] = True
    end_s = float(ends.max()) if len(ends) else 0.0
    return ReplicaRun(end_s, ends if isinstance(end, np.ndarray) else array("d", end), tuple(last.tolist()),
                      tuple(last_zero.tolist()), frozenset(zero.tolist()), engine)


class GraphRun:
    """Replicas run together by the event loop over their `hetplan.planner.sim.pipeline_pass.Graph`s (each
    its template's tasks and dependencies, laid out without the template), one block after
    another in replica order as in the whole graph: a replica the pass does not fit (link
    directions shared within it, several stages on one device), or replicas that share devices
    or link directions (a group). Each member's resource slots are numbered by `canons` (the
    group's numbering), its value slots follow the previous members'."""

    __slots__ = ("cores", "firsts", "slots", "flat", "succ_ptr", "succ_idx", "ndeps_array", "n_res", "lists",
                 "by_res", "state", "engines")
    shared: tuple[int, ...] = ()    # hetplan.planner.sim.engines.Tasks: every task holds one resource,
    wake: dict[int, float] = {}     # and none wakes up (graph_fits)

    def __init__(self, cores, canons, engines=DEFAULT_ENGINES):
        graphs = [pipeline_graph(*c.args) for c in cores]
        firsts = np.cumsum([0] + [len(g.task_slot) for g in graphs])[:-1]
        values = np.cumsum([0] + [c.n_values for c in cores])[:-1]
        self.cores = tuple(cores)
        self.firsts = tuple(firsts.tolist())   # each member's first task
        self.slots = np.concatenate([g.task_slot + v for g, v in zip(graphs, values)])
        self.flat = np.concatenate([np.array([r[0] for r in canon], np.int64)[g.res_slot]
                                    for g, canon in zip(graphs, canons)])
        self.succ_idx = np.concatenate([g.succ_idx + f for g, f in zip(graphs, firsts)])
        self.succ_ptr = np.append(np.concatenate([g.succ_ptr[:-1] + e for g, e in
                                                  zip(graphs, np.cumsum([0] + [len(g.succ_idx) for g in graphs]))]),
                                  len(self.succ_idx)).astype(np.int64)
        self.ndeps_array = np.concatenate([g.ndeps for g in graphs])
        self.n_res = 1 + max((r[0] for canon in canons for r in canon), default=-1)
        self.lists = None
        self.by_res = ByResource.of(self.flat, self.n_res)
        self.state, self.engines = EngineState(), engines   # hetplan.planner.sim.engines

    fits = staticmethod(graph_fits)

    def _lists(self) -> tuple[list, list, list]:
        if self.lists is None:
            ptr, idx = self.succ_ptr.tolist(), self.succ_idx.tolist()
            self.lists = ([(x,) for x in self.flat.tolist()],
                          [tuple(idx[ptr[t]:ptr[t + 1]]) for t in range(len(self.flat))], self.ndeps_array.tolist())
        return self.lists

    res = property(lambda self: self._lists()[0])
    succ = property(lambda self: self._lists()[1])
    ndeps = property(lambda self: self._lists()[2])

    def prepare_compiled(self) -> "fastloop.Prepared":
        n = len(self.flat)
        return fastloop.from_arrays(np.arange(n + 1, dtype=np.int64), self.flat, self.succ_ptr, self.succ_idx,
                                    self.ndeps_array, (), self.n_res, np.zeros(n))

    def run(self, values: tuple[float, ...]) -> "ReplicaRun":
        start, end, engine = run_graph(self, np.asarray(values, np.float64)[self.slots], self.engines)
        return _flat_result(start, end, self.flat, self.by_res, engine)


class Linked:
    """Replicas whose routes share link directions, devices apart (one, or a group): by the
    pass where it settles (hetplan.planner.sim.pipeline_pass.LinkedRun), else by the event loop over their
    graphs (`GraphRun`), its results renumbered as the pass numbers them (compute tasks only,
    members in turn: `firsts`)."""

    __slots__ = ("by_pass", "canons", "by_loop", "keep", "to_pass", "engines")

    def __init__(self, cores, canons, engines=DEFAULT_ENGINES, by_pass: LinkedRun | None = None):
        self.by_pass, self.canons, self.by_loop = by_pass or LinkedRun(cores, canons), canons, None
        self.engines = engines

    @property
    def firsts(self) -> tuple[int, ...]:
        return self.by_pass.firsts

    def run(self, values: tuple[float, ...]) -> "ReplicaRun":
        out = self.by_pass.run(values)
        if out is not None:
            return out
        if self.by_loop is None:   # the graphs' compute tasks, and each graph task's id in the pass's numbering
            p = self.by_pass
            self.by_loop = GraphRun(p.cores, self.canons, self.engines)
            n = np.diff(np.append(p.firsts, len(p.lay.task_slot)))
            self.keep = np.concatenate([np.arange(g, g + k) for g, k in zip(p.graph_firsts, n)]).astype(np.int64)
            self.to_pass = np.full(len(self.by_loop.slots), -1, np.int64)
            self.to_pass[self.keep] = np.arange(len(self.keep))
        out = self.by_loop.run(values)
        moved = self.to_pass[sorted(out.zeros)] if out.zeros else np.zeros(0, np.int64)
        return out._replace(ends=np.asarray(out.ends)[self.keep], zeros=frozenset(moved[moved >= 0].tolist()))


def _independent(g: TaskGraph, coupling, owner: dict[int, int], wake: dict[int, float],
                 links: set | frozenset = frozenset()) -> bool:
    """No coupling task of g wakes up or holds a replica's resource beside others, except a
    link direction (`links`: resources as tasks hold them) that `Delta.run` checks per plan."""
    for t in coupling:
        if t in wake or (len(g.res[t]) > 1 and any(x in owner and (x,) not in links for x in g.res[t])):
            return False
    return True


class Part(NamedTuple):
    """One replica of a task graph: its first task id, its structure, its recipes (value
    indices in the order its pattern numbers them) and its resources' local numbers."""
    first: int
    structure: Structure
    recipes: tuple[int, ...]
    local: dict[int, int]


class Delta:
    """A task graph's replicas and its coupling graph: release tasks (ids 0..R-1, each on a
    resource of its own) then the coupling tasks in id order (`coupling`: their value
    indices); `checks` are the coupling tasks on one replica resource: (coupling id, part,
    local resource)."""

    __slots__ = ("parts", "release", "coupling", "res", "succ", "ndeps", "shared", "n_res", "checks", "preds",
                 "state", "engines")
    wake: dict[int, float] = {}   # hetplan.planner.sim.engines.Tasks: no coupling task wakes up (_independent)

    def __init__(self, parts, release, coupling, res, n_res, succ, ndeps, checks, preds, engines=DEFAULT_ENGINES):
        self.parts, self.release, self.coupling = parts, release, coupling
        self.res, self.succ, self.ndeps, self.n_res = res, succ, ndeps, n_res
        self.shared = shared_resources(res)
        self.checks, self.preds = checks, preds
        self.state, self.engines = EngineState(coupling=True), engines   # hetplan.planner.sim.engines

    @staticmethod
    def of(g: TaskGraph, wake: dict[int, float], n_res: int, structures: dict,
           engines=DEFAULT_ENGINES) -> "Delta | None":
        """g's `Delta`, or None where a condition of the module docstring fails on the graph."""
        if g.meta is not None or g.iteration_ends is not None or len(g.replica_tasks) < 2:
            return None
        bounds = []
        owner: dict[int, int] = {}   # resource -> the replica holding it
        for p, tasks in enumerate(g.replica_tasks):
            if not tasks or tasks != list(range(tasks[0], tasks[0] + len(tasks))):
                return None   # not one block (a collapsed graph's twin)
            bounds.append((tasks[0], tasks[0] + len(tasks)))
            for x in g.replica_resources(p):
                if owner.setdefault(x, p) != p:
                    return None   # two replicas share a device or link direction
        which = [-1] * len(g.res)   # task -> its replica, -1: coupling
        for p, (a, b) in enumerate(bounds):
            which[a:b] = [p] * (b - a)
        for t, vs in enumerate(g.succ):
            if any(which[v] >= 0 and which[v] != which[t] for v in vs):
                return None   # a dependency enters a replica from outside
        coupling = [t for t in range(len(g.res)) if which[t] < 0]
        if not _independent(g, coupling, owner, wake):
            return None
        parts = [Delta._part(g, a, b, wake, structures, engines) for a, b in bounds]
        return Delta._coupled(g, parts, which, owner, coupling, n_res, engines)

    @staticmethod
    def of_parts(g: TaskGraph, wake: dict[int, float], structures: dict, wake_at: dict, links: set,
                 engines=DEFAULT_ENGINES) -> "Delta | None":
        """The `Delta` of a delta build (hetplan.planner.sim.build.Builder.releases: g's release tasks
        first, then the coupling tasks), or None where a condition fails on the graph.
        Structures are kept under (template, resources renumbered, their wake-ups and links)."""
        if not g.parts:
            return None   # not a delta build
        groups_ = groups([{x for r in res for x in r} for _, _, res, _ in g.parts])
        owner: dict[int, int] = {}
        parts, at = [], {}   # at: replica -> (its group's part, its first task there)
        for k, members in enumerate(groups_):
            used = sorted({x for p in members for r in g.parts[p][2] for x in r})
            local = dict(zip(used, range(len(used))))
            owner.update(dict.fromkeys(used, k))
            cores = [g.parts[p][0] for p in members]   # each a hetplan.planner.sim.template.ReplicaCore
            canons = [tuple(tuple(map(local.__getitem__, r)) for r in g.parts[p][2]) for p in members]
            res = [g.parts[p][2] for p in members]
            key = (tuple(map(id, cores)), tuple(canons), tuple(wake_at.get(r) for rs in res for r in rs),
                   tuple(r in links for rs in res for r in rs))
            kept = structures.get(key)
            if kept is None or any(a is not b for a, b in zip(kept[0], cores)):
                made = _structure(cores, canons, res, wake_at, links, engines)
                if made is None:
                    return None   # replicas sharing a resource whose tasks are not all the graph's
                kept = structures[key] = (cores, made)
            firsts = kept[1].firsts if len(members) > 1 else (0,)   # a group's members one block after another
            at.update((p, (k, f)) for p, f in zip(members, firsts))
            parts.append(Part(-1, kept[1], tuple(v for p in members for v in g.parts[p][1]), local))
        release = [(at[p][0], at[p][1] + x) for p, (_, _, _, ids) in enumerate(g.parts) for x in ids]
        first = len(release)
        if [i for *_, ids in g.parts for i in ids.values()] != list(range(first)):
            return None   # not a delta build's layout
        coupling = range(first, len(g.res))
        if not _independent(g, coupling, owner, wake, links):
            return None
        checks = [(t, owner[x], parts[owner[x]].local[x]) for t in coupling for x in g.res[t] if x in owner]
        preds: list[list[int]] = [[] for _ in coupling]
        for t, vs in enumerate(g.succ):
            for v in vs:
                preds[v - first].append(t)
        return Delta(parts, release, g.dkey[first:], *_dense(g.res), g.succ, g.ndeps, checks, preds, engines)

    @staticmethod
    def _coupled(g: TaskGraph, parts: list["Part"], which: list[int], owner: dict[int, int],
                 coupling: list[int], n_res: int, engines) -> "Delta":
        """The coupling graph: a release task per replica task that a coupling task waits for
        (on a resource numbered from n_res), then the coupling tasks."""
        release: list[tuple[int, int]] = []   # (part, local task)
        src: dict[int, int] = {}   # task of g -> its id in the coupling graph
        for t, vs in enumerate(g.succ):
            if which[t] >= 0 and any(which[v] < 0 for v in vs):
                src[t] = len(release)
                release.append((which[t], t - parts[which[t]].first))
        for i, t in enumerate(coupling):
            src[t] = len(release) + i
        res = [(n_res + i,) for i in range(len(release))] + [g.res[t] for t in coupling]
        checks = []
        for t in coupling:
            mine = [x for x in g.res[t] if x in owner]   # one at most (Delta.of)
            if mine:
                p = owner[mine[0]]
                checks.append((src[t], p, parts[p].local[mine[0]]))
        succ: list[tuple[int, ...]] = [()] * len(res)
        ndeps = [0] * len(res)
        preds: list[list[int]] = [[] for _ in coupling]
        for t, i in src.items():
            succ[i] = out = tuple(src[v] for v in g.succ[t] if which[v] < 0)
            for v in out:
                ndeps[v] += 1
                preds[v - len(release)].append(i)
        return Delta(parts, release, [g.dkey[t] for t in coupling], *_dense(res), succ, ndeps, checks, preds, engines)

    @staticmethod
    def _part(g: TaskGraph, a: int, b: int, wake: dict[int, float], structures: dict, engines) -> Part:
        """Replica tasks [a, b) of g as a Part; equal structures are one object (`structures`)."""
        used = sorted({x for r in g.res[a:b] for x in r})
        local = dict(zip(used, range(len(used))))
        res = tuple(tuple(map(local.__getitem__, r)) for r in g.res[a:b])
        succ = tuple(tuple(v - a for v in vs if a <= v < b) for vs in g.succ[a:b])
        ndeps = tuple(g.ndeps[a:b])
        dkey = g.dkey[a:b]
        recipes = tuple(dict.fromkeys(dkey))
        at = dict(zip(recipes, range(len(recipes))))
        pattern = tuple(map(at.__getitem__, dkey))
        w = {t - a: s for t, s in wake.items() if a <= t < b}
        key = (res, succ, pattern, tuple(sorted(w.items())))
        s = structures.get(key)
        if s is None:
            s = structures[key] = Structure(res, succ, ndeps, pattern, w, len(used), engines=engines)
        return Part(a, s, recipes, local)

    def run(self, values: list[float], runs: dict) -> tuple[float, str] | None:
        """The last end of the plan's tasks (recipe values `values`), each distinct replica
        run once or taken from `runs`, and the engines that ran (`delta/<replicas'>/<coupling's>`);
        None where a condition fails on this plan's times (the caller runs the whole graph)."""
        done = []
        for part in self.parts:
            s = part.structure
            key = (s, tuple(map(values.__getitem__, part.recipes)))
            out = runs.get(key)
            if out is None:
                out = s.run(key[1])
                if len(runs) >= RUN_CACHE_SIZE:
                    runs.pop(next(iter(runs)))
                runs[key] = out
            done.append(out)
        dur = []
        for p, t in self.release:
            if t in done[p].zeros:   # it ends a round later than its release task would
                return None
            dur.append(float(done[p].ends[t]))
        first = len(self.release)
        dur += map(values.__getitem__, self.coupling)
        _, end, coupled_by = run_graph(self, dur, self.engines)
        if isinstance(end, np.ndarray):
            end = end.tolist()
        for c, p, x in self.checks:
            ready = max((end[q] for q in self.preds[c - first]), default=0.0)
            last = done[p].last[x]
            if ready < last or (ready == last and done[p].last_zero[x]):
                return None
        last = max(end, default=0.0)
        engine = f"delta/{','.join(dict.fromkeys(r.engine for r in done))}/{coupled_by}"
        return max(last, max((r.end_s for r in done), default=0.0)), engine


def _structure(cores, canons, res, wake_at: dict, links: set, engines=DEFAULT_ENGINES):
    """What runs a group's replicas (cores on resources `res`, numbered by `canons`): the first
    replica engine of `engines` that takes them (hetplan.planner.sim.engines: one replica by the pass,
    replicas whose routes share links by the linked pass, `Linked` running the graphs where it
    declines on a plan's times), else the graph engines over the graphs (`GraphRun`), or one
    replica over its template (held sends, wake-ups); None for several that GraphRun cannot."""
    for e in engines:
        made = e.prepare(cores, canons, res, wake_at) if e.level == "replica" else None
        if made is not None:
            return Linked(cores, canons, engines, made) if isinstance(made, LinkedRun) else made
    if all(map(GraphRun.fits, cores, res, [wake_at] * len(cores))):
        return GraphRun(cores, canons, engines)
    if len(cores) > 1:
        return None
    return Structure.of_template(replica_template(*cores[0].args), canons[0], res[0], wake_at, links, engines)


def groups(used: list[set[int]]) -> list[list[int]]:
    """The replicas (by their resources `used`) in groups that share a resource, transitively;
    each group's replicas in order, the groups by their first."""
    parent = list(range(len(used)))

    def root(p: int) -> int:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p
    holder: dict[int, int] = {}
    for p, xs in enumerate(used):
        for x in xs:
            q = holder.setdefault(x, p)
            a, b = root(p), root(q)
            if a != b:
                parent[max(a, b)] = min(a, b)
    out: dict[int, list[int]] = {}
    for p in range(len(used)):
        out.setdefault(root(p), []).append(p)
    return list(out.values())


def _dense(res: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], int]:
    """A coupling graph's resources numbered 0.. in the same order (the event loop serves queues
    in id order) and their count: its per-resource lists as long as the resources it uses, not
    the topology's lanes plus one per release task."""
    used = sorted({x for r in res for x in r})
    dense = dict(zip(used, range(len(used))))
    return [tuple(map(dense.__getitem__, r)) for r in res], len(used)

__all__ = ["Delta", "Structure", "GraphRun", "ReplicaRun", "RUN_CACHE_SIZE", "groups"]
