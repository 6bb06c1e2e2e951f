"""hetplan.planner.sim.pipeline_pass: a replica timed by one pass over its schedule gives the event loop's
times bit for bit (each compute task's end, each resource's last end and whether a task taking
no time ends there, the iteration's end), compiled and in Python; `fits` refuses what the pass
does not model; a replica's graph laid out without its template (`graph`, run by
hetplan.planner.sim.delta.GraphRun where links are shared) is the template's; where routes share links,
the linked pass (`LinkedRun`) gives the event loop's times or declines."""
from __future__ import annotations

import random

import numpy as np
import pytest

from hetplan.planner.sim import fastloop, pipeline_pass as pipeline
from hetplan.planner.sim.pipeline_pass import LinkedRun, PipelineRun, fits, graph, linked_fits
from hetplan.planner.sim.delta import GraphRun, Linked, Structure
from hetplan.planner.sim.template import Stream, replica_core, replica_template

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "hippie")


def random_replica(rng: random.Random):
    """(template arguments, resources per slot, links, slot values): durations drawn from a few
    values with zeros, so ties and tasks taking no time are common."""
    n, m = rng.randint(1, 5), rng.randint(1, 7)
    schedule = rng.choice(SCHEDULES)
    pieces = tuple(rng.randint(1, 3) for _ in range(n))
    hops = tuple((rng.randint(0, 3), rng.randint(0, 3)) for _ in range(n - 1))
    args = (schedule, m, pieces, hops, None, None, None)
    core = replica_core(*args)
    n_res = n + sum(a + b for a, b in hops)
    ids = rng.sample(range(3 * n_res + 5), n_res)   # the plan's resource ids, distinct
    res = tuple((x,) for x in ids)
    links = {(x,) for x in ids[n:]}
    choices = [0.0, 1.0, 2.0, 0.5, 3.0, 1e-9, 7.25]
    values = tuple(rng.choice(choices) for _ in range(core.n_values))
    return args, res, links, values


def canonical(res):
    used = sorted({x for r in res for x in r})
    local = dict(zip(used, range(len(used))))
    return tuple(tuple(map(local.__getitem__, r)) for r in res)


def event_loop_run(args, res, links, values):
    canon = canonical(res)
    return Structure.of_template(replica_template(*args), canon, res, {}, links).run(values)


def assert_same(fast, slow, n_compute):
    assert fast.end_s == slow.end_s
    assert np.asarray(fast.ends).tolist() == np.asarray(slow.ends)[:n_compute].tolist()
    assert fast.last == slow.last
    assert fast.last_zero == slow.last_zero
    assert fast.zeros == frozenset(t for t in slow.zeros if t < n_compute)


def compiled_from(monkeypatch, module, name: str, compiled: bool) -> None:
    """module.name (the size from which a loop runs compiled) set so that every run is compiled
    or none is; skips where numba is missing and compiled runs are asked for."""
    if compiled and not fastloop.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(module, name, 0 if compiled else 10**9)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_pass_gives_the_event_loops_times_on_random_replicas(compiled, monkeypatch):
    compiled_from(monkeypatch, pipeline, "COMPILED_FROM", compiled)
    rng = random.Random(7)
    for _ in range(300):
        args, res, links, values = random_replica(rng)
        core = replica_core(*args)
        assert fits(core, res, {})
        fast = PipelineRun(core, canonical(res)).run(values)
        assert_same(fast, event_loop_run(args, res, links, values), len(core.c.value))


def test_the_pass_follows_a_late_posted_receive_and_a_busy_link():
    # GPipe, 2 stages, 4 microbatches, one hop each way: stage 1 posts its third receive only
    # after its first forward (POSTED_AHEAD 2), so activation 2 waits on the link for it
    args = ("gpipe", 4, (1, 1), ((1, 1),), None, None, None)
    core = replica_core(*args)
    res, links = ((0,), (1,), (2,), (3,)), {(2,), (3,)}
    fwd, hop, slow = 1.0, 0.25, 5.0
    values = [0.0] * core.n_values
    values[core.slots.fwd[0]], values[core.slots.fwd[1]] = fwd, slow
    for s in range(2):
        for k in core.slots.last[s] + core.slots.fresh[s] + core.slots.other[s]:
            values[k] = 1.0
    values[core.slots.ahead[0][0]] = values[core.slots.back[0][0]] = hop
    run = PipelineRun(core, canonical(res)).run(tuple(values))
    assert_same(run, event_loop_run(args, res, links, tuple(values)), len(core.c.value))
    # stage 1's forwards take 5: F0 from 1.25 (stage 0's F0, then the hop) to 6.25, F1 right
    # after; activation 2 leaves stage 0 at 3 but waits for its post (F0's end, 6.25), lands at
    # 6.5, and F2 starts when F1 ends
    f = [run.ends[t] for t in core.c.start[core.sk.fwd[1]]]
    assert f == [6.25, 11.25, 16.25, 21.25]


def test_fits_refuses_what_the_pass_does_not_model():
    plain = replica_core("1f1b", 4, (1, 1), ((1, 1),), None, None, None)
    res = ((0,), (1,), (2,), (3,))
    assert fits(plain, res, {})
    assert not fits(plain, ((0,), (1,), (2,), (2,)), {})          # a link carrying two streams
    assert not fits(plain, ((0, 5), (1,), (2,), (3,)), {})        # a stage holding two resources
    assert not fits(plain, res, {(1,): 1e-5})                     # a device that wakes up
    assert not fits(replica_core("interleaved-1f1b", 4, (1,) * 4, ((1, 1),) * 3, 2, None, None), res, {})
    assert not fits(replica_core("1f1b", 4, (1, 1), ((1, 1),), None, Stream(4, 1), None), res, {})
    assert not fits(replica_core("gpipe", 4, (1, 1), ((1, 1),), None, None, (True, True)), res, {})


def random_linked_replica(rng: random.Random):
    """A replica whose hops may share link directions (routes through one another's links) and,
    interleaved, whose stages share devices: (template arguments, resources per slot, links,
    slot values)."""
    schedule = rng.choice(SCHEDULES + ("interleaved-1f1b",))
    n, m = rng.randint(1, 6), rng.randint(1, 7)
    devices = None
    if schedule == "interleaved-1f1b":
        devices = rng.choice([p for p in range(1, n + 1) if n % p == 0 and m % p == 0] or [1])
        m = m if m % devices == 0 else devices
    pieces = tuple(rng.randint(1, 3) for _ in range(n))
    hops = tuple((rng.randint(0, 3), rng.randint(0, 3)) for _ in range(n - 1))
    args = (schedule, m, pieces, hops, devices, None, None)
    core = replica_core(*args)
    stage_dev = [(s % devices if devices else s) for s in range(n)]
    n_links = sum(a + b for a, b in hops)
    pool = [100 + rng.randint(0, max(1, n_links // 2)) for _ in range(n_links)]   # repeats: shared
    res = tuple((d,) for d in stage_dev) + tuple((x,) for x in pool)
    values = tuple(rng.choice([0.0, 1.0, 2.0, 0.5, 3.0, 1e-9, 7.25]) for _ in range(core.n_values))
    return args, res, {(x,) for x in pool}, values


def test_a_graph_laid_out_without_its_template_is_the_templates():
    rng = random.Random(3)
    for _ in range(200):
        args, *_ = random_linked_replica(rng)
        t, g = replica_template(*args), graph(*args)
        assert g.task_slot.tolist() == list(t.value) and g.res_slot.tolist() == list(t.res)
        assert g.ndeps.tolist() == list(t.ndeps)
        assert [sorted(g.succ_idx[a:b].tolist()) for a, b in zip(g.succ_ptr[:-1], g.succ_ptr[1:])] == \
            [sorted(x) for x in t.succ]


@pytest.mark.parametrize("compiled", [False, True])
def test_graph_runs_give_the_templates_times_where_links_are_shared(compiled, monkeypatch):
    compiled_from(monkeypatch, fastloop, "MIN_TASKS", compiled)
    rng = random.Random(11)
    shared = 0
    for _ in range(200):
        args, res, links, values = random_linked_replica(rng)
        core = replica_core(*args)
        assert GraphRun.fits(core, res, {})
        shared += len(set(res)) < len(res)
        run = GraphRun([core], [canonical(res)]).run(values)
        slow = event_loop_run(args, res, links, values)
        assert (run.end_s, run.last, run.last_zero, run.zeros) == (slow.end_s, slow.last, slow.last_zero, slow.zeros)
        assert np.asarray(run.ends).tolist() == np.asarray(slow.ends).tolist()
    assert shared >= 100


@pytest.mark.parametrize("compiled", [False, True])
def test_the_linked_pass_gives_the_event_loops_times_where_routes_share_links(compiled, monkeypatch):
    # where LinkedRun times a replica it is the event loop's timing; where it declines (a tie of
    # hops made ready by a task taking no time, or no hop that can safely go), the split's
    # Linked runs the graph, with the same times
    compiled_from(monkeypatch, pipeline, "COMPILED_FROM", compiled)
    rng = random.Random(5)
    timed = shared = declined = 0
    for _ in range(300):
        args, res, links, values = random_linked_replica(rng)
        core = replica_core(*args)
        if not linked_fits([core], [res], {}):
            assert args[4] is not None   # interleaved: stages share devices
            continue
        slow = event_loop_run(args, res, links, values)
        run = LinkedRun([core], [canonical(res)]).run(values)
        if run is None:
            declined += 1
        else:
            timed += 1
            shared += len(set(res)) < len(res)
            assert_same(run, slow, len(core.c.value))
        both = Linked([core], [canonical(res)]).run(values)
        assert_same(both, slow, len(core.c.value))
    assert timed >= 120 and shared >= 60 and declined >= 20


def test_a_shared_link_serves_the_hop_ready_first_not_the_stream_met_first():
    # GPipe, 3 stages, 2 microbatches; both pairs' activations cross link 10. Stage 0's
    # forwards take 5 (end 5, 10), stage 1's and 2's take 1, a hop 0.5: activation 0 of pair 0
    # crosses at 5-5.5, stage 1's F0 runs 5.5-6.5, its activation leaves at 6.5 and crosses
    # before pair 0's activation 1 (ready at 10): stage 2's F0 ends at 8, not at 12
    args = ("gpipe", 2, (1, 1, 1), ((1, 0), (1, 0)), None, None, None)
    core = replica_core(*args)
    res, links = ((0,), (1,), (2,), (10,), (10,)), {(10,)}
    values = [1.0] * core.n_values
    values[core.slots.fwd[0]] = 5.0
    values[core.slots.ahead[0][0]] = values[core.slots.ahead[1][0]] = 0.5
    assert linked_fits([core], [res], {}) and not fits(core, res, {})
    run = LinkedRun([core], [canonical(res)]).run(tuple(values))
    assert run is not None
    assert_same(run, event_loop_run(args, res, links, tuple(values)), len(core.c.value))
    assert [run.ends[t] for t in core.c.start[core.sk.fwd[2]]] == [8.0, 13.0]


def test_linked_fits_refuses_stages_that_share_a_device_or_sit_on_a_link():
    core = replica_core("1f1b", 4, (1, 1, 1), ((1, 1), (1, 1)), None, None, None)
    shared_link = ((0,), (1,), (2,), (5,), (6,), (5,), (7,))
    assert linked_fits([core], [shared_link], {}) and not fits(core, shared_link, {})
    assert not linked_fits([core], [((0,), (0,), (2,), (5,), (6,), (8,), (7,))], {})   # two stages, one device
    assert not linked_fits([core], [((0,), (1,), (5,), (5,), (6,), (8,), (7,))], {})   # a stage on a link
    assert not linked_fits([core], [shared_link], {(1,): 1e-5})                        # a device that wakes up
    other = ((3,), (4,), (9,), (5,), (10,), (11,), (12,))
    assert linked_fits([core, core], [shared_link, other], {})                         # two replicas, one link
    assert not linked_fits([core, core], [shared_link, ((3,), (1,)) + other[2:]], {})  # and one device


@pytest.mark.parametrize("compiled", [False, True])
def test_the_linked_pass_times_a_group_of_replicas_as_their_graphs_run_together(compiled, monkeypatch):
    # 2-3 replicas on devices of their own whose routes draw on one pool of links: where the
    # pass times them, each member's compute tasks end as in GraphRun (the group's graphs one
    # block after another, tested against whole graphs in test_split); Linked always does
    compiled_from(monkeypatch, pipeline, "COMPILED_FROM", compiled)
    rng = random.Random(9)
    timed = 0
    for _ in range(150):
        cores, res, values = [], [], []
        pool = rng.randint(1, 4)
        for r in range(rng.randint(2, 3)):
            n, m = rng.randint(1, 4), rng.randint(1, 6)
            hops = tuple((rng.randint(0, 2), rng.randint(0, 2)) for _ in range(n - 1))
            args = (rng.choice(SCHEDULES), m, tuple(rng.randint(1, 2) for _ in range(n)), hops, None, None, None)
            core = replica_core(*args)
            cores.append(core)
            res.append(tuple((10 * r + s,) for s in range(n))
                       + tuple((100 + rng.randint(0, pool),) for _ in range(sum(a + b for a, b in hops))))
            values += [rng.choice([0.0, 1.0, 2.0, 0.5, 3.0, 1e-9, 7.25]) for _ in range(core.n_values)]
        assert linked_fits(cores, res, {})
        used = sorted({x for rs in res for r in rs for x in r})
        local = dict(zip(used, range(len(used))))
        canons = [tuple((local[r[0]],) for r in rs) for rs in res]
        ref = GraphRun(cores, canons).run(tuple(values))
        ends = np.asarray(ref.ends)
        n = [len(c.c.value) for c in cores]
        want = [ends[f:f + k].tolist() for f, k in zip(GraphRun(cores, canons).firsts, n)]
        fast = LinkedRun(cores, canons)
        got = fast.run(tuple(values))
        for out in ([got] if got is not None else []) + [Linked(cores, canons).run(tuple(values))]:
            assert (out.end_s, out.last, out.last_zero) == (ref.end_s, ref.last, ref.last_zero)
            assert [np.asarray(out.ends)[f:f + k].tolist() for f, k in zip(fast.firsts, n)] == want
        timed += got is not None
    assert timed >= 60


def test_warm_compiles_the_passes_and_the_event_loop():
    # a search calls it before forking its chains (hetplan.planner.search.mcmc.Problem.before_fork)
    if not fastloop.available():
        pytest.skip("numba is not installed")
    pipeline.warm()
    assert pipeline._pass().signatures and pipeline._pass_linked().signatures and fastloop._compiled().signatures
