"""Layers: a workload's model exported as one flat graph of ATen operators, each operator
assigned to a layer.

The model is exported with `torch.export.export(..., strict=False)` (non-strict export runs the
Python forward, so shape-dependent `if`s and Hugging Face-style code work; `torch.fx.symbolic_trace`
is the fallback when export fails). Every operator is assigned to a *layer* (`assign_layers`), the
grouping that both the capture (planner.workload.capture) and the stages
(planner.workload.partition) use:

- an operator belongs to the module that called it (`node.meta["nn_module_stack"]`), reduced
  to its *layer key*: the top-level child, except that containers are expanded: a
  `ModuleList`/`ModuleDict`/`Sequential` becomes one layer per element (`blocks.3`), and a
  wrapper module that holds a `ModuleList`/`ModuleDict` (the Hugging Face `transformer` holding
  `h`) is expanded into its children (`transformer.wte`, `transformer.h.0`, ...);
- an operator called by no child (a functional op in a forward that is being expanded, e.g.
  `F.relu`/`view` in the cnn built-in's root forward) joins the layer before it, or the first
  layer if it runs before any layer;
- a layer is a maximal run of operators with the same key in execution order, so layers are
  contiguous; a module that runs again later (weight sharing) starts a new layer `name#2`.

Batch size: the graph is exported with a dynamic batch dimension (`Dim.AUTO` on dim 0 of every
input) so one export serves any batch size. When the model specializes the batch (for example
`view(32, -1)`), it is exported again with static shapes at `batch` (`Exported.dynamic_batch`
says which).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_LISTS = (nn.ModuleList, nn.ModuleDict)
# nodes that check shapes at run time; they are dropped from stages (the stage's own ops still
# raise on a shape mismatch)
_DROP_TARGETS = {"_guards_fn"}
_EXPORT_BATCH = 2   # batch used for the dynamic-shape export when the caller gives none


@dataclass(frozen=True)
class Exported:
    """A model exported as a flat graph, every compute node assigned to a layer."""
    gm: fx.GraphModule
    layer_of: dict            # fx.Node -> layer index (placeholders, get_attr: absent)
    names: tuple[str, ...]    # layer names, execution order
    dynamic_batch: bool       # True: the graph runs at any batch size
    batch: int                # batch of the example inputs it was exported with
    method: str               # "export" or "symbolic_trace"
    out_spec: Any             # pytree spec of the model output (None for symbolic_trace)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n in self.layer_of]


def as_tuple(inputs) -> tuple:
    """Model inputs or stage outputs as a tuple: a tuple or list as is, anything else as `(x,)`."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def example_inputs(workload, batch: int) -> tuple:
    inputs, _ = workload.make_batch(batch, 0)
    return as_tuple(inputs)


# --- layer keys --------------------------------------------------------------------------
def _expand(mod: nn.Module) -> bool:
    """Containers and wrappers of module lists are split into their children."""
    return isinstance(mod, _CONTAINERS) or any(isinstance(c, _LISTS) for c in mod.children())


def layer_key(model: nn.Module, fqn: str) -> str | None:
    """'blocks.0.qkv' -> 'blocks.0'; 'conv1' -> 'conv1'; '' (the root) -> None."""
    if not fqn:
        return None
    key, mod = [], model
    for part in fqn.split("."):
        mod = getattr(mod, part, None)
        if not isinstance(mod, nn.Module):
            break
        key.append(part)
        if not _expand(mod):
            break
    return ".".join(key) or None


def _node_fqn(node: fx.Node) -> str:
    if node.op == "call_module":            # symbolic_trace leaf module
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str)]
    # export names the root "" and marks module-less nodes with a hook name; keep real paths
    paths = [p for p in paths if p and not p.startswith("_")]
    return paths[-1] if paths else ""


def assign_layers(gm: fx.GraphModule, model: nn.Module) -> tuple[dict, tuple[str, ...]]:
    """Map compute nodes to layer indices (see the module docstring for the rule)."""
    keyed: list[tuple[fx.Node, str | None]] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if n.op == "call_module" and n.target in _DROP_TARGETS:
            continue
        if n.op == "call_function" and _is_assert(n):
            continue
        keyed.append((n, layer_key(model, _node_fqn(n))))
    if not any(k for _, k in keyed):
        raise ValueError("the model has no child modules to group operators into layers")
    first = next(k for _, k in keyed if k)
    layer_of, names, seen = {}, [], {}
    cur = None
    for n, k in keyed:
        k = k or cur or first               # module-less op: joins the layer before it
        if k != cur:
            seen[k] = seen.get(k, 0) + 1
            names.append(k if seen[k] == 1 else f"{k}#{seen[k]}")
            cur = k
        layer_of[n] = len(names) - 1
    return layer_of, tuple(names)


def _is_assert(n: fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target))
    return "assert" in name or "sym_constrain_range" in name


# --- export ------------------------------------------------------------------------------
def _export(model: nn.Module, inputs: tuple, dynamic: bool):
    from torch.export import Dim, export
    shapes = None
    if dynamic:
        shapes = tuple({0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None
                       for x in inputs)
    ep = export(model, inputs, strict=False, dynamic_shapes=shapes)
    gm = ep.module()
    dyn = any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
              and isinstance(n.meta["val"].shape[0], torch.SymInt)
              for n in gm.graph.nodes if n.op == "placeholder")
    return gm, dyn, ep.call_spec.out_spec


def export_model(workload, batch: int | None = None, *, dynamic: bool = True) -> Exported:
    """Export `workload.model` on `make_batch(batch, 0)` (see the module docstring)."""
    model = workload.model
    b = batch if batch is not None else _EXPORT_BATCH
    inputs = example_inputs(workload, max(b, 2) if dynamic else b)
    try:
        gm, dyn, out_spec = _export(model, inputs, dynamic)
        method = "export"
    except Exception as e:  # noqa: BLE001 - any export failure falls back to fx
        print(f"hetplan: torch.export failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
              "falling back to torch.fx.symbolic_trace", file=sys.stderr)
        try:
            gm = fx.symbolic_trace(model)
        except Exception as e2:  # noqa: BLE001
            raise ValueError(f"cannot capture the model: torch.export: {str(e).splitlines()[0][:200]}; "
                             f"symbolic_trace: {str(e2).splitlines()[0][:200]}") from None
        dyn, out_spec, method = True, None, "symbolic_trace"
    export_batch = inputs[0].shape[0] if isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else b
    if method == "export" and not dyn and export_batch != b:   # specialized at the wrong batch
        return export_model(workload, b, dynamic=False)
    layer_of, names = assign_layers(gm, model)
    return Exported(gm, layer_of, names, dyn, int(export_batch), method, out_spec)


def layer_names(workload, batch: int | None = None) -> list[str]:
    return list(export_model(workload, batch).names)


def num_layers(workload, batch: int | None = None) -> int:
    return export_model(workload, batch).num_layers
