"""capture_graph: exact FLOPs on hand-computable models, layers, cuts, warnings; `hetplan graph`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetplan.planner.workload.capture import capture_graph
from hetplan.planner.files.io import InputError
from hetplan.planner.workload.load import load_workload

ROOT = Path(__file__).resolve().parent.parent


def test_square_linear_layers_exact():
    n, B = 16, 4
    g = capture_graph(load_workload("tests.factories:square", {"n": n, "depth": 3}), B)
    assert [l.name for l in g.layers] == ["layers.0", "layers.1", "layers.2"]
    assert [l.fwd_flops for l in g.layers] == [2 * B * n * n] * 3
    # backward: weight grad 2·B·n² always, input grad 2·B·n² except for the first layer, whose
    # input (the model input) does not require grad
    assert [l.bwd_flops for l in g.layers] == [2 * B * n * n, 4 * B * n * n, 4 * B * n * n]
    assert [l.param_bytes for l in g.layers] == [n * n * 4] * 3
    assert [l.activation_bytes for l in g.layers] == [B * n * 4] * 3
    assert [l.saved_bytes for l in g.layers] == [B * n * 4] * 3      # each layer saves its input
    assert g.cut_bytes == (B * n * 4,) * 4
    assert [l.param_names for l in g.layers] == [(f"layers.{i}.weight",) for i in range(3)]
    assert len({l.signature for l in g.layers}) == 1                 # identical layers, one key
    assert g.info["warnings"] == []
    # at batch 2B every activation-like quantity doubles, parameters do not
    g2 = capture_graph(load_workload("tests.factories:square", {"n": n, "depth": 3}), 2 * B)
    assert g2.layers[1] == g.layers[1].scaled(2.0)                   # signature included
    assert g2.cut_bytes_at(2, B) == g.cut_bytes[2]


def test_a_layer_has_one_signature_at_every_capture_batch():
    # the layer-cost cache keys a layer by its signature and times it at each microbatch size:
    # captures of one model at different batches (a data-parallel plan's, a pipeline's) must
    # share one cost curve, while a layer of other non-batch shapes must not
    sigs = [[l.signature for l in capture_graph(load_workload("tests.factories:square", {"n": n, "depth": 2}), b).layers]
            for n, b in ((16, 4), (16, 8), (16, 1), (32, 4))]
    assert sigs[0] == sigs[1] == sigs[2]
    assert not set(sigs[0]) & set(sigs[3])
    gpt = {"layers": 1, "heads": 2, "d_model": 32, "vocab": 64, "context": 8}
    a, b = (capture_graph(load_workload("gpt", gpt), n) for n in (2, 3))   # (B, T, C) and (B*T, C) views
    assert [l.signature for l in a.layers] == [l.signature for l in b.layers]
    c = capture_graph(load_workload("gpt", {**gpt, "context": 16}), 2)
    assert not {l.signature for l in a.layers} & {l.signature for l in c.layers}


def test_gpt_against_analytic_count():
    L, H, d, V, T, B = 2, 2, 32, 64, 8, 3
    w = load_workload("gpt", {"layers": L, "heads": H, "d_model": d, "vocab": V, "context": T})
    g = capture_graph(w, B)
    assert [l.name for l in g.layers] == ["emb", "blocks.0", "blocks.1", "head"]
    linear = 2 * B * T * (3 * d * d + d * d + 4 * d * d + 4 * d * d)   # qkv, proj, fc, fc_out
    attention = 4 * B * T * T * d      # QKᵀ and PV over all heads (causal mask not discounted)
    for blk in g.layers[1:3]:
        assert blk.fwd_flops == linear + attention
        # linear backward = 2x forward; attention backward = 2.5x (recomputes QKᵀ)
        assert blk.bwd_flops == 2 * linear + 2.5 * attention
    assert g.layers[3].fwd_flops == 2 * B * T * d * V
    assert g.layers[0].fwd_flops == 0 and g.layers[0].bwd_flops == 0
    assert g.cut_bytes[1:4] == (B * T * d * 4,) * 3 and g.cut_bytes[0] == B * T * 8
    assert g.param_bytes == sum(p.numel() * 4 for p in w.model.parameters())
    # torch's own counter agrees on everything but CPU attention, which it counts as 0
    from torch.utils.flop_counter import FlopCounterMode
    x, _ = w.make_batch(B, 0)
    with FlopCounterMode(display=False) as fc:
        w.model(x)
    assert fc.get_total_flops() == sum(l.fwd_flops for l in g.layers) - L * attention


def test_residual_cnn_conv_flops_and_skip_cut():
    B, c, hw = 2, 4, 8
    w = load_workload("tests.factories:rescnn", {"c": c, "hw": hw})
    running = w.model.a.bn.running_mean.clone()
    g = capture_graph(w, B)
    assert [l.name for l in g.layers] == ["stem", "a", "b", "head"]
    conv = lambda cout, cin, k: 2 * cout * cin * k * k * hw * hw * B   # 2·Cout·Cin·k²·Hout·Wout·B
    assert [l.fwd_flops for l in g.layers] == [conv(c, 1, 3), conv(c, c, 3), conv(c, c, 3),
                                               2 * B * c * hw * hw * 10]
    assert [l.bwd_flops for l in g.layers] == [conv(c, 1, 3), 2 * conv(c, c, 3), 2 * conv(c, c, 3),
                                               2 * 2 * B * c * hw * hw * 10]
    act = B * c * hw * hw * 4
    # the stem output s is live across a|b (beside a's output): the skip connection is counted
    assert g.cut_bytes == (B * hw * hw * 4, act, 2 * act, act, B * 10 * 4)
    # each block's BatchNorm buffers (running mean and variance, c floats each; the batch
    # count, one int64): what a data parallel plan broadcasts before each iteration
    assert [l.buffer_bytes for l in g.layers] == [(), *[(("torch.float32", 2 * c * 4), ("torch.int64", 8))] * 2, ()]
    # capturing does not change the model: BatchNorm statistics and gradients are restored
    assert torch.equal(w.model.a.bn.running_mean, running)
    assert all(p.grad is None for p in w.model.parameters())


class _Recurrent(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.rnn = torch.nn.LSTM(d, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_recurrent_layer_flops_are_its_gates_matmuls():
    # nn.LSTM on CPU runs oneDNN's mkldnn_rnn_layer, which torch's counter has no formula for:
    # per time step and sample 2·(W_ih + W_hh), 4 gates each; backward twice that
    from hetplan.planner.workload import Workload
    B, T, d, h = 2, 5, 6, 4
    w = Workload(model=_Recurrent(d, h), loss_fn=torch.nn.functional.cross_entropy,
                 make_batch=lambda b, seed: (torch.randn(b, T, d), torch.zeros(b, dtype=torch.long)))
    g = capture_graph(w, B)
    assert [l.name for l in g.layers] == ["rnn", "head"]
    gates = 2 * B * T * (4 * h * d + 4 * h * h) + 2 * B * T * (4 * h * h + 4 * h * h)   # layers 1 and 2
    assert g.layers[0].fwd_flops == gates and g.layers[0].bwd_flops == 2 * gates


class _PositionNet(torch.nn.Module):
    """Layers pos, a, b: the cut before b carries a's output (a gradient) and a position table
    made from a buffer (none), which b's product uses; the cut before a: the data and the table."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.pos = _Positions()
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        p = self.pos(x)
        return self.b(self.a(x)) * p


class _Positions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x):
        return (x * 0 + self.table) * 0.5


def test_cut_tensors_and_those_carrying_gradients_match_what_a_stage_sends():
    from hetplan.planner.workload import Workload
    from hetplan.planner.workload.partition import build_stages, stage_inputs
    w = Workload(model=_PositionNet(), make_batch=lambda b, seed: (torch.randn(b, 4), torch.randn(b, 4)),
                 loss_fn=torch.nn.functional.mse_loss)
    g = capture_graph(w, 2)
    assert g.cut_tensors == (1, 2, 2, 1)
    assert g.cut_grad_tensors == (0, 0, 1, 1)
    assert (g.message_tensors(2), g.message_tensors(2, back=True)) == (2, 1)
    # the runtime's stage 0 of [0, 2) | [2, 3) outputs what PeerLink sends: 2 tensors, 1 with grad
    x, _ = w.make_batch(2, 0)
    out = build_stages(w, [(0, 2), (2, 3)], 2)[0](*stage_inputs(build_stages(w, [(0, 2), (2, 3)], 2)[0], x))
    assert (len(out), sum(o.requires_grad for o in out)) == (g.cut_tensors[2], g.cut_grad_tensors[2])


def test_shape_dependent_model_not_traceable_by_fx():
    w = load_workload("tests.factories:shape_dependent", {"n": 8})
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(w.model)
    g = capture_graph(w, 5)
    assert [l.name for l in g.layers] == ["wide", "out"]
    assert [l.fwd_flops for l in g.layers] == [2 * 5 * 64, 2 * 5 * 64]
    g = capture_graph(load_workload("tests.factories:shape_dependent", {"n": 4}), 5)
    assert [l.name for l in g.layers] == ["narrow", "out"]            # the other branch
    assert [l.fwd_flops for l in g.layers] == [2 * 5 * 4 * 2, 2 * 5 * 16]


def test_op_without_formula_warns_not_aborts(capsys):
    g = capture_graph(load_workload("tests.factories:no_formula", {"n": 8}), 4)
    assert any("cumprod" in w for w in g.info["warnings"])
    assert g.layers[0].fwd_flops == 2 * 4 * 64                         # the Linear only
    cum = [d for _, d in g.ops.nodes(data=True) if "cumprod" in d["target"]]
    assert len(cum) == 1 and cum[0]["fwd_flops"] == 0 and cum[0]["fwd_bytes_moved"] == 2 * 4 * 8 * 4


def test_op_graph_nodes_and_edges():
    g = capture_graph(load_workload("cnn"), 2)
    ops = [d for _, d in g.ops.nodes(data=True) if d["kind"] == "op"]
    for i, layer in enumerate(g.layers):
        assert sum(d["fwd_flops"] for d in ops if d["layer"] == i) == layer.fwd_flops
        assert sum(d["bwd_flops"] for d in ops if d["layer"] == i) == layer.bwd_flops
    conv1 = next(n for n, d in g.ops.nodes(data=True) if d["target"] == "aten.conv2d.default")
    assert g.ops.nodes[conv1]["shapes"] == ((2, 10, 24, 24),)
    assert list(g.ops.predecessors(conv1)) == ["x"]
    import networkx as nx
    assert nx.is_directed_acyclic_graph(g.ops)


def test_bf16_capture_halves_activations_and_keeps_weight_casts_apart():
    from hetplan.planner.cost.memory import activation_bytes
    from hetplan.planner.files.plan import ModelRef, Plan, Replica, Stage
    w = load_workload("mlp", {"hidden": 16, "depth": 3})   # every parameter belongs to a Linear
    g32, g16 = capture_graph(w, 8), capture_graph(w, 8, "bf16")
    assert g32.precision == "fp32" and g16.precision == "bf16"
    assert [l.fwd_flops for l in g16.layers] == [l.fwd_flops for l in g32.layers]
    assert [l.param_bytes for l in g16.layers] == [l.param_bytes for l in g32.layers]   # fp32 masters
    # autocast casts every Linear's input, output, weight and bias to bf16: half the bytes
    assert [2 * l.saved_bytes for l in g16.layers] == [l.saved_bytes for l in g32.layers]
    assert [2 * c for c in g16.cut_bytes[1:]] == list(g32.cut_bytes[1:])   # the input stays fp32
    assert [l.cast_param_bytes for l in g32.layers] == [0] * 4
    assert [2 * l.cast_param_bytes for l in g16.layers] == [l.param_bytes for l in g16.layers]
    # memory model, one device, GPipe, 2 microbatches of 32 (4x the capture batch) in flight:
    # fp32: 2 * saved * 4; bf16: 2 * (saved / 2 * 4 + param_bytes / 2) (the bf16 weight copies)
    plan = Plan(ModelRef("mlp"), 64, (Replica(1.0, 2, (Stage("cpu:0", (0, 4)),)),), schedule="gpipe")
    saved = sum(l.saved_bytes for l in g32.layers)
    params = sum(l.param_bytes for l in g32.layers)
    assert activation_bytes(plan, g32, 0, 0) == 2 * saved * 4 == 212992
    assert activation_bytes(plan, g16, 0, 0) == 2 * (saved // 2 * 4 + params // 2) == 159592
    # a ReLU's output is the next Linear's saved input, one tensor (8 x 16 x 4 B): charged to the
    # ReLU's layer; a stage that starts with that Linear receives it and holds it too
    assert [l.saved_from for l in g32.layers] == [(), ((0, 512),), ((1, 512),), ((2, 512),)]
    assert g32.saved_bytes_at(1, 4, 8) == sum(l.saved_bytes for l in g32.layers[1:]) + 512


def _counted_in_real_tensors(monkeypatch, workload, batch, precision="fp32"):
    from hetplan.planner.workload import capture
    with monkeypatch.context() as m:
        m.setattr(capture, "FAKE_COUNTING", False)
        return capture_graph(workload, batch, precision)


@pytest.mark.parametrize("spec,args,precision", [
    ("mlp", {"hidden": 16, "depth": 3}, "bf16"),   # autocast's weight copies made and freed as it goes
    ("cnn", {}, "fp32"),
    ("gpt", {"layers": 2}, "fp32"),
    ("gpt", {"layers": 2}, "bf16"),
    ("tests.factories:shape_dependent", {"n": 8}, "fp32"),
])
def test_the_counting_run_in_fake_tensors_counts_what_the_real_one_does(monkeypatch, spec, args, precision):
    w = load_workload(spec, args)
    fake = capture_graph(w, 4, precision)
    real = _counted_in_real_tensors(monkeypatch, w, 4, precision)
    assert (fake.info["counted"], real.info["counted"]) == ("fake tensors", "real tensors")
    assert fake.layers == real.layers and fake.cut_bytes == real.cut_bytes
    assert (fake.cut_tensors, fake.cut_grad_tensors, fake.pairs, fake.tied) == \
        (real.cut_tensors, real.cut_grad_tensors, real.pairs, real.tied)
    assert dict(fake.ops.nodes(data=True)) == dict(real.ops.nodes(data=True))
    assert sorted(fake.ops.edges) == sorted(real.ops.edges)
    assert all(p.grad is None for p in w.model.parameters())   # no fake gradient left behind


def test_a_model_the_fake_run_cannot_count_is_counted_in_real_tensors(monkeypatch):
    from hetplan.planner.workload import capture
    w = load_workload("mlp", {"hidden": 16, "depth": 2})

    def no_fake(self, mode, params):
        raise RuntimeError("no fake kernel")
    monkeypatch.setattr(capture.Recorder, "fake", no_fake)
    g = capture_graph(w, 4)
    assert g.info["counted"] == "real tensors (RuntimeError in fake tensors)"
    monkeypatch.undo()
    assert g.layers == capture_graph(w, 4).layers


def _same_graph(a, b):
    assert a.layers == b.layers and a.cut_bytes == b.cut_bytes
    assert (a.cut_tensors, a.cut_grad_tensors, a.pairs, a.tied) == (b.cut_tensors, b.cut_grad_tensors, b.pairs, b.tied)
    assert dict(a.ops.nodes(data=True)) == dict(b.ops.nodes(data=True)) and sorted(a.ops.edges) == sorted(b.ops.edges)


@pytest.mark.parametrize("spec,args", [("gpt", {"layers": 2}), ("cnn", {}),
                                       ("tests.hf_models:gpt2", {}),      # tied embedding and head
                                       ("tests.factories:shape_dependent", {"n": 8})])
def test_a_model_built_for_its_shapes_only_is_captured_as_the_whole_one(spec, args):
    from hetplan.planner.workload.load import with_values
    shapes = load_workload(spec, args, weights=False)
    whole = load_workload(spec, args)
    assert all(t.device.type == "cpu" for t in [*shapes.model.parameters(), *shapes.model.buffers()])
    assert [n for n, _ in shapes.model.named_parameters()] == [n for n, _ in whole.model.named_parameters()]
    assert with_values(whole) is whole and with_values(shapes) is not shapes
    assert torch.equal(next(with_values(shapes).model.parameters()), next(whole.model.parameters()))
    for precision in ("fp32", "bf16"):
        _same_graph(capture_graph(shapes, 4, precision), capture_graph(whole, 4, precision))


def test_a_factory_that_needs_values_is_built_whole():
    from hetplan.planner.workload.load import with_values
    # its gate reads a tensor's value while being built; its data made in the factory
    for spec in ("tests.factories:built_from_values", "tests.factories:data_made_in_the_factory"):
        w = load_workload(spec, weights=False)
        assert with_values(w) is w and not any(t.is_meta for t in w.model.parameters())
        assert capture_graph(w, 4).layers == capture_graph(load_workload(spec), 4).layers


def test_a_shapes_only_model_the_fake_run_cannot_count_is_counted_built_whole(monkeypatch):
    from hetplan.planner.workload import capture
    shapes = load_workload("mlp", {"hidden": 16, "depth": 2}, weights=False)
    whole = capture_graph(load_workload("mlp", {"hidden": 16, "depth": 2}), 4)
    seen = []
    real = capture._counting_run

    def spy(ex, stages, model, inputs, precision, fake):
        seen.append((fake, model is shapes.model))
        if fake:
            raise RuntimeError("no fake kernel")
        return real(ex, stages, model, inputs, precision, fake=fake)
    monkeypatch.setattr(capture, "_counting_run", spy)
    g = capture_graph(shapes, 4)
    assert seen == [(True, True), (False, False)]   # the real run on the model built whole
    assert g.info["counted"] == "real tensors (RuntimeError in fake tensors)" and g.layers == whole.layers


def test_bad_batch():
    with pytest.raises(InputError):
        capture_graph(load_workload("mlp", {"hidden": 8, "depth": 1}), 0)


def _hetplan(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_cli_graph_json_user_factory():
    r = _hetplan("graph", "--model", "tests.factories:tiny", "--model-arg", "width=8",
                 "--batch", "4", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [(l["index"], l["name"]) for l in data["layers"]] == [(0, "layers.0"), (1, "layers.1")]
    assert [l["fwd_flops"] for l in data["layers"]] == [512, 512]
    assert [l["activation_bytes"] for l in data["layers"]] == [128, 128]
    assert data["total"] == {**data["total"], "fwd_flops": 1024, "bwd_flops": 512 + 1024,
                             "param_bytes": 2 * 64 * 4}


@pytest.mark.parametrize("args,needle", [
    (["--model", "nosuch", "--batch", "2"], "unknown model"),
    (["--model", "nosuch.module:f", "--batch", "2"], "cannot import"),
    (["--model", "mlp", "--batch", "0"], "--batch"),
    (["--model", "mlp", "--model-arg", "depth=0", "--batch", "2"], "depth"),
])
def test_cli_bad_input_one_line_exit_2(args, needle):
    r = _hetplan("graph", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr and "Traceback" not in r.stderr
