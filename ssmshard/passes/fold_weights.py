"""The ``fold_weights`` pass: compute weight-only subgraphs once per binding of the weights.

Nodes whose inputs are only weights (parameters, buffers, lifted constants) or other such nodes
give the same values every call: Mamba's ``A = -exp(A_log.float())``, the float32 casts of
``dt_bias`` and ``D``. This pass moves them into a separate graph (``program.folded``, a
:class:`FoldedWeights`); the program takes each value they hand to the rest of the graph as one
more input (a ``derived`` input), which ``Program.weight_args`` computes from the bound weights
on first use and again whenever a weight is replaced (another tensor bound) or modified in
place (its version counter moved).

Inference programs only: the folded values are computed without autograd, so no gradient
reaches the weights through them. ``Plan.pipeline`` runs it on decode programs, and on
prefill/chunk programs when ``Plan(training=False)``; ``Plan(fold_weights=False)`` switches it off.

Only pure aten ops (no mutation, no randomness) fold; a value that would take more memory than
``max_bytes`` (option, default 16 MiB) beyond the weights it reads stays in the graph, so a
cast of a large matrix is not kept twice.
"""

from __future__ import annotations

import operator

import torch

from ..program import GraphInput
from .manager import register

DEFAULT_MAX_BYTES = 16 << 20


class FoldedWeights:
    """The weight-only subgraph of a program: ``values(weights)`` -> derived input tensors."""

    def __init__(self, graph_module: torch.fx.GraphModule, sources: list[str], names: list[str]):
        self.graph_module = graph_module
        self.sources = sources  # weight FQNs the subgraph reads, in its placeholder order
        self.names = names  # the derived inputs it computes, in its output order
        self._key = None
        self._values: dict[str, torch.Tensor] = {}

    def values(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The derived inputs for ``weights``, recomputed when a source tensor changed."""
        tensors = [weights[fqn] for fqn in self.sources]
        key = tuple((id(t), t._version) for t in tensors)
        if key != self._key:
            with torch.no_grad():
                outputs = self.graph_module(*tensors)
            self._values = dict(zip(self.names, outputs))
            self._key = key
        return self._values


def _foldable_op(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or getattr(node.target, "namespace", None) != "aten":
        return False
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return True


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


@register("fold_weights")
def fold_weights(program, ctx):
    """Move weight-only subgraphs into ``program.folded`` (see the module docstring)."""
    if program.mode == "forward":
        raise ValueError("fold_weights is for inference programs; a forward program is trained through")
    if getattr(program, "folded", None) is not None:
        raise ValueError("fold_weights already ran on this program")
    max_bytes = ctx.options.get("max_bytes", DEFAULT_MAX_BYTES)
    graph = program.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weight_of = {n: spec.target for n, spec in zip(placeholders, program.inputs) if spec.kind != "user"}
    folded: set[torch.fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if inputs and _foldable_op(node) and all(i in weight_of or i in folded for i in inputs):
            folded.add(node)
    # The values the rest of the graph reads (tensors only: a getitem of a folded tuple is the value).
    frontier = [n for n in graph.nodes if n in folded and isinstance(n.meta.get("val"), torch.Tensor)
                and any(u not in folded for u in n.users)]
    frontier = [n for n in frontier if _nbytes(n) <= max_bytes
                or _nbytes(n) <= sum(_nbytes(w) for w in n.all_input_nodes if w in weight_of)]
    if not frontier:
        program.folded = None
        return program
    # The subgraph: the folded nodes the frontier needs, over the weights they read.
    needed, stack = set(), list(frontier)
    while stack:
        node = stack.pop()
        if node in needed or node in weight_of:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    sub = torch.fx.Graph()
    env, sources = {}, []
    for node in placeholders:
        if node in weight_of and any(u in needed for u in node.users):
            env[node] = sub.placeholder(node.name)
            env[node].meta = dict(node.meta)
            sources.append(weight_of[node])
    for node in graph.nodes:
        if node in needed:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in frontier))
    names = [f"folded_{n.name}" for n in frontier]
    # Each frontier value becomes a placeholder before the user inputs, as weights are.
    first_user = next(n for n, spec in zip(placeholders, program.inputs) if spec.kind == "user")
    position = next(i for i, spec in enumerate(program.inputs) if spec.kind == "user")
    for offset, (node, name) in enumerate(zip(frontier, names)):
        with graph.inserting_before(first_user):
            derived = graph.placeholder(name)
        derived.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(derived)
        program.inputs.insert(position + offset, GraphInput(derived.name, "derived", name))
    for node in reversed(list(graph.nodes)):
        if node in folded and not node.users:
            graph.erase_node(node)
    program.folded = FoldedWeights(torch.fx.GraphModule(program.graph_module, sub), sources, names)
    return program
