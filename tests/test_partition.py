"""Stages built by hetplan.planner.workload.partition compose to the original model: bit-identical outputs and
gradients (by parameter name), shared parameters, live values across cuts, any batch size."""
from __future__ import annotations

import pytest
import torch

from hetplan.planner.workload.layers import export_model as trace
from hetplan.planner.workload.partition import build_stages
from hetplan.planner.workload.load import load_workload

GPT_ARGS = {"layers": 2, "heads": 2, "d_model": 32, "vocab": 64, "context": 8}


def _run(stages, inputs):
    h = inputs if isinstance(inputs, tuple) else (inputs,)
    for s in stages:
        h = s(*h)
        assert isinstance(h, tuple)
    assert len(h) == 1
    return h[0]


def _reference(w, batch, seed=3):
    x, y = w.make_batch(batch, seed)
    out = w.model(x)
    w.loss_fn(out, y).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in w.model.named_parameters()}
    w.model.zero_grad(set_to_none=True)
    return x, y, out.detach(), grads


def _check_equivalent(w, ranges, batch):
    x, y, ref_out, ref_grads = _reference(w, batch)
    stages = build_stages(w, ranges)
    out = _run(stages, x)
    assert torch.equal(out, ref_out)
    w.loss_fn(out, y).backward()
    for n, p in w.model.named_parameters():
        if ref_grads[n] is None:        # unused parameter (a branch not taken)
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, ref_grads[n]), n
    return stages


@pytest.mark.parametrize("spec,args,ranges", [
    ("mlp", {"hidden": 32, "depth": 3}, [(0, 1), (1, 3), (3, 4)]),
    ("gpt", GPT_ARGS, [(0, 2), (2, 3), (3, 4)]),
    ("cnn", {}, [(0, 1), (1, 2), (2, 4)]),
    ("tests.factories:rescnn", {}, [(0, 1), (1, 2), (2, 3), (3, 4)]),
])
def test_stages_equal_single_device(spec, args, ranges):
    w = load_workload(spec, args)
    # batch 5 differs from the batch the graph is exported with (2): dynamic batch dimension
    stages = _check_equivalent(w, ranges, batch=5)
    assert all(s.batch is None for s in stages)


def test_layer_names_of_builtins():
    assert trace(load_workload("mlp", {"hidden": 8, "depth": 2})).names == ("layers.0", "layers.1", "out")
    assert trace(load_workload("gpt", GPT_ARGS)).names == ("emb", "blocks.0", "blocks.1", "head")
    # cnn: F.relu / max_pool2d / view in the root forward join the layer before them
    tr = trace(load_workload("cnn"))
    assert tr.names == ("conv1", "conv2", "fc1", "fc2")
    by_layer = {}
    for n in tr.compute_nodes():
        by_layer.setdefault(tr.layer_of[n], []).append(str(n.target))
    assert by_layer[0] == ["aten.conv2d.default", "aten.max_pool2d.default", "aten.relu.default"]
    assert "aten.view.default" in by_layer[1]


def test_parameters_shared_with_original_names():
    w = load_workload("gpt", GPT_ARGS)
    stages = build_stages(w, [(0, 1), (1, 4)])
    orig = dict(w.model.named_parameters())
    seen = []
    for s in stages:
        for name, p in s.named_parameters():
            assert p is orig[name], name
            seen.append(name)
    assert sorted(seen) == sorted(orig)
    assert [n for n, _ in stages[0].named_parameters()] == ["emb.tok.weight", "emb.pos.weight"]


def test_skip_connection_crosses_cut_and_buffers_update():
    w = load_workload("tests.factories:rescnn", {})
    stages = build_stages(w, [(0, 1), (1, 2), (2, 3), (3, 4)])
    # the stem output is live at every later cut: a's input, then the skip (s) beside a/b's output
    assert len(stages[0].output_names) == 1
    assert len(stages[1].output_names) == 2 and len(stages[2].output_names) == 1
    bn = w.model.a.bn
    assert dict(stages[1].named_buffers())["a.bn.running_mean"] is bn.running_mean
    before = bn.running_mean.clone()
    x, _ = w.make_batch(4, 0)
    _run(stages, x)
    assert not torch.equal(bn.running_mean, before)     # train-mode BatchNorm updated the original
    assert int(bn.num_batches_tracked) == 1


def test_shape_dependent_model_and_dict_output():
    w = load_workload("tests.factories:shape_dependent", {})
    assert trace(w).names == ("wide", "out")
    _check_equivalent(w, [(0, 1), (1, 2)], batch=3)
    w = load_workload("tests.factories:two_outputs", {})
    x, y = w.make_batch(4, 0)
    (out,) = build_stages(w, [(0, 1), (1, 2)])[1](*build_stages(w, [(0, 1), (1, 2)])[0](x))
    ref = w.model(x)
    assert set(out) == {"y", "h"} and torch.equal(out["y"], ref["y"]) and torch.equal(out["h"], ref["h"])


@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 1), (2, 3)], [(0, 2), (2, 2), (2, 3)], [(0, 4)]])
def test_bad_ranges_rejected(ranges):
    w = load_workload("mlp", {"hidden": 8, "depth": 2})   # 3 layers
    with pytest.raises(ValueError):
        build_stages(w, ranges)


def test_layer_map_cache_hits_the_same_workload_and_misses_another(tmp_path, monkeypatch):
    from hetplan.planner.workload import layer_cache
    from hetplan.planner.workload.load import load_workload
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    computed = []
    real = layer_cache.compute_layer_map

    def counting(workload, batch):
        computed.append(batch)
        return real(workload, batch)
    monkeypatch.setattr(layer_cache, "compute_layer_map", counting)
    args = {"hidden": 16, "depth": 2}
    first = layer_cache.layer_map(load_workload("mlp", args), "mlp", args, 4)
    again = layer_cache.layer_map(load_workload("mlp", args), "mlp", args, 4)
    assert again == first and computed == [4]                       # the second is a cache hit
    assert first.names == ("layers.0", "layers.1", "out")
    assert first.params[2] == ("out.weight", "out.bias")
    wider = {"hidden": 32, "depth": 2}                                 # other shapes: another key
    layer_cache.layer_map(load_workload("mlp", wider), "mlp", wider, 4)
    deeper = {"hidden": 16, "depth": 3}                                # other layers: another key
    assert layer_cache.layer_map(load_workload("mlp", deeper), "mlp", deeper, 4).num_layers == 4
    assert computed == [4, 4, 4]


def test_cold_layer_map_export_is_reused_for_the_stages(tmp_path, monkeypatch):
    # a pipeline worker on a cold cache exports once: the map's export cuts its stages too
    from hetplan.planner.workload import layer_cache, partition
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path))
    exports = []
    real = partition.export_model

    def counting(workload, batch=None, **kw):
        exports.append(batch)
        return real(workload, batch, **kw)
    monkeypatch.setattr(partition, "export_model", counting)
    args = {"hidden": 16, "depth": 2}
    w = load_workload("mlp", args)
    cold = layer_cache.layer_map(w, "mlp", args, 4)
    stages = build_stages(w, [(0, 2), (2, 3)], 4, cold.exported)
    assert exports == [4]
    x, _ = w.make_batch(4, 0)
    torch.testing.assert_close(stages[1](*stages[0](x))[0], w.model(x))
    assert layer_cache.layer_map(w, "mlp", args, 4).exported is None     # a hit holds no export
