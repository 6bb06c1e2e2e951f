"""Trained parameters compared against one-device training in a way that holds on any CPU.

A plan sums the same gradients as one device in another order (replicas, microbatches, a split
pair's halves), so they differ by fp32 rounding. SGD passes that rounding on scaled by lr: the
parameters agree to ~1e-7. Adam divides it by sqrt(v_hat) + eps: where an element's gradient is
near zero (|g| ~ eps = 1e-8, or a sign the rounding flips) the same rounding moves the element by
up to ~lr a step, and by how much depends on the CPU's kernels. `AdamSlack` bounds that per element
from the reference's own moments (`GRAD_ROUNDING` of the largest gradient in the element's row,
divided as Adam divides it); elements with a gradient of their row's size stay held to about the caller's
tolerance, and `assert_params_match` refuses a comparison in which more than `MAX_LOOSE` of the
model gets a slack that could hide a broken plan's error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

GRAD_ROUNDING = 1e-6    # a reordered fp32 sum's error, relative to the largest |gradient| of its row (~10 ulps)
SLACK_FACTOR = 2.0      # Adam's update moves with both moments: d(m/sqrt(v)) <= 2 dg / sqrt(v)
LOOSE = 1e-4            # a slack above this could hide a broken plan's error (~lr = 3e-3 ... 1e-2 a step)...
MAX_LOOSE = 0.05        # ...so at most this share of a model's elements may have one


class AdamSlack:
    """Per parameter element, how far gradient rounding can carry Adam's steps (zero under SGD)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: dict[str, torch.nn.Parameter]):
        self.optimizer, self.named = optimizer, named
        self.slack = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named.items()}
        self.rounding = {n: torch.tensor(0.0) for n in named}   # the largest so far: the moments keep it

    def after_step(self) -> None:
        """Add this step's bound: lr * 2 * rounding / (sqrt(v_hat) + eps), at most 2 * lr * 2."""
        if not isinstance(self.optimizer, torch.optim.Adam):
            return
        group = self.optimizer.param_groups[0]
        lr, (_, beta2), eps = group["lr"], group["betas"], group["eps"]
        for n, p in self.named.items():
            state = self.optimizer.state.get(p)
            if p.grad is None or not state:
                continue
            row = p.grad.abs().reshape(p.shape[0], -1).amax(1) if p.dim() > 1 else p.grad.abs().max()
            self.rounding[n] = torch.maximum(self.rounding[n], GRAD_ROUNDING * row.view(-1, *[1] * (p.dim() - 1)))
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            step = lr * SLACK_FACTOR * self.rounding[n] / (v_hat.sqrt() + eps)
            step[v_hat == 0] = 0.0          # never a gradient (an unused row, a dead unit): none in any order
            self.slack[n] += step.clamp(max=2 * lr * SLACK_FACTOR)   # two updates of |m/sqrt(v)| <= ~2 apart


@dataclass
class Trained:
    """One device's training: the loss of each step, the final parameters, and Adam's slack."""
    losses: list[float]
    params: dict[str, torch.Tensor]
    slack: dict[str, torch.Tensor] = field(default_factory=dict)


def assert_params_match(params: dict[str, torch.Tensor], ref: Trained, rtol: float, atol: float) -> None:
    """Every element within atol + rtol * |ref| + its Adam slack; the slack loose on few elements."""
    assert set(params) == set(ref.params)
    loose = total = 0
    for name, want in ref.params.items():
        got = params[name]
        assert got.shape == want.shape, name
        slack = ref.slack.get(name, torch.zeros_like(want))
        excess = (got - want).abs() - (atol + rtol * want.abs() + slack)
        if (excess > 0).any():
            i = int(excess.argmax())
            raise AssertionError(
                f"{name}: {int((excess > 0).sum())} of {want.numel()} elements differ from one device's "
                f"training; worst at flat index {i}: {float(got.flatten()[i]):.6g} against "
                f"{float(want.flatten()[i]):.6g} (Adam slack {float(slack.flatten()[i]):.2e})")
        loose += int((slack > LOOSE).sum())
        total += want.numel()
    assert loose <= MAX_LOOSE * total, (
        f"Adam's slack exceeds {LOOSE:g} on {loose} of {total} elements: too few held to compare")
