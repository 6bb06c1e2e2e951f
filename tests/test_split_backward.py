"""The split backward of zero-bubble schedules (hetplan.planner.workload.split_backward) and zb-h1 runs.

Unit tier: the I pass gives exactly the fused backward's input gradients and the W pass its
weight gradients, with post-accumulate-grad hooks fired once per weight. Run tier: zb-h1 plans
train like one device (losses within rel 1e-4 over 4 iterations, gloo on CPU), and each stage
holds the saved activations of as many microbatches as the memory model counts.
"""
from __future__ import annotations

import copy

import pytest
import torch

from hetplan.planner.cost.memory import in_flight
from hetplan.planner.workload.load import load_workload
from hetplan.planner.workload.partition import build_stages
from hetplan.planner.workload.split_backward import input_pass
from equivalence import assert_params_match
from test_runtime import GPT, SKIP, plan, reference, run_plan

ITERS = 4


class _Block(torch.nn.Module):
    """Weights on and off the input path: a position term added to the input, a LayerNorm, two
    Linears, a residual; and a second input passed through (a skip connection across the cut)."""

    def __init__(self):
        super().__init__()
        self.ln, self.a, self.b = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.pos = torch.nn.Parameter(torch.randn(8))

    def forward(self, x, h):
        return self.b(torch.relu(self.a(self.ln(x + self.pos)))) * h.sum() + x, h


def _split_and_fused(module, inputs, out_grads, loss=False, twin=None):
    """(split: input grads, weight grads, hook counts), (fused: input grads, weight grads); the
    fused backward runs on `twin`, an identical module (default: a deep copy)."""
    twin = twin if twin is not None else copy.deepcopy(module)
    fired: dict[int, int] = {}
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.__setitem__(id(p), fired.get(id(p), 0) + 1))
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = list(module(*xs))
    outs = [outs[0].square().mean()] if loss else outs
    got, wp = input_pass(outs, None if loss else out_grads, xs, list(module.parameters()))
    assert all(p.grad is None for p in module.parameters())   # the I pass leaves the weights alone
    wp.run()
    ys = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref = list(twin(*ys))
    torch.autograd.backward([ref[0].square().mean()] if loss else ref, None if loss else out_grads)
    return ((got, [p.grad for p in module.parameters()], fired),
            ([y.grad for y in ys], [p.grad for p in twin.parameters()]))


@pytest.mark.parametrize("loss", [False, True])
def test_input_and_weight_passes_give_the_fused_gradients(loss):
    torch.manual_seed(0)
    m = _Block()
    x, h = torch.randn(4, 8), torch.randn(4, 8)
    (gi, gw, fired), (ri, rw) = _split_and_fused(m, [x, h], [torch.randn(4, 8), torch.randn(4, 8)], loss)
    for a, b in zip(gi + gw, ri + rw):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert sorted(fired.values()) == [1] * len(list(m.parameters()))


def test_split_backward_of_a_gpt_stage_matches_the_fused_one():
    # a transformer block cut out of the built-in gpt (attention, tied embedding elsewhere)
    stages = []
    for _ in range(2):
        torch.manual_seed(0)
        w = load_workload(GPT["spec"], GPT["args"])
        stages.append(build_stages(w, [(0, 1), (1, 3), (3, 4)], 2))
    first, mid, _ = stages[0]
    x, _ = w.make_batch(2, 0)
    hidden = [t.detach() for t in first(*first.flat_inputs(x))]
    grads = [torch.randn_like(t) for t in mid(*hidden)]
    (gi, gw, fired), (ri, rw) = _split_and_fused(mid, hidden, grads, twin=stages[1][1])
    for a, b in zip(gi + gw, ri + rw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(fired) == len([p for p in mid.parameters() if p.grad is not None])


def test_the_two_passes_add_up_to_the_fused_backward_flops_about_half_each():
    # nothing runs twice (one backward call per weight group, not one from every intermediate,
    # which would run the input-gradient path again), and W is about half of the backward, the
    # rule of hetplan.planner.cost.model.weight_grad_share
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    w = load_workload(GPT["spec"], {**GPT["args"], "d_model": 32})
    first, last = build_stages(w, [(0, 2), (2, 4)], 4)
    x, y = w.make_batch(4, 0)

    def loss_of_last():
        hidden = [t.detach().requires_grad_(t.is_floating_point()) for t in first(*first.flat_inputs(x))]
        return hidden, w.loss_fn(last(*hidden)[0], y)
    _, loss = loss_of_last()
    with FlopCounterMode(display=False) as fused:
        loss.backward()
    hidden, loss = loss_of_last()
    with FlopCounterMode(display=False) as i_pass:
        _, wp = input_pass([loss], None, [h for h in hidden if h.requires_grad], list(last.parameters()))
    with FlopCounterMode(display=False) as w_pass:
        wp.run()
    total = fused.get_total_flops()
    assert i_pass.get_total_flops() + w_pass.get_total_flops() == total > 0
    assert 0.4 * total <= w_pass.get_total_flops() <= 0.6 * total


def test_inputs_without_gradient_leave_the_whole_backward_to_the_weight_pass():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    out = m(torch.randn(2, 8))
    got, wp = input_pass([out], [torch.ones(2, 4)], [], list(m.parameters()))
    assert got == [] and wp.fused is not None and m.weight.grad is None
    wp.run()
    torch.testing.assert_close(m.bias.grad, torch.full((4,), 2.0))


def test_a_weight_off_the_input_path_leaves_a_whole_backward_to_the_weight_pass():
    # `scale` reaches the second output without meeting the input's path: no intermediate to
    # resume from, so W runs a whole backward restricted to the weights (the input path twice)
    torch.manual_seed(0)
    lin, scale = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    outs = [lin(x), scale * 3.0]
    grads = [torch.ones(3, 4), torch.ones(4)]
    got, wp = input_pass(outs, grads, [x], [*lin.parameters(), scale])
    assert wp.fused is not None and scale.grad is None
    torch.testing.assert_close(got[0], torch.ones(3, 4) @ lin.weight)
    wp.run()
    torch.testing.assert_close(scale.grad, torch.full((4,), 3.0))
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 4).T @ x.detach())


def test_weight_groups_run_last_layer_first():
    # post-accumulate-grad hooks fire in a fused backward's order: hetplan.runtime.sync's buckets become
    # final from the last layer down, as the simulator's backward chunks assume
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    order = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    x = torch.randn(2, 4, requires_grad=True)
    _, wp = input_pass([net(x)], [torch.ones(2, 4)], [x], list(net.parameters()))
    wp.run()
    assert [n.split(".")[0] for n in order] == ["2", "2", "0", "0"]


def _check(tmp_path, p):
    result, params = run_plan(tmp_path, p, iters=ITERS)
    ref = reference(p["model"], p["global_batch"], ITERS, p["optimizer"]["name"], p["optimizer"]["lr"])
    assert result["losses"] == pytest.approx(ref.losses, rel=1e-4)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)
    return result


def test_zb_h1_two_workers_train_like_one_device(tmp_path):
    _check(tmp_path, plan([(1.0, 4, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])], schedule="zb-h1"))


def test_zb_h1_skip_connection_and_fine_sync_hybrid(tmp_path):
    # the cut carries two tensors; replica 1's W passes finish the buckets its all-reduces wait for
    _check(tmp_path, plan([(1 / 3, 2, [("cpu:0", (0, 4))]),
                           (2 / 3, 2, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])],
                          model=SKIP, schedule="zb-h1", sync="fine", bucket_bytes=1024))


def test_zb_h1_gpt_three_stages(tmp_path):
    _check(tmp_path, plan([(1.0, 3, [("cpu:0", (0, 1)), ("cpu:1", (1, 3)), ("cpu:2", (3, 4))])],
                          model=GPT, schedule="zb-h1"))


def test_zb_h1_stages_hold_the_microbatches_the_memory_model_counts(tmp_path):
    # 2 stages, 4 microbatches of 3 samples: ZB-H1 holds min(p, m) = 2 on both stages, 1F1B 2 and 1
    stages = [("cpu:0", (0, 2)), ("cpu:1", (2, 4))]
    peak = {}
    for schedule in ("1f1b", "zb-h1"):
        r, _ = run_plan(tmp_path, plan([(1.0, 4, stages)], schedule=schedule), iters=2)
        peak[schedule] = [r["per_device"][d]["saved_activation_peak_bytes"] for d in ("cpu:0", "cpu:1")]
    one_mb = [peak["1f1b"][0] / in_flight("1f1b", 2, 0, 4), peak["1f1b"][1] / in_flight("1f1b", 2, 1, 4)]
    assert peak["zb-h1"] == [one_mb[s] * in_flight("zb-h1", 2, s, 4) for s in range(2)]
    assert peak["zb-h1"][1] == 2 * peak["1f1b"][1]


def test_zb_h1_bf16_trains_like_bf16_on_one_device(tmp_path):
    # autocast's bf16 weight copies sit between each weight and its matmul: the W pass goes
    # through them into the fp32 master weights (tolerances of test_runtime's bf16 test)
    p = plan([(1.0, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])], schedule="zb-h1", precision="bf16")
    result, params = run_plan(tmp_path, p, iters=ITERS)
    bf16 = reference(p["model"], 12, ITERS, precision="bf16")
    bf16_losses, bf16_params, fp32_losses = bf16.losses, bf16.params, reference(p["model"], 12, ITERS).losses
    assert result["losses"] == pytest.approx(bf16_losses, rel=2e-2)
    for name, ref in bf16_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-2, atol=2e-2, msg=name)

    def worst(ref):
        return max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref))
    assert worst(bf16_losses) * 10 < worst(fp32_losses)
