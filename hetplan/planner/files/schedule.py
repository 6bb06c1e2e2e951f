"""Pipeline schedules as data (in the style of torch.distributed.pipelining).

An `Action` is one stage's forward or backward of one microbatch and prints as `1F0`
(stage 1, forward, microbatch 0) or `0B3`; `Action.parse` reads it back. Zero-bubble schedules
split a backward into `I` (the gradient of the stage's inputs, sent back) and `W` (the gradient
of its weights, which nothing downstream waits for). A schedule is a list
of actions per device, in the order that device runs them: one stage per device, except under
interleaved 1F1B, where device r of p holds the virtual stages r, r + p, r + 2p, ... `grid` dry-runs a schedule
with unit-time actions and prints the step x stage table (and names the step of a deadlock).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

import numpy as np

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


class Action(NamedTuple):
    stage: int
    kind: str          # "F" (forward), "B" (backward), or its halves "I" (input grad), "W" (weight grad)
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION.match(text.strip())
        if not m:
            raise ValueError(f"bad action {text!r}; expected like '1F0' or '0B3'")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs all forwards, then all backwards (microbatches in order)."""
    return [[Action(s, "F", i) for i in range(microbatches)]
            + [Action(s, "B", i) for i in range(microbatches)] for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """Non-interleaved 1F1B (PipeDream-Flush): stage s holds at most p - s microbatches."""
    out = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        acts = [Action(s, "F", i) for i in range(warmup)]                  # warm-up
        for i in range(microbatches - warmup):                            # steady: 1F then 1B
            acts += [Action(s, "F", warmup + i), Action(s, "B", i)]
        acts += [Action(s, "B", i) for i in range(microbatches - warmup, microbatches)]  # cool-down
        out.append(acts)
    return out


def hippie(stages: int, microbatches: int) -> list[list[Action]]:
    """Hippie (Ye et al., ICPP 2021): every stage but the last runs ahead like GPipe (all its
    forwards as their inputs arrive, then its backwards); the last alternates F0 B0 F1 B1 ...,
    so the backward wave starts after one microbatch, not m. Stage s < p - 1 holds m
    microbatches, the last 1; each stage's exchange and step start at its own last backward."""
    out = gpipe(stages - 1, microbatches)
    out.append([Action(stages - 1, k, i) for i in range(microbatches) for k in "FB"])
    return out


def interleaved_1f1b(devices: int, stages: int, microbatches: int) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): p devices, v = stages / p virtual
    stages each (stage c*p + r on device r), m a multiple of p. Device r's k-th forward runs
    chunk (k // p) % v on microbatch (k // (p*v)) * p + k % p; its k-th backward the same
    microbatch of chunk v - 1 - (k // p) % v. Warm-up: (p - r - 1) * 2 + (v - 1) * p forwards
    (at most m*v), then 1F1B, then the remaining backwards. Bubble (p - 1) / (v * m)."""
    p, v, m = devices, stages // devices, microbatches
    if p < 1 or v * p != stages or m % p:
        raise ValueError(f"interleaved-1f1b needs stages a multiple of devices and microbatches a "
                         f"multiple of devices; got {stages} stages, {p} devices, {m} microbatches")

    def act(r: int, k: int, kind: str) -> Action:
        c = (k // p) % v
        return Action((c if kind == "F" else v - 1 - c) * p + r, kind, (k // (p * v)) * p + k % p)

    out = []
    for r in range(p):
        total = m * v
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [act(r, k, "F") for k in range(warmup)]                     # warm-up
        for k in range(total - warmup):                                   # steady: 1F then 1B
            acts += [act(r, warmup + k, "F"), act(r, k, "B")]
        acts += [act(r, k, "B") for k in range(total - warmup, total)]     # cool-down
        out.append(acts)
    return out


def zb_h1(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each
    backward split into I and W; stage s runs its W's s microbatches late (the W of microbatch
    i after the I of i + s), so every stage holds min(p, m) microbatches, 1F1B's stage-0 peak,
    and the late W's fill the cool-down bubble: (p-1)(F + I - W) instead of (p-1)(F + I + W)."""
    out = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        acts = [Action(s, "F", i) for i in range(warmup)]                  # warm-up
        done_w = 0

        def backward(i: int) -> list[Action]:
            nonlocal done_w
            out_ = [Action(s, "I", i)]
            if i >= s:                                                    # W lags s behind I
                out_.append(Action(s, "W", done_w))
                done_w += 1
            return out_
        for i in range(microbatches - warmup):                            # steady: F, I (, W)
            acts += [Action(s, "F", warmup + i), *backward(i)]
        for i in range(microbatches - warmup, microbatches):              # cool-down: I (, W)
            acts += backward(i)
        acts += [Action(s, "W", i) for i in range(done_w, microbatches)]  # the W's still owed
        out.append(acts)
    return out


def make_schedule(name: str, stages: int, microbatches: int, devices: int | None = None) -> list[list[Action]]:
    """Each device's actions; `devices` (interleaved-1f1b only) is the number of distinct
    devices p of the pipeline (default: one per stage)."""
    return [list(row) for row in _schedule(name, stages, microbatches, devices)]


@lru_cache(maxsize=256)
def _schedule(name: str, stages: int, microbatches: int, devices: int | None) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, _make(name, stages, microbatches, devices)))


def _make(name: str, stages: int, microbatches: int, devices: int | None) -> list[list[Action]]:
    if name == "interleaved-1f1b":
        return interleaved_1f1b(devices or stages, stages, microbatches)
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "zb-h1":
        return zb_h1(stages, microbatches)
    if name == "hippie":
        return hippie(stages, microbatches)
    raise ValueError(f"unknown schedule {name!r}; expected gpipe, 1f1b, interleaved-1f1b, zb-h1 or hippie")


KINDS = "FBIW"   # an action's kind as a number: its index here (`schedule_arrays`)


@lru_cache(maxsize=256)
def schedule_arrays(name: str, stages: int, microbatches: int, devices: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`make_schedule` as arrays, the rows one after another: (each row's first index and the
    end, then per action its stage, its kind's index in KINDS, its microbatch). Laid out with
    arrays for GPipe, 1F1B, ZB-H1 and Hippie (the same actions in the same order); read off the
    actions for interleaved 1F1B."""
    n, m = stages, microbatches
    if name == "interleaved-1f1b":
        acts = [a for row in _schedule(name, n, m, devices) for a in row]
        offset = np.cumsum([0] + [len(row) for row in _schedule(name, n, m, devices)])
        return _frozen(offset.astype(np.int64), np.array([a.stage for a in acts], np.int64),
                       np.array([KINDS.index(a.kind) for a in acts], np.int64),
                       np.array([a.microbatch for a in acts], np.int64))
    _make(name, 0, 0, None)   # the name's check
    rows = [_row_arrays(name, n, m, s) for s in range(n)]
    offset = np.cumsum([0] + [len(k) for k, _ in rows]).astype(np.int64)
    stage = np.repeat(np.arange(n, dtype=np.int64), np.diff(offset))
    kinds = np.concatenate([k for k, _ in rows]).astype(np.int64) if rows else np.zeros(0, np.int64)
    mbs = np.concatenate([i for _, i in rows]).astype(np.int64) if rows else np.zeros(0, np.int64)
    return _frozen(offset, stage, kinds, mbs)


def _frozen(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays made read-only (they are cached and shared)."""
    for a in arrays:
        a.flags.writeable = False
    return arrays


def _row_arrays(name: str, n: int, m: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage s's row of a non-interleaved schedule: (kinds, microbatches)."""
    F, B, I, W = range(4)
    i = np.arange(m)
    if name == "gpipe" or (name == "hippie" and s < n - 1):
        return np.repeat([F, B], m), np.concatenate([i, i])
    if name == "hippie":   # the last stage: F0 B0 F1 B1 ...
        return np.tile([F, B], m), np.repeat(i, 2)
    w = min(n - s - 1, m)   # 1F1B and ZB-H1: warm-up forwards, then F with each backward
    steady = i < m - w
    late = i >= s if name == "zb-h1" else np.zeros(m, bool)   # ZB-H1: W(i - s) after I(i)
    size = steady + 1 + late
    at = w + np.cumsum(size) - size   # where microbatch i's backward block starts
    owed = np.arange(max(m - s, 0), m) if name == "zb-h1" else np.zeros(0, np.int64)
    n_acts = w + int(size.sum()) + len(owed)
    kinds, mbs = np.empty(n_acts, np.int64), np.empty(n_acts, np.int64)
    kinds[:w], mbs[:w] = F, np.arange(w)
    kinds[at[steady]], mbs[at[steady]] = F, w + i[steady]
    back = at + steady
    kinds[back], mbs[back] = (I if name == "zb-h1" else B), i
    kinds[back[late] + 1], mbs[back[late] + 1] = W, i[late] - s
    kinds[len(kinds) - len(owed):], mbs[len(kinds) - len(owed):] = W, owed
    return kinds, mbs


def split_backward(name: str) -> bool:
    """Whether schedule `name` splits each backward into I and W actions."""
    return name == "zb-h1"


# Receives a pipeline worker keeps posted per peer (hetplan.runtime.pipeline / hetplan.runtime.interleaved
# `_post_ahead`): a gloo or NCCL message moves only once its receive is posted, so with one posted
# a device's second receive in a row from a peer waited for its whole transfer (GPipe's forwards,
# Hippie's backwards, an interleaved device's virtual stages); two keep the next one moving during
# the compute that takes the first, for one more message buffer per link.
POSTED_AHEAD = 2


def receives(schedule: list[list[Action]], window: int = POSTED_AHEAD
             ) -> dict[tuple[str, int, int], tuple[int, int, int | None]]:
    """When each message's receive is posted and taken, as the runtime does it: a device
    receives each peer's messages in the peer's send order (an early arrival is taken when a
    later one is needed: hetplan.runtime.interleaved), and keeps `window` receives per peer posted, the
    next one posted as an action starts once one is taken (`_post_ahead`) or when it is needed.

    Messages: ("act", s, i) from F(s-1, i) to F(s, i); ("grad", s, i) from B or I (s+1, i) to
    B or I (s, i). Returns message -> (receiving device, the index of the action that takes it,
    the index of the action after whose end its receive is posted; None: at the iteration's
    start). Over gloo a message moves only once its receive is posted (hetplan.planner.sim.template,
    whose skeletons apply this rule over arrays; tests/simreference.py builds from this one)."""
    last = max((a.stage for acts in schedule for a in acts), default=0)
    device = {a.stage: d for d, acts in enumerate(schedule) for a in acts}
    consumer: dict[tuple[str, int, int], int] = {}
    for acts in schedule:
        for k, a in enumerate(acts):
            if a.kind == "F" and a.stage > 0:
                consumer[("act", a.stage, a.microbatch)] = k
            elif a.kind in "BI" and a.stage < last:
                consumer[("grad", a.stage, a.microbatch)] = k
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}   # (from, to) -> send order
    for d, acts in enumerate(schedule):
        for a in acts:
            if a.kind == "F" and a.stage < last:
                msg = ("act", a.stage + 1, a.microbatch)
            elif a.kind in "BI" and a.stage > 0:
                msg = ("grad", a.stage - 1, a.microbatch)
            else:
                continue
            sent.setdefault((d, device[msg[1]]), []).append(msg)
    out = {}
    for (_, to), msgs in sent.items():
        take, first = [0] * len(msgs), len(schedule[to])
        for j in range(len(msgs) - 1, -1, -1):    # taken by the first action needing it or a later one
            first = take[j] = min(first, consumer[msgs[j]])
        for j, msg in enumerate(msgs):
            if j < window:                        # posted as the iteration starts
                posted = None
            elif take[j] > take[j - window]:      # posted as the action after that take starts
                posted = take[j - window]
            else:                                 # taken with that one: posted when needed
                posted = take[j] - 1 if take[j] > 0 else None
            out[msg] = (to, take[j], posted)
    return out


def format_schedule(schedule: list[list[Action]]) -> str:
    return "\n".join(" ".join(str(a) for a in acts) for acts in schedule)


def parse_schedule(text: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in line.split()] for line in text.strip().splitlines()]


def dry_run(schedule: list[list[Action]]) -> list[list[Action | None]]:
    """Unit-time execution: per step, the action each device runs (None when idle).

    F(s, i) needs F(s-1, i) done in an earlier step; B(s, i) needs B(s+1, i) (or, on the last
    stage, F(s, i)); I as B, with I(s+1, i); W(s, i) needs I(s, i). Raises ValueError naming the
    step when no device can progress."""
    p = len(schedule)
    last = max((a.stage for acts in schedule for a in acts), default=0)
    done: set[tuple[int, str, int]] = set()
    pos = [0] * p
    steps: list[list[Action | None]] = []
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        row: list[Action | None] = []
        for s in range(p):
            a = schedule[s][pos[s]] if pos[s] < len(schedule[s]) else None
            if a is not None:
                k = a.stage
                need = ((k - 1, "F", a.microbatch) if a.kind == "F" and k > 0 else
                        (k + 1, a.kind, a.microbatch) if a.kind in "BI" and k < last else
                        (k, "F", a.microbatch) if a.kind in "BI" else
                        (k, "I", a.microbatch) if a.kind == "W" else None)
                if need is not None and need not in done:
                    a = None
            row.append(a)
        if all(a is None for a in row):
            waiting = [str(schedule[s][pos[s]]) for s in range(p) if pos[s] < len(schedule[s])]
            raise ValueError(f"deadlock at step {len(steps)}: waiting {', '.join(waiting)}")
        for s, a in enumerate(row):
            if a is not None:
                done.add((a.stage, a.kind, a.microbatch))
                pos[s] += 1
        steps.append(row)
    return steps


def grid(schedule: list[list[Action]], names: list[str] | None = None) -> str:
    """The step x device table of a unit-time dry run, one row per step."""
    names = names or [f"stage{s}" for s in range(len(schedule))]
    steps = dry_run(schedule)
    w = max(4, *(len(n) for n in names))
    lines = ["step " + " ".join(n.rjust(w) for n in names)]
    for t, row in enumerate(steps):
        lines.append(f"{t:>4} " + " ".join((str(a) if a else ".").rjust(w) for a in row))
    return "\n".join(lines)


__all__ = ["Action", "KINDS", "schedule_arrays", "gpipe", "one_f_one_b", "hippie", "interleaved_1f1b", "zb_h1",
           "make_schedule", "split_backward", "POSTED_AHEAD", "receives", "format_schedule",
           "parse_schedule", "dry_run", "grid"]
