"""One training step's contract, checked before a command writes or starts anything:
`make_batch(b, 0)` honours the batch size (every tensor of its inputs and target with a
dimension leads with b, as the runtime slices them), the model's forward runs on its inputs, and
`loss_fn` returns a finite floating-point scalar that depends on the parameters.

The step runs in fake tensors first (shapes and dtypes, nothing computed: a model larger than
this machine can train is checked in seconds), counting its FLOPs; a step of at most
`REAL_STEP_FLOPS` then runs again on the model's values, for the loss's value. A larger one has
its loss's value unchecked (it would take longer than planning). A step fake tensors cannot run
(an op without a fake kernel, shapes that depend on data) runs on the values only.
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch.utils import _pytree as pytree

from hetplan.planner.files.io import InputError

CHECK_BATCHES = (2, 3)    # make_batch(b) must lead with b for each (two sizes: one constant batch passes one)
REAL_STEP_FLOPS = 2e10    # a step this small runs on values too (well under a second on a CPU core)


def check_step(workload, batch: int, label: str = "--model", spec: str = "the model") -> None:
    """InputError (one line: `label: spec's make_batch / forward / loss_fn ...`) where one step of
    `workload` at min(batch, 2) samples breaks the contract; the model is left as it was (RNG,
    buffers, gradients)."""
    from hetplan.planner.workload.load import with_values
    b = min(batch, CHECK_BATCHES[0])
    for n in sorted({min(batch, c) for c in CHECK_BATCHES}):
        _check_batch_size(workload.make_batch(n, 0), n, label, spec)
    flops = None
    try:
        flops = _step(workload, b, fake=True, label=label, spec=spec)
    except InputError:
        raise
    except Exception:   # noqa: BLE001 - fake tensors could not run it: run it on values, which tells why
        pass
    if flops is None or flops <= REAL_STEP_FLOPS:
        # a model built for its shapes only is built whole
        _step(with_values(workload), b, fake=False, label=label, spec=spec)


def _check_batch_size(batch, n: int, label: str, spec: str) -> None:
    inputs, target = batch
    for what, tree in (("inputs", inputs), ("target", target)):
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != n:
                raise InputError(f"{label}: {spec}'s make_batch({n}, 0) returned {what} of shape "
                                 f"{tuple(t.shape)}; expected every tensor to lead with the batch size {n}")


def _step(workload, b: int, fake: bool, label: str = "--model", spec: str = "the model") -> float | None:
    """Forward and loss at `b` samples: the step's FLOPs (fake), else None; InputError where the
    loss is not a floating-point scalar depending on the parameters (or, on values, not finite)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from hetplan.planner.workload.capture import preserved
    from hetplan.planner.workload.inputs import call_model
    from hetplan.planner.workload.load import error_line
    model = workload.model
    inputs, target = workload.make_batch(b, 0)
    counter = FlopCounterMode(display=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with (torch.random.fork_rng(devices=[]), torch.enable_grad(), preserved(model), _quiet(fake), mode,
          counter):
        try:
            out = call_model(model, inputs)
        except Exception as e:  # noqa: BLE001 - the user's forward
            if fake:
                raise
            raise InputError(f"{label}: {spec}'s forward failed on make_batch({b}, 0)'s inputs: {error_line(e)}") from None
        try:
            loss = workload.loss_fn(out, target)
        except Exception as e:  # noqa: BLE001 - the user's loss
            if fake:
                raise
            raise InputError(f"{label}: {spec}'s loss_fn failed on the forward's output: {error_line(e)}") from None
        _check_loss(loss, model, label, spec)
        if not fake and not math.isfinite(loss.item()):
            raise InputError(f"{label}: {spec}'s loss_fn returned {loss.item()} on make_batch({b}, 0); "
                             "expected a finite scalar")
    return counter.get_total_flops() if fake else None


@contextlib.contextmanager
def _quiet(fake: bool):
    """Fake tensors log a traceback where an op fails on shapes; the run on values says it in one line."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    if fake:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _check_loss(loss, model, label: str, spec: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        got = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor)
               else type(loss).__name__)
        raise InputError(f"{label}: {spec}'s loss_fn returned {got}; expected a floating-point scalar tensor "
                         "(the mean over the batch)")
    if not loss.requires_grad and any(p.requires_grad for p in model.parameters()):
        raise InputError(f"{label}: {spec}'s loss_fn returned a scalar that does not depend on the model's "
                         "parameters (no gradient); expected the loss of the forward's output")


__all__ = ["check_step"]
