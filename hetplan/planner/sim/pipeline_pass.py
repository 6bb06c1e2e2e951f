"""One replica's pipeline timed from its schedule, without its task graph (delta simulation).

Where every resource of a replica serves its tasks in an order known before the run, the
event loop's times follow from one pass in that order: a task starts at the latest of its
predecessors' ends and its resource's previous end, and ends that much later (the same float
operations, so the same times bit for bit). In a replica built from a template
(hetplan.planner.sim.template) that holds when
- each stage has a device of its own (not interleaved): a device runs its row of the
  schedule, each task chained after the previous one;
- every link direction carries one message stream (one stage pair's activations or its
  gradients, one hop of their route): its messages leave in microbatch order (a stage sends
  in its row's order, and receives are posted in that order), and on a tie the loop serves
  the lower task id, the earlier microbatch; so each hop starts at the latest of its
  message's ready time and its link's previous end;
- no task wakes up, no send is held, no stream (their durations or order depend on more).
`fits` checks this per replica. Where routes share link directions (`linked_fits`), a link
serves its hops by (ready time, task id), an order the times decide: `LinkedRun`'s pass
serves a hop there once no other can come before it, and declines where it cannot tell.
Elsewhere hetplan.planner.sim.delta runs the event loop over the replica's `graph`, laid out from the
same arrays. The passes (`_times`, `_times_linked`) are plain Python
over arrays, compiled with numba where it is installed and the replica is large;
tests/test_pipeline_pass.py compares it with the event loop on random replicas.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from hetplan.planner.sim import fastloop
from hetplan.planner.sim.deadlock import Deadlock
from hetplan.planner.sim.template import ReplicaCore, message_ends, replica_core

COMPILED_FROM = 200   # compute tasks from which the pass runs compiled (where numba is installed)


class Layout(NamedTuple):
    """A replica core's pass arrays: device rows of compute tasks (row d is tasks
    row_ptr[d]..row_ptr[d+1]-1: stage d's, one stage per device), each task's value slot and
    the message it takes (queue, microbatch; -1: none), per message queue (2p: pair p's activations, 2p+1 its
    gradients) and microbatch the task it leaves after, the task after which its receive
    is posted (-1: at the start) and the task that takes it, per queue its hops (hop_ptr) with
    their value and resource slots and (`first_hop`) the template's id of its first hop of
    microbatch 0 (those of microbatch i are `stride[q]` ids later)."""
    row_ptr: np.ndarray
    task_slot: np.ndarray
    take_q: np.ndarray
    take_i: np.ndarray
    send: np.ndarray
    post: np.ndarray
    recv: np.ndarray
    hop_ptr: np.ndarray
    hop_slot: np.ndarray
    hop_res: np.ndarray
    first_hop: np.ndarray
    stride: np.ndarray


@lru_cache(maxsize=1024)
def layout(*args) -> Layout:
    """The `Layout` of the replica core of `replica_template`'s arguments."""
    core = replica_core(*args)
    sk, c, slots = core.sk, core.c, core.slots
    n, m = sk.fwd.shape
    fwd, first, last, posted = message_ends(sk, c)
    q = max(n - 1, 0)
    take_q = np.full(len(c.value), -1, np.int64)
    take_i = np.zeros(len(c.value), np.int64)
    send, post, recv = (np.zeros((2 * q, m), np.int64) for _ in range(3))
    mb = np.arange(m)
    for p in range(q):
        take_q[fwd[p + 1]], take_i[fwd[p + 1]] = 2 * p, mb
        take_q[first[p]], take_i[first[p]] = 2 * p + 1, mb
        send[2 * p], post[2 * p], recv[2 * p] = fwd[p], posted[0][p], fwd[p + 1]
        send[2 * p + 1], post[2 * p + 1], recv[2 * p + 1] = last[p + 1], posted[1][p], first[p]
    hop_slot = [x for p in range(q) for x in slots.ahead[p] + slots.back[p]]
    hop_res = [x for p in range(q) for x in slots.ahead_res[p] + slots.back_res[p]]
    sizes = np.array([len(h) for p in range(q) for h in (slots.ahead[p], slots.back[p])], np.int64)
    per_pair = sizes.reshape(-1, 2).sum(axis=1) if q else sizes   # a pair's hops per microbatch
    # the template's hop ids: pair after pair, microbatch after microbatch, ahead then back
    pair_first = len(c.value) + np.append(0, np.cumsum(per_pair * m))[:-1]
    first_hop = (np.repeat(pair_first, 2) + np.where(np.arange(2 * q) % 2, np.repeat(sizes[::2], 2), 0)
                 if q else np.zeros(0, np.int64))
    rows = np.append(0, c.end[sk.row_last] + 1)
    return Layout(rows.astype(np.int64), c.value.astype(np.int64), take_q, take_i, send, post, recv,
                  np.append(0, np.cumsum(sizes, dtype=np.int64)).astype(np.int64),
                  np.array(hop_slot, np.int64), np.array(hop_res, np.int64), first_hop.astype(np.int64),
                  np.repeat(per_pair, 2).astype(np.int64))


class Graph(NamedTuple):
    """A replica's task graph as the template has it (the same task ids, dependencies and slots;
    each task's successors in no particular order: the event loop takes ready tasks in id
    order), laid out from its `Layout` without the template's other fields."""
    task_slot: np.ndarray   # value slot per task
    res_slot: np.ndarray    # resource slot per task
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    ndeps: np.ndarray


@lru_cache(maxsize=1024)
def graph(*args) -> Graph:
    """The `Graph` of the replica core of `replica_template`'s arguments."""
    core, lay = replica_core(*args), layout(*args)
    n_compute, m = len(lay.task_slot), lay.send.shape[1]
    n = n_compute + int(lay.stride[::2].sum()) * m
    slot, res = np.empty(n, np.int64), np.empty(n, np.int64)
    slot[:n_compute], res[:n_compute] = lay.task_slot, core.c.res
    chained = np.ones(n_compute, bool)
    chained[lay.row_ptr[1:][lay.row_ptr[1:] > lay.row_ptr[:-1]] - 1] = False   # each row's last
    src, dst = [np.flatnonzero(chained)], [np.flatnonzero(chained) + 1]
    count = np.diff(lay.hop_ptr)
    for k in np.unique(count).tolist():   # the queues with k hops at once: [queue, microbatch, hop]
        qs = np.flatnonzero(count == k)
        if k == 0:   # no hops: the receiver waits for the sender
            src.append(lay.send[qs].ravel())
            dst.append(lay.recv[qs].ravel())
            continue
        first = lay.first_hop[qs, None] + lay.stride[qs, None] * np.arange(m)
        hops = first[:, :, None] + np.arange(k)
        at = lay.hop_ptr[qs, None, None] + np.arange(k)
        slot[hops], res[hops] = lay.hop_slot[at], lay.hop_res[at]
        posted = lay.post[qs] >= 0
        src += [lay.send[qs].ravel(), lay.post[qs][posted], hops[:, :, :-1].ravel(), hops[:, :, -1].ravel()]
        dst += [first.ravel(), first[posted], hops[:, :, 1:].ravel(), lay.recv[qs].ravel()]
    src, dst = np.concatenate(src), np.concatenate(dst)
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    return Graph(slot, res, ptr, dst[order].astype(np.int64), np.bincount(dst, minlength=n).astype(np.int64))


def graph_fits(core: ReplicaCore, res: tuple[tuple[int, ...], ...], wake_at: dict) -> bool:
    """Whether `graph` holds all of a replica of `core` on resources `res` (per resource slot):
    no stream, no held sends, each task on one resource, nothing woken up."""
    _, _, _, _, _, stream, _ = core.args
    return stream is None and not core.holds and all(len(r) == 1 for r in res) and not any(r in wake_at for r in res)


def fits(core: ReplicaCore, res: tuple[tuple[int, ...], ...], wake_at: dict) -> bool:
    """Whether the pass gives such a replica its event-loop times (the module docstring's
    conditions): `graph_fits`, a device per stage, each resource slot its own resource."""
    return graph_fits(core, res, wake_at) and core.args[4] is None and len(set(res)) == len(res)


def _times(row_ptr, dur, take_q, take_i, send, post, hop_ptr, hop_dur):
    """(start, end) of each compute task, each hop's link's last end and whether the hop
    ending there took no time; ok False on a deadlock (a schedule that cannot run)."""
    n_tasks, n_rows, n_hops = len(dur), len(row_ptr) - 1, len(hop_dur)
    start, end = np.zeros(n_tasks), np.zeros(n_tasks)
    done = np.zeros(n_tasks, np.bool_)
    free = np.zeros(n_rows)
    pos = row_ptr[:-1].copy()
    link, link_zero = np.zeros(n_hops), np.zeros(n_hops, np.bool_)
    arrive = np.zeros(send.shape)
    nxt = np.zeros(send.shape[0], np.int64)   # per queue: its next message to send
    left = n_tasks
    while left > 0:
        moved = False
        for d in range(n_rows):
            while pos[d] < row_ptr[d + 1]:
                t = pos[d]
                ready = free[d]
                q = take_q[t]
                if q >= 0:
                    i = take_i[t]
                    while nxt[q] <= i:   # the queue's messages in order, as far as they can go
                        j = nxt[q]
                        s, after = send[q, j], post[q, j]
                        if not done[s] or (after >= 0 and not done[after]):
                            break
                        r = end[s]
                        if hop_ptr[q + 1] > hop_ptr[q]:
                            if after >= 0 and end[after] > r:
                                r = end[after]
                            for h in range(hop_ptr[q], hop_ptr[q + 1]):
                                if link[h] > r:
                                    r = link[h]
                                e = r + hop_dur[h]
                                link_zero[h] = e == r
                                link[h] = e
                                r = e
                        arrive[q, j] = r
                        nxt[q] = j + 1
                    if nxt[q] <= i:
                        break
                    if arrive[q, i] > ready:
                        ready = arrive[q, i]
                start[t] = ready
                end[t] = ready + dur[t]
                done[t] = True
                free[d] = end[t]
                pos[d] += 1
                left -= 1
                moved = True
        if not moved:
            return start, end, link, link_zero, False
    return start, end, link, link_zero, True


class LinkedState(NamedTuple):
    """`_times_linked`'s arrays, its results among them: each compute task's start, end and
    whether it ran; per row when it is free and its next task; per link its last end, whether
    the hop ending then took no time, and how many hops it served; per hop slot and microbatch
    the hop's ready time, whether it became ready in a later round of that instant than the
    loop's first (a task taking no time made it ready), and its place on its link; per queue
    and microbatch when the message arrives; per queue its message under way (`nxt`), that
    message's next hop (`hk`, -1: not left yet), when it is ready for it (`rq`) and whether in
    a later round of that instant (`lq`); per row the earliest its next task can start
    (`lb_row`, made when asked: `lb_made[0]`)."""
    start: np.ndarray
    end: np.ndarray
    done: np.ndarray
    free_at: np.ndarray
    pos: np.ndarray
    last: np.ndarray
    last_zero: np.ndarray
    served: np.ndarray
    ready: np.ndarray
    late: np.ndarray
    place: np.ndarray
    arrive: np.ndarray
    nxt: np.ndarray
    hk: np.ndarray
    rq: np.ndarray
    lq: np.ndarray
    lb_row: np.ndarray
    lb_made: np.ndarray


class LinkedTimes(NamedTuple):
    """The linked pass's times (`LinkedState`'s fields of the same names); `ok` False where
    nothing could move (a bound too weak, or a deadlock)."""
    start: np.ndarray
    end: np.ndarray
    last: np.ndarray
    last_zero: np.ndarray
    ready: np.ndarray
    late: np.ndarray
    place: np.ndarray
    ok: bool


def linked_pass(lay, dur, hop_dur) -> LinkedTimes:
    """The linked pass over `lay` (a `LinkedLayout`) for the compute tasks' durations `dur` and
    the hop slots' `hop_dur` (compiled as one: `_pass_linked`)."""
    st = linked_state(lay)
    ok = _times_linked(lay, dur, hop_dur, st)
    return LinkedTimes(st.start, st.end, st.last, st.last_zero, st.ready, st.late, st.place, ok)


def linked_state(lay) -> LinkedState:
    """A fresh `LinkedState` for `lay`."""
    n, n_rows, n_q, m = len(lay.task_slot), len(lay.row_ptr) - 1, lay.send.shape[0], lay.send.shape[1]
    n_hops, n_links = len(lay.hop_slot), lay.n_links
    return LinkedState(np.zeros(n), np.zeros(n), np.zeros(n, np.bool_), np.zeros(n_rows), lay.row_ptr[:-1].copy(),
                       np.zeros(n_links), np.zeros(n_links, np.bool_), np.zeros(n_links, np.int64),
                       np.zeros((n_hops, m)), np.zeros((n_hops, m), np.bool_), np.zeros((n_hops, m), np.int64),
                       np.zeros(lay.send.shape), np.zeros(n_q, np.int64), np.full(n_q, -1, np.int64), np.zeros(n_q),
                       np.zeros(n_q, np.bool_), np.zeros(n_rows), np.zeros(1, np.bool_))


def _times_linked(lay, dur, hop_dur, st) -> bool:
    """`_times` where hop slots share links (`lay`: a `LinkedLayout`), into `st` (a `LinkedState`),
    a shared link serving a hop once no other can come first (`LinkedRun`); False where nothing
    can move. One loop: compiled, each call in it would count references to every array it takes."""
    row_ptr, take_q, take_i, send, post, q_m, q_src, hop_ptr, hop_link, link_ptr, link_hop, hop_q, first_hop, stride = (
        lay.row_ptr, lay.take_q, lay.take_i, lay.send, lay.post, lay.q_m, lay.q_src, lay.hop_ptr, lay.hop_link,
        lay.link_ptr, lay.link_hop, lay.hop_q, lay.first_hop, lay.stride)
    (start, end, done, free_at, pos, last, last_zero, served, ready, late, place, arrive, nxt, hk, rq, lq, lb_row,
     lb_made) = st   # every field, in order
    n_rows, n_q, left = len(row_ptr) - 1, send.shape[0], len(dur)
    while left > 0:
        moved = lb_made[0] = False
        for step in range(n_rows + 1):   # every queue, then each row and the queues it sends on
            lo, hi = 0, n_q
            if step > 0:
                d = step - 1
                lo, hi = max(2 * d - 1, 0), min(2 * d + 1, n_q)
                while pos[d] < row_ptr[d + 1]:   # row d's tasks as far as their messages have arrived
                    t = pos[d]
                    r, q, i = free_at[d], take_q[t], take_i[t]
                    if q >= 0 and nxt[q] <= i:
                        break
                    if q >= 0 and arrive[q, i] > r:
                        r = arrive[q, i]
                    start[t], end[t], done[t] = r, r + dur[t], True
                    free_at[d] = end[t]
                    pos[d], left, moved = pos[d] + 1, left - 1, True
            for q in range(lo, hi):   # the queue's messages sent and moved hop by hop as far as they can go
                while nxt[q] < q_m[q]:
                    j = nxt[q]
                    if hk[q] < 0:
                        s, after = send[q, j], post[q, j]
                        if not done[s] or (after >= 0 and not done[after]):
                            break
                        r = end[s]
                        if hop_ptr[q + 1] > hop_ptr[q] and after >= 0 and end[after] > r:
                            r = end[after]
                        lq[q] = (end[s] == r and start[s] == r) or (
                            hop_ptr[q + 1] > hop_ptr[q] and after >= 0 and end[after] == r and start[after] == r)
                        hk[q], rq[q] = hop_ptr[q], r
                        moved = True
                    h, r = hk[q], rq[q]
                    while h < hop_ptr[q + 1]:
                        k, go, mine = hop_link[h], True, first_hop[q] + stride[q] * j + h - hop_ptr[q]
                        for a in range(link_ptr[k], link_ptr[k + 1]):   # another slot's hop first?
                            h2 = link_hop[a]
                            q2 = hop_q[h2]
                            j2 = nxt[q2] + (1 if hk[q2] > h2 else 0)   # its next message through h2
                            if h2 == h or j2 >= q_m[q2]:
                                continue
                            if j2 == nxt[q2] and hk[q2] == h2:         # waiting there: known exactly
                                lb, tie = rq[q2], first_hop[q2] + stride[q2] * j2 + h2 - hop_ptr[q2] < mine
                            elif j2 == nxt[q2] and hk[q2] >= 0:        # on its way, before h2
                                lb, tie = rq[q2] + hop_dur[hk[q2]], True
                            elif done[send[q2, j2]]:
                                lb, tie = end[send[q2, j2]], True
                            else:                                       # not sent: its row's next task first
                                if not lb_made[0]:
                                    _linked_bounds(lay, dur, hop_dur, st)
                                lb, tie = lb_row[q_src[q2]] + dur[pos[q_src[q2]]], True
                            if lb < r or (lb == r and tie):
                                go = False
                                break
                        if not go:
                            break
                        ready[h, j], late[h, j], place[h, j] = r, lq[q], served[k]
                        if last[k] > r:
                            r = last[k]
                        e = r + hop_dur[h]
                        last_zero[k] = lq[q] = e == r
                        last[k], r = e, e
                        served[k], h, moved = served[k] + 1, h + 1, True
                    if h < hop_ptr[q + 1]:
                        hk[q], rq[q] = h, r
                        break
                    arrive[q, j] = r
                    nxt[q], hk[q] = j + 1, -1
        if not moved:
            return False
    return True


def _linked_bounds(lay, dur, hop_dur, st) -> None:
    """Per row the earliest its next task can start (`st.lb_row`, made once a round: `lb_made`):
    a row waiting for a message not before the message can come."""
    row_ptr, take_q, take_i, send, q_src = lay.row_ptr, lay.take_q, lay.take_i, lay.send, lay.q_src
    nxt, hk, rq, end, done, pos, lb_row = st.nxt, st.hk, st.rq, st.end, st.done, st.pos, st.lb_row
    n_rows = len(row_ptr) - 1
    st.lb_made[0] = True
    lb_row[:] = st.free_at
    for _ in range(n_rows):
        changed = False
        for d2 in range(n_rows):
            if pos[d2] >= row_ptr[d2 + 1] or take_q[pos[d2]] < 0:
                continue
            q3, i3 = take_q[pos[d2]], take_i[pos[d2]]
            if nxt[q3] > i3:
                continue
            if i3 == nxt[q3] and hk[q3] >= 0:
                b = rq[q3] + hop_dur[hk[q3]]
            elif done[send[q3, i3]]:
                b = end[send[q3, i3]]
            else:
                b = lb_row[q_src[q3]] + dur[pos[q_src[q3]]]
            if b > lb_row[d2]:
                lb_row[d2] = b
                changed = True
        if not changed:
            break


_compiled_linked = None


def _pass_linked():
    global _compiled_linked
    if _compiled_linked is None:
        _compiled_linked = fastloop.jit(linked_pass, linked_state, _times_linked, _linked_bounds)
    return _compiled_linked


_compiled = None


def _pass():
    global _compiled
    if _compiled is None:
        _compiled = fastloop.jit(_times)
    return _compiled


def warm() -> None:
    """The compiled passes and event loop made now (numba, where installed; from its cache when
    compiled before), on a two-stage replica whose hops share one link: processes forked later
    (a search's chains) find them made instead of each compiling its own."""
    if not fastloop.available():
        return
    core = replica_core("1f1b", 2, (1, 1), ((1, 1),), None, None, None)
    canon = ((0,), (1,), (2,), (2,))
    v = np.linspace(1.0, 2.0, core.n_values)
    lay, ln = layout(*core.args), LinkedRun([core], [canon]).lay
    _pass()(lay.row_ptr, v[lay.task_slot], lay.take_q, lay.take_i, lay.send, lay.post, lay.hop_ptr, v[lay.hop_slot])
    _pass_linked()(ln, v[ln.task_slot], v[ln.hop_slot])
    g = graph(*core.args)
    fastloop.run(fastloop.from_arrays(np.arange(len(g.res_slot) + 1, dtype=np.int64), g.res_slot, g.succ_ptr,
                                      g.succ_idx, g.ndeps, (), int(g.res_slot.max()) + 1, np.zeros(len(g.res_slot))),
                 v[g.task_slot])


class PipelineRun:
    """A replica's structure timed by the pass: its core's `Layout`, and per resource slot its
    local resource (the numbering hetplan.planner.sim.delta gives a part's resources)."""

    __slots__ = ("core", "layout", "local", "n_res")

    def __init__(self, core: ReplicaCore, canon: tuple[tuple[int, ...], ...]):
        self.core, self.layout = core, layout(*core.args)
        self.local = np.array([r[0] for r in canon], np.int64)
        self.n_res = 1 + int(self.local.max(initial=-1))

    def run(self, values: tuple[float, ...]):
        """The replica's `ReplicaRun` for its value slots' `values` (ends of
        its compute tasks only: the coupling waits for no hop)."""
        lay = self.layout
        v = np.asarray(values, np.float64)
        dur, hop_dur = v[lay.task_slot], v[lay.hop_slot]
        f = (_pass() if len(dur) >= COMPILED_FROM and fastloop.available() else _times)
        start, end, link, link_zero, ok = f(lay.row_ptr, dur, lay.take_q, lay.take_i, lay.send, lay.post,
                                            lay.hop_ptr, hop_dur)
        if not ok:
            raise Deadlock(what=f"schedule {self.core.args[0]!r} cannot run")
        return _replica_run(self.n_res, lay.row_ptr, self.local, start, end, self.local[lay.hop_res], link, link_zero,
                            "pipeline-pass")


class ReplicaRun(NamedTuple):
    """A replica's times alone: its last end, each task's end, each (local) resource's last
    end and whether a task taking no time ends then, the tasks that took no time; the engine
    that timed it (hetplan.planner.sim.engines)."""
    end_s: float
    ends: Any
    last: tuple[float, ...]
    last_zero: tuple[bool, ...]
    zeros: frozenset[int]
    engine: str = ""


def _replica_run(n_res, rows, row_res, start, end, at, link, link_zero, engine):
    """The `ReplicaRun` of a pass's times: its rows' (row_ptr `rows`, local resources
    `row_res`) and its links' (local resources `at`) last ends."""
    last, last_zero = np.zeros(n_res), np.zeros(n_res, bool)
    tail = rows[1:][rows[1:] > rows[:-1]] - 1          # each non-empty row's last task
    stages = np.flatnonzero(rows[1:] > rows[:-1])
    last[row_res[stages]] = end[tail]
    last_zero[row_res[stages]] = start[tail] == end[tail]
    last[at], last_zero[at] = link, link_zero
    zeros = frozenset(np.flatnonzero(start == end).tolist())
    return ReplicaRun(float(end.max()) if len(end) else 0.0, end, tuple(last.tolist()),
                      tuple(last_zero.tolist()), zeros, engine)


def linked_fits(cores: list[ReplicaCore], res: list[tuple[tuple[int, ...], ...]], wake_at: dict) -> bool:
    """Whether `LinkedRun` may time replicas of `cores` on resources `res` together: each
    `graph_fits`, a device per stage and none shared or a link; link directions may carry
    several message streams, of one replica or of several."""
    devices = []
    for core, r in zip(cores, res):
        if not graph_fits(core, r, wake_at) or core.args[4] is not None:
            return False
        devices += [r[x] for x in np.unique(core.c.res).tolist()]
    hops = {r[x] for core, r in zip(cores, res) for x in layout(*core.args).hop_res.tolist()}
    return len(set(devices)) == len(devices) and not set(devices) & hops


class LinkedLayout(NamedTuple):
    """Several replica cores' pass arrays, one after another (`Layout`'s, shifted), as
    `_times_linked` takes them: rows, tasks' value slots and messages, queues' sends and posts,
    hops; each hop slot's link (links numbered 0..n_links-1), each link's slots
    (link_hop[link_ptr[k]:link_ptr[k + 1]]), each slot's queue, each queue's sending row and
    microbatches, each queue's first hop id and stride in the members' graphs' numbering."""
    row_ptr: np.ndarray
    task_slot: np.ndarray
    take_q: np.ndarray
    take_i: np.ndarray
    send: np.ndarray
    post: np.ndarray
    hop_ptr: np.ndarray
    hop_slot: np.ndarray
    hop_link: np.ndarray
    n_links: int
    link_ptr: np.ndarray
    link_hop: np.ndarray
    hop_q: np.ndarray
    q_src: np.ndarray
    q_m: np.ndarray
    first_hop: np.ndarray
    stride: np.ndarray


class LinkedRun:
    """Replicas whose routes share link directions (one replica's, or a group's: their tasks
    one block after another), timed by the pass where that is exact (`_times_linked`): a
    shared link serves its hops by (ready time, task id) in the event loop, so the pass serves
    a hop there only once no other can come before it. `run` returns None where the pass
    cannot move on, or hops on a shared link ready at the same instant include one made ready
    by a task taking no time (the loop then serves them by the round of that instant they
    became ready in): the caller runs the event loop. Its results number the members' compute
    tasks one block after another (`firsts`); `graph_firsts` are where each member's tasks
    begin in their graphs' (`graph`) numbering."""

    __slots__ = ("cores", "n_res", "firsts", "graph_firsts", "lay", "row_res", "links", "shared", "real", "shared_link",
                 "ids")

    def __init__(self, cores: list[ReplicaCore], canons: list[tuple[tuple[int, ...], ...]]):
        lays = [layout(*c.args) for c in cores]
        self.cores = tuple(cores)
        locals_ = [np.array([r[0] for r in canon], np.int64) for canon in canons]
        self.n_res = 1 + int(max(x.max(initial=-1) for x in locals_))
        n = [len(lay.task_slot) for lay in lays]
        rows = [len(lay.row_ptr) - 1 for lay in lays]
        qs = [lay.send.shape[0] for lay in lays]
        ms = [lay.send.shape[1] for lay in lays]
        hops = [len(lay.hop_slot) for lay in lays]
        graph_n = [k + int(lay.stride[::2].sum()) * m for k, lay, m in zip(n, lays, ms)]   # `graph`'s tasks
        off = lambda xs: np.cumsum([0] + xs)[:-1].tolist()   # noqa: E731
        toff, voff, roff, qoff, hoff, goff = (off(xs) for xs in (n, [c.n_values for c in cores], rows, qs, hops,
                                                                  graph_n))
        self.firsts, self.graph_firsts = tuple(toff), tuple(goff)
        big_m = max(ms, default=0)

        def pad(x, t):   # a member's [queue, microbatch] task ids, shifted, as wide as the widest
            out = np.full((x.shape[0], big_m), -1, np.int64)
            out[:, :x.shape[1]] = np.where(x >= 0, x + t, -1)
            return out
        self.row_res = np.concatenate([loc[:r] for loc, r in zip(locals_, rows)]) if cores else np.zeros(0, np.int64)
        row_ptr = np.append(np.concatenate([lay.row_ptr[:-1] + t for lay, t in zip(lays, toff)]), sum(n))
        hop_res = np.concatenate([loc[lay.hop_res] for loc, lay in zip(locals_, lays)])
        self.links, hop_link = np.unique(hop_res, return_inverse=True)
        hop_link = hop_link.astype(np.int64)
        count = np.bincount(hop_link, minlength=len(self.links))
        hop_ptr = np.append(np.concatenate([lay.hop_ptr[:-1] + h for lay, h in zip(lays, hoff)]), sum(hops))
        q = [np.arange(k) for k in qs]   # a replica's queue 2p: stage p's activations, 2p + 1: p + 1's gradients
        first_hop = np.concatenate([lay.first_hop + g for lay, g in zip(lays, goff)]).astype(np.int64)
        stride = np.concatenate([lay.stride for lay in lays]).astype(np.int64)
        hop_q = np.repeat(np.arange(len(hop_ptr) - 1), np.diff(hop_ptr)).astype(np.int64)
        self.lay = LinkedLayout(
            row_ptr.astype(np.int64), np.concatenate([lay.task_slot + v for lay, v in zip(lays, voff)]),
            np.concatenate([np.where(lay.take_q >= 0, lay.take_q + k, -1) for lay, k in zip(lays, qoff)]),
            np.concatenate([lay.take_i for lay in lays]),
            np.concatenate([pad(lay.send, t) for lay, t in zip(lays, toff)]),
            np.concatenate([pad(lay.post, t) for lay, t in zip(lays, toff)]),
            hop_ptr.astype(np.int64), np.concatenate([lay.hop_slot + v for lay, v in zip(lays, voff)]),
            hop_link, len(self.links), np.append(0, np.cumsum(count)).astype(np.int64),
            np.argsort(hop_link, kind="stable").astype(np.int64), hop_q,
            np.concatenate([x // 2 + x % 2 + r for x, r in zip(q, roff)]).astype(np.int64),
            np.concatenate([np.full(k, m, np.int64) for k, m in zip(qs, ms)]), first_hop, stride)
        self.shared = np.flatnonzero(count[hop_link] > 1)
        queue = hop_q[self.shared]
        # per shared hop slot and microbatch it has (`real`, of the slots x big_m it is laid out
        # in): its link and its task id in the event loop (`graph`'s numbering, members in turn)
        self.real = (np.arange(big_m) < self.lay.q_m[queue][:, None]).ravel()
        self.shared_link = np.repeat(hop_link[self.shared], big_m)[self.real]
        self.ids = ((first_hop[queue] + self.shared - hop_ptr[queue])[:, None]
                    + stride[queue][:, None] * np.arange(big_m)).ravel()[self.real]

    def run(self, values: tuple[float, ...]):
        lay = self.lay
        v = np.asarray(values, np.float64)
        dur, hop_dur = v[lay.task_slot], v[lay.hop_slot]
        f = (_pass_linked() if len(dur) >= COMPILED_FROM and fastloop.available() else linked_pass)
        st = f(lay, dur, hop_dur)
        if not st.ok or not self._served_in_order(st.ready, st.late, st.place):
            return None
        return _replica_run(self.n_res, lay.row_ptr, self.row_res, st.start, st.end, self.links, st.last,
                            st.last_zero, "linked-pass")

    def _served_in_order(self, ready: np.ndarray, late: np.ndarray, place: np.ndarray) -> bool:
        """Whether each shared link served its hops by (ready time, task id), none of a tie
        made ready late."""
        h, real = self.shared, self.real
        if not len(h):
            return True
        r = ready[h].ravel()[real]
        order = np.lexsort((self.ids, r, self.shared_link))
        sl, sr, sz, sp = self.shared_link[order], r[order], late[h].ravel()[real][order], place[h].ravel()[real][order]
        same = sl[1:] == sl[:-1]
        tie = same & (sr[1:] == sr[:-1])
        return not np.any(tie & (sz[1:] | sz[:-1])) and bool(np.all(sp[1:][same] > sp[:-1][same]))


__all__ = ["ReplicaRun", "Layout", "Graph", "LinkedLayout", "layout", "graph", "fits", "graph_fits", "linked_fits", "PipelineRun",
           "LinkedRun", "COMPILED_FROM", "warm"]
