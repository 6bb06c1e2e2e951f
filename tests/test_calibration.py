"""Calibration: fits on synthetic tables, the topology file round trip, and the cost model and
simulator using the figures when present and the contract's formulas when absent (exact values)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hetplan.planner.hardware.calibration import (Calibration, calibration_from_dict,
                                          calibration_to_dict, topology_calibration)
from hetplan.planner.hardware.fit import (contention_factor, fit_latency_bandwidth, fit_optimizer,
                                  lower_envelope, memory_contention_factor)
from hetplan.planner.cost.model import RooflineCost
from hetplan.planner.files.io import InputError
from hetplan.planner.cost.timing import MeasuredCost
from hetplan.planner.sim.simulator import Simulator
from hetplan.planner.hardware.topology import load_topology, save_topology
from simhelpers import device, graph, layer, link, plan, topology

CAL = {"cpu_workers": 2, "cpu_contention_factor": 2.0, "allreduce_latency_s": 1e-4,
       "allreduce_bytes_per_s": 1e9,
       "optimizer": {"adam": {"s_per_tensor": 2e-5, "s_per_byte": 5e-10},
                     "sgd": {"s_per_tensor": 1e-6, "s_per_byte": 1e-10}},
       "iteration_overhead_s": 0.0, "wake_latency_s": 0.0}


def _topo(cal=None, bw=1e9, lat=1e-5):
    t = topology([device("cpu:0", flops=1e9, mem_bw=1e9), device("cpu:1", flops=1e9, mem_bw=1e9)],
                 [link("cpu:0", "cpu:1", bw=bw, lat=lat)])
    return replace(t, measured={"calibration": cal}) if cal is not None else t


# --- fits ---------------------------------------------------------------------------------------
def test_latency_bandwidth_fit_recovers_an_exact_line():
    rows = [{"bytes": n, "s": 2e-4 + n / 5e8} for n in (1e3, 1e5, 1e6, 1e7)]
    lat, bw = fit_latency_bandwidth(rows)
    assert lat == pytest.approx(2e-4, rel=1e-6)
    assert bw == pytest.approx(5e8, rel=1e-6)


def test_latency_bandwidth_fit_clamps_a_negative_intercept_to_the_smallest_time():
    rows = [{"bytes": 1e6, "s": 1e-3}, {"bytes": 2e6, "s": 2.2e-3}]   # line through -2e-4
    lat, bw = fit_latency_bandwidth(rows)
    assert lat == pytest.approx(1e-3)
    assert bw == pytest.approx(1 / 1.2e-9, rel=1e-6)


def test_optimizer_fit_separates_per_tensor_and_per_byte_costs():
    rows = [{"tensors": n, "bytes": b, "s": n * 2e-5 + b * 5e-10}
            for n, b in ((1, 4e6), (16, 4e6), (64, 1e6), (8, 3.2e7))]
    fit = fit_optimizer(rows)
    assert fit.s_per_tensor == pytest.approx(2e-5, rel=1e-6)
    assert fit.s_per_byte == pytest.approx(5e-10, rel=1e-6)
    assert fit.step_s(10, 1e6) == pytest.approx(10 * 2e-5 + 1e6 * 5e-10)


def test_contention_factor_is_the_median_ratio_and_never_below_one():
    assert contention_factor([10.0, 10.0, 10.0], [20.0, 24.0, 30.0]) == pytest.approx(2.4)
    assert contention_factor([10.0], [9.0]) == 1.0
    with pytest.raises(ValueError):
        contention_factor([1.0], [])


def test_contention_interpolates_between_alone_and_all_workers():
    c = Calibration(cpu_workers=2, cpu_contention_factor=2.2)
    assert c.contention(1) == 1.0
    assert c.contention(2) == pytest.approx(2.2)
    assert c.contention(1.5) == pytest.approx(1.6)
    assert c.contention(5) == pytest.approx(2.2)          # capped at the measured group
    c4 = Calibration(cpu_workers=4, cpu_contention_factor=2.5)
    assert c4.contention(2) == pytest.approx(1.5)        # 1 + 1.5 * 1/3


def test_allreduce_scales_the_fit_by_ring_steps_and_volume():
    c = calibration_from_dict(CAL)
    assert c.allreduce_s(2, 1e6) == pytest.approx(1e-4 + 1e-3)
    # k = 4 from a fit over 2: latency x 3/1, volume x (3/4)/(1/2) = 1.5
    assert c.allreduce_s(4, 1e6) == pytest.approx(3e-4 + 1.5e-3)
    assert Calibration().allreduce_s(2, 1e6) is None


def test_lower_envelope_bounds_a_size_by_every_larger_ones_time():
    rows = [{"bytes": 4096, "s": 1.2e-3}, {"bytes": 1 << 20, "s": 0.8e-3}, {"bytes": 16384, "s": 0.9e-3},
            {"bytes": 4 << 20, "s": 3.8e-3}]
    assert lower_envelope(rows) == ((4096, 0.8e-3), (16384, 0.8e-3), (1 << 20, 0.8e-3), (4 << 20, 3.8e-3))


CURVE = [[1e3, 1e-3], [1e6, 2e-3], [4e6, 5e-3]]


def test_allreduce_follows_the_measured_curve_between_its_sizes_and_its_last_slope_beyond():
    c = calibration_from_dict({**CAL, "allreduce_curve": CURVE})
    assert c.allreduce_s(2, 2.5e6) == pytest.approx(3.5e-3)            # half way from 2 to 5 ms
    assert c.allreduce_s(2, 8e6) == pytest.approx(5e-3 + 4e6 * 1e-9)   # the last slope: 1 ms per MB
    assert c.allreduce_s(2, 10) == pytest.approx(1e-3)                 # the smallest size's time
    # k = 4 from the curve over 2: latency 1e-4 x 3 steps + (2e-3 - 1e-4 at 1 MB) x volume 1.5
    assert c.allreduce_s(4, 1e6) == pytest.approx(3e-4 + 1.9e-3 * 1.5)


# --- file format ----------------------------------------------------------------------------------
def test_calibration_dict_round_trips():
    assert calibration_to_dict(calibration_from_dict(CAL)) == CAL
    with_curve = {**CAL, "allreduce_curve": CURVE}
    assert calibration_to_dict(calibration_from_dict(with_curve)) == with_curve


def test_a_held_send_follows_the_measured_curve_from_zero_and_stays_flat_beyond_it():
    held = {**CAL, "held_send_curve": [[1e-3, 4e-4], [4e-3, 1e-3]]}
    c = calibration_from_dict(held)
    assert calibration_to_dict(c) == held
    assert c.held_send_s(0.0) == 0.0
    assert c.held_send_s(5e-4) == pytest.approx(2e-4)       # from (0, 0) to the first point
    assert c.held_send_s(2.5e-3) == pytest.approx(7e-4)     # half way between the points
    assert c.held_send_s(1.0) == pytest.approx(1e-3)        # flat beyond the last
    assert calibration_from_dict(CAL).held_send_s(1e-3) == 0.0
    cost = RooflineCost(graph([layer(0)]), _topo(held))
    assert cost.held_send_s("cpu:0", 5e-4) == pytest.approx(2e-4) and cost.holds_sends("cpu:0")
    assert not RooflineCost(graph([layer(0)]), _topo(CAL)).holds_sends("cpu:0")


def test_calibrated_topology_file_round_trips(tmp_path):
    t = _topo({**CAL, "raw": {"reference": []}})
    save_topology(t, tmp_path / "t.json")
    back = load_topology(tmp_path / "t.json")
    assert back == t
    assert topology_calibration(back) == calibration_from_dict(CAL)
    assert json.loads((tmp_path / "t.json").read_text())["calibration"]["cpu_contention_factor"] == 2.0


def test_bad_calibration_field_is_named(tmp_path):
    t = _topo({**CAL, "cpu_contention_factor": 0.5})
    with pytest.raises(InputError, match=r"calibration\.cpu_contention_factor: expected a number >= 1"):
        topology_calibration(t)
    t = _topo({**CAL, "allreduce_curve": [[2e6, 1e-3], [1e6, 2e-3]]})
    with pytest.raises(InputError, match=r"calibration\.allreduce_curve: expected \[\[bytes, seconds\]"):
        topology_calibration(t)
    t = _topo({**CAL, "held_send_curve": [[1e-3, 2e-4], [1e-3, 3e-4]]})
    with pytest.raises(InputError, match=r"calibration\.held_send_curve: expected \[\[window_seconds, seconds\]"):
        topology_calibration(t)
    t = _topo({**CAL, "held_send_curve": [[1e-3, -2e-4]]})
    with pytest.raises(InputError, match=r"calibration\.held_send_curve: .*seconds non-negative"):
        topology_calibration(t)
    t = _topo({**CAL, "optimizer": {"adam": {"s_per_tensor": -1, "s_per_byte": 0}}})
    with pytest.raises(InputError, match=r"calibration\.optimizer\.adam\.s_per_tensor"):
        RooflineCost(graph([layer(0)]), t)


# --- the cost model ---------------------------------------------------------------------------------
def test_without_calibration_the_cost_model_is_the_roofline_formula():
    g = graph([layer(0, param_bytes=10**6)])
    c = RooflineCost(g, _topo())
    assert c.calibration is None
    assert c.optimizer_s("cpu:0", 1e6, "adam", 10) == pytest.approx(7e6 / 1e9)
    # ring: 2(k-1) * latency + 2(k-1)/k * n / bandwidth
    assert c.allreduce_s(("cpu:0", "cpu:1"), 1e6) == pytest.approx(2e-5 + 1e6 / 1e9)
    assert c.contention("cpu:0", 2) == 1.0
    assert c.iteration_overhead_s() == 0.0


def test_with_calibration_the_cost_model_uses_the_fitted_figures():
    g = graph([layer(0, param_bytes=10**6)])
    c = RooflineCost(g, _topo({**CAL, "iteration_overhead_s": 3e-4}))
    assert c.optimizer_s("cpu:0", 1e6, "adam", 10) == pytest.approx(10 * 2e-5 + 1e6 * 5e-10)
    assert c.optimizer_s("cpu:0", 1e6, "sgd", 1) == pytest.approx(1e-6 + 1e-4)
    assert c.allreduce_s(("cpu:0", "cpu:1"), 1e6) == pytest.approx(1e-4 + 1e-3)
    assert c.iteration_overhead_s() == 3e-4
    # the roofline's scalars were profiled with all workers busy: no contention on top
    assert c.fwd_s("cpu:0", 0, 1, 1, busy=2) == c.fwd_s("cpu:0", 0, 1, 1)


def test_measured_model_slows_cpu_layers_by_the_contention_factor():
    g = graph([layer(0)])
    m = MeasuredCost(g, _topo(CAL), workload=None)
    assert m.contention("cpu:0", 2) == pytest.approx(2.0)
    assert m.contention("cpu:0", 1.25) == pytest.approx(1.25)
    assert MeasuredCost(g, _topo(), workload=None).contention("cpu:0", 2) == 1.0


# --- the simulator: contention only while other workers compute ------------------------------------
class _Contended(RooflineCost):
    """Roofline layer times, contention from the calibration (as MeasuredCost does)."""

    def contention(self, device, busy):
        return self.calibration.contention(busy) if self.calibration else 1.0


def _sim(cal):
    # 2 layers: forward 1 s, backward 2 s per sample each on a 1 GFLOP/s device; no parameters
    g = graph([layer(0), layer(1)])
    t = _topo(cal, bw=1e30, lat=0.0)
    return Simulator(g, t, _Contended(g, t))


def test_even_data_parallel_runs_both_workers_at_the_contended_speed():
    p = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2)
    # alone: 2 s forward + 4 s backward per replica; fully overlapped -> x2.0
    assert _sim(CAL).simulate(p).iteration_s == pytest.approx(12.0)
    assert _sim(None).simulate(p).iteration_s == pytest.approx(6.0)


def test_uneven_data_parallel_is_slowed_only_while_both_compute():
    p = plan([(0.75, 1, [("cpu:0", 0, 2)]), (0.25, 1, [("cpu:1", 0, 2)])], 4)
    r = _sim(CAL).simulate(p)
    # alone: cpu:0 forward [0, 6) backward [6, 18); cpu:1 forward [0, 2) backward [2, 6).
    # pass 1: cpu:0's forward overlaps fully (x2 -> 12 s), its backward not (12 s); cpu:1 x2.
    # pass 2: cpu:0 forward [0, 12) vs cpu:1 [0, 12): the same. Processor sharing gives 24 s.
    assert r.iteration_s == pytest.approx(24.0)
    assert r.per_device["cpu:1"]["busy_s"] == pytest.approx(12.0)
    assert r.per_device["cpu:0"]["busy_s"] == pytest.approx(24.0)
    # a single device is never contended
    single = plan([(1.0, 1, [("cpu:0", 0, 2)])], 4)
    assert _sim(CAL).simulate(single).iteration_s == pytest.approx(24.0)


def test_the_runtime_loops_own_work_is_added_once_per_iteration():
    # calibration's iteration_overhead_s (profile_bench.iteration_overhead): the runtime's loop
    # beside its actions, once per iteration, on a single device as on two replicas
    loop = {**CAL, "iteration_overhead_s": 0.5}
    single = plan([(1.0, 1, [("cpu:0", 0, 2)])], 4)
    assert _sim(loop).simulate(single).iteration_s == pytest.approx(24.0 + 0.5)
    even = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2)
    assert _sim(loop).simulate(even).iteration_s == pytest.approx(12.0 + 0.5)


def test_coarse_sync_is_one_flat_allreduce_per_device_set_and_no_barrier_skew():
    # 2 layers of 1 MB parameters, forward 1 s + backward 2 s per sample each; no contention
    g = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6)])
    cal = {**CAL, "cpu_contention_factor": 1.0, "multi_worker_overhead_s": 5e-5}
    t = _topo(cal, bw=1e30, lat=0.0)
    sim = Simulator(g, t, _Contended(g, t))
    p = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2, granularity="coarse",
             bucket_bytes=10**6)   # two buckets by the cap, merged into one exchange
    r = sim.simulate(p)
    compute = 2.0 + 4.0
    allreduce = 1e-4 + 2e6 / 1e9                   # one 2 MB all-reduce, one latency
    sgd = 2 * 1e-6 + 2e6 * 1e-10                     # 2 tensors, 2 MB
    # an older profile's multi_worker_overhead_s (a per-iteration barrier's skew) is not added
    assert r.iteration_s == pytest.approx(compute + allreduce + sgd, rel=1e-12)
    single = plan([(1.0, 1, [("cpu:0", 0, 2)])], 1, granularity="coarse")
    # one sample on one device: the same compute, no all-reduce
    assert sim.simulate(single).iteration_s == pytest.approx(compute + sgd, rel=1e-12)


def test_memory_contention_factor_is_the_median_ratio_of_matching_rows():
    alone = [{"tensors": 1, "bytes": 4, "s": 1.0}, {"tensors": 8, "bytes": 32, "s": 2.0},
             {"tensors": 64, "bytes": 4, "s": 4.0}]
    together = [{"tensors": 1, "bytes": 4, "s": 1.5}, {"tensors": 8, "bytes": 32, "s": 2.2},
                {"tensors": 64, "bytes": 4, "s": 8.0}, {"tensors": 2, "bytes": 2, "s": 9.0}]
    assert memory_contention_factor(alone, together) == pytest.approx(1.5)   # of 1.5, 1.1, 2.0
    assert memory_contention_factor(alone, [{"tensors": 1, "bytes": 4, "s": 0.5}]) == 1.0
    assert memory_contention_factor(alone, []) is None


def test_memory_contention_round_trips_and_defaults_to_the_compute_factor():
    c = calibration_from_dict({**CAL, "memory_contention_factor": 1.5})
    assert c.memory_contention(2) == pytest.approx(1.5)
    assert c.memory_contention(1.5) == pytest.approx(1.25)
    assert calibration_to_dict(c)["memory_contention_factor"] == 1.5
    old = calibration_from_dict(CAL)                     # a profile from before the figure
    assert old.memory_contention_factor is None and old.memory_contention(2) == pytest.approx(2.0)
    assert "memory_contention_factor" not in calibration_to_dict(old)
    with pytest.raises(InputError, match=r"calibration\.memory_contention_factor: expected a number >= 1"):
        calibration_from_dict({**CAL, "memory_contention_factor": 0.9}, "t.json")


def test_concurrent_optimizer_steps_are_slowed_by_the_memory_factor():
    # 2 layers of 1 MB parameters, forward 1 s + backward 2 s per sample each; even DP, SGD
    g = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6)])
    p = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2, granularity="coarse",
             bucket_bytes=10**6)
    compute = 2 * (2.0 + 4.0)                         # both compute at once: x2.0
    allreduce = 1e-4 + 2e6 / 1e9
    sgd = 2 * 1e-6 + 2e6 * 1e-10                      # both step at once after the all-reduce
    for mem, factor in ((1.5, 1.5), (None, 2.0)):     # without the figure: the compute factor
        cal = {**CAL, **({"memory_contention_factor": mem} if mem else {})}
        t = _topo(cal, bw=1e30, lat=0.0)
        r = Simulator(g, t, _Contended(g, t)).simulate(p)
        assert r.iteration_s == pytest.approx(compute + allreduce + factor * sgd, rel=1e-12)


# --- the accuracy benchmark's check ------------------------------------------------------------------
def test_accuracy_check_fails_when_an_error_exceeds_its_bound():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy.py"
    spec = importlib.util.spec_from_file_location("accuracy_bench", path)
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    rows = [{"plan": f"p{i}", "predicted_s": p, "measured_s": m, "error_pct": 100 * (p - m) / m}
            for i, (p, m) in enumerate([(1.0, 1.0), (2.1, 2.0), (2.9, 3.0), (4.0, 4.0)])]
    s = acc.summarise(rows)
    assert s["mape_pct"] == pytest.approx((0 + 5 + 100 / 30 + 0) / 4)
    assert s["worst_pct"] == pytest.approx(5.0) and s["worst_plan"] == "p1"
    assert s["tau"] == pytest.approx(1.0)
    assert acc.missed_targets(s) == []
    rows[3]["predicted_s"], rows[3]["error_pct"] = 4.44, 11.0      # 11 % > the 10 % bound; MAPE 4.8 %
    assert acc.missed_targets(acc.summarise(rows)) == ["worst_pct"]
    swapped = [dict(r, predicted_s=5 - r["predicted_s"]) for r in rows]   # ranking reversed
    assert "tau" in acc.missed_targets(acc.summarise(swapped))


def test_accuracy_runs_short_plans_past_their_warm_up():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy.py"
    spec = importlib.util.spec_from_file_location("accuracy_bench", path)
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    assert (acc.WARMUP_S, acc.MEASURED_S) == (0.1, 0.2)
    # 2 ms: ceil(0.1 / 0.002) = 50 warm-up, ceil(0.2 / 0.002) = 100 measured
    assert acc.run_window(0.002, 12, 3) == (150, 50)
    # 40 ms: 3 warm-up (120 ms >= 0.1 s), 9 measured (360 ms >= 0.2 s): unchanged
    assert acc.run_window(0.040, 12, 3) == (12, 3)
    # 25 ms: ceil(0.1 / 0.025) = 4 warm-up, 9 measured (225 ms)
    assert acc.run_window(0.025, 12, 3) == (13, 4)
    assert acc.run_window(0.5, 40, 10) == (40, 10)       # the flags are lower bounds


def test_a_blocked_receiver_resumes_wake_latency_after_its_message_and_a_busy_one_does_not():
    # 2 layers (forward 1 s, backward 2 s per sample), one per device, link latency 0.5 s
    g = graph([layer(0), layer(1)])
    w = 0.25

    def run(wake, microbatches):
        t = _topo({**CAL, "cpu_contention_factor": 1.0, "wake_latency_s": wake}, bw=1e30, lat=0.5)
        p = plan([(1.0, microbatches, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], microbatches, "gpipe")
        return Simulator(g, t, _Contended(g, t)).simulate(p, trace=True)

    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in run(w, 1).tasks}
    assert spans["0:1F0"] == pytest.approx((1.5, 2.75))     # idle since 0: resumes w late
    assert spans["0:1B0"] == pytest.approx((2.75, 4.75))    # its own forward before it: no wake
    assert spans["0:0B0"] == pytest.approx((5.25, 7.5))     # idle since 1: w late again
    assert run(w, 1).iteration_s - run(0.0, 1).iteration_s == pytest.approx(2 * w, rel=1e-12)
    # two microbatches: the second activation lands at 2.5 while cpu:1 still computes the
    # first forward (until 2.75), so it starts when that ends, without a wake-up
    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in run(w, 2).tasks}
    assert spans["0:1F0"] == pytest.approx((1.5, 2.75))
    assert spans["0:1F1"] == pytest.approx((2.75, 3.75))
    # all-reduces are measured with their waiters' wake-up (runtime pattern): nothing added
    dp = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2)
    sims = [Simulator(g, t, _Contended(g, t)).simulate(dp).iteration_s
            for t in (_topo({**CAL, "wake_latency_s": x}) for x in (0.0, w))]
    assert sims[0] == sims[1]


def test_the_first_compute_after_a_wait_starts_cold_and_one_back_to_back_does_not():
    # as the wake-up test above, with cold_compute_s c added to the same tasks: 1F0 (idle since
    # 0) and 0B0 (idle since 1) each take w + c longer; 1B0 follows its own forward: nothing
    g = graph([layer(0), layer(1)])
    w, c = 0.25, 0.125

    def run(cold, p):
        t = _topo({**CAL, "cpu_contention_factor": 1.0, "wake_latency_s": w, "cold_compute_s": cold},
                  bw=1e30, lat=0.5)
        return Simulator(g, t, _Contended(g, t)).simulate(p, trace=True)

    pipe = plan([(1.0, 1, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 1, "gpipe")
    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in run(c, pipe).tasks}
    assert spans["0:1F0"] == pytest.approx((1.5, 2.75 + c))
    assert spans["0:1B0"] == pytest.approx((2.75 + c, 4.75 + c))
    assert spans["0:0B0"] == pytest.approx((5.25 + c, 7.5 + 2 * c))
    # data parallel: each worker waits for the gradient all-reduce, then steps cold
    g = graph([layer(0, param_bytes=10**6), layer(1)])
    dp = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2, granularity="coarse")
    assert run(c, dp).iteration_s - run(0.0, dp).iteration_s == pytest.approx(c, rel=1e-9)
    assert calibration_from_dict({**CAL, "cold_compute_s": c}).cold_compute_s == c


def test_a_stage_pays_for_issuing_the_messages_it_sends_and_posting_those_it_receives():
    # two stages, forward 1 s / backward 2 s, free links; isend issue s = 0.125, irecv post
    # p = 0.0625 on the sending and receiving workers' threads: 0F0 sends (1 + s), 1F0 receives
    # (1 + p), 1B0 sends (2 + s), 0B0 receives (2 + p); no optimizer (no parameters)
    g = graph([layer(0), layer(1)])
    s, p = 0.125, 0.0625
    t = _topo({**CAL, "cpu_contention_factor": 1.0, "send_issue_s": s, "recv_post_s": p}, bw=1e30, lat=0.0)
    pipe = plan([(1.0, 1, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 1, "gpipe")
    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in Simulator(g, t, _Contended(g, t)).simulate(pipe, trace=True).tasks}
    assert spans["0:0F0"] == pytest.approx((0.0, 1 + s))
    assert spans["0:1F0"] == pytest.approx((1 + s, 2 + s + p))
    assert spans["0:1B0"] == pytest.approx((2 + s + p, 4 + 2 * s + p))
    assert spans["0:0B0"] == pytest.approx((4 + 2 * s + p, 6 + 2 * s + 2 * p))
    assert calibration_from_dict({**CAL, "send_issue_s": s, "recv_post_s": p}).send_issue_s == s


def test_a_message_of_several_tensors_pays_an_isend_and_an_irecv_post_per_tensor():
    # as above, but the cut carries 3 tensors ahead, 2 of which carry a gradient back (as a
    # Llama stage sends its hidden state, the rotary cos and sin and the causal mask, and gets
    # the hidden state's gradient): the runtime issues one isend and posts one irecv per tensor
    g = replace(graph([layer(0), layer(1)]), cut_tensors=(1, 3, 1), cut_grad_tensors=(0, 2, 1))
    s, p = 0.125, 0.0625
    t = _topo({**CAL, "cpu_contention_factor": 1.0, "send_issue_s": s, "recv_post_s": p}, bw=1e30, lat=0.0)
    pipe = plan([(1.0, 1, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 1, "gpipe")
    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in Simulator(g, t, _Contended(g, t)).simulate(pipe, trace=True).tasks}
    assert spans["0:0F0"] == pytest.approx((0.0, 1 + 3 * s))
    assert spans["0:1F0"] == pytest.approx((1 + 3 * s, 2 + 3 * s + 3 * p))
    assert spans["0:1B0"] == pytest.approx((2 + 3 * s + 3 * p, 4 + 5 * s + 3 * p))
    assert spans["0:0B0"] == pytest.approx((4 + 5 * s + 3 * p, 6 + 5 * s + 5 * p))
    # the early-rejection bound prices the same messages (it stays below the simulation)
    from hetplan.planner.sim.bound import lower_bound_s
    sim = Simulator(g, t, _Contended(g, t))
    assert lower_bound_s(sim, pipe) == pytest.approx(6 + 5 * s + 5 * p)


def test_every_schedule_action_pays_the_runtimes_own_work_once():
    # the runtime's driver spends a = 0.125 s of its thread per action besides the compute
    # (calibration's action_overhead_s). Two stages, forward 1 s / backward 2 s, free links:
    # 0F0 [0, 1 + a], 1F0 [1 + a, 2 + 2a], 1B0 [2 + 2a, 4 + 3a], 0B0 [4 + 3a, 6 + 4a]
    g = graph([layer(0), layer(1)])
    a = 0.125

    def sim(x, gr=g):
        t = _topo({**CAL, "cpu_contention_factor": 1.0, "action_overhead_s": x}, bw=1e30, lat=0.0)
        return Simulator(gr, t, _Contended(gr, t))

    pipe = plan([(1.0, 1, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 1, "gpipe")
    spans = {x["name"]: (x["start_s"], x["end_s"]) for x in sim(a).simulate(pipe, trace=True).tasks}
    assert spans["0:0F0"] == pytest.approx((0.0, 1 + a))
    assert spans["0:1F0"] == pytest.approx((1 + a, 2 + 2 * a))
    assert spans["0:1B0"] == pytest.approx((2 + 2 * a, 4 + 3 * a))
    assert spans["0:0B0"] == pytest.approx((4 + 3 * a, 6 + 4 * a))
    # fine sync cuts a data-parallel replica's backward at its 2 buckets: 2 tasks, one action,
    # so one F and one B pay a: everything moves by 2a (each replica alike)
    gp = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6)])
    dp = plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2, bucket_bytes=10**6)
    run = sim(a, gp).simulate(dp, trace=True)
    assert sum(x["name"].startswith("0:0B0") for x in run.tasks) == 2
    assert run.iteration_s - sim(0.0, gp).simulate(dp).iteration_s == pytest.approx(2 * a, rel=1e-9)
    assert calibration_from_dict({**CAL, "action_overhead_s": a}).action_overhead_s == a
    assert calibration_to_dict(calibration_from_dict({**CAL, "action_overhead_s": a}))["action_overhead_s"] == a


def test_microbatches_after_the_first_add_their_gradients_into_the_iterations():
    # layer timing times a backward with fresh gradients; in an iteration of m microbatches the
    # m - 1 later backwards add into .grad: k s per parameter byte x the stage's bytes P each.
    # One device runs everything in a row, so the iteration grows by exactly (m - 1) k P.
    P = 3 * 10**6                        # 10**6 + 2 * 10**6 parameter bytes on cpu:0
    g = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=2 * 10**6)])
    k = 1e-9

    def it(x, m, schedule="gpipe"):
        t = _topo({**CAL, "cpu_contention_factor": 1.0, "grad_accumulate_s_per_byte": x})
        return Simulator(g, t, _Contended(g, t)).simulate(plan([(1.0, m, [("cpu:0", 0, 2)])], 4, schedule)).iteration_s

    assert it(k, 1) == it(0.0, 1)                                   # one microbatch: nothing
    for m in (2, 4):
        assert it(k, m) - it(0.0, m) == pytest.approx((m - 1) * k * P, rel=1e-9)
    # two stages: each pays for its own layers' bytes only (cpu:1's 2e6 on its critical path)
    two = plan([(1.0, 2, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 4, "gpipe")
    t0, t1 = (_topo({**CAL, "cpu_contention_factor": 1.0, "grad_accumulate_s_per_byte": x}) for x in (0.0, k))
    spans = [{x["name"]: x["end_s"] - x["start_s"] for x in Simulator(g, t, _Contended(g, t)).simulate(two, trace=True).tasks}
             for t in (t0, t1)]
    # the first backward writes fresh gradients, the last adds into them
    for name, n_bytes in (("0:1B", 2 * 10**6), ("0:0B", 10**6)):
        assert spans[1][name + "0"] == spans[0][name + "0"]
        assert spans[1][name + "1"] - spans[0][name + "1"] == pytest.approx(k * n_bytes, rel=1e-9)
    assert calibration_from_dict({**CAL, "grad_accumulate_s_per_byte": k}).grad_accumulate_s_per_byte == k


def _sync_sim(**extra):
    # 2 layers of 10**6 parameter bytes each: forward 1 s, backward 2 s per layer on each of two
    # CPU workers, no contention
    g = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6)])
    t = _topo({**CAL, "cpu_contention_factor": 1.0, **extra})
    return Simulator(g, t, _Contended(g, t))


def _dp(granularity="coarse", placement="device", bucket_bytes=1 << 40):
    return plan([(0.5, 1, [("cpu:0", 0, 2)]), (0.5, 1, [("cpu:1", 0, 2)])], 2, granularity=granularity,
                placement=placement, bucket_bytes=bucket_bytes)


def test_ddp_pays_its_forward_work_and_one_gradient_copy_and_gradsync_copies_in_and_back():
    # f: DDP's own work per forward; k per gradient byte copied into (or out of) a bucket.
    # Plain data parallel runs on DDP: its forward takes 2 + f, its backward 4 + k P (the reducer
    # copies the P = 2e6 bytes into the bucket), the sum is the bucket: nothing copied back.
    # The same replicas with the optimizer placed "cpu" (on CPU workers: the same step) run on
    # GradSync: no DDP forward, the copy in after the backward and the sums back before the step.
    f, k, P = 0.125, 1e-7, 2 * 10**6
    on, off = _sync_sim(ddp_forward_s=f, grad_copy_s_per_byte=k), _sync_sim()
    ddp = {x["name"]: (x["start_s"], x["end_s"]) for x in on.simulate(_dp(), trace=True).tasks}
    assert ddp["0:0F0"] == pytest.approx((0.0, 2 + f))
    assert ddp["0:0B0"] == pytest.approx((2 + f, 6 + f + k * P))
    assert on.simulate(_dp()).iteration_s - off.simulate(_dp()).iteration_s == pytest.approx(f + k * P, rel=1e-9)
    gs = _dp(placement="cpu")
    spans = on.simulate(gs, trace=True).tasks
    assert {x["name"]: (x["start_s"], x["end_s"]) for x in spans}["0:0F0"] == pytest.approx((0.0, 2.0))
    assert sum(x["name"] == "gradient copy back" for x in spans) == 2      # one per worker
    assert on.simulate(gs).iteration_s - off.simulate(gs).iteration_s == pytest.approx(2 * k * P, rel=1e-9)
    c = calibration_from_dict({**CAL, "ddp_forward_s": f, "grad_copy_s_per_byte": k})
    assert (c.ddp_forward_s, c.grad_copy_s_per_byte) == (f, k)
    assert calibration_to_dict(c)["grad_copy_s_per_byte"] == k
    assert "ddp_forward_s" not in calibration_to_dict(calibration_from_dict(CAL))    # older profiles


def test_fine_sync_copies_each_bucket_in_the_backward_piece_that_makes_it_final():
    # one bucket per layer (10**6 bytes each): the backward is cut in two pieces, layer 1's
    # (2 s) then layer 0's (2 s); each piece copies its own bucket's 10**6 bytes
    k = 1e-7
    tasks = _sync_sim(grad_copy_s_per_byte=k).simulate(_dp("fine", bucket_bytes=10**6), trace=True).tasks
    pieces = sorted((x["start_s"], x["end_s"]) for x in tasks if x["name"].startswith("0:0B0"))
    assert pieces == [pytest.approx((2.0, 4 + k * 10**6)), pytest.approx((4 + k * 10**6, 6 + 2 * k * 10**6))]


def test_fine_all_reduces_on_a_saturated_host_run_back_to_back_after_the_backward():
    # two CPU workers of one thread on a 2-core host (contention.saturated_cpus); 2 layers of
    # 10**6 parameter bytes, one bucket each; forward 2 s, backward pieces 2 s + 2 s. An
    # all-reduce costs 0.5 s of latency + 10**6 B / 10**6 B/s; one issued right behind another
    # of its group 0.125 s + 1 s. With no core to spare the buckets' all-reduces wait for the
    # backward (gloo's threads get no core while the workers compute), then run back to back:
    # [6, 7.5] then the queued one [7.5, 8.625]. On a host with cores to spare each starts
    # when its bucket is final and costs 1.5 s: [4, 5.5] and [6, 7.5].
    cal = {**CAL, "cpu_contention_factor": 1.0, "allreduce_latency_s": 0.5, "allreduce_bytes_per_s": 1e6}
    g = graph([layer(0, param_bytes=10**6), layer(1, param_bytes=10**6)])

    def spans(extra, cores):
        t = topology([replace(device(f"cpu:{i}", flops=1e9, mem_bw=1e9), threads=1) for i in (0, 1)],
                     [link("cpu:0", "cpu:1", bw=1e30, lat=0.0)])
        t = replace(t, measured={"calibration": {**cal, **extra}, "host": {"cores": cores}})
        tasks = Simulator(g, t, _Contended(g, t)).simulate(_dp("fine", bucket_bytes=10**6), trace=True).tasks
        return sorted((x["start_s"], x["end_s"]) for x in tasks if x["kind"] == "allreduce")

    assert spans({"allreduce_queued_s": 0.125}, 2) == [pytest.approx((6.0, 7.5)), pytest.approx((7.5, 8.625))]
    # bound workers: the queued calls' threads share the workers' cores, dearer than a lone call
    assert spans({"allreduce_queued_s": 2.0}, 2) == [pytest.approx((6.0, 7.5)), pytest.approx((7.5, 10.5))]
    assert spans({}, 2) == [pytest.approx((6.0, 7.5)), pytest.approx((7.5, 9.0))]      # not measured: as a lone one
    assert spans({"allreduce_queued_s": 0.125}, 4) == [pytest.approx((4.0, 5.5)), pytest.approx((6.0, 7.5))]
    c = calibration_from_dict({**cal, "allreduce_queued_s": 0.125})
    assert c.allreduce_s(2, 10**6, queued=True) == pytest.approx(1.125)
    assert calibration_to_dict(c)["allreduce_queued_s"] == 0.125
    assert c.allreduce_s(2, 10**6, queued=False) == pytest.approx(1.5)

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "hippie"])
def test_the_last_backward_adds_into_the_gradients_on_the_critical_path(schedule):
    # Stage 0 (cpu:0): layer 0, forward 1 s, backward 1 s, P = 1e8 parameter bytes; stage 1
    # (cpu:1): layer 1, forward 1 s, backward 2 s, no parameters; free links; m = 3 of one sample.
    # Stage 1's backwards end at 6, 8, 10 in all three schedules; stage 0's follow each, at
    # [6, 7] (gpipe; 1F1B and Hippie [4, 5]), [7, 8], [10, 11], with slack before each but the
    # last. Its first writes fresh gradients, B1 and B2 add a = k P = 0.1 s each: the last
    # backward ends at 11 + a, then the SGD step (1e-6 s + 1e-10 s/byte x P). Charging the
    # first two instead (the critical path unchanged) would give 11 + step.
    P, k = 10**8, 1e-9
    g = graph([layer(0, bwd_flops=1e9, param_bytes=P), layer(1)])
    t = _topo({**CAL, "cpu_contention_factor": 1.0, "grad_accumulate_s_per_byte": k}, bw=1e30, lat=0.0)
    r = Simulator(g, t, _Contended(g, t)).simulate(plan([(1.0, 3, [("cpu:0", 0, 1), ("cpu:1", 1, 2)])], 3, schedule),
                                                   trace=True)
    end = {x["name"]: x["end_s"] for x in r.tasks}
    assert end["0:1B2"] == pytest.approx(10.0, rel=1e-12)
    assert end["0:0B2"] == pytest.approx(11.0 + k * P, rel=1e-12)
    assert r.iteration_s == pytest.approx(11.0 + k * P + 1e-6 + 1e-10 * P, rel=1e-12)


@pytest.mark.parametrize("schedule,mode,m,adding", [
    ("gpipe", "sync", 3, "0B1 0B2 1B1 1B2"),
    ("zb-h1", "sync", 3, "0W1 0W2 1W1 1W2"),                          # the W passes, not the I's
    ("interleaved-1f1b", "sync", 2, "0B1 1B1 2B1 3B1"),               # per virtual stage
    ("1f1b", "pipedream-2bw", 2, "0B1 0B3 0B5 1B1 1B3 1B5"),          # after each update: fresh
    ("1f1b", "pipedream", 2, ""),                                     # an update after each
])
def test_which_backwards_add_into_the_gradients(schedule, mode, m, adding):
    # per stage, the first backward of an iteration (of a stream: after each update) writes
    # fresh gradients; the others take k x their stage's parameter bytes longer
    k = 1e-9
    n = 4 if schedule == "interleaved-1f1b" else 2
    g = graph([layer(i, param_bytes=10**6) for i in range(n)])
    stages = [(f"cpu:{s % 2}", s, s + 1) for s in range(n)]
    p = plan([(1.0, m, stages)], m, schedule)
    p = replace(p, sync=replace(p.sync, mode=mode))

    def spans(x):
        t = _topo({**CAL, "cpu_contention_factor": 1.0, "grad_accumulate_s_per_byte": x})
        return {e["name"].split(":")[1]: e["end_s"] - e["start_s"]
                for e in Simulator(g, t, _Contended(g, t)).simulate(p, trace=True).tasks if e["kind"] == "backward"}
    fresh, added = spans(0.0), spans(k)
    assert fresh.keys() == added.keys()
    assert {a for a in added if added[a] - fresh[a] > 1e-6} == set(adding.split())   # spans: end - start
    assert all(added[a] - fresh[a] == pytest.approx(k * 10**6, rel=1e-9) for a in adding.split())
