"""One replica's pipeline tasks as a template: built once per structure, stamped per plan.

A replica's tasks (each stage's compute in schedule order, the store-and-forward hops of the
activations and gradients between stages) depend only on its structure: the schedule, the
microbatch count, the backward pieces of each stage's last microbatch and the hop count of
each route. `replica_template` lays them out once over *slots* (value and resource slots
numbered as `Slots` describes); `planner.sim.build.Builder.replica` maps the slots to the plan's
value and resource ids. Task ids, dependencies and the order of the statistics are those of
building the tasks one by one, so a stamped graph is identical to a hand-built one.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from planner.sim.schedule import Action, make_schedule


class Slots(NamedTuple):
    """Slot layout. Values: per stage its forward, its last microbatch's backward pieces, then
    (m > 1) the backward of other microbatches; then per stage pair the ahead hops, the back
    hops. Resources: per stage its device; then per pair the ahead hops, the back hops."""
    fwd: tuple[int, ...]                    # value slot of stage s's forward
    last: tuple[tuple[int, ...], ...]       # value slots of stage s's last-microbatch pieces
    other: tuple[tuple[int, ...], ...]      # value slots of stage s's other backwards
    ahead: tuple[tuple[int, ...], ...]      # value slots of pair p's ahead hops
    back: tuple[tuple[int, ...], ...]       # value slots of its back hops
    ahead_res: tuple[tuple[int, ...], ...]  # resource slots of pair p's ahead hops
    back_res: tuple[tuple[int, ...], ...]


class ReplicaTemplate(NamedTuple):
    """Tasks over slots: task i has value slot `value[i]`, resource slot `res[i]` and
    successors `succ[i]` (local ids); `counts` are (stage, statistic, value slots in the order
    they are counted); `chunk_end[s][j]` is the local task ending piece j of stage s's last
    microbatch (its bucket becomes final there), `last_backward[s]` stage s's last task;
    `label[i]` = (kind, stage or pair, Action or (what, microbatch)) for a trace; `shifted` caches
    `succ_at`."""
    slots: Slots
    value: tuple[int, ...]
    res: tuple[int, ...]
    succ: tuple[tuple[int, ...], ...]
    ndeps: tuple[int, ...]
    counts: tuple[tuple[int, str, tuple[int, ...]], ...]
    chunk_end: tuple[tuple[int, ...], ...]
    last_backward: tuple[int, ...]
    label: tuple[tuple, ...]
    shifted: dict[int, list[tuple[int, ...]]]

    def succ_at(self, base: int) -> list[tuple[int, ...]]:
        """`succ` with the block starting at task `base`. The last few bases are kept: a
        search stamps a replica at the same base in plan after plan."""
        out = self.shifted.get(base)
        if out is None:
            if len(self.shifted) >= 8:
                self.shifted.pop(next(iter(self.shifted)))
            add = base.__add__
            out = self.shifted[base] = [tuple(map(add, s)) for s in self.succ]
        return out


def _slots(pieces: tuple[int, ...], m: int, hops: tuple[tuple[int, int], ...]) -> tuple[Slots, int, int]:
    v = r = 0
    fwd, last, other = [], [], []
    for n in pieces:
        fwd.append(v)
        last.append(tuple(range(v + 1, v + 1 + n)))
        v += 1 + n
        other.append((v,) if m > 1 else ())
        v += 1 if m > 1 else 0
    r = len(pieces)
    ahead, back, ahead_res, back_res = [], [], [], []
    for na, nb in hops:
        ahead.append(tuple(range(v, v + na)))
        ahead_res.append(tuple(range(r, r + na)))
        v, r = v + na, r + na
        back.append(tuple(range(v, v + nb)))
        back_res.append(tuple(range(r, r + nb)))
        v, r = v + nb, r + nb
    return Slots(tuple(fwd), tuple(last), tuple(other), tuple(ahead), tuple(back),
                 tuple(ahead_res), tuple(back_res)), v, r


@lru_cache(maxsize=256)
def replica_template(schedule: str, m: int, pieces: tuple[int, ...],
                     hops: tuple[tuple[int, int], ...], devices: int | None = None) -> ReplicaTemplate:
    """The template of a replica with len(pieces) stages (stage s's last microbatch's backward
    in pieces[s] pieces) and m microbatches; hops[p] = (hops ahead, hops back) between stages
    p and p+1; `devices`: the pipeline's distinct devices (interleaved-1f1b; default one per
    stage). A device's actions are chained in its schedule order, whichever of its (virtual)
    stages they belong to; a compute task's resource slot is its stage's (the builder maps
    the virtual stages of one device to that device's resource)."""
    slots, _, _ = _slots(pieces, m, hops)
    value: list[int] = []
    res: list[int] = []
    succ: list[list[int]] = []
    ndeps: list[int] = []
    counts: dict[tuple[int, str], list[int]] = {}   # (stage, statistic) -> value slots
    label: list[tuple] = []

    def add(v: int, r: int, dep: int | None, lab: tuple) -> int:
        t = len(value)
        value.append(v)
        res.append(r)
        succ.append([])
        ndeps.append(0)
        label.append(lab)
        if dep is not None:
            succ[dep].append(t)
            ndeps[t] += 1
        return t

    n = len(pieces)
    fwd_t: list[list[int]] = [[0] * m for _ in range(n)]
    bwd_first: list[list[int]] = [[0] * m for _ in range(n)]
    bwd_last: list[list[int]] = [[0] * m for _ in range(n)]
    ends_of: list[list[int]] = [[] for _ in range(n)]
    last_of: list[int] = [0] * n
    for acts in make_schedule(schedule, n, m, devices):
        prev = None
        for act in acts:
            i, s = act.microbatch, act.stage
            f, bf, bl, ends = fwd_t[s], bwd_first[s], bwd_last[s], ends_of[s]
            if act.kind == "F":
                prev = f[i] = add(slots.fwd[s], s, prev, ("compute", s, act))
                counts.setdefault((s, "fwd_s"), []).append(slots.fwd[s])
                continue
            first = None
            for k in (slots.last[s] if i == m - 1 else slots.other[s]):
                prev = add(k, s, prev, ("compute", s, act))
                counts.setdefault((s, "bwd_s"), []).append(k)
                if first is None:
                    first = prev
                if i == m - 1:
                    ends.append(prev)
            bf[i], bl[i] = first, prev
            last_of[s] = prev
    chunk_end = [tuple(e) for e in ends_of]
    last_backward = last_of

    def chain(vals, rs, src: int, dst: int, after: int, lab: tuple) -> int:
        t = after
        for k, r in zip(vals, rs):
            t = add(k, r, t, lab)
            counts.setdefault((src, "comm_s"), []).append(k)
            counts.setdefault((dst, "comm_s"), []).append(k)
        return t

    def wire(t: int, v: int) -> None:
        succ[t].append(v)
        ndeps[v] += 1

    for s in range(1, len(pieces)):
        p = s - 1
        for i in range(m):
            wire(chain(slots.ahead[p], slots.ahead_res[p], s - 1, s, fwd_t[s - 1][i],
                       ("act", s - 1, s, i)), fwd_t[s][i])
            wire(chain(slots.back[p], slots.back_res[p], s, s - 1, bwd_last[s][i],
                       ("grad", s, s - 1, i)), bwd_first[s - 1][i])
    return ReplicaTemplate(slots, tuple(value), tuple(res), tuple(tuple(x) for x in succ), tuple(ndeps),
                           tuple((s, stat, tuple(v)) for (s, stat), v in counts.items()), tuple(chunk_end),
                           tuple(last_backward), tuple(label), {})


__all__ = ["Slots", "ReplicaTemplate", "replica_template", "Action"]
