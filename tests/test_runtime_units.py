"""Single-process unit tests of the runtime's pure parts: device mapping, thread shares,
layer ownership and bucket order, schedules, and how the measured file is assembled."""
from __future__ import annotations

import pytest

from hetplan.planner.files.plan import plan_from_dict
from hetplan.planner.hardware.topology import topology_from_dict
from hetplan.runtime.launch import thread_shares
from hetplan.runtime.results import build_measured
from hetplan.runtime.pipeline import stage_actions
from hetplan.runtime.sync import _split_by_ranks, layer_ranks
from hetplan.runtime.placement import default_threads, my_device


def test_default_threads():
    devs = ("cpu:0", "cpu:1", "cuda:0")
    assert default_threads(devs, "cpu:1", cores=16) == 8
    assert default_threads(devs, "cuda:0", cores=16) == 1
    assert default_threads(("cuda:0", "cuda:1"), "cuda:1", cores=16) == 8
    assert default_threads(("node0/cpu:0", "node1/cpu:0", "node1/cpu:1"), "node0/cpu:0", cores=16) == 16
    assert default_threads(("cpu:0", "cpu:1", "cpu:2"), "cpu:0", cores=2) == 1


def test_thread_shares_from_topology():
    plan = plan_from_dict({"model": {"spec": "mlp"}, "global_batch": 4, "replicas": [
        {"batch_fraction": 0.5, "stages": [{"device": "cpu:0", "layers": [0, 5]}]},
        {"batch_fraction": 0.5, "stages": [{"device": "cpu:1", "layers": [0, 5]}]}]})
    dev = {"memory_bytes": 1e9, "matmul_flops_per_s": 1e11, "memory_bytes_per_s": 1e10}
    topo = topology_from_dict({"devices": [{"name": "cpu:0", "threads": 3, **dev}, {"name": "cpu:1", **dev}]})
    shares = thread_shares(plan, topo)
    assert shares["cpu:0"] == 3                                  # from the topology
    assert shares["cpu:1"] == default_threads(plan.devices, "cpu:1")   # no threads there


def test_my_device_multi_node():
    devs = ("node1/cpu:0", "node0/cpu:0", "node1/cpu:1", "node10/cpu:0")
    env = {"GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert my_device(devs, env) == "node1/cpu:1"                 # nodes in natural order: 0, 1, 10
    assert my_device(devs, {"GROUP_RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) == "node10/cpu:0"
    with pytest.raises(ValueError, match="runs 1 processes but the plan has 2"):
        my_device(devs, {"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert my_device(("cpu:0", "cpu:1"), {"RANK": "1"}) == "cpu:1"


def test_layer_ranks_and_bucket_order_of_a_hybrid():
    # replica 0: rank 0 holds [0, 4); replica 1: rank 1 holds [0, 2), rank 2 holds [2, 4)
    ranks = layer_ranks([[(0, 4)], [(0, 2), (2, 4)]], [[0], [1, 2]], 4)
    assert ranks == [(0, 1), (0, 1), (0, 2), (0, 2)]
    # a bucket spanning both rank sets is split; order: last layer first
    assert _split_by_ranks([(3, 2, 1), (0,)], ranks) == [(3, 2), (1,), (0,)]


@pytest.mark.parametrize("schedule,stage,expect", [
    ("gpipe", 0, [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]),
    ("1f1b", 0, [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]),
    ("1f1b", 1, [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]),
    # ZB-H1: stage s runs the W of microbatch i after the I of i + s
    ("zb-h1", 0, [("F", 0), ("F", 1), ("I", 0), ("W", 0), ("F", 2), ("I", 1), ("W", 1), ("I", 2), ("W", 2)]),
    ("zb-h1", 1, [("F", 0), ("I", 0), ("F", 1), ("I", 1), ("W", 0), ("F", 2), ("I", 2), ("W", 1), ("W", 2)]),
    # Hippie: GPipe's order on every stage but the last, which alternates
    ("hippie", 0, [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]),
    ("hippie", 1, [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]),
])
def test_stage_actions(schedule, stage, expect):
    assert stage_actions(schedule, stage, 2, 3) == expect


def test_build_measured():
    recs = [{"rank": 0, "device": "cpu:0", "iter_s": [0.5, 0.2, 0.3, 0.1], "busy_s": [0.4, 0.1, 0.2, 0.05],
             "loss": [0.25, 0.5, 0.75, 1.0], "peak_memory_bytes": 10, "param_bytes": 4,
             "optimizer_state_bytes": 8},
            {"rank": 1, "device": "cpu:1", "iter_s": [0.4, 0.3, 0.1, 0.2], "busy_s": [0.3, 0.2, 0.1, 0.1],
             "loss": [0.5, 0.5, 0.5, 0.5], "peak_memory_bytes": 20, "param_bytes": 4,
             "optimizer_state_bytes": 8}]
    m = build_measured("abc", recs, warmup=1, extra={"iters": 4})
    assert m["iterations_s"] == pytest.approx([0.5, 0.25, 0.2, 0.15])   # max at 0, then mean
    assert m["iteration_s"] == pytest.approx(0.2)                # median of [0.25, 0.2, 0.15]
    assert m["losses"] == [0.75, 1.0, 1.25, 1.5]                 # weighted losses summed
    assert m["per_device"]["cpu:0"]["busy_s"] == 0.1             # median of [0.1, 0.2, 0.05]
    assert m["per_device"]["cpu:1"]["peak_memory_bytes"] == 20
    assert m["iters"] == 4 and m["plan_sha256"] == "abc"


def test_adam_is_the_fused_kernel_and_steps_as_the_default_one():
    import torch
    from hetplan.planner.workload.optimizer import make_optimizer
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    b.load_state_dict(a.state_dict())
    fused, plain = make_optimizer(a.parameters(), "adam", 1e-2), torch.optim.Adam(b.parameters(), lr=1e-2)
    assert fused.defaults["fused"] is True
    x = torch.randn(8, 16)
    for _ in range(5):
        for m, o in ((a, fused), (b, plain)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-6)


_LOOP_PROBE = """
import json, os, sys, torch.distributed as dist
from hetplan.runtime.gloo_threads import LOOP_THREAD, lower_gloo_loop_priority
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.new_group([0])                                  # the pipelines' own groups share the loop
def nice():
    out = {"loop": [], "other": []}
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        out["loop" if name == LOOP_THREAD else "other"].append(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return out
before = nice()
tids = lower_gloo_loop_priority()
print(json.dumps({"lowered": len(tids), "before": before, "after": nice()}))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_gloo_loop_thread_is_lowered_and_nothing_else(tmp_path):
    # gloo's TCP event loop spins while a worker's thread holds a pair (hetplan.runtime.gloo_threads);
    # at nice 19 it stops taking that thread's core. The worker's own threads keep their priority.
    import json
    import subprocess
    import sys
    out = json.loads(subprocess.run([sys.executable, "-c", _LOOP_PROBE, str(tmp_path / "store")], check=True,
                                    capture_output=True, text=True, timeout=120).stdout)
    assert out["lowered"] >= 1, "gloo started no thread named gloo_tcp_loop: did its name change?"
    assert out["lowered"] == len(out["after"]["loop"])
    assert set(out["before"]["loop"]) == {0} and set(out["after"]["loop"]) == {19}
    assert set(out["after"]["other"]) == {0}


class _Link:
    """A PeerLink's posting side: headers known, posted receives counted."""

    def __init__(self, keys):
        self.headers, self.posted = {k: [] for k in keys}, []

    def post(self, key):
        self.posted.append(key)


def test_a_stage_keeps_two_receives_posted_per_link_never_more_than_it_still_receives():
    # hetplan.planner.files.schedule.POSTED_AHEAD: the simulator moves a message once its receive is posted
    import torch

    from hetplan.planner.files.schedule import POSTED_AHEAD
    from hetplan.runtime.pipeline import StageRunner
    prev, nxt = _Link(["act"]), _Link(["grad"])
    r = StageRunner(torch.nn.Linear(1, 1), torch.device("cpu"), None, prev, nxt, 1.0, None)
    r._left = {"act": 3, "grad": 1}
    r._post_ahead()
    assert POSTED_AHEAD == 2 and prev.posted == ["act", "act"] and nxt.posted == ["grad"]
    prev.posted.pop(0)
    r._left["act"] = 2                    # one taken: the next one is posted
    r._post_ahead()
    assert len(prev.posted) == 2
    prev.posted.pop(0)
    r._left["act"] = 1                    # the last one is already posted
    r._post_ahead()
    assert len(prev.posted) == 1


class _Receiving(_Link):
    """A link a last stage receives activations on: each receive takes a posted one (posting it
    first if none is), as PeerLink.recv does."""

    def recv(self, key):
        import torch
        if not self.posted:
            self.post(key)
        self.posted.pop(0)
        self.taken = getattr(self, "taken", 0) + 1
        return [torch.ones(2, 1)]

    def send(self, key, tensors):
        pass

    def flush(self, block=True):
        pass

    def drain(self):
        pass


def test_the_next_iterations_first_receives_are_posted_once_this_ones_last_are_taken():
    # gloo moves a send once the sender's loop thread, at the lowest priority, has read the
    # receiver's notice of the posted receive, which it does when its worker's core is idle: a
    # receive posted at the start of an iteration, while the sender computes (its optimizer,
    # its first forwards), held the first activation until the sender next waited (mlp-small,
    # GPipe: ~250 us after the isend). Posted in the iteration before, they are read while the
    # sender still waits in it; the last iteration leaves none posted
    import contextlib

    import torch

    from hetplan.runtime.pipeline import StageRunner
    prev = _Receiving(["act"])
    prev.headers["act"] = [(torch.float32, (2, 1), True)]
    r = StageRunner(torch.nn.Linear(1, 1), torch.device("cpu"), torch.nn.functional.mse_loss, prev, None,
                    0.5, lambda *a, **k: contextlib.nullcontext())
    r.runs_left = 2
    gpipe = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    targets = [torch.zeros(1)] * 2          # the loss takes the stage output's first tensor
    r.run(gpipe, None, targets)
    assert prev.taken == 2 and prev.posted == ["act", "act"]      # the next run's two, posted
    r.run(gpipe, None, targets)
    assert prev.taken == 4 and prev.posted == []                  # none beyond the last run


def test_an_interleaved_rank_posts_two_ahead_in_the_peers_send_order_up_to_an_unknown_header():
    import torch

    from hetplan.runtime.interleaved import InterleavedRunner
    link = _Link(["act1", "act3"])          # grad1's header not received yet
    seq = [("act", 1, 0), ("act", 3, 0), ("grad", 1, 0), ("act", 1, 1)]
    r = InterleavedRunner({0: torch.nn.Linear(1, 1)}, 4, torch.device("cpu"), None, {1: link},
                          [0, 1, 0, 1], {1: seq}, 1.0, None)
    r._pos = {1: 0}
    r._post_ahead()
    assert link.posted == ["act1", "act3"]
    link.posted.pop(0)
    r._pos[1] = 1
    r._post_ahead()                          # grad1 is next but its header is unknown: wait
    assert link.posted == ["act3"]
    link.headers["grad1"] = []
    r._post_ahead()
    assert link.posted == ["act3", "grad1"]
