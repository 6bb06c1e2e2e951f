"""Tensor split of a stage between devices (Megatron column/row parallel): which linear
operators pair up, and which slice of a pair's hidden features each device holds.

A *pair* is two `aten.linear` calls A -> B where B's input is A's output through elementwise
operators only (ReLU, GELU, SiLU, tanh, sigmoid, dropout with p = 0), each used once, and B's
input features are A's output features. A is split by output features (column parallel), B
by input features (row parallel): with the hidden features cut in slices, each device computes
its slice of A, the elementwise ops and its partial product of B, and the partial outputs are
summed (an all-reduce); in backward the gradients of A's input are summed the same way. Pairs
are taken greedily in execution order (a linear ending a pair starts none: `greedy`), so the
built-in `mlp` pairs its layers two by two and `gpt` pairs each block's `fc` -> `fc_out`. Everything
else (attention, norms, embeddings, unpaired linears) runs whole on every device of the stage.

Dropout with p > 0 between A and B is not paired: each device would draw its own mask.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import fx

_aten = torch.ops.aten
ELEMENTWISE = {_aten.relu.default, _aten.gelu.default, _aten.silu.default, _aten.tanh.default,
               _aten.sigmoid.default}
LINEAR = _aten.linear.default


@dataclass(frozen=True)
class LinearPair:
    """A column-split linear, the elementwise ops after it, and the row-split linear."""
    col_input: str                 # graph node names: A's input, A, the ops between, B
    col: str
    between: tuple[str, ...]
    row: str
    col_weight: str                # get_attr targets (parameter names)
    col_bias: str | None
    row_weight: str
    row_bias: str | None
    hidden: int                    # the features cut in slices: A's outputs, B's inputs
    in_features: int               # A's inputs
    out_features: int              # B's outputs


def _attr(n) -> str | None:
    return n.target if isinstance(n, fx.Node) and n.op == "get_attr" else None


def _elementwise(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in ELEMENTWISE:
        return True
    return n.target is _aten.dropout.default and len(n.args) > 1 and n.args[1] == 0.0


def candidates(graph: fx.Graph, params: Mapping[str, torch.Tensor],
               exclude: frozenset[str] = frozenset()) -> list[LinearPair]:
    """Every linear A -> B of `graph` that may pair, in execution order of A (a linear may be
    the B of one candidate and the A of the next); `params` maps get_attr targets to tensors.
    A weight read by more than one get_attr use, or named in `exclude` (tied weights used in
    other stages), is never split."""
    uses = Counter(n.target for n in graph.nodes if n.op == "get_attr" for _ in n.users)
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]

    def weight_ok(n: fx.Node) -> bool:
        w = _attr(n.args[1])
        b = _attr(n.args[2]) if len(n.args) > 2 and n.args[2] is not None else None
        ok = w is not None and uses[w] == 1 and w not in exclude and isinstance(params.get(w), torch.nn.Parameter)
        return ok and params[w].dim() == 2 and (b is None or (uses[b] == 1 and b not in exclude))

    out = []
    for a in linears:
        if not weight_ok(a):
            continue
        between, cur = [], a
        while len(cur.users) == 1 and _elementwise(nxt := next(iter(cur.users))):
            between.append(nxt)
            cur = nxt
        if len(cur.users) != 1:
            continue
        b = next(iter(cur.users))
        if b.op != "call_function" or b.target is not LINEAR or b.args[0] is not cur or not weight_ok(b):
            continue
        wa, wb = params[_attr(a.args[1])], params[_attr(b.args[1])]
        if wb.shape[1] != wa.shape[0]:
            continue
        bias = [(_attr(n.args[2]) if len(n.args) > 2 else None) for n in (a, b)]
        out.append(LinearPair(a.args[0].name, a.name, tuple(n.name for n in between), b.name, _attr(a.args[1]),
                              bias[0], _attr(b.args[1]), bias[1], int(wa.shape[0]), int(wa.shape[1]),
                              int(wb.shape[0])))
    return out


def greedy(cands: list):
    """The pairs taken from candidates in execution order: a candidate whose first linear ends
    a pair already taken is skipped. Candidates are identified by their weights (`col_weight`,
    `row_weight`), so the same rule picks a stage's pairs from its own graph (runtime) and from
    the whole model's candidates within the stage's layers (ModelGraph.split_pairs)."""
    out, rows = [], set()
    for c in cands:
        if c.col_weight not in rows:
            out.append(c)
            rows.add(c.row_weight)
    return out


def find_pairs(graph: fx.Graph, params: Mapping[str, torch.Tensor],
               exclude: frozenset[str] = frozenset()) -> list[LinearPair]:
    """The pairs a stage of this graph splits: `greedy(candidates(...))`."""
    return greedy(candidates(graph, params, exclude))


def split_bounds(n: int, shares) -> list[tuple[int, int]]:
    """[lo, hi) of n features per share, in order: bounds at round(n * cumulative share), so
    the slices cover [0, n) exactly."""
    acc, bounds = 0.0, [0]
    for s in shares:
        acc += s
        bounds.append(min(n, round(n * acc)))
    bounds[-1] = n
    return list(zip(bounds, bounds[1:]))


def needs_grad(graph: fx.Graph, node_name: str, params: Mapping[str, torch.Tensor]) -> bool:
    """Whether the value `node_name` depends on a trainable parameter (its gradient is then
    computed, and under a split summed over the devices). Graph inputs count as not needing
    one: the split stage starts at the model's inputs (hetplan.planner.files.plan)."""
    nodes = {n.name: n for n in graph.nodes}
    todo, seen = [nodes[node_name]], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        t = _attr(n)
        if t is not None and getattr(params.get(t), "requires_grad", False):
            return True
        todo.extend(n.all_input_nodes)
    return False


__all__ = ["LinearPair", "candidates", "greedy", "find_pairs", "split_bounds", "needs_grad", "ELEMENTWISE"]
