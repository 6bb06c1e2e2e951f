"""Plain data parallel on torch DDP (hetplan.runtime.ddp): which plans, which microbatch syncs, and
DDP's buckets equal to the simulator's (hetplan.planner.cost.buckets)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetplan.planner.files.plan import plan_from_dict
from hetplan.runtime import ddp
from hetplan.runtime.pipeline import stage_actions
from hetplan.runtime.stage import _buckets


def _plan(stages_per_replica, placement="device", bucket_bytes=1024, devices=("cpu:0", "cpu:1"),
          schedule="1f1b"):
    reps = [{"batch_fraction": 1 / len(stages_per_replica), "microbatches": 2,
             "stages": [{"device": f"{d}", "layers": [0, 4]}] if n == 1 else
             [{"device": f"{d}", "layers": [0, 2]}, {"device": "cpu:9", "layers": [2, 4]}]}
            for d, n in zip(devices, stages_per_replica)]
    return plan_from_dict({"schema": "hetplan.plan/1", "model": {"spec": "mlp", "args": {}},
                           "global_batch": 8, "replicas": reps, "schedule": schedule,
                           "sync": {"granularity": "fine", "bucket_bytes": bucket_bytes},
                           "optimizer": {"name": "sgd", "lr": 0.1, "placement": placement}}, "p.json")


def test_is_plain_dp():
    assert ddp.is_plain_dp(_plan([1, 1]))
    assert not ddp.is_plain_dp(_plan([1]))                                  # one replica
    assert not ddp.is_plain_dp(_plan([1, 2]))                               # a pipeline replica
    assert not ddp.is_plain_dp(_plan([1, 1], placement="cpu"))              # offloaded optimizer
    assert not ddp.is_plain_dp(_plan([1, 1], devices=("cpu:0", "cuda:0")))  # CPU+GPU: host staging


BUCKET_CAPS = "bucket_cap_mb_list" in ddp.ddp_parameters()   # torch 2.13 has it, 2.11 not


def test_uses_ddp_is_one_decision_for_all_replicas():
    p = _plan([1, 1])
    assert ddp.uses_ddp(p) == BUCKET_CAPS      # 1F1B, 2 microbatches each
    assert not ddp.uses_ddp(_plan([1, 1], schedule="gpipe"))               # GPipe with 2 microbatches: no no_sync() order


def test_plain_dp_runs_on_gradsync_where_ddp_takes_no_bucket_caps(monkeypatch):
    # an older torch's DDP cannot be given the plan's buckets: GradSync runs them, and the
    # simulator, deciding with the same function, prices GradSync's copies
    from hetplan.planner.cost import grad_sync
    without = ddp.ddp_parameters() - {"bucket_cap_mb_list", "forward_sync_buffers"}
    monkeypatch.setattr(grad_sync, "ddp_parameters", lambda: without)
    assert ddp.is_plain_dp(_plan([1, 1])) and not ddp.uses_ddp(_plan([1, 1]))


def test_buffers_are_not_broadcast_before_each_forward_under_either_torch_name():
    assert ddp.no_forward_buffer_sync({"module", "broadcast_buffers"}) == {"broadcast_buffers": False}
    both = {"broadcast_buffers", "forward_sync_buffers"}
    assert ddp.no_forward_buffer_sync(both) == {"forward_sync_buffers": False}
    assert set(ddp.no_forward_buffer_sync(ddp.ddp_parameters())) <= ddp.ddp_parameters()


@pytest.mark.parametrize("schedule, expect", [("1f1b", 2), ("gpipe", None)])
def test_sync_microbatch(schedule, expect):
    # 1F1B on one stage: F0 B0 F1 B1 F2 B2, so F2 prepares the reduction; GPipe: F0 F1 F2 B0 B1 B2
    # would reduce during B0
    assert ddp.sync_microbatch(stage_actions(schedule, 0, 1, 3)) == expect


def test_bucket_caps_are_each_buckets_bytes_in_bucket_order():
    a, b, c, d, e = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 7, 11, 2))
    assert ddp.bucket_caps([a, b, c, d, e], {a: 1, b: 1, c: 0, d: 1}) == [28, 76, 8]


@pytest.mark.skipif(not BUCKET_CAPS, reason="this torch's DDP takes no per-bucket caps")
@pytest.mark.parametrize("bucket_bytes", [1024, 2200, 10**6])
def test_ddp_buckets_are_the_simulators(tmp_path, monkeypatch, bucket_bytes):
    # the mlp's layers: 784*16+16, 16*16+16 (x2), 16*10+10 float32 parameters
    model = torch.nn.Sequential(torch.nn.Linear(784, 16), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 10))
    names = [(f"{i}.weight", f"{i}.bias") for i in range(4)]
    layers = _buckets(_plan([1, 1], bucket_bytes=bucket_bytes), names, dict(model.named_parameters()))
    by_layer = {i: [getattr(model[i], "weight"), getattr(model[i], "bias")] for i in range(4)}
    expect = [sum(p.numel() * 4 for l in ls for p in by_layer[l]) for ls in layers]
    reduced: list[int] = []
    sum_hook = ddp._sum_hook

    def recording_hook(group, bucket):
        reduced.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return sum_hook(group, bucket)
    monkeypatch.setattr(ddp, "_sum_hook", recording_hook)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        wrapped = ddp.wrap(model, dist.group.WORLD, torch.device("cpu"),
                           {p: i for i, ls in enumerate(layers) for l in ls for p in by_layer[l]})
        for it in range(4):   # DDP rebuilds its buckets after the first iteration, in ready order
            reduced.clear()
            wrapped(torch.randn(2, 784)).sum().backward()
            if it:            # what each later iteration all-reduces, bucket by bucket
                assert reduced == expect
    finally:
        dist.destroy_process_group()


def test_a_parameter_without_gradient_trains_on_ddp_as_in_one_process(tmp_path, monkeypatch):
    # a user's wrapper reads only the hidden state of an inner model that also pools it (a
    # Hugging Face encoder's pooler): the pooler's parameters get no gradient; DDP refused the
    # second iteration ("Expected to have finished reduction") until told to look for them
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path / "cache"))
    from hetplan.planner.workload.layer_cache import layer_map
    from hetplan.planner.workload.load import load_workload
    from test_runtime import check_equivalent, plan
    model = {"spec": "tests.runtime_models:pooled", "args": {}}
    def found():
        return layer_map(load_workload(model["spec"], model["args"]), model["spec"], model["args"], 6)
    assert found().unused == ("inner.pool.weight", "inner.pool.bias")
    assert found().unused == ("inner.pool.weight", "inner.pool.bias")   # read back from the cache
    p = plan([(0.5, 1, [("cpu:0", (0, 2))]), (0.5, 1, [("cpu:1", (0, 2))])], model=model, sync="fine",
             bucket_bytes=256)
    assert ddp.uses_ddp(plan_from_dict(p, "p.json"))
    check_equivalent(tmp_path, p, iters=3)
