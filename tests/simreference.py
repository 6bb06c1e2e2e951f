"""Replica templates as first written, and random plans, for equivalence tests (the reference
event loop is hetplan.planner.sim.reference).

`replica_template_one_by_one` is the template builder before arrays (hetplan.planner.sim.template).
Not a test file.
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import NamedTuple

from hetplan.planner.files.schedule import Action
from hetplan.planner.files.schedule import make_schedule as _make_schedule, receives as _receives
from hetplan.planner.files.schedule import split_backward as _split_backward
from hetplan.planner.sim.template import Slots, Stream, _slots, accumulates

from simhelpers import device, graph, layer, link, plan, topology


def random_case(rng: random.Random):
    """(graph, topology, plan): 1-7 layers (some with zero FLOPs, zero cut bytes), cpu:0 linked
    to four GPUs (some GPU-GPU links, zero latencies), 1-3 replicas of 1-4 stages, every
    schedule, sync granularity, optimizer placement and recompute setting."""
    nl = rng.randint(1, 7)
    g = graph([layer(i, fwd_flops=rng.choice([0, 1e9, 3e9]), bwd_flops=rng.choice([0, 2e9, 5e9]),
                     param_bytes=rng.choice([0, 10**5, 3 * 10**5, 10**6]), saved_bytes=100)
               for i in range(nl)], batch=rng.choice([1, 4, 8]),
              cut_bytes=[rng.choice([0, 800, 10**6]) for _ in range(nl + 1)])
    names = ["cpu:0", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    devs = [device(d, flops=rng.choice([2e8, 1e9, 2e9]), mem_bw=rng.choice([1e8, 1e9, 1e10]))
            for d in names]
    links = [link("cpu:0", d, rng.choice([1e6, 1e7]), rng.choice([0.0, 1e-4])) for d in names[1:]]
    if rng.random() < 0.5:
        links += [link(a, b, rng.choice([1e6, 5e7]), rng.choice([0.0, 1e-5]))
                  for a, b in [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"), ("cuda:1", "cuda:2")]
                  if rng.random() < 0.7]
    free = names[:]
    rng.shuffle(free)
    n_rep = rng.randint(1, 3)
    reps = []
    for r in range(n_rep):
        k = rng.randint(1, min(nl, len(free) - (n_rep - r - 1)))
        bounds = [0, *sorted(rng.sample(range(1, nl), k - 1)), nl]
        reps.append((rng.randint(1, 5), rng.randint(1, 4),
                     [(free.pop(), bounds[i], bounds[i + 1]) for i in range(k)]))
    total = sum(w for w, _, _ in reps)
    pl = plan([(w / total, m, st) for w, m, st in reps], 24, schedule=rng.choice(["gpipe", "1f1b"]),
              granularity=rng.choice(["fine", "coarse"]),
              bucket_bytes=rng.choice([10**5, 4 * 10**5, 1 << 40]), optimizer=rng.choice(["sgd", "adam"]),
              placement=rng.choice(["device", "cpu"]), recompute=rng.random() < 0.3)
    if not pl.recompute and rng.random() < 0.3:     # zb-h1 takes no recompute (files.plan)
        pl = replace(pl, schedule="zb-h1")
    elif rng.random() < 0.25:
        pl = replace(pl, schedule="hippie")
    return g, held_sends(pl, topology(devs, links)), pl


def held_sends(pl, topo):
    """`topo`, for half the plans, with a calibration whose CPU worker's sends can be held
    (hetplan.planner.sim.template), on the scale of these cases' seconds-long tasks; drawn from the
    plan, not from the cases' generator, which makes the same cases as before."""
    if random.Random(repr(pl)).random() < 0.5:
        return topo
    return replace(topo, measured={"calibration": {"held_send_curve": [[0.5, 0.2], [2.0, 0.6], [8.0, 1.5]]}})


def random_twin_case(rng: random.Random):
    """(graph, topology, plan) with 2-3 replicas cut alike, most with equal batches and
    microbatches (so they can be collapsed), on cpu:0 plus six GPUs with random direct links."""
    nl = rng.randint(2, 6)
    g = graph([layer(i, fwd_flops=rng.choice([0, 1e9]), bwd_flops=rng.choice([0, 2e9]),
                     param_bytes=rng.choice([0, 10**5, 10**6]), saved_bytes=100) for i in range(nl)],
              batch=4, cut_bytes=[rng.choice([0, 10**6]) for _ in range(nl + 1)])
    names = ["cpu:0"] + [f"cuda:{i}" for i in range(6)]
    links = [link("cpu:0", d, 1e7, rng.choice([0.0, 1e-4])) for d in names[1:]]
    links += [link(a, b, rng.choice([1e7, 5e7]), 1e-5) for i, a in enumerate(names[1:])
              for b in names[i + 2:] if rng.random() < 0.6]
    k, n_rep = rng.randint(1, 2), rng.randint(2, 3)
    bounds = [0, *sorted(rng.sample(range(1, nl), k - 1)), nl]
    free = names[:]
    rng.shuffle(free)
    weights = [rng.choice([1, 1, 2]) for _ in range(n_rep)]
    m = rng.choice([2, 2, 3])
    reps = [(w / sum(weights), m if rng.random() < 0.8 else 1,
             [(free.pop(), bounds[i], bounds[i + 1]) for i in range(k)]) for w in weights]
    pl = plan(reps, 24, schedule=rng.choice(["gpipe", "1f1b"]), granularity=rng.choice(["fine", "coarse"]),
              bucket_bytes=rng.choice([10**5, 10**6, 1 << 40]), optimizer=rng.choice(["sgd", "adam"]),
              placement=rng.choice(["device", "device", "cpu"]), recompute=rng.random() < 0.3)
    return g, held_sends(pl, topology([device(d, mem_bw=1e9) for d in names], links)), pl


def random_cpu_pipelines(rng: random.Random):
    """(graph, topology, plan): 1-2 replicas of 2-4 stages on CPU workers cpu:0..cpu:7 of a
    calibrated host whose sends can be held (hetplan.planner.sim.template) and whose workers wake up
    late, 2-8 microbatches, every schedule but interleaved, every sync granularity."""
    nl = rng.randint(2, 6)
    g = graph([layer(i, fwd_flops=rng.choice([0, 1e9, 3e9]), bwd_flops=rng.choice([1e9, 2e9, 5e9]),
                     param_bytes=rng.choice([0, 10**5, 10**6]), saved_bytes=100) for i in range(nl)],
              batch=rng.choice([1, 4]), cut_bytes=[rng.choice([0, 800, 10**6]) for _ in range(nl + 1)])
    names = [f"cpu:{i}" for i in range(8)]
    devs = [device(d, flops=rng.choice([5e8, 1e9, 2e9])) for d in names]
    links = [link(a, b, rng.choice([1e6, 1e7]), rng.choice([0.0, 1e-2])) for i, a in enumerate(names)
             for b in names[i + 1:]]
    free = names[:]
    rng.shuffle(free)
    reps = []
    for _ in range(rng.randint(1, 2)):
        k = rng.randint(2, min(4, nl))
        bounds = [0, *sorted(rng.sample(range(1, nl), k - 1)), nl]
        reps.append((rng.randint(1, 3), rng.randint(2, 8), [(free.pop(), bounds[i], bounds[i + 1]) for i in range(k)]))
    total = sum(w for w, _, _ in reps)
    pl = plan([(w / total, m, st) for w, m, st in reps], 24,
              schedule=rng.choice(["gpipe", "gpipe", "hippie", "zb-h1", "1f1b"]),
              granularity=rng.choice(["fine", "coarse"]), bucket_bytes=rng.choice([10**5, 1 << 40]))
    curve = [[0.3, rng.choice([0.1, 0.3])], [2.0, 0.8], [8.0, rng.choice([0.8, 2.0])]]
    calibration = {"held_send_curve": curve, "wake_latency_s": rng.choice([0.0, 0.05])}
    return g, replace(topology(devs, links), measured={"calibration": calibration}), pl


def build_one_by_one(builder, r, rep):
    """Replica r's tasks added one at a time, as the builder did before templates
    (hetplan.planner.sim.template): each stage's compute in schedule order, then per stage pair and
    microbatch the activation's hops and the gradient's hops. For equivalence tests. A split
    backward (zb-h1): an I task per I action (the gradient leaves and arrives there) and the
    backward's pieces per W action; its I values are numbered after the hops."""
    from hetplan.planner.sim.build import Chunk
    from hetplan.planner.files.schedule import make_schedule, receives, split_backward
    from hetplan.planner.sim.taskgraph import HeldSend
    g, sim, m = builder.g, builder.sim, rep.microbatches
    pairs = [(a.device, b.device) for a, b in zip(rep.stages, rep.stages[1:])]
    g.begin_replica((m, tuple(st.layers for st in rep.stages),
                     tuple((len(sim.hops(a, b)), len(sim.hops(b, a))) for a, b in pairs)), None)
    sched = make_schedule(builder.plan.schedule, len(rep.stages), m)
    split = split_backward(builder.plan.schedule)
    pieces_of = builder.weight_values if split else builder.backward_values
    if split:   # number the values as the template's slots do: stages, hops, then the I passes
        for s, st in enumerate(rep.stages):
            builder.forward_value(r, s, rep.stages)
            pieces_of(r, s, rep.stages, builder.backward_chunks(st), accumulates=m > 1)
            if m > 1:   # microbatch 0 writes fresh gradients, the later ones add (Builder.replica)
                pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)])
            if m > 2:
                pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)], accumulates=True)
        for s in range(1, len(rep.stages)):
            src, dst, cut = rep.stages[s - 1].device, rep.stages[s].device, rep.stages[s].start
            builder.route(src, dst, r, cut), builder.route(dst, src, r, cut)
    fwd, first, last, ends = [], [], [], []   # ends[s]: the last task of each action of stage s
    spans = []   # spans[s]: the first task of each action of stage s
    for s, st in enumerate(rep.stages):
        rid, dev = sim.rid[st.device], st.device
        f_k = builder.forward_value(r, s, rep.stages)
        pieces = pieces_of(r, s, rep.stages, builder.backward_chunks(st), accumulates=m > 1)
        fresh = pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)]) if m > 1 else []
        other = pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)], accumulates=True) if m > 2 else []
        i_k = builder.input_value(r, s, rep.stages) if split else None
        f, b0, b1, prev = [None] * m, [None] * m, [None] * m, None
        ends.append([])
        spans.append([])
        for act in sched[s]:
            spans[s].append(len(g.dkey))
            i = act.microbatch
            if act.kind == "F":
                prev = f[i] = g.add(f_k, (rid,), (prev,))
                g.count(dev, "fwd_s", f_k)
                ends[s].append(prev)
                continue
            if act.kind == "I":
                prev = b0[i] = b1[i] = g.add(i_k, (rid,), (prev,))
                g.count(dev, "bwd_s", i_k)
                ends[s].append(prev)
                continue
            for j, (k, bucket) in enumerate(pieces if i == m - 1 else other if i else fresh):
                prev = g.add(k, (rid,), (prev,))
                g.count(dev, "bwd_s", k)
                if act.kind == "B":
                    b0[i] = prev if j == 0 else b0[i]
                if bucket is not None:
                    builder.progress.chunk_of[(dev, bucket)] = prev
            if act.kind == "B":
                b1[i] = prev
            ends[s].append(prev)
        builder.progress.last_backward[dev] = prev
        fwd.append(f), first.append(b0), last.append(b1)
    recv = receives(sched)

    def posted(msg):
        d, _, after = recv[msg]
        return None if after is None else ends[d][after]
    routes = []
    for s in range(1, len(rep.stages)):
        src, dst, cut = rep.stages[s - 1].device, rep.stages[s].device, rep.stages[s].start
        routes.append((builder.route(src, dst, r, cut), builder.route(dst, src, r, cut)))

    def hold(msg, sender: int, kind: str, sent: int, route) -> int:
        """The hold task msg passes before its hops (hetplan.planner.sim.template), after `sent`; or
        `sent` where it passes none."""
        st = rep.stages[sender]
        if not (route and not st.split and sim.cost.holds_sends(st.device) and recv[msg][2] is not None):
            return sent
        k = next(j for j, a in enumerate(sched[sender]) if a.kind == kind and a.microbatch == msg[2])
        takes = sorted(t for d, t, _ in recv.values() if d == sender and t > k)
        stop = spans[sender][takes[0]] if takes else ends[sender][-1] + 1
        if stop <= sent + 1:
            return sent
        window = tuple(g.recipes[g.dkey[t]] for t in range(sent + 1, stop))
        return g.add(g.value(HeldSend(r, st.device, window)), (route[0][0].resource,), (sent,))
    for s in range(1, len(rep.stages)):
        src, dst = rep.stages[s - 1].device, rep.stages[s].device
        ahead, back = routes[s - 1]
        for i in range(m):   # a message moves once its receive is posted (schedule.receives)
            t = hold(("act", s, i), s - 1, "F", fwd[s - 1][i], ahead)
            g.wire(builder.chain(ahead, src, dst, t, None, posted(("act", s, i))), fwd[s][i])
            t = hold(("grad", s - 1, i), s, "I" if split else "B", last[s][i], back)
            g.wire(builder.chain(back, dst, src, t, None, posted(("grad", s - 1, i))), first[s - 1][i])
    g.end_replica()


# --- hetplan.planner.sim.template.replica_template as first written: one task at a time ------------------


class OneByOne(NamedTuple):
    """hetplan.planner.sim.template.ReplicaTemplate's fields (ReplicaTemplate.FIELDS)."""
    slots: Slots
    value: tuple[int, ...]
    res: tuple[int, ...]
    succ: tuple[tuple[int, ...], ...]
    ndeps: tuple[int, ...]
    counts: tuple[tuple[int, str, tuple[int, ...]], ...]
    chunk_end: tuple[tuple[int, ...], ...]
    last_backward: tuple[int, ...]
    label: tuple[tuple, ...]
    iteration_end: tuple[tuple[int, ...], ...]
    holds: tuple[tuple[int, tuple[int, ...]], ...]


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


def replica_template_one_by_one(schedule: str, m: int, pieces: tuple[int, ...],
                                hops: tuple[tuple[int, int], ...], devices: int | None = None,
                                stream: Stream | None = None, holds: tuple[bool, ...] | None = None) -> OneByOne:
    """hetplan.planner.sim.template.replica_template built task by task (the reference of its tests).

    The template of a replica with len(pieces) stages (stage s's last microbatch's backward
    in pieces[s] pieces) and m microbatches; hops[p] = (hops ahead, hops back) between stages
    p and p+1; `devices`: the pipeline's distinct devices (interleaved-1f1b; default one per
    stage). A device's actions are chained in its schedule order, whichever of its (virtual)
    stages they belong to; a compute task's resource slot is its stage's (the builder maps
    the virtual stages of one device to that device's resource). A `stream` adds each stage's
    updates and marks its iterations' ends. `holds[s]`: a message stage s sends, whose receive
    is posted during the iteration, first passes a hold task on its first hop's link, lasting
    the sender's tasks from its isend to its next action that takes a message (or its row's
    end); none where that window is empty."""
    slots, n_values, _ = _slots(pieces, m, hops, stream, _split_backward(schedule))
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
    rows = _make_schedule(schedule, n, m, devices)
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
    recv = _receives(rows)
    where = {act: (d, k) for d, acts in enumerate(rows) for k, act in enumerate(acts)}
    takes = [set() for _ in rows]
    for d, take, _ in recv.values():
        takes[d].add(take)
    hold_slot: dict[tuple[int, tuple[int, ...]], int] = {}

    def hold(msg: tuple[str, int, int], sender: Action, sent: int, n_hops: int) -> int | None:
        """The value slot of the hold msg passes, or None."""
        if not (n_hops and holds and holds[sender.stage] and recv[msg][2] is not None):
            return None
        d, k = where[sender]
        nxt = [j for j in range(k + 1, len(rows[d])) if j in takes[d]]
        stop = spans[d][nxt[0]][0] if nxt else spans[d][-1][1] + 1
        window = tuple(value[sent + 1:stop])
        return hold_slot.setdefault((sender.stage, window), n_values + len(hold_slot)) if window else None

    def chain(vals, rs, src: int, dst: int, after: int, lab: tuple, posted: int | None, held: int | None) -> int:
        t = after
        if held is not None:   # the hold on the first hop's link
            t = add(held, rs[0], t, ("held " + lab[0], *lab[1:]))
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

    def posted(msg: tuple[str, int, int]) -> int | None:
        """The task after which msg's receive is posted (None: at the iteration's start). In these
        schedules a device needs each peer's messages in their send order, so the message is
        taken by the action that needs it, whose task the transfer feeds."""
        d, _, after = recv[msg]
        return None if after is None else spans[d][after][1]

    for s in range(1, len(pieces)):
        p = s - 1
        for i in range(m):
            grad_sender = next(a for a in rows[where[Action(s, "F", i)][0]] if a.stage == s and a.microbatch == i
                               and a.kind in "BI")
            wire(chain(slots.ahead[p], slots.ahead_res[p], s - 1, s, fwd_t[s - 1][i], ("act", s - 1, s, i),
                       posted(("act", s, i)), hold(("act", s, i), Action(p, "F", i), fwd_t[p][i], len(slots.ahead[p]))),
                 fwd_t[s][i])
            wire(chain(slots.back[p], slots.back_res[p], s, s - 1, bwd_last[s][i], ("grad", s, s - 1, i),
                       posted(("grad", s - 1, i)), hold(("grad", p, i), grad_sender, bwd_last[s][i], len(slots.back[p]))),
                 bwd_first[s - 1][i])
    return OneByOne(slots, tuple(value), tuple(res), tuple(tuple(x) for x in succ), tuple(ndeps),
                    tuple((s, stat, tuple(v)) for (s, stat), v in counts.items()), tuple(chunk_end),
                    tuple(last_backward), tuple(label), tuple(map(tuple, iteration_end)), tuple(hold_slot))
