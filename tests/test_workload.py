"""Workload loading: built-ins, user factories by spec, argument conversion, bad specs."""
from __future__ import annotations

import pytest
import torch

from hetplan.planner.files.io import InputError
from hetplan.planner.workload import Workload
from hetplan.planner.workload.load import convert_arg, load_workload, parse_model_args


def test_convert_and_parse_args():
    assert [convert_arg(v) for v in ("12", "0.5", "true", "False", "gelu")] == [12, 0.5, True, False, "gelu"]
    assert parse_model_args(["layers=2", " d_model = 64 "]) == {"layers": 2, "d_model": 64}
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_model_args(["layers"])


@pytest.mark.parametrize("spec,args,in_shape,out_shape", [
    ("mlp", {"hidden": 16, "depth": 2}, (3, 1, 28, 28), (3, 10)),
    ("cnn", {}, (3, 1, 28, 28), (3, 10)),
    ("gpt", {"layers": 1, "heads": 2, "d_model": 16, "vocab": 32, "context": 8}, (3, 8), (3, 8, 32)),
])
def test_builtins_run_and_are_deterministic(spec, args, in_shape, out_shape):
    w = load_workload(spec, args)
    x, y = w.make_batch(3, 7)
    assert tuple(x.shape) == in_shape
    out = w.model(x)
    assert tuple(out.shape) == out_shape and w.loss_fn(out, y).dim() == 0
    assert torch.equal(w.make_batch(3, 7)[0], x)                     # same seed, same batch
    w2 = load_workload(spec, args)                                   # torch.manual_seed(0) first
    assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), w2.model.parameters()))


def test_user_factory_by_spec():
    w = load_workload("tests.factories:tiny", {"width": "4"})       # strings are converted
    assert isinstance(w, Workload) and w.model.layers[0].weight.shape == (4, 4)


@pytest.mark.parametrize("spec,args,needle", [
    ("nosuch", {}, "unknown model"),
    ("tests.nosuch:f", {}, "cannot import"),
    ("tests.factories:missing", {}, "no function"),
    ("tests.factories:not_a_workload", {}, "without 'model'"),
    ("mlp", {"width": 3}, "no argument 'width'"),
    ("mlp", {"depth": 0}, "depth"),
    ("gpt", {"heads": 3}, "divisor"),
])
def test_bad_specs_and_args(spec, args, needle):
    with pytest.raises(InputError, match=needle):
        load_workload(spec, args)
