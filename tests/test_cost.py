"""Cost formulas with hand-computed values."""
from __future__ import annotations

import pytest

from hetplan.planner.hardware.machine import this_machine
from hetplan.planner.cost.model import (RooflineCost, host_cpu, layer_bwd_s, layer_fwd_s, optimizer_s, roofline_s,
                                split_host_count)
from hetplan.planner.cost.timing import interpolate
from hetplan.planner.hardware.lookup import measured_here
from hetplan.planner.hardware.topology import Topology
from simhelpers import device, graph, layer, link, topology


def _here(memory: float = 1e9) -> Topology:
    """One CPU worker (one thread) of a topology profiled on this host: layers are timed."""
    import socket

    from hetplan.planner.hardware.topology import Device
    return Topology("h", (Device("cpu:0", "cpu", memory, 1e10, 1e9, 0.0, 1),), (),
                    {"host": {"hostname": socket.gethostname(), "fingerprint": this_machine()}})


def test_roofline_takes_the_bound_plus_overheads():
    d = device("cuda:0", flops=1e12, mem_bw=1e11, overhead=1e-5)
    assert roofline_s(2e9, 1e8, 3, d) == pytest.approx(2e-3 + 3e-5)      # compute-bound
    assert roofline_s(1e6, 1e9, 0, d) == pytest.approx(1e-2)             # memory-bound


def test_layer_bytes_count_parameters_once_forward_twice_backward():
    d = device("cpu:0", flops=1e30, mem_bw=1e9, overhead=1e-3)
    l = layer(0, fwd_flops=0, bwd_flops=0, param_bytes=10**6)
    # forward: (0 activation + 1e6 param bytes) / 1e9 + 1 op * 1e-3
    assert layer_fwd_s(l, d) == pytest.approx(1e-3 + 1e-3)
    # backward: (0 + 2 * 1e6) / 1e9 + 2 ops * 1e-3
    assert layer_bwd_s(l, d) == pytest.approx(2e-3 + 2e-3)


def test_optimizer_bytes():
    d = device("cuda:0", mem_bw=1e9)
    assert optimizer_s(1e6, "sgd", d) == pytest.approx(3e-3)
    assert optimizer_s(1e6, "adam", d) == pytest.approx(7e-3)


def test_cost_model_scales_to_the_microbatch_and_sums_ranges():
    g = graph([layer(i, fwd_flops=4e9 * (i + 1), bwd_flops=8e9) for i in range(3)], batch=4)
    t = topology([device("cuda:0", flops=1e9)])
    c = RooflineCost(g, t)
    # at 1 sample: fwd 1, 2, 3 s; bwd 2 s each
    assert c.fwd_s("cuda:0", 0, 3, 1) == pytest.approx(6.0)
    assert c.fwd_s("cuda:0", 1, 3, 2) == pytest.approx(10.0)
    assert c.bwd_s("cuda:0", 0, 2, 1) == pytest.approx(4.0)
    assert c.layer_s("cuda:0", 2, 1) == pytest.approx((3.0, 2.0))


def test_gpus_of_one_record_share_their_layer_tables():
    # RooflineCost prices a layer from the device's record, not its name: devices alike share
    # one table per batch, a device with another record gets its own; every price as if each
    # device had its own table
    g = graph([layer(i, fwd_flops=4e9 * (i + 1), bwd_flops=8e9 + i) for i in range(5)], batch=4)
    t = topology([device(f"node{n}/cuda:{k}", flops=1e9) for n in range(2) for k in range(4)]
                 + [device("node2/cuda:0", flops=2e9)])

    class Own(RooflineCost):   # a subclass pricing layers its own way: no sharing
        def layer_times(self, device, batch):
            return super().layer_times(device, batch)
    shared, own = RooflineCost(g, t), Own(g, t)
    for d in t.devices:
        for b in (1, 3, 4.5):
            for lo, hi in ((0, 5), (1, 3), (4, 5)):
                args = (d.name, lo, hi, b)
                assert ([shared.fwd_s(*args), shared.bwd_s(*args), shared.bwd_input_s(*args), shared.bwd_weight_s(*args)]
                        == [own.fwd_s(*args), own.bwd_s(*args), own.bwd_input_s(*args), own.bwd_weight_s(*args)])
    assert len({k for k in shared._twins if k[0] == "layers"}) == 2 * 3 and not own._twins   # two records, three batches
    assert shared.fwd_s("node2/cuda:0", 0, 5, 1) == shared.fwd_s("node0/cuda:0", 0, 5, 1) / 2


def test_host_cpu_is_a_linked_cpu_on_the_same_node():
    t = topology([device("cpu:0"), device("cpu:1"), device("cuda:0"), device("n1/cpu:0"), device("n1/cuda:0")],
                 [link("cpu:1", "cuda:0"), link("cpu:0", "cpu:1"), link("n1/cpu:0", "n1/cuda:0")])
    assert host_cpu(t, "cuda:0") == "cpu:1"
    assert host_cpu(t, "n1/cuda:0") == "n1/cpu:0"
    assert host_cpu(t, "cpu:0") == "cpu:0"
    with pytest.raises(ValueError, match="needs a CPU device"):
        host_cpu(topology([device("cuda:0")]), "cuda:0")


def test_split_takes_the_last_tensors_nearest_the_fraction():
    sizes = [256, 32, 64, 8]                        # 360 B; from the end: 8, 72, 104, 360
    assert split_host_count(sizes, 0.2) == 2        # target 72: exactly the last two
    assert split_host_count(sizes, 0.3) == 3        # target 108: 104 is nearer than 360
    assert split_host_count(sizes, 0.01) == 0       # target 3.6: none is nearer than 8
    assert split_host_count(sizes, 0.99) == 4


def test_ring_allreduce_uses_slowest_link():
    t = topology([device(f"cuda:{i}") for i in range(3)],
                 [link("cuda:0", "cuda:1", 2e9, 1e-5), link("cuda:1", "cuda:2", 1e9, 1e-5),
                  link("cuda:2", "cuda:0", 4e9, 1e-5)])
    # 2(k-1) lat + 2(k-1)/k n/bw = 4 * 1e-5 + 4/3 * 3e9 / 1e9
    assert t.allreduce_s(["cuda:0", "cuda:1", "cuda:2"], 3e9) == pytest.approx(4e-5 + 4.0)


def test_interpolation_and_host_check():
    assert interpolate(6, 4, 1.0, 8, 3.0) == pytest.approx(2.0)
    assert interpolate(4, 4, 1.0, 4, 1.0) == 1.0
    assert not measured_here(topology([device("cpu:0")]))
    import socket
    here = Topology("h", (device("cpu:0"),), (), {"host": {"hostname": socket.gethostname(), "fingerprint": this_machine()}})
    assert measured_here(here)


def test_measured_costs_are_timed_and_cached_on_disk(tmp_path, monkeypatch):
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.cost.timing import MeasuredCost, cache_path
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 1})
    g = capture_graph(w, 4)
    t = _here()
    a = MeasuredCost(g, t, w, repeats=2)
    f, b = a.layer_times(t.device("cpu:0"), 4)
    assert len(f) == g.num_layers and all(x > 0 for x in f + b)
    assert len(__import__("json").loads(cache_path().read_text())) == g.num_layers
    again = MeasuredCost(g, t, w, repeats=2)
    monkeypatch.setattr(again, "_time_sequence", lambda *a: pytest.fail("re-measured a cached layer"))
    monkeypatch.setattr(again, "_time_layer", lambda *a: pytest.fail("re-measured a cached layer"))
    assert again.layer_times(t.device("cpu:0"), 4) == (f, b)


def test_a_measured_cost_model_asks_once_whether_a_device_is_here(tmp_path, monkeypatch):
    # prepare() asks before a search; the search's forked chains then never ask CUDA, which a
    # forked process cannot use once its parent has
    import hetplan.planner.cost.timing as timing
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 1})
    g, t = capture_graph(w, 4), _here()
    m = timing.MeasuredCost(g, t, w, sizes=(2, 4), repeats=2)
    m.prepare(["cpu:0"])
    monkeypatch.setattr(timing, "_present", lambda d: pytest.fail("asked again whether a device is here"))
    f, b = m.layer_times(t.device("cpu:0"), 3)
    assert len(f) == g.num_layers and all(x > 0 for x in f + b)


def test_the_split_backward_is_timed_per_layer_by_the_runtimes_passes_and_cached(tmp_path, monkeypatch):
    import json

    import hetplan.planner.workload.split_backward as split_backward
    from hetplan.planner.cost.timing import SPLIT, MeasuredCost, cache_path
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 2})     # layers.0, layers.1, out: all hold weights
    g = capture_graph(w, 4)
    t = _here()
    dev = t.device("cpu:0")
    m = MeasuredCost(g, t, w, repeats=2)
    _, bwd = m.layer_times(dev, 4)
    assert not any(k.endswith(SPLIT) for k in json.loads(cache_path().read_text()))   # only when asked
    passes = []
    real = split_backward.input_pass

    def spy(outs, grads, inputs, weights):   # the runtime's own I pass is what is timed
        passes.append(len(weights))
        return real(outs, grads, inputs, weights)
    monkeypatch.setattr(split_backward, "input_pass", spy)
    inp, wgt = m.split_times(dev, 4)
    assert passes and set(passes) == {2}                 # layers 1 and 2: weight and bias each
    # the first layer's input needs no gradient: I = 0, W its whole backward (a first stage's)
    assert inp[0] == 0.0 and wgt[0] == bwd[0]
    assert all(x > 0 for x in inp[1:] + wgt[1:])
    keys = json.loads(cache_path().read_text())
    assert sum(k.endswith(SPLIT) for k in keys) == g.num_layers - 1
    # entries are shares of the fused backward timed in the same runs; the loss holds no
    # weights: its backward is in the last layer's I, not its W
    k = m._key(g.num_layers - 1, dev, 4)
    assert inp[-1] == keys[k + SPLIT][0] * keys[k][1] + keys[k][3]
    assert wgt[-1] == keys[k + SPLIT][1] * keys[k][1]
    # a second model reads them back; nothing is timed again
    again = MeasuredCost(g, t, w)
    monkeypatch.setattr(again, "_time_sequence", lambda *a: pytest.fail("re-measured a cached layer"))
    monkeypatch.setattr(again, "_time_layer", lambda *a, **k: pytest.fail("re-measured a cached layer"))
    assert again.split_times(dev, 4) == (inp, wgt)
    assert again.bwd_input_s("cpu:0", 1, 3, 4) == pytest.approx(inp[1] + inp[2])
    assert again.bwd_weight_s("cpu:0", 1, 3, 4) == pytest.approx(wgt[1] + wgt[2])


def test_roofline_prices_the_graphs_precision_from_the_device_table():
    from dataclasses import replace

    from hetplan.planner.files.plan import ModelRef, Plan, Replica, Stage
    from hetplan.planner.sim.simulator import ByPrecision, PrecisionMismatch, Simulator
    fast_bf16 = replace(device("cpu:0", flops=1e9), matmul_flops_per_s_by_precision={"fp32": 1e9, "bf16": 4e9})
    what_if = device("cpu:0", flops=1e9)                      # no table: matmul_flops_per_s for all
    l = layer(0, fwd_flops=4e9, bwd_flops=8e9)
    assert roofline_s(4e9, 0, 0, fast_bf16, "bf16") == pytest.approx(1.0)
    assert layer_fwd_s(l, fast_bf16, "bf16") == pytest.approx(1.0)              # 4e9 / 4e9
    assert layer_bwd_s(l, fast_bf16, "bf16") == pytest.approx(2.0)              # 8e9 / 4e9
    assert layer_fwd_s(l, fast_bf16, "fp32") == layer_fwd_s(l, what_if, "bf16") == pytest.approx(4.0)
    g32 = graph([l], batch=2)
    g16 = replace(g32, precision="bf16")
    t = topology([fast_bf16])
    assert RooflineCost(g16, t).fwd_s("cpu:0", 0, 1, 1) == pytest.approx(0.5)   # half the batch
    assert RooflineCost(g32, t).fwd_s("cpu:0", 0, 1, 1) == pytest.approx(2.0)
    one = Plan(ModelRef("synthetic"), 2, (Replica(1.0, 1, (Stage("cpu:0", (0, 1)),)),), precision="bf16")
    sims = ByPrecision({"fp32": Simulator(g32, t), "bf16": Simulator(g16, t)})
    assert sims.simulate(one).iteration_s == pytest.approx(1.0 + 2.0)            # 2 samples in bf16
    assert sims.simulate(replace(one, precision="fp32")).iteration_s == pytest.approx(4.0 + 8.0)
    with pytest.raises(PrecisionMismatch, match="captured in fp32"):
        Simulator(g32, t).simulate(one)


def test_measured_costs_are_keyed_by_precision(tmp_path, monkeypatch):
    import json
    from dataclasses import replace

    import torch

    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.cost import timing
    from hetplan.planner.cost.timing import MeasuredCost, cache_path
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 1})
    t = _here()
    g32, g16 = capture_graph(w, 4), capture_graph(w, 4, "bf16")
    MeasuredCost(g32, t, w, repeats=1).layer_times(t.device("cpu:0"), 4)
    seen = []                                    # the dtype each timed pass computes in
    real = timing._timed

    def spy(sync, fn):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real(sync, fn)
    monkeypatch.setattr(timing, "_timed", spy)
    MeasuredCost(g16, t, w, repeats=1).layer_times(t.device("cpu:0"), 4)
    n = g16.num_layers + 1                       # every layer and the loss, forwards then backwards
    assert seen[:2 * n] == [torch.bfloat16] * n + [None] * n
    keys = json.loads(cache_path().read_text())
    assert sum(k.endswith("|bf16") for k in keys) == g16.num_layers == len(keys) - g32.num_layers
    # tf32 on a CPU is fp32: served from the fp32 entries, never measured again
    monkeypatch.setattr(timing, "_timed", lambda *a: pytest.fail("re-measured"))
    MeasuredCost(replace(g32, precision="tf32"), t, w).layer_times(t.device("cpu:0"), 4)


def test_batch_grid_and_the_cost_curve_between_and_beyond_measured_sizes():
    from hetplan.planner.cost.timing import MeasuredCost, batch_grid
    assert batch_grid(1) == (1,)
    assert batch_grid(12) == (1, 2, 4, 8, 12)
    assert batch_grid(16) == (1, 2, 4, 8, 16)
    t = topology([device("cpu:0")])
    g = graph([layer(0), layer(1)])
    m = MeasuredCost(g, t, workload=None, sizes=batch_grid(12))
    timed = []

    def fake(dev, b):   # layer 0: 1 ms + 1 ms/sample forward; backward twice; layer 1: 5 ms flat
        timed.append(b)
        return [1e-3 + 1e-3 * b, 5e-3], [2e-3 + 2e-3 * b, 5e-3]
    m._measure = fake
    f, b = m.layer_times(t.device("cpu:0"), 6)            # between 4 and 8: on the line
    assert f == pytest.approx([7e-3, 5e-3]) and b == pytest.approx([14e-3, 5e-3])
    f, _ = m.layer_times(t.device("cpu:0"), 20)           # beyond 12: the line through 8 and 12
    assert f == pytest.approx([21e-3, 5e-3])
    assert set(timed) <= set(batch_grid(12))              # only the grid is ever timed
    fit = m.fit_report("cpu:0")                           # whole model: 13 ms + 3 ms/sample
    assert fit["fixed_s"] == pytest.approx(13e-3) and fit["per_sample_s"] == pytest.approx(3e-3)
    assert fit["residual_pct"] == pytest.approx(0.0, abs=1e-9) and fit["sizes"] == [1, 2, 4, 8, 12]


def test_planning_on_a_measured_host_times_layers_once_before_the_search(tmp_path, monkeypatch):
    import random
    import socket

    from hetplan.planner.cost.timing import MeasuredCost, batch_grid
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.hardware.topology import Device, Link
    from hetplan.planner.search.mcmc import SearchConfig, search
    from hetplan.planner.search.problem import plan_problem
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 2})
    cpus = tuple(Device(f"cpu:{i}", "cpu", 1e9, 1e10, 1e9, 0.0, 1) for i in range(2))
    t = Topology("h", cpus, (Link("cpu:0", "cpu:1", 1e9, 1e-5),), {"host": {"hostname": socket.gethostname(), "fingerprint": this_machine()}})
    timed = []
    real = MeasuredCost._measure

    def counting(self, dev, b, split=False, again=False, announce=True):
        timed.append((dev.name, b, split))
        return real(self, dev, b, split, again, announce)
    monkeypatch.setattr(MeasuredCost, "_measure", counting)
    monkeypatch.setattr(MeasuredCost, "_time_layer", _fail_after_prepare(MeasuredCost._time_layer))
    monkeypatch.setattr(MeasuredCost, "_time_sequence", _fail_after_prepare(MeasuredCost._time_sequence))
    _, problem = plan_problem(w, ModelRef("mlp", {"hidden": 32, "depth": 2}), 24, t, "adam", 1e-3)
    # two devices: a zb-h1 pipeline may be drawn, so its split backward is timed up front too
    assert {b for _, b, split in timed if split} == {b for _, b, _ in timed} == set(batch_grid(24))
    _fail_after_prepare.armed = True          # from here on, timing a layer fails the test
    try:
        result = search(problem, random.Random(0), SearchConfig(iterations=200, time_limit_s=60))
    finally:
        _fail_after_prepare.armed = False
    assert result.best is not None and result.stopped_by != "time limit"


def _fail_after_prepare(fn):
    def wrapper(*args, **kwargs):
        if _fail_after_prepare.armed:
            pytest.fail("a layer was timed during the search")
        return fn(*args, **kwargs)
    return wrapper


_fail_after_prepare.armed = False


def test_layers_are_timed_in_steps_over_windows_that_fit_half_the_memory(tmp_path, monkeypatch):
    # a model whose activations at the whole batch do not fit one device is timed in windows of
    # consecutive layers, each a training step of its own; with room for all, one step
    from hetplan.planner.cost.timing import MeasuredCost, cache_path
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 2})
    g = capture_graph(w, 4)
    L = g.num_layers
    per_layer = max(g.saved_bytes_at(i, i + 1, 4) for i in range(L))

    def timed_windows(memory: float) -> list[int]:
        t = _here(memory)
        sizes = []
        real = MeasuredCost._time_sequence

        def spy(self, layers, *args, **kwargs):
            sizes.append(len(layers))
            return real(self, layers, *args, **kwargs)
        monkeypatch.setattr(MeasuredCost, "_time_sequence", spy)
        f, b = MeasuredCost(g, t, w, repeats=1).layer_times(t.device("cpu:0"), 4)
        assert len(f) == len(b) == L and all(x > 0 for x in f)
        cache_path().unlink()
        return sizes

    assert timed_windows(1e12) == [L + 1]                 # every layer and the loss in one step
    assert timed_windows(2 * per_layer) == [1, L]          # the first alone, then what fits half
    assert timed_windows(1.0) == [1] * (L - 1) + [2]      # one layer each; the loss with the last


def test_a_size_timed_out_of_line_with_the_curve_is_timed_again_and_the_faster_kept(tmp_path, monkeypatch):
    # a passing slowdown (the VM slow for a moment) made one size of the curve 50 % slow: more
    # samples never take less time, so a size whose step takes longer than the next larger
    # size's (or less than the next smaller's) is timed again and the faster median kept
    from hetplan.planner.cost.timing import MeasuredCost
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 1})
    g = capture_graph(w, 4)
    t = _here()
    calls = []

    def fake(self, layers, x, *args, **kwargs):   # seconds per sample, the first timing of 2 slow
        batch = x[0].shape[0]
        calls.append(batch)
        slow = 3.0 if batch == 2 and calls.count(2) == 1 else 1.0
        n = len(layers)
        return [1e-3 * batch * slow] * n, [2e-3 * batch * slow] * n, 0.0
    monkeypatch.setattr(MeasuredCost, "_time_sequence", fake)
    m = MeasuredCost(g, t, w, sizes=(1, 2, 4))
    dev = t.device("cpu:0")
    f4, _ = m.layer_times(dev, 4)            # sizes 2 (timed slow: 6 units > size 4's 4), then 4
    assert calls == [2, 4, 4, 2]             # 4 is out of line with 2: both timed again
    f1, _ = m.layer_times(dev, 1)
    f2, b2 = m.layer_times(dev, 2)
    assert calls == [2, 4, 4, 2, 1]          # 1 is in line: nothing timed again
    assert f2[0] == pytest.approx(2e-3) and b2[0] == pytest.approx(4e-3)   # the faster kept
    assert f1[0] == pytest.approx(1e-3) and f4[0] == pytest.approx(4e-3)


def test_a_size_timed_far_above_the_line_through_its_neighbours_is_timed_again_with_them(tmp_path, monkeypatch):
    # a slow spell made one size 50 % slow without passing the next larger size's time (Llama's
    # batch 8 at 12.2 ms between 5.8 at 4 and 13.7 at 16): the three sizes are timed again
    from hetplan.planner.cost.timing import KINK, MeasuredCost
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 1})
    g = capture_graph(w, 4)
    t = _here()
    calls, slow = [], {2: 1.5}

    def fake(self, layers, x, *args, **kwargs):   # seconds per sample, the first timing of 2 slow
        batch = x[0].shape[0]
        calls.append(batch)
        k = slow.pop(batch, 1.0)
        n = len(layers)
        return [1e-3 * batch * k] * n, [2e-3 * batch * k] * n, 0.0
    monkeypatch.setattr(MeasuredCost, "_time_sequence", fake)
    m = MeasuredCost(g, t, w, sizes=(1, 2, 4))
    dev = t.device("cpu:0")
    m.layer_times(dev, 4)                    # sizes 2 (1.5x: 9 units, under 4's 12) and 4
    assert calls == [2, 4]
    m.layer_times(dev, 1)                    # 1 (3 units): 2 lies 50 % above the line 1-4
    assert calls == [2, 4, 1, 1, 2, 4]
    f2, b2 = m.layer_times(dev, 2)
    assert f2[0] == pytest.approx(2e-3) and b2[0] == pytest.approx(4e-3)   # the faster kept
    # within KINK of the line: nothing timed again
    calls.clear()
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path / "2"))
    slow[2] = 1 + 0.9 * KINK                 # 2 at (1 + 0.9 KINK) x the line's 6 units
    m = MeasuredCost(g, t, w, sizes=(1, 2, 4))
    for b in (4, 1):
        m.layer_times(dev, b)
    assert calls == [2, 4, 1]


class _Calls(RooflineCost):
    """Roofline layer times with a backward call of `call` seconds in each layer's backward, as
    layers timed one at a time measure it (hetplan.planner.cost.timing)."""

    def __init__(self, g, t, call: float):
        super().__init__(g, t)
        self.call = call

    def backward_call_s(self, device, batch: float) -> float:
        return self.call


def test_a_stages_backward_pays_one_backward_call_for_all_its_layers():
    # layers timed alone each pay a backward call of their own (the last one a second: the
    # loss's); a stage runs one call over its layers. bwd 2 s per layer at 1 sample, call 0.25 s
    g = graph([layer(i, fwd_flops=4e9, bwd_flops=8e9) for i in range(3)], batch=4)
    t = topology([device("cuda:0", flops=1e9)])
    c = _Calls(g, t, 0.25)
    assert c.bwd_s("cuda:0", 0, 1, 1) == pytest.approx(2.0)                # one layer: as timed
    assert c.bwd_s("cuda:0", 0, 2, 1) == pytest.approx(4.0 - 0.25)         # two layers, one call
    assert c.bwd_s("cuda:0", 0, 3, 1) == pytest.approx(6.0 - 3 * 0.25)     # and the loss's call
    # a backward cut into pieces (DDP buckets) is one call: its later pieces pay none
    assert c.bwd_s("cuda:0", 0, 1, 1) + c.bwd_s("cuda:0", 1, 3, 1, call=False) == pytest.approx(
        c.bwd_s("cuda:0", 0, 3, 1))
    assert c.fwd_s("cuda:0", 0, 3, 1) == pytest.approx(3.0)                # forwards as timed
    assert c.layer_s("cuda:0", 2, 1) == pytest.approx((1.0, 2.0))


def test_a_layer_is_timed_with_a_gradient_only_for_inputs_that_carry_one():
    # a layer's outputs that need no gradient (Llama's rotary cos/sin, from buffers) reach the
    # next layer as inputs without one, as the runtime's stages receive them: timing each layer
    # with every floating-point input a leaf requiring grad made its backward compute and
    # accumulate their gradients too (llama at 16: 8.99 against 8.15 ms)
    import contextlib

    import torch

    from hetplan.planner.cost.timing import _next_inputs, _sequence_once
    seen = []

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("pos", torch.ones(4))

        def forward(self, x):
            return self.lin(x), self.pos * 2.0

    class Use(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, h, pos):
            seen.append((h.requires_grad, pos.requires_grad))
            return (self.lin(h + pos),)

    layers, x = [Pair(), Use()], (torch.randn(2, 4),)
    times = _sequence_once(layers, x, lambda: None, contextlib.nullcontext, data=True)
    assert seen == [(True, False)] and all(t > 0 for t in times)
    h, pos = _next_inputs(layers[:1], x, contextlib.nullcontext)    # a window's next inputs
    assert (h.requires_grad, pos.requires_grad) == (True, False) and h.grad_fn is None


def test_a_cpus_backward_call_is_measured_against_one_chained_call(tmp_path, monkeypatch):
    # the layers' separate backward calls against one chained call of the same layers, in the
    # same runs: the difference per call saved prices a stage's backward (CostModel.bwd_s)
    from hetplan.planner.cost import timing
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    w = load_workload("mlp", {"hidden": 32, "depth": 2})
    g = capture_graph(w, 4)
    L = g.num_layers
    n = L + 1                                          # the loss is timed as a last pseudo-layer
    monkeypatch.setattr(timing, "_sequence_once", lambda layers, *a, **k: (1e-3,) * n + (2e-3,) * n)
    monkeypatch.setattr(timing, "_chained_once", lambda layers, *a, **k: (n * 1e-3, n * 2e-3 - (n - 1) * 1e-4))
    t = _here()
    m = timing.MeasuredCost(g, t, w, repeats=1)
    dev = t.device("cpu:0")
    assert m.backward_call_s(dev, 4) == pytest.approx(1e-4)
    assert m.bwd_s("cpu:0", 0, L, 4) == pytest.approx(n * 2e-3 - (n - 1) * 1e-4)   # the chained step
    assert m.bwd_s("cpu:0", 0, 1, 4) == pytest.approx(2e-3)                         # one layer alone
