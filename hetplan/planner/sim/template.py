"""One replica's pipeline tasks as a template: built once per structure, stamped per plan.

A replica's tasks (each stage's compute in schedule order, the store-and-forward hops of the
activations and gradients between stages) depend only on its structure: the schedule, the
microbatch count, the backward pieces of each stage's last microbatch and the hop count of
each route. `replica_template` lays them out once over *slots* (value and resource slots
numbered as `Slots` describes); `hetplan.planner.sim.build.Builder.replica` maps the slots to the plan's
value and resource ids. Task ids, dependencies and the order of the statistics are those of
building the tasks one by one, so a stamped graph is identical to a hand-built one.

A message's first hop also waits for the receiver's task after which the runtime posts its
receive (hetplan.planner.files.schedule.receives). A message whose receive is posted during the iteration,
from a stage whose sends can be held (`holds`), first passes a hold task on its first hop's
link: it lasts the expected hold for the sender's compute from its isend to its next wait (the
window: the sender's tasks up to its next action that takes a message, or to its row's end), a
value slot per distinct window after the others (`ReplicaTemplate.holds`); the hop then waits
for the hold and the post.

A split backward (zb-h1: actions I and W) has one more value slot per stage, its I pass: the
gradient goes back from I to the previous stage's I, and the W pass takes the backward's
pieces and buckets (the weights' gradients are final when the last microbatch's W ends).
"""
from __future__ import annotations

from functools import cached_property, lru_cache
from itertools import chain, repeat
from typing import Callable, NamedTuple

import numpy as np

from hetplan.planner.files.schedule import KINDS, POSTED_AHEAD, Action, make_schedule, schedule_arrays, split_backward


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


class ReplicaTemplate:
    """Tasks over slots: task i has value slot `value[i]`, resource slot `res[i]` and
    successors `succ[i]` (local ids); `counts` are (stage, statistic, value slots in the order
    they are counted); `chunk_end[s][j]` is the local task ending piece j of stage s's last
    microbatch (its bucket becomes final there), `last_backward[s]` stage s's last task;
    `label[i]` = (kind, stage or pair, Action or (what, microbatch)) for a trace. A stream
    (`Stream`): `iteration_end[s][i]` is stage s's last task of iteration i (its update after
    the iteration's last backward). `holds`: per hold value slot (numbered after the slots),
    the sending stage and the value slots of its window in task order. The successors are kept
    flat (`succ_at` makes the tuples per stamping base) and the labels made when first asked for
    (a trace, offloads, splits)."""
    FIELDS = ("slots", "value", "res", "succ", "ndeps", "counts", "chunk_end", "last_backward", "label",
              "iteration_end", "holds")

    def __init__(self, slots: Slots, value: tuple[int, ...], res: tuple[int, ...],
                 succ: tuple[np.ndarray, np.ndarray], ndeps: tuple[int, ...],
                 counted: np.ndarray, count_cuts: tuple[tuple[int, str, int, int], ...],
                 chunk_end: tuple[tuple[int, ...], ...],
                 last_backward: tuple[int, ...], label: Callable[[], tuple[tuple, ...]],
                 iteration_end: tuple[tuple[int, ...], ...], holds: tuple[tuple[int, tuple[int, ...]], ...] = ()):
        self.slots, self.value, self.res, self.ndeps = slots, value, res, ndeps
        self.counted, self.count_cuts = counted, count_cuts   # `counts` concatenated, each one's slice
        self.holds = holds
        self.chunk_end, self.last_backward, self.iteration_end = chunk_end, last_backward, iteration_end
        self._succ, self._label = succ, label   # (successor ids in task order, per task how many)
        self.shifted: dict[int, list[tuple[int, ...]]] = {}

    @cached_property
    def label(self) -> tuple[tuple, ...]:
        return self._label()

    @cached_property
    def counts(self) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
        return _counts(self.counted, self.count_cuts)

    @cached_property
    def res_array(self) -> np.ndarray:
        """`res` as an array."""
        return np.array(self.res, np.int64)

    @cached_property
    def value_array(self) -> np.ndarray:
        """`value` as an array."""
        return np.array(self.value, np.int64)

    @property
    def edge_dst(self) -> np.ndarray:
        """Every edge's successor, the edges in task order (each task's in wiring order)."""
        return self._succ[0]

    @cached_property
    def succ_ptr(self) -> np.ndarray:
        """Task t's successors are edge_dst[succ_ptr[t]:succ_ptr[t + 1]]."""
        ptr = np.zeros(len(self._succ[1]) + 1, np.int64)
        np.cumsum(self._succ[1], out=ptr[1:])
        return ptr

    @cached_property
    def ndeps_array(self) -> np.ndarray:
        return np.array(self.ndeps, np.int64)

    @cached_property
    def edge_src(self) -> np.ndarray:
        """Every edge's predecessor, in `edge_dst`'s order."""
        return np.repeat(np.arange(len(self._succ[1])), self._succ[1])

    @cached_property
    def succ(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.succ_at(0))

    def succ_at(self, base: int) -> list[tuple[int, ...]]:
        """`succ` with the block starting at task `base`. The last few bases are kept: a
        search stamps a replica at the same base in plan after plan."""
        out = self.shifted.get(base)
        if out is None:
            if len(self.shifted) >= 8:
                self.shifted.pop(next(iter(self.shifted)))
            flat, sizes = self._succ
            out = self.shifted[base] = _tuples(flat + base, sizes)
        return out


class Stream(NamedTuple):
    """A pipeline that keeps running across iterations (sync.mode pipedream, pipedream-2bw):
    the template's microbatches are several iterations of `per_iteration` each, and every stage
    updates its weights after every `update_every`-th backward (hetplan.planner.sim.build)."""
    per_iteration: int
    update_every: int


def accumulates(i: int, stream: Stream | None) -> bool:
    """Whether microbatch i's backward adds its weight gradients into .grad (cost.grad_accumulate_s)
    rather than writing them: every one but the first of the iteration, whose optimizer's
    zero_grad set them to None (hetplan.runtime.optim.StageOptimizer); in a stream, every one but the
    first after each update (hetplan.planner.workload.weight_versions). Every schedule runs a stage's
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


class _Skeleton(NamedTuple):
    """What a replica's template takes from its schedule alone (`_skeleton`): the actions in
    task order (device rows one after another) as arrays, and which action each dependency
    of the pipeline's messages comes from."""
    stage: np.ndarray        # per action its stage
    kind: np.ndarray         # per action _F, _I, _FRESH, _OTHER or _LAST (its value slot)
    update: np.ndarray       # per action: a stream's weight update follows it
    row_last: np.ndarray     # the last action of each device row
    fwd: np.ndarray          # [stage, microbatch]: the action F
    bwd: np.ndarray          # [stage, microbatch]: the action B, or I (split backward)
    posted_act: np.ndarray   # [pair p, microbatch]: the action after which ("act", p + 1, i)'s
    posted_grad: np.ndarray  # receive (("grad", p, i)'s) is posted; -1 at the iteration's start
    last: np.ndarray         # [stage]: its last microbatch's B or W (the pieces)
    final: np.ndarray        # [stage]: its last backward action
    next_take: np.ndarray    # per action: the next action of its row that takes a message, or the
                             #   index after the row's last
    iteration_end: tuple[tuple[int, ...], ...]   # per stage: a stream's actions ending an iteration
    keys: tuple[tuple[int, str], ...]            # compute statistics in first-count order
    n_fwd: tuple[int, ...]                       # per stage its forwards


_F, _I, _FRESH, _OTHER, _LAST = range(5)   # the value slot of an action's tasks (Slots)


@lru_cache(maxsize=256)
def _skeleton(schedule: str, n: int, m: int, devices: int | None, stream: Stream | None) -> _Skeleton:
    """The schedule's actions and messages as arrays (`_Skeleton`), shared by its templates."""
    offset, stage, letter, mb = schedule_arrays(schedule, n, m, devices)   # letter: an index in KINDS
    f, i_pass = letter == KINDS.index("F"), letter == KINDS.index("I")
    bw = ~(f | i_pass)
    adds = mb % stream.update_every != 0 if stream else mb > 0   # accumulates(i, stream), per action
    kind = np.select([f, i_pass, mb == m - 1, adds], [_F, _I, _LAST, _OTHER], _FRESH)
    # a stream's stage updates its weights after every update_every-th backward (Stream)
    update = bw & ((mb + 1) % stream.update_every == 0) if stream else np.zeros(len(stage), bool)
    idx = np.arange(len(stage))
    fwd, bwd = np.zeros((n, m), np.int64), np.zeros((n, m), np.int64)
    fwd[stage[f], mb[f]] = idx[f]
    took = ~f & (letter != KINDS.index("W"))   # B, or I: what the gradient leaves and arrives at
    bwd[stage[took], mb[took]] = idx[took]
    last, final = np.zeros(n, np.int64), np.zeros(n, np.int64)
    last[stage[kind == _LAST]] = idx[kind == _LAST]
    np.maximum.at(final, stage[~f], idx[~f])   # a stage's actions are in one row, in order
    ends = bw & ((mb + 1) % stream.per_iteration == 0) if stream else np.zeros(len(stage), bool)
    posted, takes = _receives(offset, stage, mb, f, took, fwd, bwd)
    takes[offset[1:]] = True   # each row's end
    at = np.flatnonzero(takes)
    next_take = at[np.searchsorted(at, idx + 1)]
    first = {}   # (stage, statistic) -> (first action counting it, then bwd_s before optimizer_s)
    for stat, mask, late in (("fwd_s", f, 0), ("bwd_s", ~f, 0), ("optimizer_s", update, 1)):
        counted, at = np.unique(stage[mask], return_index=True)   # each stage's first such action
        for s, a in zip(counted.tolist(), np.flatnonzero(mask)[at].tolist()):
            first[(s, stat)] = (a, late)
    return _Skeleton(stage, kind, update, offset[1:][offset[1:] > offset[:-1]] - 1, fwd, bwd, posted[0], posted[1],
                     last, final, next_take,
                     tuple(tuple(idx[ends & (stage == s)].tolist()) for s in range(n)) if stream else ((),) * n,
                     tuple(sorted(first, key=first.__getitem__)), tuple(np.bincount(stage[f], minlength=n).tolist()))


def _receives(offset: np.ndarray, stage: np.ndarray, mb: np.ndarray, f: np.ndarray, took: np.ndarray,
              fwd: np.ndarray, bwd: np.ndarray, window: int = POSTED_AHEAD) -> tuple[np.ndarray, np.ndarray]:
    """`hetplan.planner.files.schedule.receives` over the skeleton's arrays (actions in row order; f: the
    forwards, took: what a gradient leaves and arrives at): [activation 0 or gradient 1, pair,
    microbatch] the action after whose end the message's receive is posted (-1: at the
    iteration's start), and per action (one more slot: the end) whether it takes a message."""
    n, m = fwd.shape
    row = np.repeat(np.arange(len(offset) - 1), np.diff(offset))
    grad = took & (stage > 0)
    sent = np.flatnonzero((f & (stage < n - 1)) | grad)   # each peer's messages in its send order
    back = grad[sent]
    to = np.where(back, stage[sent] - 1, stage[sent] + 1)
    consumer = np.where(back, bwd[to, mb[sent]], fwd[to, mb[sent]])
    to_row = row[consumer]
    peers = row[sent] * len(offset) + to_row
    order = np.argsort(peers, kind="stable")
    cut = np.flatnonzero(np.diff(peers[order])) + 1
    need = consumer[order] - offset[to_row[order]]   # the index in its row of the action needing it
    take, post = np.empty_like(need), np.full(len(need), -1, np.int64)
    for a, b in zip(np.append(0, cut).tolist(), np.append(cut, len(need)).tolist()):
        t = take[a:b] = np.minimum.accumulate(need[a:b][::-1])[::-1]   # taken by it or a later one
        if b - a > window:
            now, before = t[window:], t[:-window]
            # posted as the action after that take starts, or (taken with it) when needed
            post[a + window:b] = np.where(now > before, before, np.where(now > 0, now - 1, -1))
    posted = np.full((2, max(n - 1, 0), m), -1, np.int64)
    ordered = sent[order]
    base = offset[to_row[order]]
    k = back[order].astype(np.int64)
    pair = to[order] - 1 + k   # an activation to stage s crosses pair s - 1, a gradient to s pair s
    has = post >= 0
    posted[k[has], pair[has], mb[ordered][has]] = (base + post)[has]
    takes = np.zeros(len(stage) + 1, bool)
    takes[base + take] = True
    return posted, takes


def _tuples(flat: np.ndarray, sizes: np.ndarray) -> list[tuple[int, ...]]:
    """flat cut into consecutive tuples of the given sizes (the tuples of one size made at
    once: zip over their columns)."""
    out = np.empty(len(sizes), object)
    first = np.cumsum(sizes) - sizes
    for k in np.unique(sizes).tolist():
        at = np.flatnonzero(sizes == k)
        cols = [flat[first[at] + j].tolist() for j in range(k)]
        out[at] = np.fromiter(zip(*cols), object, len(at)) if k else _empty(len(at))
    return out.tolist()


def _empty(n: int) -> np.ndarray:
    out = np.empty(n, object)
    out.fill(())
    return out


class ReplicaCore(NamedTuple):
    """What a replica's template holds apart from its hop tasks (`replica_core`): its
    arguments, slots, the schedule's skeleton, its compute tasks (ids as in the template:
    compute tasks come first), statistics, each stage's last-backward pieces and last task,
    a stream's iteration ends, and the holds (`ReplicaTemplate.holds`; `held` per message).
    Enough to build a replica's values and a delta build's part (hetplan.planner.sim.pipeline_pass times
    it without the template where that is exact)."""
    args: tuple
    slots: Slots
    n_values: int
    sk: "_Skeleton"
    c: "_Compute"
    chunk_end: tuple[tuple[int, ...], ...]
    last_backward: tuple[int, ...]
    iteration_end: tuple[tuple[int, ...], ...]
    holds: tuple[tuple[int, tuple[int, ...]], ...]
    held: np.ndarray
    counted: np.ndarray   # the value slots of `counts`, concatenated
    count_cuts: tuple[tuple[int, str, int, int], ...]   # per count: stage, statistic, its slice of `counted`

    @property
    def counts(self) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
        """(stage, statistic, value slots) in the order the one-at-a-time builder counted them."""
        return _counts(self.counted, self.count_cuts)


@lru_cache(maxsize=1024)
def replica_core(schedule: str, m: int, pieces: tuple[int, ...], hops: tuple[tuple[int, int], ...],
                 devices: int | None = None, stream: Stream | None = None,
                 holds: tuple[bool, ...] | None = None) -> ReplicaCore:
    """The `ReplicaCore` of `replica_template`'s arguments."""
    n = len(pieces)
    if min(pieces, default=1) < 1:
        raise ValueError(f"every stage's last backward has at least one piece; got {pieces}")
    sk = _skeleton(schedule, n, m, devices, stream)
    slots, n_values, _ = _slots(pieces, m, hops, stream, split_backward(schedule))
    c = _compute_tasks(sk, slots, pieces)
    starts, ends = c.start.tolist(), c.end.tolist()
    held, hold_windows = _hold_slots(sk, c, hops, holds, n_values)
    counted, cuts = _statistics(sk, c, slots, hops, m)
    return ReplicaCore(
        (schedule, m, pieces, hops, devices, stream, holds), slots, n_values, sk, c,
        tuple(tuple(range(starts[a], starts[a] + pieces[s])) for s, a in enumerate(sk.last.tolist())),
        tuple(ends[a] for a in sk.final.tolist()),
        tuple(tuple(ends[a] for a in e) for e in sk.iteration_end), hold_windows, held, counted, cuts)


@lru_cache(maxsize=256)
def replica_template(schedule: str, m: int, pieces: tuple[int, ...],
                     hops: tuple[tuple[int, int], ...], devices: int | None = None,
                     stream: Stream | None = None, holds: tuple[bool, ...] | None = None) -> ReplicaTemplate:
    """The template of a replica with len(pieces) stages (stage s's last microbatch's backward
    in pieces[s] >= 1 pieces) and m microbatches; hops[p] = (hops ahead, hops back) between
    stages p and p+1; `devices`: the pipeline's distinct devices (interleaved-1f1b; default one
    per stage). A device's actions are chained in its schedule order, whichever of its
    (virtual) stages they belong to; a compute task's resource slot is its stage's (the builder
    maps the virtual stages of one device to that device's resource). A `stream` adds each
    stage's updates and marks its iterations' ends.

    Tasks: each action's (one; a last microbatch's B or W one per piece; then a stream's
    update), device row after row, then per stage pair and microbatch the hops ahead and back.
    Laid out with arrays over the schedule's `_skeleton`; the edges are listed in the order
    the one-at-a-time builder added them (tests/simreference.py), so each task's successors
    come in the same order."""
    core = replica_core(schedule, m, pieces, hops, devices, stream, holds)
    sk, c, slots, held = core.sk, core.c, core.slots, core.held
    v, r, src, dst = (_hop_tasks(sk, c, slots, hops, len(c.value)) if not core.holds
                      else _held_hop_tasks(sk, c, slots, hops, len(c.value), held))
    src, dst = np.concatenate([c.src, src]), np.concatenate([c.dst, dst])
    base = len(c.value) + len(v)
    order = np.argsort(src, kind="stable")   # a task's successors in the order they were wired
    return ReplicaTemplate(
        slots, tuple(np.concatenate([c.value, v]).tolist()), tuple(np.concatenate([c.res, r]).tolist()),
        (dst[order], np.bincount(src, minlength=base)), tuple(np.bincount(dst, minlength=base).tolist()),
        core.counted, core.count_cuts, core.chunk_end, core.last_backward,
        lambda: _labels(make_schedule(schedule, len(pieces), m, devices), sk, c, hops, m, held),
        core.iteration_end, core.holds)


class _Compute(NamedTuple):
    """A template's compute tasks: action a's are start[a] .. end[a] (its pieces, then a
    stream's update); per task its value slot, its stage, its action; the device chains."""
    start: np.ndarray
    end: np.ndarray
    value: np.ndarray
    res: np.ndarray
    of: np.ndarray
    src: np.ndarray
    dst: np.ndarray


def _compute_tasks(sk: _Skeleton, slots: Slots, pieces: tuple[int, ...]) -> _Compute:
    size = 1 + sk.update + (sk.kind == _LAST) * (np.array(pieces, np.int64)[sk.stage] - 1)
    end = np.cumsum(size) - 1
    start = end - size + 1
    of = np.repeat(np.arange(len(size)), size)
    first_slot = np.array([slots.fwd, slots.inp or slots.fwd, [f[0] if f else -1 for f in slots.fresh],
                           [o[0] if o else -1 for o in slots.other], [k[0] for k in slots.last]], np.int64)
    value = first_slot[sk.kind, sk.stage][of] + np.arange(len(of)) - start[of]
    ups = np.flatnonzero(sk.update)
    if len(ups):
        value[end[ups]] = np.array([u[0] for u in slots.update])[sk.stage[ups]]
    chained = np.ones(len(of), bool)   # each task waits for its device's previous one
    chained[end[sk.row_last]] = False
    src = np.flatnonzero(chained[:-1])
    return _Compute(start, end, value, sk.stage[of], of, src, src + 1)


def message_ends(sk: _Skeleton, c: _Compute) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """[stage, microbatch]: the task of its forward (an activation leaves after it and arrives
    before it), the first task of its backward (a gradient arrives before it), the task a
    gradient leaves after (its backward's last piece); and per direction [pair, microbatch] the
    task after which the message's receive is posted, -1 at the iteration's start."""
    posted = [np.where(x >= 0, c.end[np.maximum(x, 0)], -1) for x in (sk.posted_act, sk.posted_grad)]
    return c.start[sk.fwd], c.start[sk.bwd], c.end[sk.bwd] - sk.update[sk.bwd], posted


def _hold_slots(sk: _Skeleton, c: _Compute, hops: tuple[tuple[int, int], ...], holds: tuple[bool, ...] | None,
                first_value: int) -> tuple[np.ndarray, tuple[tuple[int, tuple[int, ...]], ...]]:
    """[activation 0 or gradient 1, pair, microbatch]: the value slot of the hold the message
    passes, or -1: one where its receive is posted during the iteration, its sending stage's
    sends can be held, it has hops and its sender computes after its isend (the window, up to
    its next action that takes a message); and `ReplicaTemplate.holds`, a slot per distinct
    (sender, window) in the order met (pair after pair, microbatch after microbatch, the
    activation's before the gradient's)."""
    out = np.full((2, len(hops), sk.fwd.shape[1]), -1, np.int64)
    if not holds or not any(holds):
        return out, ()
    fwd, _, last, _ = message_ends(sk, c)
    sent = (fwd[:-1], last[1:])   # [pair, microbatch]: the task each message leaves after
    stop = np.append(c.start, len(c.value))[sk.next_take]   # per action: where its window ends
    acts = (sk.fwd[:-1], sk.bwd[1:])
    posted = (sk.posted_act, sk.posted_grad)
    slot_of: dict[tuple[int, tuple[int, ...]], int] = {}
    for p, counts in enumerate(hops):
        for i in range(sk.fwd.shape[1]):
            for k in (0, 1):
                sender = p + k
                if not (counts[k] and holds[sender] and posted[k][p, i] >= 0):
                    continue
                window = tuple(c.value[sent[k][p, i] + 1:stop[acts[k][p, i]]].tolist())
                if window:   # else the sender waits right after its isend
                    out[k, p, i] = slot_of.setdefault((sender, window), first_value + len(slot_of))
    return out, tuple(slot_of)


def _hop_tasks(sk: _Skeleton, c: _Compute, slots: Slots, hops: tuple[tuple[int, int], ...], base: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The hop tasks from task `base` on, pair after pair and in a pair microbatch after
    microbatch (its na hops ahead, then its nb back): value slots, resource slots, and their
    edges in the order they are wired. Pairs with the same hop counts are laid out at once."""
    m, n_pairs = sk.fwd.shape[1], len(hops)
    empty = np.zeros(0, np.int64)
    if not n_pairs:
        return empty, empty, empty, empty
    na, nb = (np.array(x, np.int64) for x in zip(*hops))
    first_task = base + np.concatenate([[0], np.cumsum((na + nb) * m)[:-1]])
    cols = np.where(na > 0, na + 2, 1) + np.where(nb > 0, nb + 2, 1)   # edges per microbatch
    first_edge = np.concatenate([[0], np.cumsum(cols * m)[:-1]])
    lo_value = np.array([(a + b + (0,))[0] for a, b in zip(slots.ahead, slots.back)], np.int64)
    lo_res = np.array([(a + b + (0,))[0] for a, b in zip(slots.ahead_res, slots.back_res)], np.int64)
    fwd, first, last, posted = message_ends(sk, c)
    total = int(((na + nb) * m).sum())
    value, res = np.empty(total, np.int64), np.empty(total, np.int64)
    srcs, dsts, keeps, ranks = [], [], [], []
    for a, b in sorted(set(hops)):
        ps = np.flatnonzero((na == a) & (nb == b))
        block = first_task[ps, None] + (a + b) * np.arange(m)            # [pairs, microbatch]
        at = block[:, :, None] - base + np.arange(a + b)                   # their tasks
        value[at] = lo_value[ps, None, None] + np.arange(a + b)
        res[at] = lo_res[ps, None, None] + np.arange(a + b)
        ahead = _chain_edges(block, a, fwd[ps], posted[0][ps], fwd[ps + 1])
        back = _chain_edges(block + a, b, last[ps + 1], posted[1][ps], first[ps])
        k = len(ahead[0]) + len(back[0])
        src, dst, keep = (np.stack(x + y, -1) for x, y in zip(ahead, back))
        srcs.append(src.ravel())
        dsts.append(dst.ravel())
        keeps.append(keep.ravel())
        ranks.append((first_edge[ps, None, None] + k * np.arange(m)[:, None] + np.arange(k)).ravel())
    order = np.argsort(np.concatenate(ranks))   # the edges pair after pair, as wired
    src, dst, keep = (np.concatenate(x)[order] for x in (srcs, dsts, keeps))
    return value, res, src[keep], dst[keep]


def _held_hop_tasks(sk: _Skeleton, c: _Compute, slots: Slots, hops: tuple[tuple[int, int], ...], base: int,
                    held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_hop_tasks` where some messages pass a hold (`held`: its value slot per message, or -1):
    the hold task on the first hop's link just before the message's hops, after the sender's
    task; the first hop after the hold and the post. Message by message."""
    fwd, first, last, posted = message_ends(sk, c)
    value, res, src, dst = [], [], [], []
    for p, (na, nb) in enumerate(hops):
        for i in range(sk.fwd.shape[1]):
            for k, n_hops, after, before, vs, rs in ((0, na, fwd[p, i], fwd[p + 1, i], slots.ahead[p], slots.ahead_res[p]),
                                                     (1, nb, last[p + 1, i], first[p, i], slots.back[p], slots.back_res[p])):
                t = int(after)
                if held[k, p, i] >= 0:
                    value.append(int(held[k, p, i]))
                    res.append(rs[0])
                    src.append(t)
                    dst.append(t := base + len(value) - 1)
                for j in range(n_hops):
                    value.append(vs[j])
                    res.append(rs[j])
                    src.append(t)
                    dst.append(t := base + len(value) - 1)
                    if j == 0 and posted[k][p, i] >= 0:
                        src.append(int(posted[k][p, i]))
                        dst.append(t)
                src.append(t)
                dst.append(int(before))
    return tuple(np.array(x, np.int64) for x in (value, res, src, dst))


def _chain_edges(block: np.ndarray, n_hops: int, after: np.ndarray, posted: np.ndarray,
                 before: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per microbatch (rows), the edges of one message's chain of `n_hops` tasks starting at
    `block`, in the order the builder wires them: the sender's task to the first hop, the task
    after which the receive is posted (posted >= 0) to the first hop, hop to hop, the last hop
    to the receiver's task; no hops: the sender's task to the receiver's. Columns of
    (sources, destinations, kept)."""
    yes = np.ones(block.shape, bool)
    if n_hops == 0:
        return [after], [before], [yes]
    src, dst, keep = [after, np.maximum(posted, 0)], [block, block], [yes, posted >= 0]
    for j in range(n_hops - 1):
        src.append(block + j)
        dst.append(block + j + 1)
        keep.append(yes)
    return src + [block + n_hops - 1], dst + [before], keep + [yes]


def _statistics(sk: _Skeleton, c: _Compute, slots: Slots, hops: tuple[tuple[int, int], ...], m: int
                ) -> tuple[np.ndarray, tuple[tuple[int, str, int, int], ...]]:
    """The value slots counted per (stage, statistic), in the order the one-at-a-time builder
    counted them (the compute statistics as first counted, then the hops', each counted for
    both stages), concatenated; per count (stage, statistic, its slice of them)."""
    n = len(sk.n_fwd)
    ups = np.flatnonzero(sk.update)
    backward = sk.kind[c.of] != _F
    backward[c.end[ups]] = False
    on = c.res[backward]
    flat = c.value[backward][np.argsort(on, kind="stable")]
    ends = np.cumsum(np.bincount(on, minlength=n)).tolist()
    by_stage = [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]
    counts: dict[tuple[int, str], np.ndarray] = {}
    for s, stat in sk.keys:
        counts[(s, stat)] = (np.full(sk.n_fwd[s], slots.fwd[s], np.int64) if stat == "fwd_s" else by_stage[s]
                             if stat == "bwd_s" else np.tile(np.asarray(slots.update[s], np.int64),
                                                             int(np.count_nonzero(sk.stage[ups] == s))))
    comm: dict[int, list[np.ndarray]] = {}
    for p, (na, nb) in enumerate(hops):
        ks = np.tile(np.asarray(slots.ahead[p] + slots.back[p], np.int64), m)
        for s in ((p, p + 1) if na else (p + 1, p) if nb else ()):
            comm.setdefault(s, []).append(ks)
    counts.update(((s, "comm_s"), np.concatenate(ks)) for s, ks in comm.items())
    sizes = np.cumsum([0] + [len(v) for v in counts.values()]).tolist()
    counted = np.concatenate([np.zeros(0, np.int64), *counts.values()]).astype(np.int64, copy=False)
    return counted, tuple((s, stat, a, b) for (s, stat), a, b in zip(counts, sizes[:-1], sizes[1:]))


def _counts(counted: np.ndarray, cuts: tuple[tuple[int, str, int, int], ...]
            ) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """(stage, statistic, value slots) per count, from `_statistics`' arrays."""
    flat = counted.tolist()
    return tuple((s, stat, tuple(flat[a:b])) for s, stat, a, b in cuts)


def _labels(rows: list[list[Action]], sk: _Skeleton, c: _Compute, hops: tuple[tuple[int, int], ...],
            m: int, held: np.ndarray) -> tuple[tuple, ...]:
    """Per task ("compute" or "update", stage, Action), ("act", p, p + 1, microbatch) or
    ("grad", p + 1, p, microbatch), a hold ("held act" or "held grad", ...) before its
    message's hops."""
    acts = [a for row in rows for a in row]
    sizes = (c.end - c.start + 1).tolist()
    label = list(chain.from_iterable(map(repeat, (("compute", a.stage, a) for a in acts), sizes)))
    for a in np.flatnonzero(sk.update).tolist():
        label[int(c.end[a])] = ("update", acts[a].stage, acts[a])
    for p, (na, nb) in enumerate(hops):
        for i in range(m):
            label += [("held act", p, p + 1, i)] * int(held[0, p, i] >= 0) + [("act", p, p + 1, i)] * na
            label += [("held grad", p + 1, p, i)] * int(held[1, p, i] >= 0) + [("grad", p + 1, p, i)] * nb
    return tuple(label)


__all__ = ["Slots", "Stream", "accumulates", "ReplicaTemplate", "ReplicaCore", "replica_core", "replica_template",
           "Action"]
