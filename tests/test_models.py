"""A model matrix: tiny Hugging Face models (random init, nothing downloaded) in user-style
wrappers (tests/hf_models.py), captured into layers, trained by a two-stage pipeline and by
two-replica data parallelism, and planned on two CPU workers.

Equivalence is against one process training the same plan's slices (`reference`): each
replica's microbatch is its own forward (BatchNorm normalizes over it, as in DDP), every
replica starts the iteration from the first replica's buffers (DDP's buffer broadcast), and the
gradients are weighted like the runtime's. For models without batch statistics this is plain
single-device training on the global batch.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hetplan.planner.workload.capture import capture_graph  # noqa: E402
from hetplan.planner.workload.inputs import call_model, slice_inputs  # noqa: E402
from hetplan.planner.workload.load import load_workload  # noqa: E402
from tests.equivalence import AdamSlack, Trained, assert_params_match  # noqa: E402
from tests.test_cli_inputs import one_error_line  # noqa: E402
from tests.test_runtime import plan, run_plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ITERS = 4
HEAD = {"gpt2": ["hf.transformer.ln_f", "hf.lm_head"], "llama": ["hf.model.norm", "hf.lm_head"],
        "bert": ["hf.bert.pooler", "hf.dropout", "hf.classifier"],
        "resnet": ["hf.resnet.pooler", "hf.classifier.0", "hf.classifier.1"],
        "vit": ["hf.vit.layernorm", "hf.classifier"]}
# embedding(s), one layer per block, head pieces (the automatic rule of hetplan.planner.workload.layers)
LAYERS = {
    "gpt2": ["hf.transformer.wte", "hf.transformer.wpe", "hf.transformer.drop",
             "hf.transformer.h.0", "hf.transformer.h.1", *HEAD["gpt2"]],
    "llama": ["hf.model.embed_tokens", "hf.model.rotary_emb", "hf.model.layers.0", "hf.model.layers.1",
              *HEAD["llama"]],
    "bert": ["hf.bert.embeddings", "hf.bert.encoder.layer.0", "hf.bert.encoder.layer.1", *HEAD["bert"]],
    "resnet": ["hf.resnet.embedder", "hf.resnet.encoder.stages.0", "hf.resnet.encoder.stages.1",
               *HEAD["resnet"]],
    "vit": ["hf.vit.embeddings", "hf.vit.layers.0", "hf.vit.layers.1", *HEAD["vit"]],
}
MODELS = sorted(LAYERS)


def model_ref(name: str) -> dict:
    return {"spec": f"tests.hf_models:{name}", "args": {}}


def reference(p: dict, iters: int = ITERS) -> Trained:
    """One process training the plan's slices (see the module docstring)."""
    m = p["model"]
    w = load_workload(m["spec"], m["args"], m.get("layers"))
    opt = p["optimizer"]
    o = (torch.optim.Adam if opt["name"] == "adam" else torch.optim.SGD)(w.model.parameters(), lr=opt["lr"])
    slack = AdamSlack(o, dict(w.model.named_parameters()))
    G, losses = p["global_batch"], []
    for i in range(iters):
        x, y = w.make_batch(G, i)
        o.zero_grad()
        losses.append(_one_iteration(w, p["replicas"], x, y, G))
        o.step()
        slack.after_step()
    return Trained(losses, {n: t.detach().clone() for n, t in w.model.named_parameters()}, slack.slack)


def _one_iteration(w, replicas, x, y, G) -> float:
    start = {n: b.clone() for n, b in w.model.named_buffers()}
    total, offset, first = 0.0, 0, None
    for r, rep in enumerate(replicas):
        _load_buffers(w.model, start)
        b, m = round(rep["batch_fraction"] * G), rep["microbatches"]
        for k in range(m):
            a, e = offset + k * b // m, offset + (k + 1) * b // m
            loss = w.loss_fn(call_model(w.model, slice_inputs(x, a, e)), slice_inputs(y, a, e)) * (b / G / m)
            loss.backward()
            total += loss.item()
        offset += b
        first = first or {n: t.clone() for n, t in w.model.named_buffers()}
    _load_buffers(w.model, first)
    return total


def _load_buffers(model, values: dict) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(values[n])


def check(tmp_path, p: dict, rtol: float = 1e-5):
    result, params = run_plan(tmp_path, p, iters=ITERS)
    ref = reference(p)
    assert result["losses"] == pytest.approx(ref.losses, rel=1e-4)
    assert_params_match(params, ref, rtol=rtol, atol=rtol)
    worst = max(float((params[n] - t).abs().max()) for n, t in ref.params.items())
    rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref.losses))
    print(f"losses rel {rel:.2e}, parameters max abs {worst:.2e}")
    return result


@pytest.mark.parametrize("name", MODELS)
def test_capture_one_layer_per_block(name):
    g = capture_graph(load_workload(f"tests.hf_models:{name}"), 4)
    assert [l.name for l in g.layers] == LAYERS[name]
    blocks = [l for l in g.layers if l.name[-1].isdigit() and "classifier" not in l.name]
    assert len(blocks) == 2 and all(b.param_bytes > 0 and b.fwd_flops > 0 for b in blocks)
    if name != "resnet":          # the transformer blocks are alike (ResNet's 2nd stage downsamples)
        assert blocks[0].fwd_flops == blocks[1].fwd_flops and blocks[0].signature == blocks[1].signature


@pytest.mark.parametrize("name", MODELS)
def test_two_stage_pipeline_trains_like_one_device(tmp_path, name):
    L, cut = len(LAYERS[name]), LAYERS[name].index(HEAD[name][0]) - 1    # the 2nd block starts stage 1
    check(tmp_path, plan([(1.0, 2, [("cpu:0", (0, cut)), ("cpu:1", (cut, L))])], model=model_ref(name),
                         global_batch=4, opt="sgd", lr=0.1))


@pytest.mark.parametrize("name", MODELS)
def test_two_replicas_train_like_one_device(tmp_path, name):
    L = len(LAYERS[name])
    check(tmp_path, plan([(0.5, 1, [("cpu:0", (0, L))]), (0.5, 1, [("cpu:1", (0, L))])],
                         model=model_ref(name), global_batch=4, sync="fine", bucket_bytes=4096, opt="sgd", lr=0.1))


CENTERED = {"spec": "tests.runtime_models:centered", "args": {"width": 16}}   # a buffer the forward uses


@pytest.mark.parametrize("replicas,sync", [
    ([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 1, [("cpu:1", (0, 4))])], "coarse"),     # whole models
    ([(0.5, 1, [("cpu:0", (0, 4))]), (0.5, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])], "fine"),  # hybrid
], ids=["data-parallel", "hybrid"])
def test_buffers_follow_the_first_replica(tmp_path, replicas, sync):
    # without the broadcast, the second replica keeps its own running mean from iteration 1 on
    # and its losses drift from the reference's (every replica starts from the first's buffers)
    check(tmp_path, plan(replicas, model=CENTERED, global_batch=8, sync=sync, opt="sgd", lr=0.1))


# --- --layers, plans on two CPU workers, models that cannot be captured ---------------------------
def hetplan(*args):
    import os
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


BLOCKS = "hf.resnet.encoder.stages.*.layers.*"   # one layer per residual block, not per stage
RESNET2 = {"spec": "tests.hf_models:resnet", "args": {"depths": 2}, "layers": BLOCKS}


def test_layers_pattern_regroups_graph_and_pipeline(tmp_path):
    r = hetplan("graph", "--model", "tests.hf_models:resnet", "--model-arg", "depths=2", "--layers", BLOCKS,
                "--batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    names = [l["name"] for l in json.loads(r.stdout)["layers"]]
    assert names == ["hf.resnet.embedder", *[f"hf.resnet.encoder.stages.{s}.layers.{b}" for s in (0, 1) for b in (0, 1)],
                     "hf.resnet.pooler", "hf.classifier"]
    # a cut between the two blocks of the first stage, which the automatic rule keeps together;
    # the plan's model.layers reaches the runtime's stages and gradient buckets
    check(tmp_path, plan([(1.0, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 7))])], model=RESNET2,
                         global_batch=4, sync="fine", bucket_bytes=4096, opt="sgd", lr=0.1))


def test_layers_pattern_matching_nothing_is_refused(tmp_path):
    one_error_line(hetplan("graph", "--model", "tests.hf_models:gpt2", "--layers", "hf.model.layers.*",
                           "--batch", "2"), "--layers", "matches no module", "hf.transformer.h.*")
    p = plan([(1.0, 1, [("cpu:0", (0, 7))])], model={**model_ref("gpt2"), "layers": "nope.*"}, global_batch=2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p))
    one_error_line(hetplan("run", path, "--iters", "1", "--warmup", "0"), str(path), "model.layers", "nope.*")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["plan.json"]


def test_model_that_cannot_be_captured_is_named(tmp_path):
    out = tmp_path / "plan.json"
    one_error_line(hetplan("plan", "--model", "tests.factories:data_dependent", "--batch", "4",
                           "--topology", two_cpus(tmp_path), "-o", out), "'gate' (Gate)", "exportable")
    assert not out.exists()


def two_cpus(tmp_path) -> Path:
    """A what-if topology of two CPU workers."""
    devices = [{"name": f"cpu:{i}", "kind": "cpu", "threads": 1, "memory_bytes": 8e9,
                "matmul_flops_per_s": 2e10, "memory_bytes_per_s": 1e10, "op_overhead_s": 1e-5}
               for i in range(2)]
    path = tmp_path / "two-cpus.json"
    path.write_text(json.dumps({"schema": "hetplan.topology/1", "name": "two-cpus", "devices": devices,
                                "links": [{"a": "cpu:0", "b": "cpu:1", "bandwidth_bytes_per_s": 5e9,
                                           "latency_s": 2e-5}]}))
    return path


@pytest.mark.parametrize("name", MODELS)
def test_plan_on_two_cpu_workers(tmp_path, name):
    from hetplan.cli import main as cli_main
    from hetplan.planner.files.plan import load_plan
    out = tmp_path / "plan.json"
    layers = ["--layers", "hf.transformer.h.*"] if name == "gpt2" else []
    assert cli_main(["plan", "--model", f"tests.hf_models:{name}", *layers, "--batch", "8", "--topology",
                     str(two_cpus(tmp_path)), "--iterations", "200", "-o", str(out)]) == 0
    p = load_plan(out)
    assert p.num_layers == len(LAYERS[name]) and p.predicted.iteration_s > 0
    assert p.model.layers == ("hf.transformer.h.*" if name == "gpt2" else None)


def test_transformer_blocks_forward_flops_match_the_analytic_count():
    # matmul FLOPs (a multiply-add = 2) of one block at batch B, sequence T, width d:
    # GPT-2: qkv 6BTd^2 + proj 2BTd^2 + MLP 16BTd^2 + scores and weighted sum 4BT^2 d;
    # Llama: q, o 2BTd^2 each, k, v 2BTd(K hd) each (K key-value heads), scores 4BT^2 d, MLP 6BTdI
    from tests.hf_models import HIDDEN as d, SEQ as T, gpt2, llama
    B = 4
    blocks = {l.name: l for l in capture_graph(gpt2(), B).layers}
    assert blocks["hf.transformer.h.0"].fwd_flops == pytest.approx(24 * B * T * d * d + 4 * B * T * T * d, rel=0.01)
    blocks = {l.name: l for l in capture_graph(llama(), B).layers}
    heads, kv_heads, inner = 2, 1, 32
    hd = d // heads
    llama_block = 2 * B * T * d * (2 * d + 2 * kv_heads * hd) + 4 * B * T * T * d + 6 * B * T * d * inner
    assert blocks["hf.model.layers.0"].fwd_flops == pytest.approx(llama_block, rel=0.01)
