"""Sharded data parallel (plan field `shard`, ZeRO stages): stage 1 trains like one device on two
CPU workers, equal and unequal shares, and beside a pipeline; each rank keeps about 1/N of the
optimizer state; the memory model's figures per stage, hand-computed; what does not run yet is
one line and exit 2."""
from __future__ import annotations

import json

import pytest

from equivalence import assert_params_match
from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import plan_from_dict
from test_cli_inputs import one_error_line
from test_train import _hetplan, plan, reference, train

EQUAL = [(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])]
UNEQUAL = [(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 4))])]
PIPELINES = [(0.5, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))]), (0.5, 2, [("cpu:2", (0, 2)), ("cpu:3", (2, 4))])]


def sharded(replicas, stage: int = 1) -> dict:
    return {**plan(replicas), "shard": {"stage": stage}}


@pytest.mark.parametrize("replicas", [EQUAL, UNEQUAL, PIPELINES], ids=["equal", "unequal", "pipelines"])
def test_zero1_trains_like_one_device(tmp_path, replicas):
    rows, params = train(tmp_path, sharded(replicas), steps=6)
    ref = reference(6, {"name": "adam", "lr": 0.01})
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


def test_shard_is_validated_with_one_line(tmp_path):
    def refused(p: dict, *needles: str) -> None:
        with pytest.raises(InputError) as e:
            plan_from_dict(p, "p.json")
        assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    refused({**plan(EQUAL), "shard": {"stage": 4}}, "p.json: shard.stage", "expected one of 0, 1, 2, 3")
    refused({**plan(EQUAL), "shard": {"level": 1}}, "p.json: shard.level", "unknown field")
    refused({**plan(EQUAL), "shard": 1}, "p.json: shard", "expected an object")
    refused(sharded([(1.0, 1, [("cpu:0", (0, 4))])]), "shard.stage", "two or more replicas")
    refused(sharded([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])]),
            "replicas[1].stages", "expected the layers of replicas[0]'s stages")
    refused({**sharded(EQUAL), "optimizer": {"name": "adam", "lr": 0.01, "placement": "cpu"}},
            "optimizer.placement", "expected \"device\"")
    assert plan_from_dict(sharded(EQUAL, 3), "p.json").shard == 3


def test_what_does_not_run_yet_is_one_line_exit_2(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(sharded(EQUAL, 3)))
    one_error_line(_hetplan("run", path, "--steps", 2), "shard.stage", "not run in this version")
    path.write_text(json.dumps(sharded(EQUAL, 1)))
    one_error_line(_hetplan("run", path, "--steps", 2, "--checkpoint-dir", tmp_path / "ck"),
                   "shard.stage", "checkpoints of sharded optimizer state")
    assert not (tmp_path / "ck").exists()
