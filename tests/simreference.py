"""The simulator's event loop as first written, and random plans, for equivalence tests.

`reference_run` is the plain version of `Simulator._run` (tuple heaps, no fast paths): the
order of task starts that the fast loop must reproduce exactly. Not a test file.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import replace

from simhelpers import device, graph, layer, link, plan, topology


def reference_run(dur, res, succ, ndeps, n_res):
    """Events (end, id), all applied before any start; queues by (ready time, id), served in
    resource id order; a multi-resource task starts when all its resources are free."""
    ndeps = list(ndeps)
    n = len(dur)
    start, end = [0.0] * n, [0.0] * n
    busy, started = [False] * n_res, [False] * n
    waiting = [[] for _ in range(n_res)]
    events, touched = [], []
    newly = [t for t in range(n) if ndeps[t] == 0]
    now = 0.0
    while True:
        for t in newly:
            if not res[t]:
                started[t] = True
                start[t] = end[t] = now
                heapq.heappush(events, (now, t))
            for x in res[t]:
                heapq.heappush(waiting[x], (now, t))
                touched.append(x)
        for x in sorted(set(touched)):
            w = waiting[x]
            while w and started[w[0][1]]:
                heapq.heappop(w)
            if busy[x] or not w:
                continue
            t = w[0][1]
            if any(busy[y] for y in res[t]):
                continue
            if len(res[t]) == 1:
                heapq.heappop(w)
            for y in res[t]:
                busy[y] = True
            started[t], start[t], end[t] = True, now, now + dur[t]
            heapq.heappush(events, (end[t], t))
        touched, newly = [], []
        if not events:
            return start, end
        now = events[0][0]
        while events and events[0][0] == now:
            t = heapq.heappop(events)[1]
            for x in res[t]:
                busy[x] = False
                touched.append(x)
            for v in succ[t]:
                ndeps[v] -= 1
                if ndeps[v] == 0:
                    newly.append(v)


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
    return g, topology(devs, links), pl


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
    return g, topology([device(d, mem_bw=1e9) for d in names], links), pl


def build_one_by_one(builder, r, rep):
    """Replica r's tasks added one at a time, as the builder did before templates
    (planner.sim.template): each stage's compute in schedule order, then per stage pair and
    microbatch the activation's hops and the gradient's hops. For equivalence tests. A split
    backward (zb-h1): an I task per I action (the gradient leaves and arrives there) and the
    backward's pieces per W action; its I values are numbered after the hops."""
    from planner.sim.build import Chunk
    from planner.sim.schedule import make_schedule, receives, split_backward
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
    for s, st in enumerate(rep.stages):
        rid, dev = sim._rid[st.device], st.device
        f_k = builder.forward_value(r, s, rep.stages)
        pieces = pieces_of(r, s, rep.stages, builder.backward_chunks(st), accumulates=m > 1)
        fresh = pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)]) if m > 1 else []
        other = pieces_of(r, s, rep.stages, [Chunk(st.end, st.start, None)], accumulates=True) if m > 2 else []
        i_k = builder.input_value(r, s, rep.stages) if split else None
        f, b0, b1, prev = [None] * m, [None] * m, [None] * m, None
        ends.append([])
        for act in sched[s]:
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
    for s in range(1, len(rep.stages)):
        src, dst, cut = rep.stages[s - 1].device, rep.stages[s].device, rep.stages[s].start
        ahead, back = builder.route(src, dst, r, cut), builder.route(dst, src, r, cut)
        for i in range(m):   # a message moves once its receive is posted (schedule.receives)
            g.wire(builder.chain(ahead, src, dst, fwd[s - 1][i], None, posted(("act", s, i))), fwd[s][i])
            g.wire(builder.chain(back, dst, src, last[s][i], None, posted(("grad", s - 1, i))), first[s - 1][i])
    g.end_replica()
