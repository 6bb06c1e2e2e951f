"""Layers: a workload's model exported as one flat graph of ATen operators, each operator
assigned to a layer.

The model is exported with `torch.export.export(..., strict=False)` (non-strict export runs the
Python forward, so shape-dependent `if`s and Hugging Face-style code work; `torch.fx.symbolic_trace`
is the fallback when export fails). Every operator is assigned to a *layer* (`assign_layers`), the
grouping that both the capture (hetplan.planner.workload.capture) and the stages
(hetplan.planner.workload.partition) use:

- an operator belongs to the module that called it (`node.meta["nn_module_stack"]`), reduced
  to its *layer key* by `layer_key`: the path from the root down to the first module that is a
  *target* or that holds no target (see below); so every target is a layer, every module on the
  way to a target is *expanded* (replaced by its children), and every other child of an expanded
  module (what runs before and after the targets: embeddings, final norm, head) is a layer of its
  own;
- the targets, automatically (`auto_targets`): the elements of every *outermost* container, a
  `ModuleList`/`ModuleDict`/`Sequential` not inside another container, at any depth (an element
  that is itself a container is expanded in turn). So the block list is found wherever it sits:
  `wrapper.hf.transformer.h.N` (GPT-2), `wrapper.hf.model.layers.N` (Llama),
  `hf.bert.encoder.layer.N`, `layerN.M` / `features.N` (torchvision-style); a model with no
  container is split into its top-level children. Lists inside a block (heads, experts) are not
  outermost, so a block stays one layer;
- the targets, given by the user (`--layers PATTERN`, the plan's `model.layers`, or a factory's
  `Workload.layers`): the modules whose dotted names match the pattern, component by component
  (`fnmatch` per name: `hf.transformer.h.*`, `hf.resnet.encoder.stages.*.layers.*`); several
  patterns are separated by commas; a module inside another match is not a target of its own;
  a pattern that matches no module is refused (`LayerPatternError`);
- an operator called by no layer (a functional op in the forward of an expanded module, e.g.
  the causal mask built in `GPT2Model.forward`, or `F.relu` in the cnn built-in's root forward)
  joins the layer before it, or the first layer if it runs before any layer;
- a layer is a maximal run of operators with the same key in execution order, so layers are
  contiguous; a module that runs again later (weight sharing) starts a new layer `name#2`.

Inputs: `make_batch` may return the model inputs as a tensor, a tuple (positional) or a dict
(keyword arguments). The model is exported with them as given; its flat graph takes the leaves
in the order of the export's input spec (`Exported.flat_inputs`).

Batch size: the graph is exported with a dynamic batch dimension (`Dim.AUTO` on dim 0 of every
input) so one export serves any batch size. When the model specializes the batch (for example
`view(32, -1)`), it is exported again with static shapes at `batch` (`Exported.dynamic_batch`
says which).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from hetplan.planner.workload.inputs import call_args, flatten_inputs

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
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
    in_spec: Any = None       # pytree spec of the model's (args, kwargs) (None: positional)
    in_keys: tuple[str, ...] | None = None   # keyword inputs: their names, placeholder order
    pattern: str | None = None   # the layer pattern it was grouped by (None: the automatic rule)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def flat_inputs(self, inputs) -> tuple:
        """Model inputs (tensor, tuple or dict, as make_batch returns them) as the graph's
        placeholders take them: the first stage's arguments."""
        return flatten_inputs(inputs, self.in_spec, self.in_keys)

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n in self.layer_of]


def example_inputs(workload, batch: int):
    """The model inputs of `make_batch(batch, 0)`, as it returns them (tensor, tuple or dict)."""
    inputs, _ = workload.make_batch(batch, 0)
    return inputs


# --- layer keys --------------------------------------------------------------------------
class LayerPatternError(ValueError):
    """A layer pattern that matches no module of the model."""


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def auto_targets(model: nn.Module) -> set[str]:
    """The elements of every outermost container, containers among them expanded in turn."""
    targets: set[str] = set()

    def elements(fqn: str, box: nn.Module) -> None:
        for name, ch in box.named_children():
            if isinstance(ch, _CONTAINERS):
                elements(_child(fqn, name), ch)
            else:
                targets.add(_child(fqn, name))

    def visit(fqn: str, mod: nn.Module) -> None:
        for name, ch in mod.named_children():
            (elements if isinstance(ch, _CONTAINERS) else visit)(_child(fqn, name), ch)

    (elements if isinstance(model, _CONTAINERS) else visit)("", model)
    return targets


def _matches(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.strip().split(".")
    return len(parts) == len(pats) and all(fnmatchcase(n, p) for n, p in zip(parts, pats))


def pattern_targets(model: nn.Module, pattern: str) -> set[str]:
    """Modules whose names match `pattern` (comma-separated globs, one per dotted name), minus
    those inside another match; LayerPatternError when none matches."""
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    found = sorted(n for n, _ in model.named_modules() if n and any(_matches(n, p) for p in pats))
    targets = {n for n in found if not any(n.startswith(o + ".") for o in found)}
    if not targets:
        lists = sorted({t.rsplit(".", 1)[0] + ".*" for t in auto_targets(model) if "." in t})
        hint = f"; the model's module lists: {', '.join(lists[:4])}" if lists else ""
        raise LayerPatternError(f"{pattern!r} matches no module of the model{hint}")
    return targets


def layer_targets(model: nn.Module, pattern: str | None = None) -> set[str]:
    """The modules that are layers of their own: matched by `pattern`, else `auto_targets`."""
    return pattern_targets(model, pattern) if pattern else auto_targets(model)


@dataclass(frozen=True)
class LayerRule:
    """`layer_key` for one model and target set: the targets and every module above one."""
    targets: frozenset[str]
    expanded: frozenset[str]   # strict ancestors of the targets ("" is the root)

    @staticmethod
    def of(model: nn.Module, pattern: str | None = None) -> "LayerRule":
        targets = layer_targets(model, pattern)
        above = {t.rsplit(".", 1)[0] if "." in t else "" for t in targets}
        expanded = {""} | {".".join(p.split(".")[:i]) for p in above for i in range(1, p.count(".") + 2)
                           if p}
        return LayerRule(frozenset(targets), frozenset(expanded))

    def layer_key(self, fqn: str) -> str | None:
        """'hf.transformer.h.0.attn' -> 'hf.transformer.h.0'; an op of an expanded module -> None."""
        parts = fqn.split(".") if fqn else []
        for i in range(1, len(parts) + 1):
            key = ".".join(parts[:i])
            if key in self.targets or key not in self.expanded:
                return key
        return None


def layer_key(model: nn.Module, fqn: str, pattern: str | None = None) -> str | None:
    """'blocks.0.qkv' -> 'blocks.0'; 'conv1' -> 'conv1'; '' (the root) -> None."""
    return LayerRule.of(model, pattern).layer_key(fqn)


def _node_fqn(node: fx.Node) -> str:
    if node.op == "call_module":            # symbolic_trace leaf module
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str)]
    # export names the root "" and marks module-less nodes with a hook name; keep real paths
    paths = [p for p in paths if p and not p.startswith("_")]
    return paths[-1] if paths else ""


def assign_layers(gm: fx.GraphModule, model: nn.Module,
                  pattern: str | None = None) -> tuple[dict, tuple[str, ...]]:
    """Map compute nodes to layer indices (see the module docstring for the rule)."""
    rule = LayerRule.of(model, pattern)
    keyed: list[tuple[fx.Node, str | None]] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if n.op == "call_module" and n.target in _DROP_TARGETS:
            continue
        if n.op == "call_function" and _is_assert(n):
            continue
        keyed.append((n, rule.layer_key(_node_fqn(n))))
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
def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict):
    """Dim.AUTO on dim 0 of every input tensor (the batch), keyed by the names of `forward`'s
    parameters (torch.export's dict form; `**inputs` takes a dict, `*args` a tuple)."""
    from torch.export import Dim
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return pytree.tree_map(lambda x: {0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0
                           else None, dict(bound))


class _Keywords(nn.Module):
    """The model called with keyword inputs given as positional values in `keys`' order.

    torch.export cannot give dynamic shapes to a `**inputs` forward (an internal assertion in
    torch 2.13), so keyword inputs are exported through this module. It shares the model's
    children, parameters and buffers (the same objects under the same names), so the graph's
    module paths and attribute names are the model's own."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        object.__setattr__(self, "_model", model)   # not a child: no "_model." prefix in names
        self.keys = keys

    def forward(self, *values):
        return self._model(**dict(zip(self.keys, values)))


def _export(model: nn.Module, inputs, dynamic: bool):
    from torch.export import export
    args, kwargs = call_args(inputs)
    keys = tuple(kwargs) if kwargs and not args else None
    if keys is not None:
        model, args, kwargs = _Keywords(model, keys), tuple(kwargs.values()), {}
    shapes = _dynamic_shapes(model, args, kwargs) if dynamic else None
    with _module_trail() as trail, _quiet_torch_logs():
        try:
            ep = export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
        except Exception as e:  # noqa: BLE001 - re-raised with the module that was running
            raise CaptureError(_where(trail, model), e) from e
    gm = ep.module()
    dyn = any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
              and isinstance(n.meta["val"].shape[0], torch.SymInt)
              for n in gm.graph.nodes if n.op == "placeholder")
    return gm, dyn, ep.call_spec.out_spec, (ep.call_spec.in_spec, keys)


class CaptureError(ValueError):
    """torch.export failed inside `module` (a dotted name, "" for the root's own forward)."""

    def __init__(self, module: str, error: BaseException):
        self.module, self.error = module, error
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        super().__init__(f"{type(error).__name__}: {first}")


@contextlib.contextmanager
def _module_trail():
    """The modules whose forward is running (a stack), kept by global forward hooks; on an
    exception the stack is left as it was where the exception was raised."""
    from torch.nn.modules.module import (register_module_forward_hook,
                                         register_module_forward_pre_hook)
    trail: list[nn.Module] = []

    def leave(mod, _inputs, _output) -> None:      # a forward hook must return None
        if trail and trail[-1] is mod:
            trail.pop()

    pre = register_module_forward_pre_hook(lambda m, _: trail.append(m) and None)
    post = register_module_forward_hook(leave)
    try:
        yield trail
    finally:
        pre.remove()
        post.remove()


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs a failed guard and prints the partial graph to stderr; the failure is
    reported once, as one line, by `export_model`'s caller. (Anything else written to stderr
    during the export is dropped too.)"""
    import io
    import logging
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch._export",
                                              "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _where(trail: list[nn.Module], model: nn.Module) -> str:
    names = {id(m): n for n, m in model.named_modules()}
    inner = [names[id(m)] for m in trail if id(m) in names]
    return inner[-1] if inner else ""


def _describe_failure(model: nn.Module, err: CaptureError, fx_err: BaseException) -> str:
    mod = err.module
    kind = type(model.get_submodule(mod)).__name__ if mod else type(model).__name__
    where = f"module {mod!r} ({kind})" if mod else f"the model's own forward ({kind})"
    return (f"cannot capture the model: torch.export failed in {where}: {err} "
            f"(torch.fx.symbolic_trace: {str(fx_err).strip().splitlines()[0][:120] if str(fx_err).strip() else type(fx_err).__name__}); "
            "hetplan needs the whole forward as one graph (--layers only regroups it): make that "
            "module exportable (no Python control flow on tensor values; a torch.library custom op "
            "for opaque code)")


def export_model(workload, batch: int | None = None, *, dynamic: bool = True) -> Exported:
    """Export `workload.model` on `make_batch(batch, 0)` (see the module docstring)."""
    model = workload.model
    b = batch if batch is not None else _EXPORT_BATCH
    inputs = example_inputs(workload, max(b, 2) if dynamic else b)
    try:
        gm, dyn, out_spec, (in_spec, in_keys) = _export(model, inputs, dynamic)
        method = "export"
    except CaptureError as e:
        try:
            gm = fx.symbolic_trace(model)
        except Exception as e2:  # noqa: BLE001
            raise ValueError(_describe_failure(model, e, e2)) from None
        print(f"hetplan: torch.export failed ({e}); captured with torch.fx.symbolic_trace instead",
              file=sys.stderr)
        dyn, out_spec, in_spec, in_keys, method = True, None, None, None, "symbolic_trace"
    first = next(iter(pytree.tree_leaves(inputs)), None)
    export_batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else b
    if method == "export" and not dyn and export_batch != b:   # specialized at the wrong batch
        return export_model(workload, b, dynamic=False)
    pattern = getattr(workload, "layers", None)
    layer_of, names = assign_layers(gm, model, pattern)
    return Exported(gm, layer_of, names, dyn, int(export_batch), method, out_spec, in_spec, in_keys,
                    pattern)


def layer_names(workload, batch: int | None = None) -> list[str]:
    return list(export_model(workload, batch).names)


def num_layers(workload, batch: int | None = None) -> int:
    return export_model(workload, batch).num_layers


def unused_parameters(gm) -> tuple[str, ...]:
    """Trainable parameters of a graph module that nothing on the way to its output reads (a
    Hugging Face model's pooler under a wrapper that returns the hidden states): they get no
    gradient."""
    out = [n for n in gm.graph.nodes if n.op == "output"]
    seen, todo = set(out), list(out)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    read = {n.target for n in seen if n.op in ("get_attr", "call_module")}
    return tuple(name for name, p in gm.named_parameters() if p.requires_grad
                 and not any(name == t or name.startswith(f"{t}.") for t in read))
