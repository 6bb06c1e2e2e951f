"""Model inputs as `make_batch` returns them: a tensor, a tuple (passed positionally) or a dict
(passed as keyword arguments), and the stage outputs that cross a cut (a tuple of tensors).

Every tensor in the inputs is batch-major: a replica's or microbatch's share is `x[a:b]` of each
(`slice_inputs`); non-tensor values (flags such as `use_cache=False`) are passed unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def as_tuple(inputs) -> tuple:
    """Stage outputs (or positional inputs) as a tuple: a tuple or list as is, else `(x,)`."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def call_args(inputs) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) to call the model with: a dict is keyword arguments, anything else positional."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return as_tuple(inputs), {}


def call_model(model, inputs):
    """`model(*args, **kwargs)` for inputs as `make_batch` returns them."""
    args, kwargs = call_args(inputs)
    return model(*args, **kwargs)


def slice_inputs(inputs, a: int, b: int):
    """Samples [a, b) of every batch-major tensor in `inputs` (tensor, tuple, list or dict)."""
    return pytree.tree_map(lambda x: x[a:b] if isinstance(x, torch.Tensor) and x.dim() else x, inputs)


def to_device(inputs, device):
    return pytree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor)
                           else x, inputs)


def flatten_inputs(inputs, in_spec, keys: tuple[str, ...] | None = None) -> tuple:
    """The leaves of `inputs` in the order of an exported graph's placeholders: for keyword
    inputs, their values in the order of `keys` (the order they were exported in); else by
    `in_spec`, the export's `(args, kwargs)` spec (None: positional tensors, symbolic_trace)."""
    if keys is not None:
        if not isinstance(inputs, dict) or set(inputs) != set(keys):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"make_batch: expected keyword inputs {list(keys)}, got {got}")
        return tuple(inputs[k] for k in keys)
    if in_spec is None:
        return as_tuple(inputs)
    from torch.fx import _pytree as fx_pytree
    return tuple(fx_pytree.tree_flatten_spec(call_args(inputs), in_spec))


__all__ = ["as_tuple", "call_args", "call_model", "slice_inputs", "to_device", "flatten_inputs"]
