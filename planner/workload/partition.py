"""Executable stages: a workload's model cut into layer ranges.

The model is captured once as a flat graph of ATen operators with
`torch.export.export(..., strict=False)` (non-strict export runs the Python forward, so
shape-dependent `if`s and Hugging Face-style code work; `torch.fx.symbolic_trace` is the
fallback when export fails). Every operator is assigned to a *layer* (`assign_layers`), the
same grouping `planner.workload.graph.capture_graph` reports:

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

`build_stages` then cuts the graph at layer boundaries. Each stage is a `torch.fx.GraphModule`
whose `get_attr`s point at the original model's parameters and buffers under their fully
qualified names, so gradients land on the original parameters. A stage returns *every* live
value that crosses its end cut (skip connections and branches work); the last returns
`(model_output,)`.

Batch size: the graph is exported with a dynamic batch dimension (`Dim.AUTO` on dim 0 of every
input) so a stage built once runs at any batch size. When the model specializes the batch (for
example `view(32, -1)`) or a non-tensor value (a symbolic size) would cross a cut, the graph is
exported again with static shapes at `batch`; such stages only run at that batch size
(`StageModule.batch` says which; `None` means any).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_LISTS = (nn.ModuleList, nn.ModuleDict)
# nodes that check shapes at run time; they are dropped from stages (the stage's own ops still
# raise on a shape mismatch)
_DROP_TARGETS = {"_guards_fn"}
_TRACE_BATCH = 2   # batch used for the dynamic-shape export when the caller gives none


@dataclass(frozen=True)
class Traced:
    """A model captured as a flat graph, every compute node assigned to a layer."""
    gm: fx.GraphModule
    layer_of: dict            # fx.Node -> layer index (placeholders, get_attr: absent)
    names: tuple[str, ...]    # layer names, execution order
    dynamic_batch: bool       # True: the graph runs at any batch size
    batch: int                # batch of the example inputs it was traced with
    method: str               # "export" or "symbolic_trace"
    out_spec: Any             # pytree spec of the model output (None for symbolic_trace)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n in self.layer_of]


def as_tuple(inputs) -> tuple:
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


# --- capture -----------------------------------------------------------------------------
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


def trace(workload, batch: int | None = None, *, dynamic: bool = True) -> Traced:
    """Capture `workload.model` on `make_batch(batch, 0)` (see the module docstring)."""
    model = workload.model
    b = batch if batch is not None else _TRACE_BATCH
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
    traced_batch = inputs[0].shape[0] if isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else b
    if method == "export" and not dyn and traced_batch != b:   # specialized at the wrong batch
        return trace(workload, b, dynamic=False)
    layer_of, names = assign_layers(gm, model)
    return Traced(gm, layer_of, names, dyn, int(traced_batch), method, out_spec)


def layer_names(workload, batch: int | None = None) -> list[str]:
    return list(trace(workload, batch).names)


def num_layers(workload, batch: int | None = None) -> int:
    return trace(workload, batch).num_layers


# --- stages ------------------------------------------------------------------------------
class StageModule(fx.GraphModule):
    """One pipeline stage: layers [start, end). Attributes set by `build_stages`:
    index, start, end, batch (None: any batch size), input_names, output_names."""


class _NonTensorCut(Exception):
    pass


def _is_tensor_value(n: fx.Node) -> bool:
    v = n.meta.get("val", n.meta.get("example_value"))
    return v is None or isinstance(v, torch.Tensor)   # symbolic_trace keeps no values


def _derive_sizes(live: list[fx.Node], k: int) -> dict:
    """For each symbolic-int value in `live`: a (tensor value, dim) whose size equals it."""
    out = {}
    for v in live:
        if _is_tensor_value(v):
            continue
        val = v.meta.get("val")
        expr = getattr(getattr(val, "node", None), "expr", None)
        found = None
        for t in live:
            tv = t.meta.get("val")
            if expr is None or not isinstance(tv, torch.Tensor):
                continue
            for d, size in enumerate(tv.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    found = (t, d)
                    break
            if found:
                break
        if found is None:
            raise _NonTensorCut(f"non-tensor value {v.name} crosses the cut before stage {k}")
        out[v] = found
    return out


def _check_ranges(ranges, L: int) -> list[tuple[int, int]]:
    out = [(int(a), int(b)) for a, b in ranges]
    pos = 0
    for a, b in out:
        if a != pos or b <= a:
            raise ValueError(f"stage ranges {out} must cover [0, {L}) in order without gaps")
        pos = b
    if pos != L:
        raise ValueError(f"stage ranges {out} must cover [0, {L}); the model has {L} layers")
    return out


def _resolve_attr(model: nn.Module, gm: fx.GraphModule, target: str):
    """The original model's parameter/buffer/module under `target`, else the graph's constant."""
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if obj is None:
        obj = gm
        for part in target.split("."):
            obj = getattr(obj, part)
    return obj


def split(tr: Traced, model: nn.Module, ranges) -> list[StageModule]:
    ranges = _check_ranges(ranges, tr.num_layers)
    stage_of_layer = {l: s for s, (a, b) in enumerate(ranges) for l in range(a, b)}
    S = len(ranges)
    nodes = list(tr.gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    stage_of = {n: stage_of_layer[l] for n, l in tr.layer_of.items()}

    def last_use(v: fx.Node) -> int:
        uses = [S if u is out_node else stage_of.get(u, -1) for u in v.users]
        return max(uses, default=-1)

    values = placeholders + [n for n in nodes if n in stage_of]
    defined = {n: -1 for n in placeholders} | stage_of
    live_in = [[v for v in values if defined[v] < k <= last_use(v)] for k in range(S)]
    # symbolic sizes (the dynamic batch) do not travel between stages: each stage re-reads them
    # from the shape of a tensor it receives (`_derive_sizes`)
    sizes_in = [{} if k == 0 else _derive_sizes(live_in[k], k) for k in range(S)]
    live_in = [[v for v in vs if v not in sizes_in[k]] for k, vs in enumerate(live_in)]

    stages = []
    for k, (a, b) in enumerate(ranges):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        attrs: dict[str, Any] = {}
        for v in (placeholders if k == 0 else live_in[k]):
            env[v] = g.placeholder(v.name)
            env[v].meta = dict(v.meta)
        for v, (t, d) in sizes_in[k].items():
            env[v] = g.call_function(torch.ops.aten.sym_size.int, (env[t], d))
            env[v].meta = dict(v.meta)

        def arg(v: fx.Node) -> fx.Node:
            if v not in env and v.op == "get_attr":
                attrs[v.target] = _resolve_attr(model, tr.gm, v.target)
                env[v] = g.get_attr(v.target)
                env[v].meta = dict(v.meta)
            return env[v]

        for n in nodes:
            if stage_of.get(n) == k:
                if n.op == "call_module":
                    attrs[n.target] = _resolve_attr(model, tr.gm, n.target)
                env[n] = g.node_copy(n, arg)
        if k == S - 1:
            flat = [arg(v) if isinstance(v, fx.Node) else v for v in pytree.tree_leaves(out_node.args[0])]
            result = _unflatten(flat, tr, out_node)
            g.output((result,))
            outs = [v for v in pytree.tree_leaves(out_node.args[0]) if isinstance(v, fx.Node)]
        else:
            g.output(tuple(env[v] for v in live_in[k + 1]))
            outs = live_in[k + 1]
        g.lint()
        m = StageModule(attrs, g, class_name=f"Stage{k}")
        m.index, m.start, m.end = k, a, b
        m.batch = None if tr.dynamic_batch else tr.batch
        m.layer_names = tr.names[a:b]
        m.input_names = tuple(v.name for v in (placeholders if k == 0 else live_in[k]))
        m.output_names = tuple(v.name for v in outs)
        m.num_stages = S
        m.node_origin = {new.name: old for old, new in env.items()}   # stage node -> traced node
        stages.append(m)
    return stages


def _unflatten(flat: list, tr: Traced, out_node: fx.Node):
    """The model output rebuilt from graph nodes (tuples/lists/dicts; a tensor stays a tensor)."""
    if tr.out_spec is None:  # symbolic_trace: output node args already hold the structure
        return pytree.tree_unflatten(flat, pytree.tree_structure(out_node.args[0]))
    out = pytree.tree_unflatten(flat, tr.out_spec)
    return out


def traced_stages(workload, ranges=None, batch: int | None = None) -> tuple[Traced, list[StageModule]]:
    """The traced graph and its stages (default ranges: one stage per layer)."""
    tr = trace(workload, batch)
    try:
        return tr, split(tr, workload.model, ranges or [(i, i + 1) for i in range(tr.num_layers)])
    except _NonTensorCut:
        if not tr.dynamic_batch:
            raise
    tr = trace(workload, batch, dynamic=False)
    return tr, split(tr, workload.model, ranges or [(i, i + 1) for i in range(tr.num_layers)])


def place_stages(stages: list[StageModule], device) -> list[StageModule]:
    """Move stages to `device` (a torch.device), with the tensors their factory ops create: export
    records the device the model was traced on (`arange(..., device=cpu)`), so those ops are
    retargeted too. Parameters move in place (stages share them with their model)."""
    device = torch.device(device)
    for st in stages:
        changed = False
        for n in st.graph.nodes:
            d = n.kwargs.get("device")
            if isinstance(d, torch.device) and d != device:
                n.kwargs = {**n.kwargs, "device": device}
                changed = True
        if changed:
            st.recompile()
        st.to(device)
    return stages


def build_stages(workload, ranges: list[tuple[int, int]], batch: int | None = None) -> list[StageModule]:
    """Executable stages for half-open layer `ranges` that cover [0, L) in order.

    Stage 0 takes the model inputs positionally, stage k>0 the tuple stage k-1 returned; each
    returns a tuple of tensors, the last `(model_output,)`. Parameters and buffers are the
    original model's (shared, same names). `batch` is the (micro)batch the stages will run at;
    it only matters when the model cannot be exported with a dynamic batch dimension.
    """
    return traced_stages(workload, ranges, batch)[1]
