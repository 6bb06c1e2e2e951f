"""The plan file's `optimizer` against torch: which torch.optim class a name means, how its step
is priced ("sgd": one read-modify-write of the parameters, "adam": two moments besides), and
whether its arguments are ones torch accepts. Read by the plan's validation (hetplan.planner.files.plan)
and by hetplan.planner.workload.optimizer, which makes the optimizer.
"""
from __future__ import annotations

from typing import Any

# how torch.optim classes are priced; a class not listed is priced as Adam (two states a parameter)
PRICED_AS = {"SGD": "sgd", "Adagrad": "sgd", "RMSprop": "sgd", "Adam": "adam", "AdamW": "adam",
             "NAdam": "adam", "RAdam": "adam", "Adamax": "adam", "Adadelta": "adam"}
DEFAULT_CLASS = {"sgd": "SGD", "adam": "Adam"}


class OptimizerSpecError(ValueError):
    """A bad optimizer spec; `field` names the plan field (name, torch_class, args)."""

    def __init__(self, field: str, msg: str):
        super().__init__(msg)
        self.field = field


def torch_class(name: str):
    """The torch.optim class called `name` (case as torch spells it, or any case), or None."""
    import torch
    by_lower = {k.lower(): k for k in dir(torch.optim)}
    cls = getattr(torch.optim, by_lower.get(name.lower(), ""), None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


# torch.optim classes whose update of an element needs only that element (and its state): a
# sharded step (plan `shard`, hetplan.runtime.shard.ShardedStep) updates slices of tensors exactly
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")


def priced_as(class_name: str) -> str:
    """The cost family ("sgd" or "adam") of a torch.optim class."""
    cls = torch_class(class_name)
    return PRICED_AS.get(cls.__name__ if cls is not None else class_name, "adam")


def check_spec(name: str, cls_name: str | None, args: dict[str, Any]) -> None:
    """The plan's optimizer fields agree with torch: raise OptimizerSpecError naming the field."""
    import inspect
    if name not in DEFAULT_CLASS:
        raise OptimizerSpecError("name", f"expected one of {', '.join(DEFAULT_CLASS)}, got {name!r}")
    if not isinstance(args, dict):
        raise OptimizerSpecError("args", f"expected an object of keyword arguments, got {args!r}")
    if cls_name is None:
        cls_name = DEFAULT_CLASS[name]
    cls = torch_class(cls_name)
    if cls is None:
        raise OptimizerSpecError("torch_class", f"expected a torch.optim optimizer class such as AdamW or "
                                                f"SGD, got {cls_name!r}")
    if priced_as(cls.__name__) != name:
        raise OptimizerSpecError("name", f"expected {priced_as(cls.__name__)!r} for torch_class "
                                         f"{cls.__name__} (how its step is priced), got {name!r}")
    params = inspect.signature(cls.__init__).parameters
    for key in args:
        if key in ("params", "lr") or key not in params:
            allowed = [k for k in params if k not in ("self", "params", "lr")]
            raise OptimizerSpecError("args", f"{cls.__name__} takes no argument {key!r} here; expected one "
                                             f"of {', '.join(allowed)} (lr is optimizer.lr)")
    import torch
    try:                           # the values too: torch checks them when the optimizer is made
        cls([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, **args)
    except (TypeError, ValueError, RuntimeError) as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OptimizerSpecError("args", f"{cls.__name__} refused {args}: {line}") from None
