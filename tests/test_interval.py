"""How sure a prediction is (hetplan.planner.sim.interval): draws of the measured inputs, the interval,
the rule that keeps the simpler plan unless the richer one is surely faster, and `plan --confirm`."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.hardware.machine import this_machine
from hetplan.planner.cost.model import RooflineCost
from hetplan.planner.files.plan import load_plan, plan_to_dict, save_plan
from hetplan.planner.sim.interval import (Draws, Judged, Residual, Spread, beat_probability, choose, interval,
                                  parts, spread_of)
from hetplan.planner.sim.simulator import Simulator
from tests.simhelpers import device, graph, layer, link, plan, topology

ROOT = Path(__file__).resolve().parent.parent
Z90 = 1.6448536269514722


def _sim():
    topo = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1", bw=1e9, lat=1e-4)])
    g = graph([layer(0), layer(1)], cut_bytes=[0, 4e6, 0])
    return Simulator(g, topo, RooflineCost(g, topo))


SINGLE = plan([(1.0, 1, [("cuda:0", 0, 2)])], 1)
PIPELINE = plan([(1.0, 4, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 4)


def test_nothing_drawn_without_spread():
    sim = _sim()
    point = sim.simulate(PIPELINE).iteration_s
    assert Draws(sim, Spread()).times(PIPELINE) == [point]
    lo, hi = interval([point], Residual(0.0, 0.0, ""))
    assert lo == hi == point


def test_an_input_the_plan_does_not_use_adds_nothing():
    sim = _sim()
    point = sim.simulate(SINGLE).iteration_s
    # the link and cuda:1 have a spread; the single-device plan uses neither
    d = Draws(sim, Spread(compute={"cuda:1": 0.2}, links={("cuda:0", "cuda:1"): 0.3}, collective=0.1), n=16)
    assert d.times(SINGLE) == pytest.approx([point] * 16, rel=1e-12)
    assert len(set(d.times(PIPELINE))) > 1      # the pipeline crosses the link: its draws differ


def test_a_device_spread_scales_its_compute_on_each_draw():
    sim = _sim()
    point = sim.simulate(SINGLE).iteration_s     # forward + backward on cuda:0: compute only
    d = Draws(sim, Spread(compute={"cuda:0": 0.1}), n=8)
    want = [point * math.exp(0.1 * z[0]["cuda:0"]) for z in d.z]
    assert d.times(SINGLE) == pytest.approx(want, rel=1e-12)


def test_the_residual_alone_gives_the_normal_quantiles():
    lo, hi = interval([0.1], Residual(-0.05, 0.04, ""))
    # measured = predicted * exp(-e), e ~ N(-0.05, 0.04)
    assert lo == pytest.approx(0.1 * math.exp(0.05 - Z90 * 0.04), rel=1e-9)
    assert hi == pytest.approx(0.1 * math.exp(0.05 + Z90 * 0.04), rel=1e-9)


def test_infeasible_draws_give_no_interval():
    assert interval([math.inf], Residual(0, 0.1, "")) == (math.inf, math.inf)


def test_parts_count_what_a_plan_adds():
    assert parts(SINGLE) == 1
    assert parts(PIPELINE) == 2 + 3
    assert parts(plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 2)) == 2


def test_choice_keeps_the_baseline_when_the_gain_lies_within_the_spread():
    r = Residual(0.0, 0.05, "")
    base, rich = Judged("single", SINGLE, [0.100], r), Judged("pipeline", PIPELINE, [0.095], r)
    # P = Phi(log(0.100 / 0.095) / (0.05 * sqrt 2)) = Phi(0.7254) = 0.766
    assert beat_probability(rich.times, r, base.times, r) == pytest.approx(0.7659, abs=1e-3)
    assert choose([rich, base]).name == "single"


def test_choice_takes_the_richer_plan_when_it_is_clearly_faster():
    r = Residual(0.0, 0.05, "")
    base, rich = Judged("single", SINGLE, [0.100], r), Judged("pipeline", PIPELINE, [0.080], r)
    # Phi(log(0.100 / 0.080) / 0.0707) = Phi(3.156) = 0.9992
    assert beat_probability(rich.times, r, base.times, r) == pytest.approx(0.9992, abs=1e-3)
    assert choose([base, rich]).name == "pipeline"


def test_choice_between_plans_of_as_many_parts_takes_the_faster():
    r = Residual(0.0, 0.05, "")
    a = Judged("a", plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 2), [0.100], r)
    b = Judged("b", plan([(0.3, 1, [("cuda:0", 0, 2)]), (0.7, 1, [("cuda:1", 0, 2)])], 2), [0.099], r)
    assert choose([a, b]).name == "b"


def test_shared_draws_compare_two_plans_alike():
    """Two plans that differ only where nothing is drawn see the same factors: with the residual
    set to nothing, the faster on every draw wins with probability 1."""
    sim = _sim()
    d = Draws(sim, Spread(compute={"cuda:0": 0.3, "cuda:1": 0.3}), n=32)
    fast = d.times(PIPELINE)
    slow = d.times(plan([(1.0, 4, [("cuda:0", 0, 1), ("cuda:1", 1, 2)])], 4, recompute=True))
    none = Residual(0.0, 0.0, "")
    assert all(f < s for f, s in zip(fast, slow))
    assert beat_probability(fast, none, slow, none) == 1.0


def test_spread_of_reads_the_profile_tables():
    topo = json.loads((ROOT / "hetplan/topologies/workstation-gtx1650.json").read_text())
    from hetplan.planner.hardware.topology import topology_from_dict
    t = topology_from_dict(topo)
    assert spread_of(t) == Spread()          # a what-if file measured nothing
    dev = dict(topo["devices"][0])
    dev["matmul_table"] = [{"n": 64, "flops_per_s": 1e11, "spread": 0.0, "samples": 9},
                           {"n": 256, "flops_per_s": 1e11, "spread": 0.0, "samples": 9}]
    topo["devices"][0] = dev
    assert spread_of(topology_from_dict(topo)).compute == {}     # measured without spread: nothing
    dev["matmul_table"][0]["spread"] = dev["matmul_table"][1]["spread"] = 0.1349
    # median spread 0.1349 = 0.1 sd; a layer time is a median of 5 runs: 1.2533 * 0.1 / sqrt 5
    got = spread_of(topology_from_dict(topo)).compute
    assert got == {dev["name"]: pytest.approx(1.2533 * 0.1 / math.sqrt(5), rel=1e-4)}


def _hetplan(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True,
                          cwd=cwd, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_plan_records_the_interval_and_a_what_if_topology_cannot_confirm(tmp_path):
    r = _hetplan("plan", "--model", "mlp", "--batch", "32", "--topology",
                 str(ROOT / "hetplan/topologies/workstation-gtx1650.json"), "--iterations", "300",
                 "--confirm", "-o", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "not confirmed: the topology is not this machine's profile" in r.stdout
    assert "probability the chosen plan" in r.stdout or "is the best baseline" in r.stdout
    p = load_plan(tmp_path / "p.json")
    lo, hi = p.predicted.iteration_s_interval
    assert lo < p.predicted.iteration_s < hi and p.predicted.interval_probability == 0.9
    assert p.predicted.extra["choice"]["kept"]
    s = _hetplan("simulate", "p.json", "--topology", str(ROOT / "hetplan/topologies/workstation-gtx1650.json"),
                 "--json", cwd=tmp_path)
    assert s.returncode == 0, s.stderr
    # simulate captures the graph at the plan's microbatch, plan at a small batch scaled: close
    assert json.loads(s.stdout)["iteration_s_interval"] == pytest.approx([lo, hi], rel=1e-3)


@pytest.mark.parametrize("bad,why", [([0.2, 0.1], "lo <= hi"), ([0.1], "[lo, hi]"), ([0, 0.1], "0 < lo"),
                                     ("x", "expected a list")])
def test_a_bad_interval_in_a_plan_file_is_one_line(tmp_path, bad, why):
    p = plan_to_dict(SINGLE)
    p["model"] = {"spec": "mlp"}
    p["predicted"] = {"iteration_s": 0.1, "iteration_s_interval": bad, "interval_probability": 0.9}
    (tmp_path / "p.json").write_text(json.dumps(p))
    with pytest.raises(Exception) as e:
        load_plan(tmp_path / "p.json")
    assert "predicted.iteration_s_interval" in str(e.value) and why in str(e.value)


def _here_topology(path: Path) -> None:
    """One CPU worker, profiled here as far as the cost model can tell (its host is this one)."""
    topo = {"schema": "hetplan.topology/1", "name": "here", "host": {"hostname": socket.gethostname(), "fingerprint": this_machine()},
            "devices": [{"name": "cpu:0", "kind": "cpu", "threads": 1, "memory_bytes": 8e9,
                         "matmul_flops_per_s": 5e10, "memory_bytes_per_s": 1e10, "op_overhead_s": 1e-5}],
            "links": []}
    path.write_text(json.dumps(topo))


def test_confirm_keeps_the_measured_fastest_when_the_predicted_best_is_slow(tmp_path):
    """A candidate predicted fastest that runs 64 one-sample microbatches against one of 64
    samples: confirming keeps the truly fast one."""
    from dataclasses import replace

    from hetplan.confirm import confirm, fastest
    from hetplan.planner.files.plan import ModelRef, TopologyRef
    from hetplan.planner.hardware.topology import load_topology

    _here_topology(tmp_path / "t.json")
    topo = load_topology(tmp_path / "t.json")
    model = ModelRef("tests.factories:square", {"n": 256, "depth": 3})
    base = replace(plan([(1.0, 1, [("cpu:0", 0, 3)])], 64), model=model,
                   topology=TopologyRef(topo.name, topo.sha256))
    slow = replace(base, replicas=(replace(base.replicas[0], microbatches=64),), recompute=True)
    got, foreign = confirm([("predicted best", slow, 0.01), ("baseline", base, 0.02)], topo, rounds=1,
                           log=lambda msg: None)
    assert 0.0 <= foreign <= 1.0
    assert [c.name for c in got] == ["predicted best", "baseline"]
    assert got[0].median_s > got[1].median_s
    assert fastest(got).name == "baseline"


def test_a_searched_plan_replaces_a_baseline_of_as_many_parts_only_when_surely_faster():
    r = Residual(0.0, 0.05, "")
    dp = plan([(0.5, 1, [("cuda:0", 0, 2)]), (0.5, 1, [("cuda:1", 0, 2)])], 2)
    shares = plan([(0.45, 1, [("cuda:0", 0, 2)]), (0.55, 1, [("cuda:1", 0, 2)])], 2)
    base = Judged("data parallel", dp, [0.100], r, baseline=True)
    assert choose([base, Judged("search's best", shares, [0.099], r)]).name == "data parallel"
    assert choose([base, Judged("search's best", shares, [0.080], r)]).name == "search's best"


def test_confirming_keeps_the_pick_unless_another_is_clearly_faster():
    from hetplan.confirm import Confirmed, fastest
    pick = Confirmed("pick", 0.01, (0.0100, 0.0101))
    assert fastest([pick, Confirmed("other", 0.01, (0.0099, 0.0099))]).name == "pick"     # 2 %: noise
    assert fastest([pick, Confirmed("other", 0.01, (0.0090, 0.0091))]).name == "other"    # 10 %
