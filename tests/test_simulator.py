"""Exact-time tests of the simulator on hand-computable what-if cases (op overhead 0)."""
from __future__ import annotations

import itertools

import pytest

from hetplan.planner.cost.buckets import Bucket, grad_buckets
from hetplan.planner.cost.memory import peak_memory
from hetplan.planner.sim.simulator import Simulator, simulate
from simhelpers import device, graph, layer, link, plan, topology


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def chain(n, bw=1e30, lat=0.0, kind="cuda"):
    devs = [device(f"{kind}:{i}") for i in range(n)]
    return topology(devs, [link(f"{kind}:{i}", f"{kind}:{i + 1}", bw, lat) for i in range(n - 1)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(4, 4), (2, 6), (3, 3)])
def test_uniform_pipeline_takes_m_plus_p_minus_1_slots(schedule, p, m):
    # one layer per stage, 1e9 FLOP/s: at a microbatch of 1 sample (graph batch 4):
    # t_f = 1e9 / 4 / 1e9 = 0.25 s, t_b = 0.5 s; free links; no parameters -> no optimizer
    g = graph([layer(i) for i in range(p)], batch=4)
    pl = plan([(1.0, m, [(f"cuda:{i}", i, i + 1) for i in range(p)])], m, schedule=schedule)
    r = simulate(pl, g, chain(p))
    assert r.iteration_s == approx((m + p - 1) * (0.25 + 0.5))
    assert r.per_device["cuda:0"]["busy_s"] == approx(m * 0.75)


@pytest.mark.parametrize("p,m", [(4, 4), (2, 6), (3, 3), (4, 8)])
def test_zb_h1_fills_the_cool_down_with_weight_gradients(p, m):
    # one layer per stage holding weights: t_f = 0.25 s, t_b = 0.5 s split into I = W = 0.25 s
    # (cost.model.weight_grad_share); stage 0 has no input gradient: I = 0, W = 0.5 s.
    # Hand-run (hetplan.planner.files.schedule.grid): every stage is busy 3m quarter-slots after its warm-up,
    # and the pipeline fills and drains in p - 1 slots of F + I - W = 0.25 s: (3m + p - 1) * 0.25
    # against 1F1B's (m + p - 1) * 0.75; the same work per device.
    g = graph([layer(i, param_bytes=4) for i in range(p)], batch=4)
    stages = [(f"cuda:{i}", i, i + 1) for i in range(p)]
    zb = simulate(plan([(1.0, m, stages)], m, schedule="zb-h1"), g, chain(p))
    fb = simulate(plan([(1.0, m, stages)], m, schedule="1f1b"), g, chain(p))
    assert zb.iteration_s == approx((3 * m + p - 1) * 0.25)
    assert fb.iteration_s == approx((m + p - 1) * 0.75)
    for d in ("cuda:0", f"cuda:{p - 1}"):
        assert zb.per_device[d]["bwd_s"] == approx(fb.per_device[d]["bwd_s"]) == approx(m * 0.5)


def test_zb_h1_prices_the_measured_split_passes_where_the_cost_model_has_them():
    # split_times (the measured model's I and W per layer) replaces weight_grad_share: a split
    # backward costing 1.2x the fused one, I = W = 0.3 s (fused t_b = 0.5 s; t_f = 0.25 s).
    # p = 2, m = 1: F cuda:0 [0, 0.25], F cuda:1 [0.25, 0.5], I cuda:1 [0.5, 0.8] sends the
    # gradient, cuda:0 runs stage 0's whole fused backward [0.8, 1.3] (its input needs no
    # gradient; the table's first layer is not used), W cuda:1 [0.8, 1.1]: 1.3 s. Priced by the
    # share (I = 0.25 s) it would be 1.25 s.
    from hetplan.planner.cost.model import RooflineCost

    class Measured(RooflineCost):
        def split_times(self, device, batch):
            return [9.0, 0.3], [9.0, 0.3]
    g = graph([layer(i, param_bytes=4) for i in range(2)], batch=4)
    t = chain(2)
    pl = plan([(1.0, 1, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 1, schedule="zb-h1")
    assert Simulator(g, t, Measured(g, t)).simulate(pl).iteration_s == approx(1.3)
    assert simulate(pl, g, t).iteration_s == approx(1.25)


def test_zb_h1_gradient_transfers_leave_after_the_input_pass():
    # 2 stages, 2 microbatches, 1 s per transfer (1 B cut at 1 B/s): F = 1, I = W = 1 (stage 0:
    # I = 0, W = 2). Orders: stage 0 F0 F1 I0 W0 I1 W1, stage 1 F0 I0 F1 I1 W0 W1.
    # Activations arrive at 2 and 3. Stage 1: F0 2-3, I0 3-4, F1 4-5, I1 5-6, W0 6-7, W1 7-8;
    # gradients arrive at 5 and 7. Stage 0: F0 0-1, F1 1-2, I0 at 5, W0 5-7, I1 at 7, W1 7-9: 9 s.
    # Fused 1F1B (B = 2): stage 1 F0 2-3, B0 3-5, F1 5-6, B1 6-8; gradients at 6 and 9;
    # stage 0 B0 6-8, B1 9-11: 11 s.
    g = graph([layer(0, fwd_flops=1e9, bwd_flops=2e9, param_bytes=4), layer(1, fwd_flops=1e9, bwd_flops=2e9,
                                                                           param_bytes=4)],
              batch=1, cut_bytes=[0, 1, 0])
    stages = [("cuda:0", 0, 1), ("cuda:1", 1, 2)]
    t = chain(2, bw=1.0)
    assert simulate(plan([(1.0, 2, stages)], 2, schedule="zb-h1"), g, t).iteration_s == approx(9.0)
    assert simulate(plan([(1.0, 2, stages)], 2, schedule="1f1b"), g, t).iteration_s == approx(11.0)


@pytest.mark.parametrize("schedule", ["1f1b", "hippie"])
def test_each_stage_exchanges_inside_the_cool_down(schedule):
    # each stage's exchange and step start at its own last backward, not after the whole
    # pipeline's: two replicas of a 2-stage pipeline, m = 4, F = 1 s, B = 2 s, coarse sync.
    # Stage 1's last backward ends at 13 s, stage 0's at 15 s ((m + p - 1) * 3); under Hippie
    # stage 0 F 0-4; stage 1 F0 1-2 B0 2-4 F1 4-5 B1 5-7 F2 7-8 B2 8-10 F3 10-11 B3 11-13; stage 0
    # B0 4-6 B1 7-9 B2 10-12 B3 13-15. Each stage's all-reduce (1e6 B at 1e6 B/s over 2 devices:
    # 1 s) starts at its own last backward, stage 1's inside stage 0's cool-down, then its SGD
    # step (3e6 B at 1e8 B/s: 0.03 s): 15 + 1 + 0.03.
    g = graph([layer(i, param_bytes=10**6) for i in range(2)], batch=1)
    t = topology([device(f"cuda:{i}", mem_bw=1e8) for i in range(4)],
                 [link("cuda:0", "cuda:1"), link("cuda:2", "cuda:3"),
                  link("cuda:0", "cuda:2", bw=1e6), link("cuda:1", "cuda:3", bw=1e6)])
    pl = plan([(0.5, 4, [("cuda:0", 0, 1), ("cuda:1", 1, 2)]), (0.5, 4, [("cuda:2", 0, 1), ("cuda:3", 1, 2)])],
              8, granularity="coarse", schedule=schedule)
    r = simulate(pl, g, t, trace=True)
    assert r.iteration_s == approx(16.03)
    starts = sorted((x["start_s"], x["lane"]) for x in r.tasks if x["kind"] == "allreduce")
    assert [s for s, _ in starts] == [approx(13.0), approx(15.0)]
    assert set(starts[0][1].split("+")) == {"cuda:1", "cuda:3"}


def test_coarse_data_parallel_is_compute_plus_ring_allreduce_plus_optimizer():
    # 2 replicas x 1 sample; layer: 1e9 fwd / 2e9 bwd FLOPs at batch 2 -> 0.5 s + 1.0 s.
    # all-reduce of 1e6 B over 2 devices, 1e6 B/s, 10 ms: 2*1*0.01 + 2*1/2*1e6/1e6 = 1.02 s.
    # SGD on 1e6 B at 1e8 B/s: 3 * 1e6 / 1e8 = 0.03 s.
    g = graph([layer(0, param_bytes=10**6)], batch=2)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    pl = plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 2, granularity="coarse")
    r = simulate(pl, g, t)
    assert t.allreduce_s(["cuda:0", "cuda:1"], 1e6) == approx(1.02)
    assert r.iteration_s == approx(0.5 + 1.0 + 1.02 + 0.03)
    assert r.per_device["cuda:1"]["comm_s"] == approx(1.02)
    assert r.per_device["cuda:1"]["optimizer_s"] == approx(0.03)


def test_clipping_adds_its_gradient_passes_and_the_norms_all_reduce_before_each_step():
    # the case above with clip_grad_norm: each device reads its 1e6 B of gradients for the norm
    # and reads and writes them to scale, 3e6 / 1e8 = 0.03 s, then the all-reduce of one float64
    # over both devices, 2 * 1 * 0.01 + 2 * 1/2 * 8 / 1e6 = 0.020008 s, before its SGD step
    import dataclasses
    g = graph([layer(0, param_bytes=10**6)], batch=2)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    pl = plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 2, granularity="coarse")
    clipped = dataclasses.replace(pl, optimizer=dataclasses.replace(pl.optimizer, clip_grad_norm=1.0))
    r = simulate(clipped, g, t)
    assert r.iteration_s == approx(0.5 + 1.0 + 1.02 + 0.03 + 0.020008 + 0.03)
    assert r.per_device["cuda:1"]["optimizer_s"] == approx(0.03 + 0.020008 + 0.03)
    assert simulate(pl, g, t).iteration_s == approx(0.5 + 1.0 + 1.02 + 0.03)   # cached values not shared


def test_buffers_are_broadcast_before_each_iteration_one_collective_per_device_set_and_dtype():
    # the coarse case above with buffers (BatchNorm statistics): the runtime broadcasts them from
    # the first replica before each iteration, per device set and dtype (hetplan.runtime.sync.BufferSync):
    # float32 of layers 0 and 1 together (1e5 + 3e5 B), int64 apart (16 B), each priced as an
    # all-reduce of its bytes: 2*1*0.01 + 4e5/1e6 = 0.42 s and 2*1*0.01 + 16/1e6 s
    from dataclasses import replace
    from hetplan.planner.cost.buckets import buffer_broadcasts
    bn = (("torch.float32", 10**5), ("torch.int64", 8))
    bn1 = (("torch.float32", 3 * 10**5), ("torch.int64", 8))
    g = graph([replace(layer(0, param_bytes=10**6), buffer_bytes=bn),
               replace(layer(1, fwd_flops=0, bwd_flops=0), buffer_bytes=bn1)], batch=2)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    pl = plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 2, granularity="coarse")
    assert [(b.devices, b.bytes) for b in buffer_broadcasts(pl, g)] == [
        (("cuda:0", "cuda:1"), 4 * 10**5), (("cuda:0", "cuda:1"), 16)]
    broadcasts = 0.02 + 0.4 + 0.02 + 16 / 1e6
    r = simulate(pl, g, t)
    assert r.iteration_s == approx(0.5 + 1.0 + 1.02 + 0.03 + broadcasts)
    assert r.per_device["cuda:1"]["comm_s"] == approx(1.02 + broadcasts)   # as the runtime's events count them
    # the same whole graph, its twin replicas collapsed or not, and by delta simulation
    from hetplan.planner.sim.simulator import Simulator
    for delta, collapse in ((False, True), (False, False), (True, True)):
        assert Simulator(g, t, delta=delta, collapse=collapse).simulate(pl).iteration_s == approx(r.iteration_s)
    # one device holds the layers (a pipeline of one replica): nothing to broadcast
    one = plan([(1.0, 1, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2)
    assert buffer_broadcasts(one, g) == []
    # per device set: layer 0 on cuda:0 + cuda:1, layer 1 on cuda:2 + cuda:3 run at once
    t4 = topology([device(f"cuda:{i}", mem_bw=1e8) for i in range(4)],
                  [link(f"cuda:{i}", f"cuda:{j}", bw=1e6, lat=0.01) for i in range(4) for j in range(i + 1, 4)])
    hybrid = plan([(0.5, 1, [("cuda:0", 0, 1), ("cuda:2", 1, 2)]),
                   (0.5, 1, [("cuda:1", 0, 1), ("cuda:3", 1, 2)])], 2)
    assert [b.devices for b in buffer_broadcasts(hybrid, g)] == \
        [("cuda:0", "cuda:1")] * 2 + [("cuda:2", "cuda:3")] * 2
    from hetplan.planner.cost.model import RooflineCost
    sim = Simulator(g, t4, RooflineCost(g, t4))
    spent = sim.buffer_sync_s(hybrid)
    assert spent["cuda:2"] == spent["cuda:3"] == approx(0.02 + 0.3 + 0.02 + 8 / 1e6)
    assert spent["cuda:0"] == approx(0.02 + 0.1 + 0.02 + 8 / 1e6)
    # asynchronous modes keep each replica's buffers: nothing broadcast
    assert buffer_broadcasts(replace(pl, sync=replace(pl.sync, mode="hogwild")), g) == []


def _dp4(granularity):
    # 4 layers of 1e6 B params, one bucket each (cap 1e6); t_f = 0.5 s, t_b = 1.0 s per layer;
    # all-reduce per bucket 2*1/2*1e6/1e6 = 1.0 s; SGD 3*4e6/1e8 = 0.12 s
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=2)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6)])
    pl = plan([(0.5, 1, [("cuda:0", 0, 4)]), (0.5, 1, [("cuda:1", 0, 4)])], 2,
              granularity=granularity, bucket_bytes=10**6)
    return simulate(pl, g, t)


def test_fine_sync_overlaps_backward_and_beats_coarse():
    # fine: backward chunks end at 3, 4, 5, 6 s; the four all-reduces run 3-4, 4-5, 5-6, 6-7
    # coarse: all four after backward: 6 + 4 = 10 s
    assert _dp4("fine").iteration_s == approx(7.0 + 0.12)
    assert _dp4("coarse").iteration_s == approx(10.0 + 0.12)


def test_one_f_one_b_holds_less_activation_memory_than_gpipe():
    # saved 100 B per layer at batch 4 -> 25 B per sample-microbatch; 2 layers per stage = 50 B;
    # params 1000 B per layer, SGD: params + grads = 4000 B per stage
    g = graph([layer(i, param_bytes=1000, saved_bytes=100) for i in range(4)], batch=4,
              cut_bytes=[40, 40, 40, 40, 40])
    t = chain(2)
    stages = [("cuda:0", 0, 2), ("cuda:1", 2, 4)]
    gp = peak_memory(plan([(1.0, 4, stages)], 4, schedule="gpipe"), g, t)
    fb = peak_memory(plan([(1.0, 4, stages)], 4, schedule="1f1b"), g, t)
    assert gp == {"cuda:0": 4000 + 4 * 50, "cuda:1": 4000 + 4 * 50}
    assert fb == {"cuda:0": 4000 + 2 * 50, "cuda:1": 4000 + 1 * 50}
    # recompute: stage input (40 B at batch 4 -> 10 B) per in-flight microbatch + one full
    rc = peak_memory(plan([(1.0, 4, stages)], 4, schedule="1f1b", recompute=True), g, t)
    assert rc == {"cuda:0": 4000 + 2 * 10 + 50, "cuda:1": 4000 + 1 * 10 + 50}
    adam = peak_memory(plan([(1.0, 4, stages)], 4, optimizer="adam"), g, t)
    assert adam["cuda:0"] == 4000 + 2 * 2000 + 2 * 50


def test_zb_h1_holds_p_microbatches_on_every_stage():
    # a microbatch is held from F to W; stage s runs its W's s late: min(p, m) everywhere, the
    # most 1F1B holds on any stage (50 B per microbatch per stage, as above)
    g = graph([layer(i, param_bytes=1000, saved_bytes=100) for i in range(4)], batch=4,
              cut_bytes=[40, 40, 40, 40, 40])
    stages = [("cuda:0", 0, 2), ("cuda:1", 2, 4)]
    zb = peak_memory(plan([(1.0, 4, stages)], 4, schedule="zb-h1"), g, chain(2))
    assert zb == {"cuda:0": 4000 + 2 * 50, "cuda:1": 4000 + 2 * 50}


def test_recompute_adds_forward_to_backward():
    g = graph([layer(0), layer(1)], batch=1)
    pl = plan([(1.0, 2, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2, recompute=True)
    # microbatch of 1 sample = graph batch: t_f = 1 s, t_b = 2 s + 1 s of recompute = 3 s
    r = simulate(pl, g, chain(2))
    assert r.iteration_s == approx((2 + 2 - 1) * (1.0 + 3.0))


def test_cpu_optimizer_placement_moves_state_and_adds_copies():
    # cuda:0: fwd 1e9/1e9 = 1 s, bwd 2 s; Adam on 1e6 B: 7e6 B moved.
    g = graph([layer(0, param_bytes=10**6)], batch=1)
    t = topology([device("cpu:0", mem_bw=1e7), device("cuda:0", mem_bw=1e9)],
                 [link("cpu:0", "cuda:0", bw=1e6)])
    on_dev = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam"), g, t)
    on_cpu = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam", placement="cpu"), g, t)
    assert on_dev.iteration_s == approx(3.0 + 7e6 / 1e9)
    # grads 1e6 B down (1 s) + update on cpu:0 (7e6 / 1e7 = 0.7 s) + params back (1 s)
    assert on_cpu.iteration_s == approx(3.0 + 1.0 + 0.7 + 1.0)
    assert on_dev.peak_memory_bytes == {"cuda:0": 4e6}
    assert on_cpu.peak_memory_bytes == {"cuda:0": 2e6, "cpu:0": 3e6}
    assert on_cpu.per_device["cpu:0"]["optimizer_s"] == approx(0.7)
    assert on_cpu.per_device["cuda:0"]["comm_s"] == approx(2.0)


def test_split_optimizer_runs_device_and_host_parts_at_once():
    # a slow GPU: Adam on 1e6 B there takes 7e6 / 1e6 = 7 s; on cpu:0 0.7 s; the link 1 s per 1e6 B
    g = graph([layer(0, param_bytes=10**6)], batch=1)
    t = topology([device("cpu:0", mem_bw=1e7), device("cuda:0", mem_bw=1e6)],
                 [link("cpu:0", "cuda:0", bw=1e6)])

    def split(f):
        return simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam", placement="split",
                             cpu_fraction=f), g, t)
    on_cpu = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam", placement="cpu"), g, t)
    assert on_cpu.iteration_s == approx(3.0 + 1.0 + 0.7 + 1.0)
    # f = 0.75: device part 0.25 * 7 = 1.75 s beside host part 0.75 + 0.525 + 0.75 = 2.025 s
    r = split(0.75)
    assert r.iteration_s == approx(3.0 + 2.025)
    assert r.per_device["cuda:0"]["optimizer_s"] == approx(1.75)
    assert r.per_device["cpu:0"]["optimizer_s"] == approx(0.525)
    # f = 0.25: the device part (0.75 * 7 = 5.25 s) is the longer one
    assert split(0.25).iteration_s == approx(3.0 + 5.25)
    # the GPU keeps params + grads + Adam state of its quarter; the host state + grads of 3/4
    assert r.peak_memory_bytes == {"cuda:0": approx(2.5e6), "cpu:0": approx(2.25e6)}


def test_split_optimizer_host_part_waits_for_the_devices_launches():
    # as above, but the GPU's profile timed its steps: s = 0.5 s fixed (its host's work, the
    # launches) + 7e-6 s per byte. The worker launches the device's part, then updates the host's
    # part on its own thread: the host chain starts 0.5 s after the backward
    from dataclasses import replace
    rows = [{"tensors": n, "bytes": b, "s": 0.5 + 7e-6 * b} for n, b in ((1, 1e5), (4, 1e6), (16, 4e6))]
    g = graph([layer(0, param_bytes=10**6)], batch=1)
    gpu = replace(device("cuda:0", mem_bw=1e6), measured={"optimizer_table": {"adam": rows}})
    t = topology([device("cpu:0", mem_bw=1e7), gpu], [link("cpu:0", "cuda:0", bw=1e6)])
    r = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam", placement="split",
                      cpu_fraction=0.75), g, t)
    # device part 0.5 + 0.25e6 * 7e-6 = 2.25 s; host chain 0.5 + 0.75 + 0.525 + 0.75 = 2.525 s
    assert r.iteration_s == approx(3.0 + 2.525)
    assert r.per_device["cuda:0"]["optimizer_s"] == approx(2.25)
    alone = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam"), g, t)
    assert alone.iteration_s == approx(3.0 + 0.5 + 7.0)


def test_offloaded_activations_copied_out_beside_compute_and_back_before_backward():
    # one GPU stage of two layers, GPipe over 2 microbatches of 1 sample: F = 2 s, B = 4 s; each
    # microbatch saves 2e6 B, 2 s over the 1e6 B/s link each way
    g = graph([layer(0, saved_bytes=10**6), layer(1, saved_bytes=10**6)], batch=1)
    t = topology([device("cpu:0"), device("cuda:0")], [link("cpu:0", "cuda:0", bw=1e6)])
    kept = simulate(plan([(1.0, 2, [("cuda:0", 0, 2)])], 2, schedule="gpipe"), g, t)
    off = simulate(plan([(1.0, 2, [("cuda:0", 0, 2, True)])], 2, schedule="gpipe"), g, t)
    assert kept.iteration_s == approx(2 * 2.0 + 2 * 4.0)
    # F0 [0, 2], F1 [2, 4]; out: mb0 [2, 4], mb1 [4, 6]; back: mb0 [4, 6] (after F1), B0 [6, 10];
    # back mb1 [10, 12] (after B0), B1 [12, 16]
    assert off.iteration_s == approx(16.0)
    assert off.per_device["cuda:0"]["comm_s"] == approx(4 * 2.0)
    assert off.per_device["cpu:0"]["comm_s"] == approx(4 * 2.0)
    # the device keeps two of its largest layer's (1e6 B each); the host both microbatches
    assert kept.peak_memory_bytes == {"cuda:0": 4e6}
    assert off.peak_memory_bytes == {"cuda:0": 2e6, "cpu:0": 4e6}


def test_offloaded_optimizer_copies_priced_by_the_measured_pinned_host_copy():
    # as above, but cuda:0 carries a measured host-copy fit (profile): the runtime copies through
    # pinned buffers in its own process, so the copies cost the fit, not the (gloo) link
    from dataclasses import replace
    g = graph([layer(0, param_bytes=10**6)], batch=1)
    fit = {"pinned": {"d2h": {"latency_s": 0.1, "bytes_per_s": 1e7},
                      "h2d": {"latency_s": 0.2, "bytes_per_s": 2e6}},
           "pageable": {"d2h": {"latency_s": 0.0, "bytes_per_s": 1.0},    # the data's copies
                        "h2d": {"latency_s": 0.0, "bytes_per_s": 1.0}}}   # (no bytes here)
    gpu = replace(device("cuda:0", mem_bw=1e9), measured={"host_copy": fit})
    t = topology([device("cpu:0", mem_bw=1e7), gpu], [link("cpu:0", "cuda:0", bw=1e6)])
    r = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1, optimizer="adam", placement="cpu"), g, t)
    # 3 s compute + grads d2h (0.1 + 1e6/1e7 = 0.2 s) + update 0.7 s + params h2d (0.2 + 0.5 s)
    assert r.iteration_s == approx(3.0 + 0.2 + 0.7 + 0.7)
    assert r.per_device["cuda:0"]["comm_s"] == approx(0.9)


def test_each_microbatchs_data_is_copied_to_a_gpu_stage_from_pageable_memory():
    # the runtime copies a microbatch's inputs to the first stage's GPU and its targets to the
    # last's (Tensor.to from make_batch's pageable tensors): 0.1 s + 1e6 B / 1e6 B/s = 1.1 s for
    # the inputs, 0.1 s for the targets (their bytes are not in the graph), per microbatch
    from dataclasses import replace
    g = graph([layer(0), layer(1)], batch=1, cut_bytes=[10**6, 0, 0])
    fit = {"pageable": {"h2d": {"latency_s": 0.1, "bytes_per_s": 1e6}}}
    plain = topology([device("cuda:0"), device("cpu:0")], [link("cpu:0", "cuda:0")])
    timed = topology([replace(device("cuda:0"), measured={"host_copy": fit}),
                      replace(device("cpu:0"), measured={"host_copy": fit})], [link("cpu:0", "cuda:0")])
    one = plan([(1.0, 2, [("cuda:0", 0, 2)])], 2)
    assert simulate(one, g, timed).iteration_s == approx(simulate(one, g, plain).iteration_s + 2 * 1.2)
    # a CPU stage computes on the host's tensors: no copy
    on_cpu = plan([(1.0, 2, [("cpu:0", 0, 2)])], 2)
    assert simulate(on_cpu, g, timed).iteration_s == approx(simulate(on_cpu, g, plain).iteration_s)
    # a CPU -> GPU pipeline: only the targets go to the GPU
    two = plan([(1.0, 1, [("cpu:0", 0, 1), ("cuda:0", 1, 2)])], 1)
    assert simulate(two, g, timed).iteration_s == approx(simulate(two, g, plain).iteration_s + 0.1)


def test_transfer_routed_over_two_hops():
    # cuda:0 - cpu:0 - cuda:1, no direct link; 1e6 B cut, 1e6 B/s, 0.1 s per hop -> 1.1 s per hop
    g = graph([layer(0), layer(1)], batch=1, cut_bytes=[0, 10**6, 0])
    t = topology([device("cuda:0"), device("cpu:0"), device("cuda:1")],
                 [link("cuda:0", "cpu:0", 1e6, 0.1), link("cpu:0", "cuda:1", 1e6, 0.1)])
    assert t.transfer_s("cuda:0", "cuda:1", 1e6) == approx(2.2)
    r = simulate(plan([(1.0, 1, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 1), g, t, trace=True)
    # F0 1 s, act 2.2 s, F1 1 s, B1 2 s, grad 2.2 s, B0 2 s
    assert r.iteration_s == approx(1 + 2.2 + 1 + 2 + 2.2 + 2)
    lanes = {x["lane"] for x in r.tasks if x["kind"] == "transfer"}
    assert lanes == {"cuda:0->cpu:0", "cpu:0->cuda:1", "cuda:1->cpu:0", "cpu:0->cuda:0"}


def test_unroutable_plan_is_rejected():
    g = graph([layer(0), layer(1)], batch=1)
    t = topology([device("cuda:0"), device("cuda:1")])
    with pytest.raises(ValueError, match="no path"):
        simulate(plan([(1.0, 1, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 1), g, t)


def test_transfers_on_one_link_direction_queue():
    # 2 stages, m=2, microbatch forward 0.5 s, activation transfer 2 s each on one link:
    # act0 0.5-2.5, act1 2.5-4.5 (queued behind act0 although ready at 1.0)
    g = graph([layer(0, bwd_flops=0), layer(1, bwd_flops=0)], batch=2, cut_bytes=[0, 4, 0])
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1.0)])
    r = simulate(plan([(1.0, 2, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2, schedule="gpipe"), g, t,
                 trace=True)
    acts = sorted((x["start_s"], x["end_s"]) for x in r.tasks if x["lane"] == "cuda:0->cuda:1")
    assert acts == [(0.5, 2.5), (2.5, 4.5)]


def test_a_message_moves_once_its_receive_is_posted_two_ahead_per_peer():
    # GPipe, 2 stages, m = 3 of 1 sample: stage 0's F 0.5 s, stage 1's F 2 s, no backward work,
    # each activation 0.5 s on the link. A gloo message moves only once its receive is posted,
    # and a worker keeps POSTED_AHEAD = 2 receives per peer posted, the next one posted as an
    # action starts after one is taken (hetplan.planner.files.schedule.receives): act0 0.5-1.0 and act1
    # 1.0-1.5 were posted at the start; act2, sent at 1.5, is posted when 1F0 (1.0-3.0), which
    # took act0, ends: 3.0-3.5 (dropping the rule: 1.5-2.0); hidden by 1F1 3.0-5.0, 1F2 5.0-7.0.
    # The gradients (0.5 s each, backwards of no time at 7.0): 7.0-7.5, 7.5-8.0, 8.0-8.5: 8.5 s.
    g = graph([layer(0, fwd_flops=1.5e9, bwd_flops=0), layer(1, fwd_flops=6e9, bwd_flops=0)],
              batch=3, cut_bytes=[0, 3, 0])
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=2.0)])
    r = simulate(plan([(1.0, 3, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 3, schedule="gpipe"), g, t,
                 trace=True)
    acts = sorted((x["start_s"], x["end_s"]) for x in r.tasks if x["lane"] == "cuda:0->cuda:1")
    assert acts == [(0.5, 1.0), (1.0, 1.5), (3.0, 3.5)]
    assert r.iteration_s == approx(8.5)


def test_a_message_posted_while_its_cpu_sender_computes_is_held_for_the_senders_window():
    # GPipe, 2 CPU workers, m = 4 of 1 sample: F 1 s, B 2 s on each stage, 0.1 s per message.
    # gloo sends a message once the sender's loop thread has read the receive's notice, which
    # it may do only when the worker waits (hetplan.planner.sim.template). act2's receive is posted
    # during the iteration (after 1F0); stage 0 goes on computing F3 (1 s) after its isend
    # before it waits (B0 takes a gradient): held held_send_s(1 s) = 0.5 s on the link, 3.0-3.5,
    # then 3.5-3.6. act3: stage 0 waits right after: not held. grad2 (after 0B0 took grad0):
    # stage 1 computes B3 (2 s) and then drains: held 0.5 + 0.5 * 1/3 s, 11.6-12.267, then
    # 12.267-12.367. Stage 1: F 1.1-2.1, 2.1-3.1, 3.6-4.6, 4.6-5.6, B 5.6-7.6 ... 11.6-13.6;
    # stage 0's B 7.7-9.7, 9.7-11.7, 12.367-14.367, 14.367-16.367. Without holds: 15.2 s.
    g = graph([layer(0, fwd_flops=1e9, bwd_flops=2e9), layer(1, fwd_flops=1e9, bwd_flops=2e9)], batch=1)
    t = topology([device("cpu:0"), device("cpu:1")], [link("cpu:0", "cpu:1", lat=0.1)])
    pl = plan([(1.0, 4, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 4, schedule="gpipe")
    assert simulate(pl, g, t).iteration_s == approx(15.2)
    held = replace(t, measured={"calibration": {"held_send_curve": [[1.0, 0.5], [4.0, 1.0]]}})
    r = simulate(pl, g, held, trace=True)
    assert r.iteration_s == approx(16.2 + 0.5 / 3)
    ahead = sorted(x for t in r.tasks if t["lane"] == "cpu:0->cpu:1" for x in (t["start_s"], t["end_s"]))
    assert ahead == approx([1.0, 1.1, 2.0, 2.1, 3.0, 3.5, 3.5, 3.6, 4.0, 4.1])
    back = sorted(x for t in r.tasks if t["lane"] == "cpu:1->cpu:0" for x in (t["start_s"], t["end_s"]))
    assert back == approx([7.6, 7.7, 9.6, 9.7, 11.6, 11.6 + 2 / 3, 11.6 + 2 / 3, 11.7 + 2 / 3, 13.6, 13.7])


def test_buckets_follow_ddp_reverse_order_groups_and_cap():
    g = graph([layer(i, param_bytes=b) for i, b in enumerate([10, 20, 30, 40, 0])], batch=2)
    pl = plan([(0.5, 1, [("cuda:0", 0, 2), ("cuda:1", 2, 5)]), (0.5, 1, [("cpu:0", 0, 5)])], 2,
              bucket_bytes=50)
    assert grad_buckets(pl, g) == [Bucket((3,), ("cuda:1", "cpu:0"), 40),
                                   Bucket((2,), ("cuda:1", "cpu:0"), 30),
                                   Bucket((1, 0), ("cuda:0", "cpu:0"), 30)]
    big = plan([(1.0, 1, [("cuda:0", 0, 5)])], 2, bucket_bytes=25)
    assert [b.layers for b in grad_buckets(big, g)] == [(3,), (2,), (1,), (0,)]


def _mixed():
    g = graph([layer(i, fwd_flops=1e9 * (i + 1), param_bytes=10**5 * (i + 1), saved_bytes=1000)
               for i in range(6)], batch=8, cut_bytes=[800] * 7)
    t = topology([device("cpu:0", flops=2e8, mem_bw=1e9), device("cuda:0", mem_bw=1e10),
                  device("cuda:1", mem_bw=1e10), device("cuda:2", flops=2e9, mem_bw=1e10)],
                 [link("cpu:0", "cuda:0", 1e7, 1e-4), link("cpu:0", "cuda:1", 1e7, 1e-4),
                  link("cuda:0", "cuda:1", 5e7, 1e-5), link("cpu:0", "cuda:2", 1e7, 1e-4)])
    pl = plan([(0.25, 1, [("cpu:0", 0, 6)]),
               (0.5, 2, [("cuda:0", 0, 2), ("cuda:1", 2, 6)]),
               (0.25, 2, [("cuda:2", 0, 6)])], 8, optimizer="adam", placement="cpu", bucket_bytes=2 * 10**5)
    return g, t, pl


def test_deterministic_and_cached():
    g, t, pl = _mixed()
    a = simulate(pl, g, t, trace=True)
    b = simulate(pl, g, t, trace=True)
    assert a == b and a.tasks == b.tasks
    sim = Simulator(g, t)
    assert sim.simulate(pl) == a and sim.simulate(pl) is sim.simulate(pl)
    assert a.iteration_s > 0 and set(a.per_device) == {"cpu:0", "cuda:0", "cuda:1", "cuda:2"}
    # each device's compute queue runs one task at a time
    for lane in a.per_device:
        spans = sorted((x["start_s"], x["end_s"]) for x in a.tasks if x["lane"] == lane)
        assert all(e0 <= s1 + 1e-15 for (_, e0), (s1, _) in zip(spans, spans[1:]))


def test_feasibility_follows_device_memory():
    g = graph([layer(0, param_bytes=600)], batch=1)
    t = topology([device("cuda:0", memory=1000)])
    r = simulate(plan([(1.0, 1, [("cuda:0", 0, 1)])], 1), g, t)   # SGD: 600 + 600 > 1000
    assert r.peak_memory_bytes == {"cuda:0": 1200} and r.feasible is False


# --- the CLI ----------------------------------------------------------------------------------
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

WORKSTATION = Path(__file__).resolve().parent.parent / "hetplan" / "topologies" / "workstation-gtx1650.json"
CLI_PLAN = {
    "schema": "hetplan.plan/1", "model": {"spec": "mlp", "args": {"hidden": 32, "depth": 2}},
    "global_batch": 8,
    "replicas": [
        {"batch_fraction": 0.25, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 3]}]},
        {"batch_fraction": 0.75, "microbatches": 2, "stages": [{"device": "cuda:0", "layers": [0, 3]}]}],
    "schedule": "gpipe", "sync": {"granularity": "fine", "bucket_bytes": 4096},
    "optimizer": {"name": "adam", "lr": 0.001, "placement": "device"},
}


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hetplan", "simulate", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


def test_cli_json_and_trace(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(CLI_PLAN))
    out = _cli(p, "--topology", WORKSTATION, "--json", "--trace", tmp_path / "trace.json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res) == {"iteration_s", "peak_memory_bytes", "feasible", "per_device", "engine",
                        "iteration_s_interval", "interval_probability", "interval_basis"}
    lo, hi = res["iteration_s_interval"]
    assert lo < res["iteration_s"] < hi and res["interval_probability"] == 0.9
    assert res["engine"] in ("event-loop", "fixed-order", "compiled")   # traced: the whole graph
    assert set(res["per_device"]) == {"cpu:0", "cuda:0"} and res["feasible"] is True
    assert res["iteration_s"] > 0 and all(v["busy_s"] > 0 for v in res["per_device"].values())
    trace = json.loads((tmp_path / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"cpu:0", "cuda:0", "cpu:0+cuda:0"}
    assert any(e.get("cat") == "allreduce" for e in trace["traceEvents"])


def test_cli_finds_topology_by_sha256_and_prints_grid(tmp_path):
    from hetplan.planner.files.io import file_sha256
    (tmp_path / "profiles" / "x").mkdir(parents=True)
    (tmp_path / "profiles" / "x" / "ws.json").write_bytes(WORKSTATION.read_bytes())
    plan = {**CLI_PLAN, "topology": {"name": "ws", "sha256": file_sha256(WORKSTATION)}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _cli("plan.json", "--grid", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "iteration:" in out.stdout and "step cuda:0" in out.stdout and "0F1" in out.stdout
    plan["topology"]["sha256"] = "0" * 64
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _cli("plan.json", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "pass --topology FILE" in out.stderr
    out = _cli("plan.json", "--topology", WORKSTATION, "--json", cwd=tmp_path)
    assert out.returncode == 0 and "warning" in out.stderr


def test_cli_rejects_plan_that_does_not_fit_graph_or_topology(tmp_path):
    bad = json.loads(json.dumps(CLI_PLAN))
    bad["replicas"][1]["stages"][0]["device"] = "cuda:7"
    (tmp_path / "plan.json").write_text(json.dumps(bad))
    out = _cli(tmp_path / "plan.json", "--topology", WORKSTATION)
    assert out.returncode == 2 and "replicas[1].stages[0].device: expected a device of the topology" in out.stderr
    bad = json.loads(json.dumps(CLI_PLAN))
    for r in bad["replicas"]:
        r["stages"][0]["layers"] = [0, 5]
    (tmp_path / "plan.json").write_text(json.dumps(bad))
    out = _cli(tmp_path / "plan.json", "--topology", WORKSTATION)
    assert out.returncode == 2 and "the model has 3 layers" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# --- the fast paths change no result ----------------------------------------------------------
import random  # noqa: E402
from dataclasses import replace  # noqa: E402

from hetplan.planner.sim.eventloop import run as run_tasks  # noqa: E402
from hetplan.planner.sim.reference import run as reference_run  # noqa: E402
from simreference import random_case, random_twin_case  # noqa: E402


@pytest.mark.parametrize("seed", range(3))
def test_event_loop_starts_tasks_exactly_as_the_reference_loop(seed):
    # random plans with all-reduces sharing links with transfers, zero-length tasks, offload
    rng = random.Random(seed)
    for _ in range(120):
        g, t, pl = random_case(rng)
        sim = Simulator(g, t, cache_size=0)
        shape = sim._shape(pl, trace=False)
        values = sim._evaluate(pl, shape)
        dur = [values[k] for k in shape.dkey]
        fast = run_tasks(dur, shape.res, shape.succ, list(shape.ndeps), shape.shared_res,
                         len(sim.lanes))
        assert fast == reference_run(dur, shape.res, shape.succ, shape.ndeps, len(sim.lanes))   # no wake-ups here


def test_plans_of_one_shape_share_the_task_graph_and_match_a_fresh_simulator(monkeypatch):
    g, t, pl = _mixed()
    builds = []
    build = Simulator._build
    monkeypatch.setattr(Simulator, "_build", lambda self, plan, g_, like=None, delta=False:
                        builds.append(delta) or build(self, plan, g_, like, delta))
    sim = Simulator(g, t, cache_size=0)
    variants = [pl, replace(pl, global_batch=16),
                replace(pl, replicas=tuple(replace(r, batch_fraction=f) for r, f in
                                           zip(pl.replicas, (0.125, 0.625, 0.25))))]
    for p in variants:
        shared = sim.simulate(p)
        fresh = Simulator(g, t, cache_size=0, shape_cache_size=0).simulate(p)
        traced = Simulator(g, t).simulate(p, trace=True)
        assert repr(shared) == repr(fresh) == repr(traced)
        assert max(x["end_s"] for x in traced.tasks) == shared.iteration_s
    # one shared build; fresh and traced simulators build their own (and a delta build each,
    # hetplan.planner.sim.delta, which this plan's host optimizer steps refuse)
    assert builds.count(False) == 1 + 3 + 3 and builds.count(True) == 1 + 3
    other = replace(pl, schedule="gpipe", recompute=True)   # another shape: built anew
    assert repr(sim.simulate(other)) == repr(Simulator(g, t).simulate(other))
    assert builds.count(False) == 9


def _mesh(n):
    names = [f"cuda:{i}" for i in range(n)]
    return topology([device(d, mem_bw=1e9) for d in names],
                    [link(a, b, 1e7, 1e-4) for i, a in enumerate(names) for b in names[i + 1:]])


@pytest.mark.parametrize("schedule,granularity,recompute", [
    ("1f1b", "fine", False), ("gpipe", "fine", True), ("1f1b", "coarse", False)])
def test_identical_replicas_are_simulated_once_with_identical_results(schedule, granularity, recompute):
    # 4 replicas x 2 stages on a full mesh: replicas 0, 1, 2 alike, 3 has a larger batch
    g = graph([layer(i, param_bytes=10**6 * (1 + i % 2), saved_bytes=100) for i in range(4)], batch=4,
              cut_bytes=[4 * 10**6] * 5)
    reps = [(f, 3, [(f"cuda:{2 * r}", 0, 1), (f"cuda:{2 * r + 1}", 1, 4)])
            for r, f in enumerate((0.2, 0.2, 0.2, 0.4))]
    pl = plan(reps, 30, schedule=schedule, granularity=granularity, bucket_bytes=10**6,
              optimizer="adam", recompute=recompute)
    sim = Simulator(g, _mesh(8), delta=False)   # delta simulation would serve it (tests/test_delta.py)
    collapsed = sim.simulate(pl)
    assert repr(collapsed) == repr(Simulator(g, _mesh(8), collapse=False).simulate(pl))
    assert repr(collapsed) == repr(sim.simulate(pl, trace=True))
    (whole, like), (part, used) = [(len(s.dkey), k[-1]) for k, s in sim._shapes.items()]
    assert like is None and used == (0, 0, 0, 3) and part < whole * 0.6


def test_replicas_sharing_links_with_all_reduces_are_not_collapsed():
    # chain cuda:0 - cuda:1 - cuda:2 - cuda:3: the ring cuda:0 <-> cuda:2 runs over the link
    # cuda:0 -> cuda:1 that replica 0's activations use. Collapsing would be wrong here
    # (9.5066 s instead of the exact 9.607 s), so the simulator must not do it.
    g = graph([layer(i, param_bytes=10**6, saved_bytes=100) for i in range(4)], batch=4,
              cut_bytes=[4 * 10**6] * 5)
    names = [f"cuda:{i}" for i in range(4)]
    t = topology([device(d, mem_bw=1e9) for d in names],
                 [link(a, b, 1e7, 1e-4) for a, b in zip(names, names[1:])])
    pl = plan([(0.5, 2, [("cuda:0", 0, 2), ("cuda:1", 2, 4)]),
               (0.5, 2, [("cuda:2", 0, 2), ("cuda:3", 2, 4)])], 8, bucket_bytes=10**6)
    sim = Simulator(g, t)
    assert sim.simulate(pl).iteration_s == approx(9.607)
    assert [k.like for k in sim._shapes if not k.delta] == [None] and not sim._shape(pl, False).collapsible
    assert repr(sim.simulate(pl)) == repr(Simulator(g, t, collapse=False).simulate(pl))


def test_collapsing_random_twin_replicas_changes_no_result():
    rng = random.Random(0)
    collapsed = 0
    for _ in range(150):
        g, t, pl = random_twin_case(rng)
        sim = Simulator(g, t, cache_size=0, delta=False)   # else delta simulation serves most
        assert repr(sim.simulate(pl)) == repr(Simulator(g, t, collapse=False).simulate(pl))
        collapsed += any(k[-1] is not None for k in sim._shapes)
    assert collapsed >= 20


def _dp4_cpu(granularity, host_cores):
    # _dp4 on two 1-thread CPU workers of a measured host with `host_cores` cores
    from dataclasses import replace as _replace
    g = graph([layer(i, param_bytes=10**6) for i in range(4)], batch=2)
    devs = [_replace(device(f"cpu:{i}", mem_bw=1e8), threads=1) for i in range(2)]
    t = _replace(topology(devs, [link("cpu:0", "cpu:1", bw=1e6)]), measured={"host": {"cores": host_cores}})
    pl = plan([(0.5, 1, [("cpu:0", 0, 4)]), (0.5, 1, [("cpu:1", 0, 4)])], 2,
              granularity=granularity, bucket_bytes=10**6)
    return simulate(pl, g, t)


def test_gloo_allreduce_cannot_overlap_compute_when_the_workers_take_every_core():
    # a spare core: fine sync overlaps backward as on GPUs (7.12 s)
    assert _dp4_cpu("fine", host_cores=4).iteration_s == approx(7.0 + 0.12)
    # no spare core: each all-reduce also holds the workers' compute queues, so fine sync
    # serializes with backward: 2 s forward + 4 s backward + 4 x 1 s all-reduce + 0.12 s SGD
    assert _dp4_cpu("fine", host_cores=2).iteration_s == approx(10.0 + 0.12)
    assert _dp4_cpu("coarse", host_cores=2).iteration_s == approx(10.0 + 0.12)


def test_tied_weight_copy_and_its_allreduce_between_two_stages():
    # layer 0 (embedding) and layer 1 (head) share a 1e6 B weight, counted in layer 0. Two stages
    # on 1e9 FLOP/s, one microbatch of 2 samples: forward 1 s, backward 2 s each, in series, plus
    # the activation and its gradient (0 B) at 10 ms latency each: stage 0's backward ends at
    # 6.02 s. The tied all-reduce over cuda:0 + cuda:1 at 1e6 B/s and 10 ms:
    # 2*1*0.01 + 2*1/2*1e6/1e6 = 1.02 s; then SGD on 1e6 B at 1e8 B/s: 3 * 1e6 / 1e8 = 0.03 s.
    from hetplan.planner.workload.graph import TiedParam
    base = graph([layer(0, param_bytes=10**6), layer(1)], batch=2)
    g = type(base)(layers=base.layers, batch=2, cut_bytes=base.cut_bytes,
                   tied=(TiedParam("l0.weight", 10**6, (0, 1)),))
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    pl = plan([(1.0, 1, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 2)
    r = simulate(pl, g, t)
    assert r.iteration_s == approx(6.02 + 1.02 + 0.03)
    assert r.per_device["cuda:1"]["comm_s"] >= 1.02
    # each stage holds the weight and its gradient (SGD: no state)
    assert peak_memory(pl, g, t) == {"cuda:0": 2e6, "cuda:1": 2e6}
    # untied, the head stage holds nothing and nothing is exchanged
    r0 = simulate(pl, base, t)
    assert r0.iteration_s == approx(6.02 + 0.03) and peak_memory(pl, base, t)["cuda:1"] == 0


def _stamped_and_built_one_by_one(g, t, pl, monkeypatch) -> list[tuple]:
    """The plan's task graph (ids, durations, resources, edges, recipes, statistics, replica
    bookkeeping) and result, stamped from templates and then built task by task."""
    from hetplan.planner.sim.build import Builder
    from hetplan.planner.sim.taskgraph import TaskGraph
    from simreference import build_one_by_one
    graphs = []
    for one_by_one in (False, True):
        monkeypatch.setattr(Builder, "BLOCKS", False)   # recipes shared as the reference shares them
        if one_by_one:
            monkeypatch.setattr(Builder, "replica", build_one_by_one)
        sim = Simulator(g, t, cache_size=0, shape_cache_size=0)
        tg = TaskGraph(False)
        sim._build(pl, tg)
        graphs.append((tg.dkey, tg.res, tg.succ, tg.ndeps, tg.recipes, tg.stat_seq,
                       tg.replica_shape, [tg.replica_recipes(r) for r in range(len(tg.replica_tasks))],
                       sim.simulate(pl)))
        monkeypatch.undo()
    return graphs


@pytest.mark.parametrize("seed", range(3))
def test_stamped_replicas_give_the_graph_built_task_by_task(seed, monkeypatch):
    # hetplan.planner.sim.template: same task ids, durations, resources, edges and statistics order
    rng = random.Random(seed)
    for _ in range(60):
        g, t, pl = random_case(rng) if rng.random() < 0.5 else random_twin_case(rng)
        stamped, built = _stamped_and_built_one_by_one(g, t, pl, monkeypatch)
        assert stamped == built


@pytest.mark.parametrize("seed", range(2))
def test_replicas_as_value_blocks_give_the_same_tasks_and_results(seed, monkeypatch):
    # Builder.BLOCKS: each replica's recipes added as one block, its statistics as arrays; every
    # task the same recipe, resources and edges, every statistic and result the same bit for bit
    from hetplan.planner.sim.build import Builder
    from hetplan.planner.sim.taskgraph import TaskGraph
    rng, blocked = random.Random(seed), 0
    for _ in range(60):
        g, t, pl = random_case(rng) if rng.random() < 0.5 else random_twin_case(rng)
        out = []
        for blocks in (True, False):
            monkeypatch.setattr(Builder, "BLOCKS", blocks)
            sim = Simulator(g, t, cache_size=0, shape_cache_size=0)
            tg = TaskGraph(False)
            sim._build(pl, tg)
            blocked += bool(tg.stat_blocks)
            out.append(([tg.recipes[k] for k in tg.dkey], tg.res, tg.succ, tg.ndeps, tg.replica_shape,
                        [tg.replica_recipes(r)[1] for r in range(len(tg.replica_tasks))],
                        repr(sim.simulate(pl)), repr(Simulator(g, t, cache_size=0, delta=False).simulate(pl))))
        assert out[0] == out[1]
    assert blocked >= 30, blocked


def test_held_sends_stamp_the_graph_built_task_by_task(monkeypatch):
    # CPU pipelines whose sends can be held: the templates' hold tasks (ids, windows, edges,
    # links) are those of adding them one by one, and the results the same
    from hetplan.planner.sim.taskgraph import HeldSend
    from simreference import random_cpu_pipelines
    rng, held = random.Random(3), 0
    for _ in range(40):
        stamped, built = _stamped_and_built_one_by_one(*random_cpu_pipelines(rng), monkeypatch)
        assert stamped == built
        held += any(isinstance(r, HeldSend) for r in stamped[4])
    assert held >= 15


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "hippie", "interleaved-1f1b"])
def test_templates_laid_out_with_arrays_equal_those_built_task_by_task(schedule):
    # hetplan.planner.sim.template.replica_template against the builder it replaced, field by field:
    # task values, resources, successors in wiring order, dependencies, statistics, labels,
    # held sends' windows
    from hetplan.planner.sim.template import ReplicaTemplate, Stream, replica_template
    from simreference import replica_template_one_by_one
    rng = random.Random(schedule)
    shapes = 0
    for n in (1, 2, 3, 4, 6):
        for m in (1, 2, 3, 4, 8):
            devices = ([d for d in range(1, n + 1) if n % d == 0 and m % d == 0]
                       if schedule == "interleaved-1f1b" else [None])
            streams = [None, Stream(m, 1), Stream(m, m)] if schedule in ("gpipe", "1f1b") else [None]
            for d in devices:
                for stream in streams:
                    for _ in range(2):
                        pieces = tuple(rng.randint(1, 4) for _ in range(n))
                        hops = tuple((rng.choice([0, 1, 2, 3]), rng.choice([0, 1, 2])) for _ in range(n - 1))
                        holds = rng.choice([None, tuple(rng.random() < 0.7 for _ in range(n))])
                        args = (schedule, 3 * m if stream else m, pieces, hops, d, stream, holds)
                        new, old = replica_template.__wrapped__(*args), replica_template_one_by_one(*args)
                        for field in ReplicaTemplate.FIELDS:
                            assert getattr(new, field) == getattr(old, field), (args, field)
                        assert new.succ_at(7) == [tuple(v + 7 for v in s) for s in old.succ]
                        shapes += 1
    assert shapes >= 50


@pytest.mark.parametrize("seed", range(2))
def test_replica_bookkeeping_lists_each_replicas_recipes_pattern_and_resources(seed):
    # TaskGraph.replica_recipes, which Simulator._like compares replicas by, against its definition
    from hetplan.planner.sim.taskgraph import TaskGraph
    rng = random.Random(seed)
    for _ in range(30):
        g, t, pl = random_case(rng) if rng.random() < 0.5 else random_twin_case(rng)
        tg = TaskGraph(False)
        Simulator(g, t, cache_size=0, shape_cache_size=0)._build(pl, tg)
        for r, tasks in enumerate(tg.replica_tasks):
            recipes = []
            for k in (tg.dkey[x] for x in tasks):
                if k not in recipes:
                    recipes.append(k)
            assert tg.replica_recipes(r) == (recipes, tuple(recipes.index(tg.dkey[x]) for x in tasks))
            assert tg.replica_resources(r) == {y for x in tasks for y in tg.res[x]}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "hippie", "interleaved-1f1b"])
def test_schedule_arrays_are_the_schedules_actions(schedule):
    # hetplan.planner.files.schedule.schedule_arrays (what the templates are laid out from) against
    # make_schedule's actions, row by row
    from hetplan.planner.files.schedule import KINDS, make_schedule, schedule_arrays
    cases = 0
    for n in range(1, 9):
        for m in range(1, 13):
            for d in ([p for p in range(1, n + 1) if n % p == 0 and m % p == 0]
                      if schedule == "interleaved-1f1b" else [None]):
                rows = make_schedule(schedule, n, m, d)
                offset, stage, kind, mb = schedule_arrays(schedule, n, m, d)
                acts = [a for row in rows for a in row]
                assert offset.tolist() == [0] + list(itertools.accumulate(len(r) for r in rows)), (n, m, d)
                assert [(s, KINDS[k], i) for s, k, i in zip(stage.tolist(), kind.tolist(), mb.tolist())] == \
                    [(a.stage, a.kind, a.microbatch) for a in acts], (n, m, d)
                cases += 1
    assert cases >= 96
