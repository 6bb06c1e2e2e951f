"""Executable stages: a workload's model cut into layer ranges.

`build_stages` exports the model (hetplan.planner.workload.layers: one flat ATen graph, every operator
assigned to a layer) and cuts the graph at layer boundaries. Each stage is a
`torch.fx.GraphModule` whose `get_attr`s point at the original model's parameters and buffers
under their fully qualified names, so gradients land on the original parameters. A stage returns
*every* live value that crosses its end cut (skip connections and branches work); the last
returns `(model_output,)`.

Batch size: stages cut from a dynamic-batch export run at any batch size. When the model
specializes the batch (for example `view(32, -1)`) or a non-tensor value (a symbolic size) would
cross a cut, the graph is exported again with static shapes at `batch`; such stages only run at
that batch size (`StageModule.batch` says which; `None` means any).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from hetplan.planner.workload.layers import Exported, export_model


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


def resolve_attr(model: nn.Module, gm: fx.GraphModule, target: str):
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


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter or buffer -> its first name (`model.named_parameters()`'s):
    a tied weight (GPT-2's `lm_head.weight` is `transformer.wte.weight`) has one name in every
    stage, the one single-device training reports."""
    out: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for name, t in named(remove_duplicate=False):
            out[name] = first.setdefault(id(t), name)
    return out


def cut_stages(ex: Exported, model: nn.Module, ranges) -> list[StageModule]:
    ranges = _check_ranges(ranges, ex.num_layers)
    stage_of_layer = {l: s for s, (a, b) in enumerate(ranges) for l in range(a, b)}
    S = len(ranges)
    nodes = list(ex.gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    stage_of = {n: stage_of_layer[l] for n, l in ex.layer_of.items()}
    canonical = canonical_names(model)

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
                target = canonical.get(v.target, v.target)
                attrs[target] = resolve_attr(model, ex.gm, target)
                env[v] = g.get_attr(target)
                env[v].meta = dict(v.meta)
            return env[v]

        for n in nodes:
            if stage_of.get(n) == k:
                if n.op == "call_module":
                    attrs[n.target] = resolve_attr(model, ex.gm, n.target)
                env[n] = g.node_copy(n, arg)
        if k == S - 1:
            flat = [arg(v) if isinstance(v, fx.Node) else v for v in pytree.tree_leaves(out_node.args[0])]
            result = _unflatten(flat, ex, out_node)
            g.output((result,))
            outs = [v for v in pytree.tree_leaves(out_node.args[0]) if isinstance(v, fx.Node)]
        else:
            g.output(tuple(env[v] for v in live_in[k + 1]))
            outs = live_in[k + 1]
        g.lint()
        m = StageModule(attrs, g, class_name=f"Stage{k}")
        m.index, m.start, m.end = k, a, b
        m.batch = None if ex.dynamic_batch else ex.batch
        m.layer_names = ex.names[a:b]
        m.input_names = tuple(v.name for v in (placeholders if k == 0 else live_in[k]))
        m.output_names = tuple(v.name for v in outs)
        m.num_stages = S
        m.flat_inputs = ex.flat_inputs          # model inputs -> stage 0's arguments
        m.node_origin = {new.name: old for old, new in env.items()}   # stage node -> exported node
        m.node_layer = {env[n].name: ex.layer_of[n] for n, s in stage_of.items() if s == k}
        stages.append(m)
    return stages


def _unflatten(flat: list, ex: Exported, out_node: fx.Node):
    """The model output rebuilt from graph nodes (tuples/lists/dicts; a tensor stays a tensor)."""
    if ex.out_spec is None:  # symbolic_trace: output node args already hold the structure
        return pytree.tree_unflatten(flat, pytree.tree_structure(out_node.args[0]))
    out = pytree.tree_unflatten(flat, ex.out_spec)
    return out


def exported_stages(workload, ranges=None, batch: int | None = None,
                    ex: Exported | None = None) -> tuple[Exported, list[StageModule]]:
    """The exported graph and its stages (default ranges: one stage per layer); `ex`: an export
    of `workload` at `batch` already made (not exported again)."""
    ex = ex or export_model(workload, batch)
    try:
        return ex, cut_stages(ex, workload.model, ranges or [(i, i + 1) for i in range(ex.num_layers)])
    except _NonTensorCut:
        if not ex.dynamic_batch:
            raise
    ex = export_model(workload, batch, dynamic=False)
    return ex, cut_stages(ex, workload.model, ranges or [(i, i + 1) for i in range(ex.num_layers)])


def stage_inputs(stage: StageModule, inputs) -> tuple:
    """The first stage's arguments for model inputs as make_batch returns them (tensor, tuple or
    dict of keyword arguments): their leaves in the export's order."""
    return stage.flat_inputs(inputs)


def place_stages(stages: list[StageModule], device) -> list[StageModule]:
    """Move stages to `device` (a torch.device), with the tensors their factory ops create: export
    records the device the model was exported on (`arange(..., device=cpu)`), so those ops are
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


def build_stages(workload, ranges: list[tuple[int, int]], batch: int | None = None,
                 exported: Exported | None = None) -> list[StageModule]:
    """Executable stages for half-open layer `ranges` that cover [0, L) in order.

    Stage 0 takes the model inputs' leaves positionally (`Exported.flat_inputs`; `stage_inputs`
    for a dict of keyword arguments), stage k>0 the tuple stage k-1 returned; each
    returns a tuple of tensors, the last `(model_output,)`. Parameters and buffers are the
    original model's (shared, same names). `batch` is the (micro)batch the stages will run at;
    it only matters when the model cannot be exported with a dynamic batch dimension.
    `exported`: an export of `workload` at `batch` already made (not exported again).
    """
    return exported_stages(workload, ranges, batch, exported)[1]
