"""Graph capture: `capture_graph` runs the model once, layer by layer, and counts each
operator's FLOPs and bytes (the counting run) into a `ModelGraph`. The run is in fake tensors
(torch's FakeTensorMode: shapes and dtypes, nothing computed), so a large model is captured in
seconds; where that fails, in real tensors.

`Recorder.run_stage` runs one stage (one layer) forward through an `fx.Interpreter` and then
backward, under a `TorchDispatchMode` that sees every ATen call:

- forward calls are charged to the graph node being interpreted;
- backward calls are charged to the graph node whose autograd function is running
  (`torch._C._current_autograd_node()`, matched by sequence number to the autograd functions a
  node created in forward); the rest (gradient accumulation into parameters) is charged to the
  stage as a whole;
- tensors saved for backward are seen by `saved_tensors_hooks` and charged to the node that
  saved them, each tensor once per stage, parameters excluded.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
from collections import defaultdict

import networkx as nx
import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hetplan.planner.files.io import InputError
from hetplan.planner.workload import flops as F
from hetplan.planner.workload.flops import where
from hetplan.planner.workload.graph import Layer, ModelGraph, SplitPair, TiedParam
from hetplan.planner.workload.layers import example_inputs
from hetplan.planner.workload.load import with_values
from hetplan.planner.workload.partition import exported_stages
from hetplan.planner.workload.precision import autocast

_FIELDS = ("fwd_flops", "bwd_flops", "output_bytes", "saved_bytes", "fwd_bytes_moved",
           "bwd_bytes_moved", "fwd_n_ops", "bwd_n_ops", "cast_param_bytes")


_DEVICE = torch.ops.prim.device.default


class _Mode(TorchDispatchMode):
    def __init__(self, rec: "Recorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not _DEVICE:    # what fake tensors ask of each other: no work
            self.rec.charge(func, args, kwargs, out)
        return out


class Recorder:
    def __init__(self, params: list[torch.Tensor], forward_context=contextlib.nullcontext):
        self.forward_context = forward_context  # () -> context each stage's forward runs in
        self.param_ptrs = {where(p) for p in params}   # with their fake copies' (`fake`)
        # parameter-shaped tensors (weights, their transposes and gradients) are left out of
        # bytes moved so that it scales with the batch; an activation of exactly a parameter's
        # shape would be left out too (rare; not modelled)
        self.param_shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params}
        self.ops: dict[str, dict] = {}
        self.stage_extra: dict[int, dict] = defaultdict(lambda: defaultdict(float))
        # a value that crosses layers and that several layers save (a ReLU's output, the next
        # Linear's input) is one tensor: charged to the first layer that saves it; each later
        # one records (the layer saving it before, bytes) in `saved_from` (Layer.saved_from)
        self.saved_by: dict[tuple, int] = {}
        self.saved_from: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.warnings: set[str] = set()
        self.unattributed_bwd_flops = 0.0
        self._current: str | None = None     # forward: exported node being interpreted
        self._phase = "fwd"
        self._stage = 0
        self._by_seq: dict[int, str] = {}     # autograd sequence number -> exported node
        self._casts: list[torch.Tensor] = []  # autocast's copies of parameters (`_cast_of_param`)

    @staticmethod
    def empty() -> dict:
        return {f: 0.0 for f in _FIELDS} | {"shapes": (), "param_bytes": 0}

    def bytes_of(self, tree) -> int:
        return F.tensor_bytes(tree)

    def fake(self, mode, params: list[torch.Tensor]) -> None:
        """A counting run in fake tensors (`mode`): the parameters' fake copies count as them."""
        self._fakes = [mode.from_tensor(p) for p in params]   # alive: the mode converts to these
        self.param_ptrs |= {where(f) for f in self._fakes}

    def _entry(self, name: str) -> dict:
        return self.ops.setdefault(name, self.empty())

    # called by the dispatch mode for every ATen call
    def charge(self, func, args, kwargs, out) -> None:
        if self._cast_of_param(func, args, out):
            return
        fl = F.op_flops(func, args, kwargs, out)
        if fl is None:
            fl = 0.0
            if F.needs_warning(func):
                self.warnings.add(f"{func}: no FLOP formula; costed by bytes moved only")
        moved = 0 if F.is_view(func) else F.tensor_bytes((args, kwargs, out), self.param_ptrs,
                                                          self.param_shapes)
        n = 0 if F.is_view(func) else 1
        if self._phase == "fwd":
            e = self._entry(self._current) if self._current else self.stage_extra[self._stage]
            e["fwd_flops"] += fl
            e["fwd_bytes_moved"] += moved
            e["fwd_n_ops"] += n
            return
        node = torch._C._current_autograd_node()
        name = self._by_seq.get(node._sequence_nr()) if node is not None else None
        e = self._entry(name) if name else self.stage_extra[self._stage]
        if not name:
            self.unattributed_bwd_flops += fl
        e["bwd_flops"] += fl
        e["bwd_bytes_moved"] += moved
        e["bwd_n_ops"] += n

    def _cast_of_param(self, func, args, out) -> bool:
        """autocast's copy of a parameter (forward `_to_copy` of one): parameter-like, so its
        result joins param_ptrs and its bytes are charged as cast_param_bytes, not moved."""
        if (self._phase != "fwd" or func is not torch.ops.aten._to_copy.default or not args
                or not isinstance(args[0], torch.Tensor) or where(args[0]) not in self.param_ptrs):
            return False
        self.param_ptrs.add(where(out))
        self._casts.append(out)   # alive to the end: no activation may take its place
        if self._current:
            self._entry(self._current)["cast_param_bytes"] += out.numel() * out.element_size()
        return True

    def _map_autograd(self, name: str, result) -> None:
        """Every autograd function created by this node's forward: walk back to known ones."""
        todo = [t.grad_fn for t in pytree.tree_leaves(result)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            seq = fn._sequence_nr()
            if seq in self._by_seq or type(fn).__name__ == "AccumulateGrad":
                continue
            self._by_seq[seq] = name
            todo.extend(f for f, _ in fn.next_functions if f is not None)

    def run_stage(self, stage: fx.GraphModule, inputs: tuple, first: bool) -> tuple:
        """Forward then backward of one stage; returns its outputs, detached."""
        self._stage = stage.index
        if not first:
            inputs = tuple(x.detach().requires_grad_(x.is_floating_point())
                           if isinstance(x, torch.Tensor) else x for x in inputs)
        seen_saved: set[tuple] = set()
        rec = self
        alive = {_key(x) for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)}
        self.saved_by = {k: v for k, v in self.saved_by.items() if k in alive}   # the rest may be freed

        def pack(t):
            key = _key(t)
            if rec._current and key[0] not in rec.param_ptrs and key not in seen_saved:
                seen_saved.add(key)
                before = rec.saved_by.get(key)
                if before is not None and before != rec._stage:
                    rec.saved_from[rec._stage].append((before, t.numel() * t.element_size()))
                else:
                    rec._entry(rec._current)["saved_bytes"] += t.numel() * t.element_size()
            return t

        class Interp(fx.Interpreter):
            def run_node(self, n):
                origin = stage.node_origin.get(n.name)
                rec._current = origin.name if origin is not None and n.op == "call_function" else None
                result = super().run_node(n)
                if rec._current:
                    e = rec._entry(rec._current)
                    e["shapes"] = tuple(tuple(t.shape) for t in pytree.tree_leaves(result)
                                        if isinstance(t, torch.Tensor))
                    if not F.is_view(n.target):
                        e["output_bytes"] += F.tensor_bytes(result, rec.param_ptrs)
                    rec._map_autograd(rec._current, result)
                elif n.op == "placeholder" and first and origin is not None:
                    rec._entry(origin.name)["shapes"] = (tuple(result.shape),) \
                        if isinstance(result, torch.Tensor) else ()
                return result

        self._phase = "fwd"
        with _Mode(self), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                self.forward_context():
            outs = Interp(stage).run(*inputs)
        self._current = None
        for t in pytree.tree_leaves(outs):           # values this layer saved that later layers receive
            if isinstance(t, torch.Tensor) and _key(t) in seen_saved:
                self.saved_by[_key(t)] = self._stage
        leaves = [t for t in pytree.tree_leaves(outs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            grads = [torch.ones_like(t) for t in leaves]
            self._phase = "bwd"
            with _Mode(self):
                torch.autograd.backward(leaves, grads)
            self._phase = "fwd"
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outs)


def _key(t: torch.Tensor) -> tuple:
    return where(t), tuple(t.shape), t.dtype


@contextlib.contextmanager
def preserved(model: torch.nn.Module):
    """Restore buffers and parameter gradients after a counting run."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


# --- capture ---------------------------------------------------------------------------------
# How: the model is exported to a flat ATen graph and cut into one stage per layer
# (hetplan.planner.workload.layers and .partition, the same grouping `build_stages` uses). Each stage runs forward and then
# backward on its own, its inputs detached leaves that require grad (except the model inputs),
# so every layer's backward FLOPs are its own: a layer pays for its input gradient unless it is
# the first. A dispatch mode sees every ATen call: forward calls are charged to the graph node
# being interpreted, backward calls to the node whose autograd function is running.
# Not modelled: parameters are left out of bytes moved (weights are read from fast memory in
# the roofline), so bytes moved scale with the batch; the optimizer step is not part of a layer.
# Precision: the forward runs under hetplan.planner.workload.precision.autocast (backward outside it, as in
# training), so a bf16 graph's activation, saved and cut bytes are of the dtypes autocast really
# gives. autocast's bf16 copies of parameters are parameter-like (they do not scale with the
# batch): they are left out of saved bytes and bytes moved and counted in Layer.cast_param_bytes.

_PRINTED_WARNINGS: set[str] = set()
FAKE_COUNTING = True   # the counting run in fake tensors first (`_counting_run`)


def capture_graph(workload, batch: int, precision: str = "fp32") -> ModelGraph:
    """Capture `workload.model` at `batch` samples (inputs from `make_batch(batch, 0)`), its
    forward run in `precision` (hetplan.planner.workload.precision.autocast on the CPU).

    The model's state is left as it was: RNG, buffers (BatchNorm statistics) and gradients are
    restored after the counting run.
    """
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputError(f"--batch: expected a positive integer, got {batch!r}")
    model = workload.model
    ex, stages = exported_stages(workload, None, batch)
    inputs = example_inputs(workload, batch)
    counted = None
    if FAKE_COUNTING:
        try:
            rec, cuts = _counting_run(ex, stages, model, inputs, precision, fake=True)
            counted = "fake tensors"
        except Exception as e:   # an op without a fake kernel, or one whose shapes depend on data
            failed = f" ({type(e).__name__} in fake tensors)"
    if counted is None:
        whole = with_values(workload)   # a model built for its shapes only: built whole
        if whole is not workload:
            model = whole.model
            ex, stages = exported_stages(whole, None, batch)
            inputs = example_inputs(whole, batch)
        rec, cuts = _counting_run(ex, stages, model, inputs, precision, fake=False)
        counted = "real tensors" + (failed if FAKE_COUNTING else "")
    cut_bytes, cut_tensors, cut_grad = cuts
    layers = _layers(ex, stages, rec, dict(model.named_buffers()))
    tied = _tied(stages)
    g = _op_graph(ex, rec)
    warnings = sorted(rec.warnings)
    for w in warnings:
        if w not in _PRINTED_WARNINGS:
            _PRINTED_WARNINGS.add(w)
            print(f"hetplan: warning: {w}", file=sys.stderr)
    info = {"method": ex.method, "dynamic_batch": ex.dynamic_batch, "warnings": warnings, "counted": counted,
            "unattributed_bwd_flops": rec.unattributed_bwd_flops}
    return ModelGraph(layers=tuple(layers), batch=batch, cut_bytes=tuple(cut_bytes), ops=g, info=info,
                      precision=precision, tied=tied, pairs=_pairs(ex, model, rec),
                      cut_tensors=tuple(cut_tensors), cut_grad_tensors=tuple(cut_grad))


def _counting_run(ex, stages, model, inputs, precision: str, fake: bool):
    """The counting run, layer by layer: (its Recorder, (bytes, tensors and tensors carrying a
    gradient at each cut)). With `fake`, in fake tensors: shapes and dtypes without computing
    anything, so a model too large to run here is captured in seconds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    params = list(model.parameters())
    rec = Recorder(params, forward_context=lambda: autocast("cpu", precision))
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with preserved(model), torch.random.fork_rng(devices=[]), mode:
        if fake:
            rec.fake(mode, params)
        torch.manual_seed(0)
        cut_bytes = [rec.bytes_of(inputs)]
        h = ex.flat_inputs(inputs)
        grad = [False] * len(h)          # the model's data carries no gradient
        cut_tensors, cut_grad = [_tensor_count(h)], [0]
        for k, stage in enumerate(stages):
            h = rec.run_stage(stage, h, first=(k == 0))
            cut_bytes.append(rec.bytes_of(h))
            grad = carries_grad(stage, grad, model)
            cut_tensors.append(_tensor_count(h))
            cut_grad.append(sum(grad))
    return rec, (cut_bytes, cut_tensors, cut_grad)


def _tensor_count(tree) -> int:
    return sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(tree))


def carries_grad(stage: fx.GraphModule, inputs: list[bool], model: torch.nn.Module) -> list[bool]:
    """Which of a stage's outputs carry a gradient in training (what the runtime sends back for
    them): floating-point values that depend on a parameter requiring grad or on an input that
    carries one, outside no-grad regions; `inputs` says it of the stage's inputs. The counting
    run cannot tell: it makes every floating-point input of a layer a leaf requiring grad."""
    from hetplan.planner.workload.partition import resolve_attr
    flag: dict[fx.Node, bool] = {}
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    flag.update(zip(placeholders, inputs))
    grad_on, outs = True, []
    for n in stage.graph.nodes:
        if n.op == "get_attr":
            t = resolve_attr(model, stage, n.target)
            flag[n] = isinstance(t, torch.Tensor) and t.requires_grad
        elif n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            grad_on = bool(n.args[0])
        elif n.op in ("call_function", "call_method", "call_module"):
            val = n.meta.get("val")      # a tuple for a multi-output op; a SymInt carries none
            can = val.is_floating_point() if isinstance(val, torch.Tensor) else isinstance(val, (tuple, list, type(None)))
            flag[n] = grad_on and can and any(flag.get(a, False) for a in n.all_input_nodes)
        elif n.op == "output":
            outs = pytree.tree_leaves(n.args[0])
    return [isinstance(v, fx.Node) and flag.get(v, False) for v in outs]


def _pairs(ex, model, rec) -> tuple[SplitPair, ...]:
    """The model's candidate linear pairs (hetplan.planner.workload.tensor_split) with what a tensor
    split divides; a stage's are picked by ModelGraph.split_pairs."""
    from hetplan.planner.workload.tensor_split import candidates, needs_grad
    params = dict(model.named_parameters(remove_duplicate=False))
    layer = {n.name: ex.layer_of[n] for n in ex.compute_nodes()}
    out = []
    for p in candidates(ex.gm.graph, params):
        def tot(field: str, names) -> float:
            return sum(rec.ops.get(n, {}).get(field, 0.0) for n in names)
        col = (p.col, *p.between)
        split = [params[p.col_weight], params[p.row_weight]] + ([params[p.col_bias]] if p.col_bias else [])
        col_out = rec.ops.get(p.col, {}).get("output_bytes", 0.0)
        in_grad = col_out * p.in_features / p.hidden if needs_grad(ex.gm.graph, p.col_input, params) else 0.0
        out.append(SplitPair(layer[p.col], layer[p.row], tot("fwd_flops", col), tot("bwd_flops", col),
                             tot("fwd_flops", [p.row]), tot("bwd_flops", [p.row]),
                             sum(t.numel() * t.element_size() for t in split),
                             int(rec.ops.get(p.row, {}).get("output_bytes", 0.0)), int(in_grad),
                             p.col_weight, p.row_weight))
    return tuple(out)


def _tied(stages) -> tuple[TiedParam, ...]:
    """Parameters that more than one layer (one-layer stage) uses, by their first name."""
    used: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            used.setdefault(name, []).append(k)
            size[name] = p.numel() * p.element_size()
    return tuple(TiedParam(n, size[n], tuple(ls)) for n, ls in sorted(used.items()) if len(ls) > 1)


def _layers(ex, stages, rec, model_buffers: dict[str, torch.Tensor]) -> list[Layer]:
    out, owned, used = [], set(), set()
    for k, stage in enumerate(stages):
        names = [n for n in ex.compute_nodes() if ex.layer_of[n] == k]
        params = [(nm, p) for nm, p in stage.named_parameters() if id(p) not in owned]
        owned.update(id(p) for _, p in params)
        # the model's buffers go with the first layer using them (as hetplan.runtime.stage._buffer_sets)
        buffers: dict[str, int] = {}
        for nm, _ in stage.named_buffers():
            if nm in model_buffers and nm not in used:
                used.add(nm)
                b = model_buffers[nm]
                buffers[str(b.dtype)] = buffers.get(str(b.dtype), 0) + b.numel() * b.element_size()

        def tot(field: str, nodes=names) -> float:
            return sum(rec.ops[n.name][field] for n in nodes if n.name in rec.ops)

        out.append(Layer(
            index=k, name=ex.names[k],
            fwd_flops=tot("fwd_flops"), bwd_flops=tot("bwd_flops") + rec.stage_extra[k]["bwd_flops"],
            param_bytes=sum(p.numel() * p.element_size() for _, p in params),
            activation_bytes=int(tot("output_bytes")), saved_bytes=int(tot("saved_bytes")),
            saved_from=tuple(rec.saved_from.get(k, ())),
            fwd_bytes_moved=tot("fwd_bytes_moved"),
            bwd_bytes_moved=tot("bwd_bytes_moved") + rec.stage_extra[k]["bwd_bytes_moved"],
            n_ops=int(tot("fwd_n_ops")), bwd_n_ops=int(tot("bwd_n_ops") + rec.stage_extra[k]["bwd_n_ops"]),
            param_names=tuple(nm for nm, _ in params),
            signature=_signature(names, rec, ex.dynamic_batch), cast_param_bytes=int(tot("cast_param_bytes")),
            buffer_bytes=tuple(sorted(buffers.items()))))
    return out


def _signature(nodes, rec, dynamic: bool) -> str:
    """sha1 of the layer's (target, output shapes) in order: equal layers share costs (the
    layer-cost cache's key, hetplan.planner.cost.timing). From a dynamic-batch export, a dimension that
    scales with the batch is written as its expression in B (`_batch_shapes`), so a layer
    captured at any batch has one key; from a static one (the model fixes its batch), the
    shapes at the capture batch."""
    h = hashlib.sha1()
    for n in nodes:
        shapes = _batch_shapes(n) if dynamic else None
        if shapes is None:
            shapes = rec.ops.get(n.name, {}).get("shapes")
        h.update(f"{n.target}|{shapes}\n".encode())
    return h.hexdigest()[:16]


def _batch_shapes(node: fx.Node) -> tuple | None:
    """The shapes of the node's output tensors as the export traced them: an int per fixed
    dimension, the dimension's expression in B (the batch, every input's dynamic dim 0) where
    it scales with the batch, e.g. (B, 1024) or (128*B, 256); None without traced values."""
    val = node.meta.get("val")
    if val is None:
        return None
    out = []
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            out.append(tuple(_batch_dim(d) for d in t.shape))
    return tuple(out)


def _batch_dim(d) -> int | str:
    if not isinstance(d, torch.SymInt):
        return int(d)
    import sympy
    expr = d.node.expr
    if not expr.free_symbols:
        return int(expr)
    b = sympy.Symbol("B", positive=True, integer=True)
    return str(expr.xreplace({x: b for x in expr.free_symbols}))


def _op_graph(ex, rec) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in ex.gm.graph.nodes:
        if n.op == "placeholder":
            g.add_node(n.name, kind="input", target="input", layer=-1,
                       shapes=rec.ops.get(n.name, {}).get("shapes", ()))
    for n in ex.compute_nodes():
        g.add_node(n.name, kind="op", target=str(n.target), layer=ex.layer_of[n],
                   **rec.ops.get(n.name, rec.empty()))
        for a in n.all_input_nodes:
            if a.name in g:
                g.add_edge(a.name, n.name)
    return g
