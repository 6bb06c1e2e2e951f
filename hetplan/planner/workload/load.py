"""Workloads: `--model SPEC` and `--model-arg KEY=VALUE`.

SPEC is a built-in name (see hetplan.planner.workload.builtin) or `package.module:function`. The function takes
the model args as keyword arguments and returns any object with `model`, `make_batch` and
`loss_fn` (the `Workload` dataclass of `hetplan.planner.workload` is the documented way).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import weakref
from typing import Any, Callable

from hetplan.planner.files.io import InputError
from hetplan.planner.workload import Workload


def convert_arg(value: str) -> Any:
    """'12' -> 12, '0.1' -> 0.1, 'true'/'false' -> bool, anything else stays a string."""
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value


def parse_model_args(items: list[str] | None, flag: str = "--model-arg") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = convert_arg(value.strip())
    return out


def resolve_factory(spec: str) -> Callable[..., Any]:
    from hetplan.planner.workload import builtin as models
    if spec in models.BUILTINS:
        return models.BUILTINS[spec]
    if ":" not in spec:
        raise InputError(f"--model: unknown model {spec!r}; expected one of "
                         f"{', '.join(sorted(models.BUILTINS))} or package.module:function")
    modname, _, fname = spec.partition(":")
    if not modname.strip() or not fname.strip():
        raise InputError(f"--model: {spec!r}: expected package.module:function, both named")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())   # `pkg.mod:fn` from the working directory, as `python -m` finds it
    try:
        mod = importlib.import_module(modname)
    except ImportError as e:
        raise InputError(f"--model: cannot import module {modname!r} of {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module: a SyntaxError, or raising on import
        raise InputError(f"--model: importing module {modname!r} of {spec!r} failed: {error_line(e)}") from None
    fn = getattr(mod, fname, None)
    if not callable(fn):
        raise InputError(f"--model: {modname!r} has no function {fname!r}")
    return fn


def load_workload(spec: str, args: dict[str, Any] | None = None, layers: str | None = None,
                  weights: bool = True) -> Workload:
    """Build the workload: torch.manual_seed(0), then the factory with the converted args.
    `layers` (`--layers`): the layer pattern, overriding the factory's `layers`; it must match
    a module of the model. Without `weights` (for a capture, whose counting run reads no
    value), `shapes_only` first."""
    import torch

    args = {k: convert_arg(v) for k, v in (args or {}).items()}
    fn = resolve_factory(spec)
    try:
        sig = inspect.signature(fn)
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        if not accepts_kwargs:
            unknown = sorted(set(args) - set(sig.parameters))
            if unknown:
                raise InputError(f"--model-arg: {spec} has no argument {unknown[0]!r}; expected one of "
                                 f"{', '.join(sig.parameters) or '(none)'}")
    except (TypeError, ValueError):
        pass
    shaped = shapes_only(fn, args) if not weights else None
    torch.manual_seed(0)
    try:
        w = shaped if shaped is not None else fn(**args)
    except InputError:
        raise
    except (TypeError, ValueError) as e:
        raise InputError(f"--model-arg: {spec} rejected its arguments {args}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise InputError(f"--model: the factory {spec} failed: {error_line(e)}") from None
    w = as_workload(w, spec)
    if layers is not None:
        w.layers = layers
    _check_layers(w, spec, flag="--layers" if layers is not None else "--model")
    if shaped is not None:
        _WHOLE[w.model] = lambda: load_workload(spec, args, layers)
    return w


def given_workload(given: Any, spec: str, args: dict[str, Any]) -> Workload:
    """A workload handed over in Python (hetplan.train) as the plan's model: a factory called with
    the plan's model.args after torch.manual_seed(0), as a spec's would be, or a Workload itself."""
    import torch
    torch.manual_seed(0)
    return as_workload(given(**args) if callable(given) else given, spec)


def as_workload(w: Any, spec: str) -> Workload:
    """`w` as a Workload: any object with model, make_batch and loss_fn (InputError otherwise)."""
    import torch
    for attr in ("model", "make_batch", "loss_fn"):
        if not hasattr(w, attr):
            raise InputError(f"--model: {spec} returned an object without {attr!r}; expected "
                             "model, make_batch and loss_fn")
    if not isinstance(w.model, torch.nn.Module):
        raise InputError(f"--model: {spec} returned a model that is not a torch.nn.Module")
    if not callable(w.make_batch) or not callable(w.loss_fn):
        raise InputError(f"--model: {spec} returned a make_batch or loss_fn that is not callable")
    if isinstance(w, Workload):
        if not isinstance(w.make_batch, GuardedBatch):
            w.make_batch = GuardedBatch(w.make_batch, spec)
        return w
    return Workload(model=w.model, make_batch=GuardedBatch(w.make_batch, spec), loss_fn=w.loss_fn,
                    optimizer=getattr(w, "optimizer", "adam"), lr=getattr(w, "lr", 1e-3),
                    layers=getattr(w, "layers", None), train_data=getattr(w, "train_data", None),
                    eval_data=getattr(w, "eval_data", None), collate_fn=getattr(w, "collate_fn", None),
                    metrics=getattr(w, "metrics", None))


def error_line(e: BaseException) -> str:
    """`Type: first line of the message` (at most 160 characters) for an error of user code."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {line[:160]}" if line else type(e).__name__


class GuardedBatch:
    """A workload's make_batch whose failure is one InputError line naming it: it raised, or it
    returned something other than (inputs, target). A class, not a closure, so it pickles."""

    def __init__(self, fn: Callable[[int, int], Any], spec: str):
        self.fn, self.spec = fn, spec

    def __call__(self, batch_size: int, seed: int) -> Any:
        try:
            out = self.fn(batch_size, seed)
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's make_batch
            raise InputError(f"--model: {self.spec}'s make_batch({batch_size}, {seed}) failed: {error_line(e)}") from None
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise InputError(f"--model: {self.spec}'s make_batch({batch_size}, {seed}) returned "
                             f"{type(out).__name__}; expected (inputs, target)")
        return out


_WHOLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # a shapes-only model -> its whole workload


def with_values(w: Workload) -> Workload:
    """`w` where its model holds the factory's values; else (`shapes_only`) the workload built
    whole, for what reads them."""
    whole = _WHOLE.get(w.model)
    return whole() if whole is not None else w


def shapes_only(fn: Callable[..., Any], args: dict[str, Any]) -> Any | None:
    """The factory's workload with its model built on the meta device, then given uninitialized
    CPU memory (`to_empty`, tied parameters kept tied): its shapes without the time and memory
    of its values; None where the factory fails on the meta device, leaves a tensor of the model
    off it, or makes its data there."""
    import torch
    from torch import __future__ as future
    torch.manual_seed(0)
    try:
        with torch.device("meta"):
            w = fn(**args)
        model = w.model
        if not isinstance(model, torch.nn.Module) or not all(
                t.is_meta for t in [*model.parameters(), *model.buffers()]):
            return None
        from torch.utils._pytree import tree_leaves
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(w.make_batch(1, 0))):
            return None   # its data was made in the factory, on the meta device too
        swap = future.get_swap_module_params_on_conversion()
        future.set_swap_module_params_on_conversion(True)   # in place: shared parameters stay shared
        try:
            model.to_empty(device="cpu")
        finally:
            future.set_swap_module_params_on_conversion(swap)
    except Exception:   # noqa: BLE001 - a factory that needs values (a checkpoint, .item()): build it whole
        return None
    return w


def _check_layers(w: Workload, spec: str, flag: str) -> None:
    """The layer pattern must be a non-empty string matching a module of the model."""
    from hetplan.planner.workload.layers import LayerPatternError, pattern_targets
    if w.layers is None:
        return
    if not isinstance(w.layers, str) or not w.layers.strip():
        raise InputError(f"{flag}: expected a module name pattern such as 'model.layers.*', got {w.layers!r}")
    try:
        pattern_targets(w.model, w.layers)
    except LayerPatternError as e:
        what = "" if flag == "--layers" else f"{spec}'s layers: "
        raise InputError(f"{flag}: {what}{e}") from None


def load_plan_workload(model, file: str, weights: bool = True) -> Workload:
    """`load_workload` for a plan file's `model` (a hetplan.planner.files.plan.ModelRef): errors name the
    file and its model.spec / model.args / model.layers fields instead of the flags."""
    try:
        return load_workload(model.spec, model.args, model.layers, weights)
    except InputError as e:
        msg = (str(e).replace("--model-arg", "model.args", 1).replace("--model:", "model.spec:", 1)
               .replace("--layers:", "model.layers:", 1))
        raise InputError(f"{file}: {msg}") from None
