"""A stage's backward split in two passes for zero-bubble schedules (zb-h1: actions I and W).

`input_pass` computes only the gradient of the stage's inputs (what the previous stage waits
for) and keeps, for each autograd node where a weight's gradient path leaves the input-gradient
path (the weights' "intermediates"), the gradient that reached it. `WeightPass.run`, later,
resumes from those gradients down to the weights, one group of weights sharing intermediates at
a time (torch.distributed.pipelining's param groups: one backward call from all intermediates
would run the input-gradient path again, from the last layer's intermediates down to the first
layer's weights), so no part of the backward runs twice (the rule of
torch.distributed.pipelining._backward's stage_backward_input / stage_backward_weight). Unlike torch's, the weight pass accumulates
through autograd (`backward(inputs=weights)`), so post-accumulate-grad hooks fire as in a fused
backward (hetplan.runtime.sync's fine-grained all-reduces).

Where the stage's inputs need no gradient (the first stage), or a weight's gradient does not
pass through the input-gradient path, the input pass computes nothing and the weight pass is the
whole backward, as torch does on its first stage.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _node(t: torch.Tensor) -> Node:
    """The autograd node producing t (a leaf's gradient accumulator)."""
    return get_gradient_edge(t).node


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward feeds it (the graph's edges reversed), from `roots`."""
    parents: dict[Node, list[Node]] = {}
    todo, seen = deque(roots), set(roots)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return parents


def _upward(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` towards the outputs, not crossing `stop`; and the stop nodes met."""
    reached, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for p in parents.get(todo.popleft(), ()):
            if p in stop:
                met.add(p)
            elif p not in reached:
                reached.add(p)
                todo.append(p)
    return reached, met


@dataclass
class WeightPass:
    """What the W pass needs: the weight groups (weights, their intermediates) and the gradients
    the intermediates received in the I pass; or (`fused`) the outputs and their gradients for a
    whole backward."""
    weights: list[torch.Tensor]
    groups: list[tuple[list[torch.Tensor], list[Node]]] = field(default_factory=list)
    grads: dict[Node, tuple] = field(default_factory=dict)
    fused: tuple | None = None           # (outputs, output gradients)

    @property
    def intermediates(self) -> list[Node]:
        return [n for _, nodes in self.groups for n in nodes]

    def run(self) -> None:
        """Accumulate the weights' gradients into .grad (hooks fire as in a fused backward)."""
        if self.fused is not None:
            outs, grads = self.fused
            if outs and self.weights:
                torch.autograd.backward(outs, grads, inputs=self.weights)
            return
        try:
            for weights, nodes in self.groups:
                self._group(weights, nodes)
        finally:
            self.groups, self.grads = [], {}

    def _group(self, weights: list[torch.Tensor], nodes: list[Node]) -> None:
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(self.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            return
        # an intermediate may also be reached from another of its group: it takes exactly the
        # gradient it had in the I pass, not that plus what flows into it again
        handles = [n.register_prehook(lambda _, saved=self.grads[n]: saved) for n in nodes if n in self.grads]
        try:   # groups share no node below their intermediates, but may share those
            torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)
        finally:
            for h in handles:
                h.remove()


def input_pass(outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
               weights: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The gradients of `inputs` (those requiring one; None for the others) from `outputs` with
    output gradients `grads` (None: a scalar loss), and the W pass still to run."""
    need = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    fused = WeightPass(weights, fused=(outputs, grads))
    if not need or not outputs:
        return [None] * len(inputs), fused
    roots = [_node(o) for o in outputs]
    parents = _parents(roots)
    input_path, _ = _upward([_node(x) for x in need], parents, set())
    groups: list[tuple[list[torch.Tensor], set[Node]]] = []
    for w in weights:
        node = _node(w)
        if node not in parents:
            continue                      # not used by these outputs: no gradient either way
        _, met = _upward([node], parents, input_path)
        if not met:                       # its gradient never meets the input path
            return _fused_inputs(outputs, grads, inputs, need), fused
        joined = [g for g in groups if g[1] & met]      # weights sharing an intermediate: one group
        groups = [g for g in groups if not g[1] & met]
        groups.append(([x for g in joined for x in g[0]] + [w], met.union(*(g[1] for g in joined))))
    # the last layers' groups first, as a fused backward finishes them (gradient buckets become
    # final in the order hetplan.runtime.sync and the simulator expect)
    ordered = sorted(groups, key=lambda g: -max(n._sequence_nr() for n in g[1]))
    wp = WeightPass(weights, [(ws, sorted(nodes, key=lambda n: -n._sequence_nr())) for ws, nodes in ordered])

    def keep(node):
        return lambda grad_outputs: wp.grads.__setitem__(node, grad_outputs)
    handles = [n.register_prehook(keep(n)) for n in wp.intermediates]
    try:
        got = torch.autograd.grad(outputs, need, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(x): g for x, g in zip(need, got)}
    return [by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in inputs], wp


def _fused_inputs(outputs, grads, inputs, need) -> list[torch.Tensor | None]:
    """The inputs' gradients alone, keeping the graph for a whole backward in the W pass (the
    input path is computed twice; used only where a weight's gradient avoids that path)."""
    got = torch.autograd.grad(outputs, need, grads, retain_graph=True, allow_unused=True)
    by_id = {id(x): g for x, g in zip(need, got)}
    return [by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in inputs]


__all__ = ["input_pass", "WeightPass"]
