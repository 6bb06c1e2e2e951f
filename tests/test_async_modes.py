"""Asynchronous sync modes (plan field sync.mode): validation, the simulator's price, and the
runtime's defining equalities on two CPU workers."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import Sync, plan_from_dict
from hetplan.planner.sim.simulator import simulate
from simhelpers import device, graph, layer, link, plan, topology


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def _local(pl, **sync):
    return dataclasses.replace(pl, sync=dataclasses.replace(pl.sync, **sync))


@pytest.mark.parametrize("mode,extra", [("local-sgd", {"period": 4}), ("easgd", {"period": 4, "alpha": 0.5}),
                                        ("hogwild", {})])
def test_local_modes_pay_the_slowest_replica_and_a_period_share_of_the_parameter_allreduce(mode, extra):
    # 2 replicas of 3 and 1 samples; layer: 1e9 fwd / 2e9 bwd FLOPs at batch 4 -> per sample
    # 0.25 s + 0.5 s: replica 0 takes 2.25 s, replica 1 0.75 s, no gradient all-reduce.
    # SGD on 1e6 B at 1e8 B/s: 0.03 s. Parameter all-reduce 2*1*0.01 + 1e6/1e6 = 1.02 s every
    # 4 iterations: 0.255 s per iteration, after both steps (hogwild: none, memory is shared).
    g = graph([layer(0, param_bytes=10**6)], batch=4)
    t = topology([device("cuda:0", mem_bw=1e8), device("cuda:1", mem_bw=1e8)],
                 [link("cuda:0", "cuda:1", bw=1e6, lat=0.01)])
    sync_plan = plan([(0.75, 1, [("cuda:0", 0, 1)]), (0.25, 1, [("cuda:1", 0, 1)])], 4, granularity="coarse")
    r = simulate(_local(sync_plan, mode=mode, **extra), g, t)
    exchange = 1.02 / 4 if mode != "hogwild" else 0.0
    assert r.iteration_s == approx(2.25 + 0.03 + exchange)
    assert r.per_device["cuda:1"]["comm_s"] == approx(exchange)
    assert simulate(sync_plan, g, t).iteration_s == approx(2.25 + 1.02 + 0.03)   # sync: every iteration


def _plan_dict(sync: dict) -> dict:
    return {"schema": "hetplan.plan/1", "model": {"spec": "mlp", "args": {"hidden": 32, "depth": 2}},
            "global_batch": 8, "schedule": "gpipe", "sync": {"granularity": "coarse", **sync},
            "optimizer": {"name": "sgd", "lr": 0.1},
            "replicas": [{"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 3]}]},
                         {"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:1", "layers": [0, 3]}]}]}


@pytest.mark.parametrize("sync,field", [
    ({"mode": "bogus"}, "sync.mode: expected one of"),
    ({"mode": "local-sgd"}, "sync.period: expected a value"),
    ({"mode": "easgd", "period": 2}, "sync.alpha: expected a value"),
    ({"mode": "easgd", "period": 2, "alpha": 2.0}, "sync.alpha: expected a number in [0, 1]"),
    ({"mode": "local-sgd", "period": 0}, "sync.period: expected a positive integer"),
    ({"period": 2}, "sync.period: applies only to sync.mode local-sgd or easgd"),
    ({"mode": "pipedream"}, "replicas: sync.mode 'pipedream' needs one replica"),
    ({"mode": "hogwild", "period": 2}, "sync.period: applies only to sync.mode local-sgd or easgd"),
])
def test_bad_sync_modes_are_refused_naming_the_field(sync, field):
    with pytest.raises(InputError, match=f"p.json: {field}".replace("[", r"\[").replace("]", r"\]")):
        plan_from_dict(_plan_dict(sync), "p.json")


def test_a_local_mode_needs_one_stage_replicas():
    d = _plan_dict({"mode": "local-sgd", "period": 1})
    d["replicas"] = [{"batch_fraction": 1.0, "microbatches": 1, "stages": [
        {"device": "cpu:0", "layers": [0, 1]}, {"device": "cpu:1", "layers": [1, 3]}]}]
    with pytest.raises(InputError, match="replicas\\[0\\].stages: sync.mode 'local-sgd' needs one-stage"):
        plan_from_dict(d, "p.json")


def test_modes_round_trip_and_a_sync_plan_file_is_unchanged():
    d = _plan_dict({"mode": "easgd", "period": 3, "alpha": 0.25, "bucket_bytes": 1000})
    p = plan_from_dict(d)
    from hetplan.planner.files.plan import plan_to_dict
    assert plan_from_dict(plan_to_dict(p)) == p
    assert p.sync == Sync("coarse", 1000, "easgd", period=3, alpha=0.25)
    assert "mode" not in plan_to_dict(plan_from_dict(_plan_dict({"bucket_bytes": 1000})))["sync"]


def test_easgd_workers_also_hold_the_center_variable():
    from hetplan.planner.cost.memory import peak_memory
    g = graph([layer(0, param_bytes=10**6)], batch=4)
    t = topology([device("cuda:0"), device("cuda:1")], [link("cuda:0", "cuda:1")])
    sync_plan = plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 4)   # SGD: no state
    assert peak_memory(sync_plan, g, t)["cuda:0"] == 2e6                                 # params + grads
    assert peak_memory(_local(sync_plan, mode="easgd", period=2, alpha=0.1), g, t)["cuda:0"] == 3e6
    assert peak_memory(_local(sync_plan, mode="local-sgd", period=2), g, t)["cuda:0"] == 2e6


# --- the runtime: the modes' defining equalities on two CPU workers (gloo) ---------------------
def _runtime_plan(sync: dict, fractions=(0.25, 0.75), opt="sgd", microbatches=(1, 3)) -> dict:
    from test_runtime import MLP, plan as runtime_plan
    p = runtime_plan([(f, m, [(f"cpu:{i}", (0, 4))]) for i, (f, m) in enumerate(zip(fractions, microbatches))],
                     opt=opt, lr=0.1)
    p["sync"].update(sync)
    assert p["model"] == MLP
    return p


def test_local_sgd_with_period_1_is_synchronous_data_parallel(tmp_path):
    from equivalence import assert_params_match
    from test_runtime import ITERS, reference, run_plan
    r, params = run_plan(tmp_path, _runtime_plan({"mode": "local-sgd", "period": 1}))
    ref = reference(_runtime_plan({})["model"], 12, ITERS, "sgd", 0.1)
    assert r["losses"] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-6)


def _alone(p: dict, samples: int, iters: int) -> dict:
    """Replica 0 trained alone on its slice [0, samples) of every global batch (plain SGD)."""
    import torch
    from hetplan.planner.workload.load import load_workload
    w = load_workload(p["model"]["spec"], p["model"]["args"])
    o = torch.optim.SGD(w.model.parameters(), lr=p["optimizer"]["lr"])
    for i in range(iters):
        x, y = w.make_batch(p["global_batch"], i)
        o.zero_grad()
        w.loss_fn(w.model(x[:samples]), y[:samples]).backward()
        o.step()
    return {n: t.detach() for n, t in w.model.named_parameters()}


def test_easgd_with_alpha_0_leaves_each_worker_training_alone_on_its_slice(tmp_path):
    import torch
    from test_runtime import ITERS, run_plan
    p = _runtime_plan({"mode": "easgd", "period": 1, "alpha": 0.0}, fractions=(0.5, 0.5), microbatches=(1, 2))
    _, params = run_plan(tmp_path, p)                    # replica 0's parameters
    for name, ref in _alone(p, 6, ITERS).items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_hogwild_workers_step_into_the_same_parameters(tmp_path):
    import torch
    from test_runtime import ITERS, run_plan
    p = _runtime_plan({"mode": "hogwild"}, fractions=(0.5, 0.5), microbatches=(1, 2))
    _, params = run_plan(tmp_path, p)                    # what replica 0 ends with
    alone = _alone(p, 6, ITERS)
    assert any((params[n] - alone[n]).abs().max() > 1e-3 for n in alone)   # the other's steps in it


LEARNABLE = {"spec": "tests.runtime_models:learnable", "args": {"width": 16}}


@pytest.mark.parametrize("sync", [{"mode": "local-sgd", "period": 2}, {"mode": "easgd", "period": 1, "alpha": 0.3},
                                  {"mode": "hogwild"}])
def test_a_local_mode_lowers_the_loss_and_differs_from_synchronous_training(tmp_path, sync):
    from test_runtime import reference, run_plan
    p = _runtime_plan(sync)
    p["model"], p["optimizer"]["lr"] = LEARNABLE, 0.3
    r, _ = run_plan(tmp_path, p, iters=12)
    ref_losses = reference(LEARNABLE, 12, 12, "sgd", 0.3).losses
    losses = r["losses"]
    if sync["mode"] != "hogwild":   # a Hogwild worker may step before the other's first forward
        assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)     # the same start
    assert losses[-1] != pytest.approx(ref_losses[-1], rel=1e-3)   # then a path of its own
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])                # that learns
    exchanged = "parameter exchange" in {e["name"] for e in r["per_device"]["cpu:0"]["events"]}
    assert exchanged == ("period" in sync)


@pytest.mark.parametrize("command", ["simulate", "run"])
def test_simulate_and_run_refuse_an_unknown_mode_in_one_line(tmp_path, command):
    from test_cli_inputs import _hetplan, one_error_line
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_dict({"mode": "pipedream-3bw"})))
    args = [command, path] + (["--topology", tmp_path / "none.json"] if command == "simulate" else ["-o", tmp_path / "m.json"])
    one_error_line(_hetplan(*args), "plan.json: sync.mode: expected one of")
    assert not (tmp_path / "m.json").exists()


def test_hogwild_workers_see_each_others_updates_through_one_mapping(tmp_path):
    import torch
    from hetplan.runtime.sync_modes import share_parameters
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    path = str(tmp_path / "params")
    share_parameters(list(a.parameters()), path, create=True)
    share_parameters(list(b.parameters()), path, create=False)
    torch.testing.assert_close(b.weight, a.weight)              # the creator's values
    with torch.no_grad():
        a.weight.sub_(1.0)                                      # one worker's step...
        b.bias.add_(2.0)
    torch.testing.assert_close(b.weight, a.weight)              # ...is the other's parameters
    torch.testing.assert_close(a.bias, b.bias)


def test_hogwild_needs_cpu_workers_of_one_node():
    d = _plan_dict({"mode": "hogwild"})
    d["replicas"][1]["stages"][0]["device"] = "node1/cpu:0"
    d["replicas"][0]["stages"][0]["device"] = "node0/cpu:0"
    with pytest.raises(InputError, match="sync.mode: hogwild needs CPU devices of one node"):
        plan_from_dict(d, "p.json")


# --- plan --objective time-to-loss ---------------------------------------------------------------
SLOW_LINK = {"schema": "hetplan.topology/1", "name": "two-cpus-slow-link",
             "devices": [{"name": f"cpu:{i}", "kind": "cpu", "threads": 1, "memory_bytes": 1e9,
                          "matmul_flops_per_s": 1e9, "memory_bytes_per_s": 1e10} for i in range(2)],
             "links": [{"a": "cpu:0", "b": "cpu:1", "bandwidth_bytes_per_s": 1e5, "latency_s": 1e-3}]}


def test_time_to_loss_picks_an_asynchronous_plan_where_the_gradient_exchange_dominates(tmp_path):
    # compute takes microseconds, an all-reduce of the parameters ~30 ms: the asynchronous
    # modes reach the loss in about as many iterations, each much faster
    from test_cli_inputs import _hetplan
    from hetplan.planner.files.plan import load_plan
    topo = tmp_path / "slow.json"
    topo.write_text(json.dumps(SLOW_LINK))
    out = tmp_path / "plan.json"
    r = _hetplan("plan", "--model", LEARNABLE["spec"], "--batch", 12, "--topology", topo, "--optimizer", "sgd",
                 "--lr", 0.3, "--objective", "time-to-loss", "--target-loss", 0.5, "--horizon", 120, "-o", out)
    assert r.returncode == 0, r.stderr
    p = load_plan(out)
    ttl = p.predicted.extra["time_to_loss"]
    assert p.sync.mode in ("local-sgd", "easgd", "hogwild")
    by_mode = {c["sync"]: c for c in ttl["candidates"]}
    assert ttl["time_s"] < by_mode["sync"]["time_s"]                         # faster than synchronous
    # the asynchronous pipelines of the balanced pipeline baseline are ranked with them
    pipes = {(c["sync"], c["average"]) for c in ttl["candidates"] if c["sync"].startswith("pipedream")}
    assert pipes == {("pipedream", None), ("pipedream-2bw", None), ("pipedream", "swa")}
    assert ttl["time_s"] == pytest.approx(ttl["iterations"] * p.predicted.iteration_s)
    lo, hi = p.predicted.iteration_s_interval           # the iterations' time has its interval too
    assert lo <= p.predicted.iteration_s <= hi and lo < hi
    assert ttl["time_s_interval"] == pytest.approx([ttl["iterations"] * lo, ttl["iterations"] * hi])
    assert "time to loss s" in r.stdout and f"sync mode {p.sync.mode}" in r.stdout
    # run it, and compare the predicted time to the loss with the measured one
    assert _hetplan("run", out, "--iters", 40, "-o", tmp_path / "m.json").returncode == 0
    c = _hetplan("compare", out, tmp_path / "m.json", "--topology", topo, "--json")
    assert c.returncode == 0, c.stderr
    got = json.loads(c.stdout)["time_to_loss"]
    assert got["target_loss"] == 0.5 and got["predicted_iterations"] == ttl["iterations"]
    assert 0 < got["measured_iterations"] <= 40 and got["measured_s"] > 0


@pytest.mark.parametrize("flags,needle", [
    (["--objective", "time-to-loss"], "--target-loss: expected a positive number"),
    (["--objective", "time-to-loss", "--target-loss", "-1"], "--target-loss: expected a positive number"),
    (["--target-loss", "0.5"], "--target-loss: applies only with --objective time-to-loss"),
    (["--objective", "time-to-loss", "--target-loss", "0.5", "--horizon", "3"], "--horizon: expected an integer from 16 to 10000"),
    (["--objective", "time-to-loss", "--target-loss", "1e-9", "--horizon", "16"], "--target-loss: no plan reaches 1e-09"),
])
def test_time_to_loss_flags_are_checked(tmp_path, flags, needle):
    from test_cli_inputs import _hetplan, one_error_line
    topo = tmp_path / "slow.json"
    topo.write_text(json.dumps(SLOW_LINK))
    r = _hetplan("plan", "--model", LEARNABLE["spec"], "--batch", 12, "--topology", topo, *flags,
                 "-o", tmp_path / "plan.json")
    one_error_line(r, needle)
    assert not (tmp_path / "plan.json").exists()


# --- the convergence model (hetplan.planner.search.convergence) -----------------------------------------
@pytest.mark.parametrize("sync", [{"mode": "local-sgd", "period": 2}, {"mode": "easgd", "period": 2, "alpha": 0.3}])
def test_the_emulated_losses_are_those_the_runtime_measures(tmp_path, sync):
    from hetplan.planner.files.plan import plan_from_dict
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_runtime import run_plan
    p = _runtime_plan(sync)
    p["model"], p["optimizer"]["lr"] = LEARNABLE, 0.3
    r, _ = run_plan(tmp_path, p, iters=6)
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    assert emulate(w, plan_from_dict(p), 6) == pytest.approx(r["losses"], rel=1e-5)


def test_local_sgd_every_iteration_emulates_as_synchronous_training():
    from hetplan.planner.files.plan import plan_from_dict
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    p = _runtime_plan({"mode": "local-sgd", "period": 1})
    p["model"] = LEARNABLE
    sync = dict(p, sync={"granularity": "coarse"})
    assert emulate(w, plan_from_dict(p), 20) == pytest.approx(emulate(w, plan_from_dict(sync), 20), rel=1e-5)


def test_iterations_to_a_target_counted_on_the_curve_or_extrapolated_by_a_power_law():
    from hetplan.planner.search.convergence import SMOOTH_WINDOW, iterations_to
    flat_then_drop = [1.0] * 20 + [0.1] * 20
    assert iterations_to(flat_then_drop, 0.5) == 20 + SMOOTH_WINDOW // 2 + 1  # the running mean crosses
    law = [0.2 + 2.0 * (i + 1) ** -0.5 for i in range(200)]   # reaches 0.3 at i + 1 = 400
    assert iterations_to(law, 0.3) == pytest.approx(400, rel=0.1)
    assert iterations_to(law, 0.1) == float("inf")                           # below its floor


# --- parameter server ---------------------------------------------------------------------------
def _ps_case():
    # workers cuda:0, cuda:1 (1 sample each: forward 0.5 s, backward 1 s), server cpu:0 on its
    # own 1e6 B/s link to each; 1e6 B of parameters; SGD on the server at 1e8 B/s: 0.03 s
    g = graph([layer(0, param_bytes=10**6)], batch=2)
    t = topology([device("cuda:0"), device("cuda:1"), device("cpu:0", mem_bw=1e8)],
                 [link("cuda:0", "cpu:0", bw=1e6), link("cuda:1", "cpu:0", bw=1e6)])
    p = plan([(0.5, 1, [("cuda:0", 0, 1)]), (0.5, 1, [("cuda:1", 0, 1)])], 2)
    return g, t, _local(p, mode="parameter-server", server="cpu:0")


def test_a_parameter_server_steps_each_workers_gradients_in_turn():
    # both push from 1.5 s to 2.5 s; the server steps 2.5-2.53 and 2.53-2.56; the pulls end
    # at 3.53 and 3.56
    from hetplan.planner.cost.memory import peak_memory
    g, t, p = _ps_case()
    r = simulate(p, g, t, trace=True)
    assert r.iteration_s == approx(1.5 + 1.0 + 2 * 0.03 + 1.0)
    assert r.per_device["cpu:0"]["optimizer_s"] == approx(0.06)
    assert r.per_device["cuda:0"]["optimizer_s"] == 0.0                   # workers do not step
    steps = sorted((x["start_s"], x["end_s"]) for x in r.tasks if x["name"].startswith("sgd step for"))
    assert steps == [approx((2.5, 2.53)), approx((2.53, 2.56))]
    assert p.devices == ("cuda:0", "cuda:1", "cpu:0")
    assert peak_memory(p, g, t) == {"cuda:0": 2e6, "cuda:1": 2e6, "cpu:0": 2e6}   # SGD: no state


def test_a_parameter_server_is_a_device_no_replica_uses():
    d = _plan_dict({"mode": "parameter-server", "server": "cpu:1"})
    with pytest.raises(InputError, match="sync.server: expected a device no replica uses"):
        plan_from_dict(d, "p.json")
    d = _plan_dict({"mode": "parameter-server", "server": "cpu:7"})
    from hetplan.planner.files.plan import validate_plan
    with pytest.raises(InputError, match="sync.server: expected a device of the topology"):
        validate_plan(plan_from_dict(d, "p.json"), "p.json", device_names={"cpu:0", "cpu:1", "cpu:2"})


def test_a_parameter_server_with_one_worker_trains_as_one_device(tmp_path):
    # the worker's gradients, stepped by the server's Adam, come back as its parameters
    from equivalence import assert_params_match
    from test_runtime import ITERS, reference, run_plan
    import torch
    from test_runtime import plan as runtime_plan
    p = runtime_plan([(1.0, 2, [("cpu:0", (0, 4))])])
    p["sync"].update({"mode": "parameter-server", "server": "cpu:1"})
    r, params = run_plan(tmp_path, p)
    ref = reference(p["model"], p["global_batch"], ITERS, "adam", 0.01)
    assert r["losses"] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-6)
    assert set(r["per_device"]) == {"cpu:0", "cpu:1"}
    assert r["per_device"]["cpu:1"]["optimizer_state_bytes"] > 0 == r["per_device"]["cpu:0"]["optimizer_state_bytes"]


def test_a_parameter_server_with_two_workers_learns(tmp_path):
    from test_runtime import reference, run_plan
    p = _runtime_plan({"mode": "parameter-server", "server": "cpu:2"})
    p["model"], p["optimizer"]["lr"] = LEARNABLE, 0.3
    r, _ = run_plan(tmp_path, p, iters=12)
    ref_losses = reference(LEARNABLE, 12, 12, "sgd", 0.3).losses
    losses = r["losses"]
    assert losses[-1] != pytest.approx(ref_losses[-1], rel=1e-3)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])


def test_a_parameter_server_with_one_worker_emulates_as_synchronous_training():
    from hetplan.planner.files.plan import plan_from_dict
    from hetplan.planner.search.convergence import emulate
    from hetplan.planner.workload.load import load_workload
    from test_runtime import plan as runtime_plan
    w = load_workload(LEARNABLE["spec"], LEARNABLE["args"])
    p = runtime_plan([(1.0, 1, [("cpu:0", (0, 4))])], model=LEARNABLE)
    server = dict(p, sync={"granularity": "coarse", "mode": "parameter-server", "server": "cpu:1"})
    assert emulate(w, plan_from_dict(server), 10) == pytest.approx(emulate(w, plan_from_dict(p), 10), rel=1e-6)
