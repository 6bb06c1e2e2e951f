"""One replica's pipeline tasks as a template: built once per structure, stamped per plan.

A replica's tasks (each stage's compute in schedule order, the store-and-forward hops of the
activations and gradients between stages) depend only on its structure: the schedule, the
microbatch count, the backward pieces of each stage's last microbatch and the hop count of
each route. `replica_template` lays them out once over *slots* (value and resource slots
numbered as `Slots` describes); `planner.sim.build.Builder.replica` maps the slots to the plan's
value and resource ids. Task ids, dependencies and the order of the statistics are those of
building the tasks one by one, so a stamped graph is identical to a hand-built one.

A message's first hop also waits for the receiver's task after which the runtime posts its
receive (planner.sim.schedule.receives).

A split backward (zb-h1: actions I and W) has one more value slot per stage, its I pass: the
gradient goes back from I to the previous stage's I, and the W pass takes the backward's
pieces and buckets (the weights' gradients are final when the last microbatch's W ends).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from planner.sim.schedule import Action, make_schedule, receives, split_backward


class Slots(NamedTuple):
    """Slot layout. Values: per stage its forward, its last microbatch's backward pieces, then
    the backward of other microbatches writing fresh gradients (m > 1), then that of those adding
    into .grad (`accumulates`; if any), then (a stream) its weight update; then per stage pair
    the ahead hops, the back hops; then (split backward) per stage its I pass.
    Resources: per stage its device; then per pair the ahead hops, the back hops."""
    fwd: tuple[int, ...]                    # value slot of stage s's forward
    last: tuple[tuple[int, ...], ...]       # value slots of stage s's last-microbatch pieces
    fresh: tuple[tuple[int, ...], ...]      # value slot of stage s's other fresh backwards, or ()
    other: tuple[tuple[int, ...], ...]      # value slot of stage s's other accumulating ones, or ()
    update: tuple[tuple[int, ...], ...]     # value slot of stage s's update (a stream), or ()
    ahead: tuple[tuple[int, ...], ...]      # value slots of pair p's ahead hops
    back: tuple[tuple[int, ...], ...]       # value slots of its back hops
    ahead_res: tuple[tuple[int, ...], ...]  # resource slots of pair p's ahead hops
    back_res: tuple[tuple[int, ...], ...]
    inp: tuple[int, ...] = ()               # value slot of stage s's I pass (split backward)


class ReplicaTemplate(NamedTuple):
    """Tasks over slots: task i has value slot `value[i]`, resource slot `res[i]` and
    successors `succ[i]` (local ids); `counts` are (stage, statistic, value slots in the order
    they are counted); `chunk_end[s][j]` is the local task ending piece j of stage s's last
    microbatch (its bucket becomes final there), `last_backward[s]` stage s's last task;
    `label[i]` = (kind, stage or pair, Action or (what, microbatch)) for a trace; `shifted` caches
    `succ_at`. A stream (`Stream`): `iteration_end[s][i]` is stage s's last task of iteration i
    (its update after the iteration's last backward)."""
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
    iteration_end: tuple[tuple[int, ...], ...] = ()

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


class Stream(NamedTuple):
    """A pipeline that keeps running across iterations (sync.mode pipedream, pipedream-2bw):
    the template's microbatches are several iterations of `per_iteration` each, and every stage
    updates its weights after every `update_every`-th backward (planner.sim.build)."""
    per_iteration: int
    update_every: int


def accumulates(i: int, stream: Stream | None) -> bool:
    """Whether microbatch i's backward adds its weight gradients into .grad (cost.grad_accumulate_s)
    rather than writing them: every one but the first of the iteration, whose optimizer's
    zero_grad set them to None (runtime.optim.StageOptimizer); in a stream, every one but the
    first after each update (planner.workload.weight_versions). Every schedule runs a stage's
    backwards (a split backward's W passes) in microbatch order."""
    return i % stream.update_every != 0 if stream else i > 0


def _slots(pieces: tuple[int, ...], m: int, hops: tuple[tuple[int, int], ...],
           stream: Stream | None = None, split: bool = False) -> tuple[Slots, int, int]:
    v = r = 0
    fwd, last, fresh, other, update = [], [], [], [], []
    adds = any(accumulates(i, stream) for i in range(1, m - 1))
    for n in pieces:
        fwd.append(v)
        last.append(tuple(range(v + 1, v + 1 + n)))
        v += 1 + n
        fresh.append((v,) if m > 1 else ())   # microbatch 0's
        v += 1 if m > 1 else 0
        other.append((v,) if adds else ())
        v += 1 if adds else 0
        update.append((v,) if stream else ())
        v += 1 if stream else 0
    r = len(pieces)
    ahead, back, ahead_res, back_res = [], [], [], []
    for na, nb in hops:
        ahead.append(tuple(range(v, v + na)))
        ahead_res.append(tuple(range(r, r + na)))
        v, r = v + na, r + na
        back.append(tuple(range(v, v + nb)))
        back_res.append(tuple(range(r, r + nb)))
        v, r = v + nb, r + nb
    inp = tuple(range(v, v + len(pieces))) if split else ()
    v += len(inp)
    return Slots(tuple(fwd), tuple(last), tuple(fresh), tuple(other), tuple(update), tuple(ahead), tuple(back),
                 tuple(ahead_res), tuple(back_res), inp), v, r


def _backward_tasks(add, counts, slots: Slots, stream: Stream | None, act: Action, prev: int | None,
                    m: int, bf: list[int], bl: list[int], ends: list[int]) -> int:
    """The tasks of a B or W action of stage act.stage after task `prev` (the last microbatch's
    backward in its pieces, ends of pieces recorded in `ends`; a stream's weight update after
    every update_every-th); returns its last task."""
    i, s, first = act.microbatch, act.stage, None
    ks = slots.last[s] if i == m - 1 else slots.other[s] if accumulates(i, stream) else slots.fresh[s]
    for k in ks:
        prev = add(k, s, prev, ("compute", s, act))
        counts.setdefault((s, "bwd_s"), []).append(k)
        if first is None:
            first = prev
        if i == m - 1:
            ends.append(prev)
    if act.kind == "B":
        bf[i], bl[i] = first, prev
    if stream and (i + 1) % stream.update_every == 0:   # the stage's weight update
        prev = add(slots.update[s][0], s, prev, ("update", s, act))
        counts.setdefault((s, "optimizer_s"), []).append(slots.update[s][0])
    return prev


@lru_cache(maxsize=256)
def replica_template(schedule: str, m: int, pieces: tuple[int, ...],
                     hops: tuple[tuple[int, int], ...], devices: int | None = None,
                     stream: Stream | None = None) -> ReplicaTemplate:
    """The template of a replica with len(pieces) stages (stage s's last microbatch's backward
    in pieces[s] pieces) and m microbatches; hops[p] = (hops ahead, hops back) between stages
    p and p+1; `devices`: the pipeline's distinct devices (interleaved-1f1b; default one per
    stage). A device's actions are chained in its schedule order, whichever of its (virtual)
    stages they belong to; a compute task's resource slot is its stage's (the builder maps
    the virtual stages of one device to that device's resource). A `stream` adds each stage's
    updates and marks its iterations' ends."""
    slots, _, _ = _slots(pieces, m, hops, stream, split_backward(schedule))
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
    iteration_end: list[list[int]] = [[] for _ in range(n)]
    rows = make_schedule(schedule, n, m, devices)
    spans: list[list[tuple[int, int]]] = []   # per device: (first task, last task) of each action
    for acts in rows:
        prev, row = None, []
        spans.append(row)
        for act in acts:
            i, s, start = act.microbatch, act.stage, len(value)
            f, bf, bl, ends = fwd_t[s], bwd_first[s], bwd_last[s], ends_of[s]
            if act.kind == "F":
                prev = f[i] = add(slots.fwd[s], s, prev, ("compute", s, act))
                counts.setdefault((s, "fwd_s"), []).append(slots.fwd[s])
            elif act.kind == "I":   # the gradient is received and sent on by the I pass
                prev = bf[i] = bl[i] = last_of[s] = add(slots.inp[s], s, prev, ("compute", s, act))
                counts.setdefault((s, "bwd_s"), []).append(slots.inp[s])
            else:
                prev = _backward_tasks(add, counts, slots, stream, act, prev, m, bf, bl, ends)
                last_of[s] = prev
                if stream and (i + 1) % stream.per_iteration == 0:
                    iteration_end[s].append(prev)
            row.append((start, prev))
    chunk_end = [tuple(e) for e in ends_of]
    last_backward = last_of

    def chain(vals, rs, src: int, dst: int, after: int, lab: tuple, posted: int | None) -> int:
        t = after
        for j, (k, r) in enumerate(zip(vals, rs)):
            t = add(k, r, t, lab)
            if j == 0 and posted is not None:   # a message moves once its receive is posted
                wire(posted, t)
            counts.setdefault((src, "comm_s"), []).append(k)
            counts.setdefault((dst, "comm_s"), []).append(k)
        return t

    def wire(t: int, v: int) -> None:
        succ[t].append(v)
        ndeps[v] += 1

    recv = receives(rows)

    def posted(msg: tuple[str, int, int]) -> int | None:
        """The task after which msg's receive is posted (None: at the iteration's start). In these
        schedules a device needs each peer's messages in their send order, so the message is
        taken by the action that needs it, whose task the transfer feeds."""
        d, _, after = recv[msg]
        return None if after is None else spans[d][after][1]

    for s in range(1, len(pieces)):
        p = s - 1
        for i in range(m):
            wire(chain(slots.ahead[p], slots.ahead_res[p], s - 1, s, fwd_t[s - 1][i],
                       ("act", s - 1, s, i), posted(("act", s, i))), fwd_t[s][i])
            wire(chain(slots.back[p], slots.back_res[p], s, s - 1, bwd_last[s][i],
                       ("grad", s, s - 1, i), posted(("grad", s - 1, i))), bwd_first[s - 1][i])
    return ReplicaTemplate(slots, tuple(value), tuple(res), tuple(tuple(x) for x in succ), tuple(ndeps),
                           tuple((s, stat, tuple(v)) for (s, stat), v in counts.items()), tuple(chunk_end),
                           tuple(last_backward), tuple(label), {}, tuple(map(tuple, iteration_end)))


__all__ = ["Slots", "Stream", "accumulates", "ReplicaTemplate", "replica_template", "Action"]
