"""hetplan.planner.sim.eventloop.run compiled (numba), for large task graphs: the same rules, the same
float operations in the same order, so the same start and end times bit for bit
(tests/test_fastloop.py compares the two on random graphs).

The graph is prepared once (`prepare`: resources and successors as flat arrays) and run per
plan with its durations (`run`). Without numba (`available()` False) callers use the Python loop.
Where numba is present, a graph of MIN_TASKS tasks or more takes this path: below that the
Python loop costs less than a call's conversions (and a small `hetplan simulate` never imports
numba).
"""
from __future__ import annotations

import types
from itertools import chain
from typing import NamedTuple

import numpy as np

from hetplan.planner.sim.deadlock import Deadlock

MIN_TASKS = 1000   # graphs at least this large run compiled (where numba is installed)

_numba = None      # numba once imported (on first use: a process that never runs a large graph
                   # does not pay its import); False where it is missing
_loop = None       # the compiled loop, made on first use


def available() -> bool:
    """Whether numba can be imported (the Python loop is the reference either way)."""
    global _numba
    if _numba is None:
        try:
            import numba
            _numba = numba
        except ImportError:            # pragma: no cover - exercised where numba is absent
            _numba = False
    return _numba is not False


def jit(f, *helpers):
    """f compiled by numba (cached on disk), and the `helpers` it calls by name compiled with it
    (the module keeps its Python functions for the Python path); call only where `available()`."""
    if not helpers:
        return _numba.njit(cache=True)(f)
    names = dict(f.__globals__)   # f and its helpers see each other compiled here
    for g in (f, *helpers):
        names[g.__name__] = types.FunctionType(g.__code__, names, g.__name__, g.__defaults__)
    for g in (f, *helpers):
        names[g.__name__] = _numba.njit(cache=True)(names[g.__name__])
    return names[f.__name__]


def _compiled():
    """The compiled loop, with the helpers it calls."""
    global _loop
    if _loop is None:
        _loop = jit(_loop_py, _loop_state, _begin, _hold_all, _push_key, _pop_key, _push_time, _pop_time)
    return _loop


class Prepared(NamedTuple):
    """A task graph's fixed part as arrays: task t holds res_idx[res_ptr[t]:res_ptr[t + 1]] and
    is followed by succ_idx[succ_ptr[t]:succ_ptr[t + 1]]; `solo[x]`: resource x is held by
    single-resource tasks only; `cap_ptr`: each resource's slice of the waiting heaps."""
    res_ptr: np.ndarray
    res_idx: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    ndeps: np.ndarray
    solo: np.ndarray
    cap_ptr: np.ndarray
    wake: np.ndarray


def _csr(rows) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter(map(len, rows), np.int64, len(rows))
    ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    flat = np.fromiter(chain.from_iterable(rows), np.int64, int(ptr[-1]))
    return ptr, flat


def prepare(res, succ, ndeps, shared_res, n_res: int, wake: dict[int, float] | None = None,
            flat: tuple | None = None) -> Prepared:
    """The arrays `run` takes, for eventloop.run's arguments of the same names; `flat`: res and
    succ already flat (TaskGraph.arrays)."""
    w = np.zeros(len(res))
    for t, s in (wake or {}).items():
        w[t] = s
    flat = flat or (*_csr(res), *_csr(succ))
    return from_arrays(*flat, np.asarray(ndeps, np.int64), shared_res, n_res, w)


def from_arrays(res_ptr, res_idx, succ_ptr, succ_idx, ndeps, shared_res, n_res: int, wake) -> Prepared:
    """`prepare` from a graph already held as flat arrays (wake: per task, 0 for none)."""
    solo = np.ones(n_res, np.bool_)
    solo[list(shared_res)] = False
    cap_ptr = np.zeros(n_res + 1, np.int64)
    np.cumsum(np.bincount(res_idx, minlength=n_res), out=cap_ptr[1:])
    return Prepared(res_ptr, res_idx, succ_ptr, succ_idx, ndeps, solo, cap_ptr, wake)


def run(p: Prepared, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) as hetplan.planner.sim.eventloop.run gives them for this graph and durations."""
    start, end, started = _compiled()(np.ascontiguousarray(dur, np.float64), p.res_ptr, p.res_idx, p.succ_ptr,
                                      p.succ_idx, p.ndeps.copy(), p.solo, p.cap_ptr, p.wake)
    if not started.all():
        raise Deadlock([s if k else None for s, k in zip(start.tolist(), started.tolist())],
                       [p.res_idx[a:b].tolist() for a, b in zip(p.res_ptr[:-1], p.res_ptr[1:])])
    return start, end


def _loop_py(dur, res_ptr, res_idx, succ_ptr, succ_idx, ndeps, solo, cap_ptr, wake):
    """eventloop.run over arrays. Waiting: a binary heap of keys rank * n + t per resource (a slice of
    `heap`); ends: a heap of (time, task). A helper with a loop only off the common path: calls count."""
    n = dur.shape[0]
    start, end, started, busy, free_at, heap, hlen, tt, tk, newly, touched, mark, ending, k_new = _loop_state(
        n, solo.shape[0], cap_ptr, ndeps)
    tlen, k_touch, now, base = 0, 0, 0.0, 0
    while True:
        if k_new > 1:
            newly[:k_new].sort()
        for i in range(k_new):                  # the newly ready, in id order
            t = newly[i]
            a, b = res_ptr[t], res_ptr[t + 1]
            if b - a == 1:
                x = res_idx[a]
                if solo[x] and not busy[x] and hlen[x] == 0:
                    busy[x] = True
                    e = now + dur[t] + (wake[t] if free_at[x] < now else 0.0)
                    tlen = _begin(start, end, started, tt, tk, tlen, t, now, e)
                    continue
            elif b == a:                       # a pure join completes at once
                tlen = _begin(start, end, started, tt, tk, tlen, t, now, now)
                continue
            for j in range(a, b):
                x = res_idx[j]
                _push_key(heap, cap_ptr[x], hlen, x, base + t)
                if not mark[x]:
                    mark[x] = True
                    touched[k_touch] = x
                    k_touch += 1
        if k_touch > 1:
            touched[:k_touch].sort()
        for i in range(k_touch):                # start what can start, lowest resource first
            x = touched[i]
            mark[x] = False
            if busy[x]:
                continue
            off = cap_ptr[x]
            while hlen[x] > 0 and started[heap[off] % n]:   # started through another resource
                _pop_key(heap, off, hlen, x)
            if hlen[x] == 0:
                continue
            t = heap[off] % n
            a, b = res_ptr[t], res_ptr[t + 1]
            if b - a > 1:
                if not _hold_all(busy, res_idx, a, b):
                    continue
                e = now + dur[t]
            else:
                _pop_key(heap, off, hlen, x)
                busy[x] = True
                e = now + dur[t] + (wake[t] if free_at[x] < now else 0.0)
            tlen = _begin(start, end, started, tt, tk, tlen, t, now, e)
        k_touch = k_new = 0
        if tlen == 0:
            break
        e = tt[0]
        if e != now:
            now, base = e, base + n
        k_end = 0
        while tlen > 0 and tt[0] == e:          # every task ending at e, off the ends heap
            ending[k_end] = tk[0]
            k_end += 1
            tlen = _pop_time(tt, tk, tlen)
        for i in range(k_end):
            t = ending[i]
            for j in range(res_ptr[t], res_ptr[t + 1]):
                x = res_idx[j]
                busy[x], free_at[x] = False, e
                if hlen[x] > 0 and not mark[x]:
                    mark[x] = True
                    touched[k_touch] = x
                    k_touch += 1
            for j in range(succ_ptr[t], succ_ptr[t + 1]):
                v = succ_idx[j]
                ndeps[v] -= 1
                if ndeps[v] == 0:
                    newly[k_new] = v
                    k_new += 1
    return start, end, started


def _loop_state(n, n_res, cap_ptr, ndeps):
    """`_loop_py`'s arrays: per task start, end, started; per resource busy, last freed, its
    waiting heap (a slice of `heap`) and that heap's length; the ends heap (times, tasks); the
    instant's newly ready tasks (at first those without predecessors: how many, last), touched
    resources (and their marks), ending tasks."""
    m = max(n, 1)
    newly, k = np.zeros(m, np.int64), 0
    for t in range(n):
        if ndeps[t] == 0:
            newly[k] = t
            k += 1
    return (np.zeros(n), np.zeros(n), np.zeros(n, np.bool_), np.zeros(n_res, np.bool_), np.zeros(n_res),
            np.zeros(max(cap_ptr[n_res], 1), np.int64), np.zeros(n_res, np.int64), np.zeros(m), np.zeros(m, np.int64),
            newly, np.zeros(max(n_res, 1), np.int64), np.zeros(n_res, np.bool_), np.zeros(m, np.int64), k)


def _begin(start, end, started, tt, tk, tlen, t, now, e):
    """Task t starts now and ends at e; the ends heap's new length."""
    start[t] = now
    started[t] = True
    end[t] = e
    return _push_time(tt, tk, tlen, e, t)


def _hold_all(busy, res_idx, a, b):
    """Whether every resource res_idx[a:b] is free; if so they are now busy."""
    for j in range(a, b):
        if busy[res_idx[j]]:
            return False
    for j in range(a, b):
        busy[res_idx[j]] = True
    return True


def _push_key(heap, off, hlen, x, key):
    i = hlen[x]
    hlen[x] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if heap[off + parent] <= key:
            break
        heap[off + i] = heap[off + parent]
        i = parent
    heap[off + i] = key


def _pop_key(heap, off, hlen, x):
    size = hlen[x] - 1
    hlen[x] = size
    last = heap[off + size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[off + c + 1] < heap[off + c]:
            c += 1
        if heap[off + c] >= last:
            break
        heap[off + i] = heap[off + c]
        i = c
    if size > 0:
        heap[off + i] = last


def _push_time(tt, tk, tlen, e, t):
    i = tlen
    while i > 0:
        parent = (i - 1) >> 1
        if tt[parent] <= e:
            break
        tt[i] = tt[parent]
        tk[i] = tk[parent]
        i = parent
    tt[i] = e
    tk[i] = t
    return tlen + 1


def _pop_time(tt, tk, tlen):
    size = tlen - 1
    le, lk = tt[size], tk[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and tt[c + 1] < tt[c]:
            c += 1
        if tt[c] >= le:
            break
        tt[i] = tt[c]
        tk[i] = tk[c]
        i = c
    if size > 0:
        tt[i] = le
        tk[i] = lk
    return size


__all__ = ["MIN_TASKS", "Prepared", "available", "jit", "prepare", "from_arrays", "run"]
