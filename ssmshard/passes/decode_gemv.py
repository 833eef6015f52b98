"""The ``decode_gemv`` pass: a decode step's linear layers on the skinny-matmul kernel.

A decode step multiplies each projection weight by one row per sequence of the batch; its time
is the weight's bytes. Every ``aten.linear`` node of a decode program becomes an
``ssmshard.decode_linear`` node, which ``swap_kernels`` (run after) puts on the kernel of
``kernels/gemv.py``: at batch 1 it streams the weight in one kernel, where cuBLAS runs a split-K
GEMV and a reduce kernel (benchmarks/results/gemv/); up to 64 rows it takes the shapes where it
was measured faster than cuBLAS (``kernels.gemv.prefers_cublas``), and the rest reach cuBLAS
through the same node.

Mamba's ``dt_proj`` is captured as ``weight @ x`` (``aten.matmul`` with the weight first, x
``(b, k, 1)``): it becomes ``decode_linear(x.mT, weight).mT``, two views around the same node.

Each new node takes the tags and placement of the node it replaces (placements of the views
with their last two dims swapped).
"""

from __future__ import annotations

import torch

from .manager import register
from .shard.context import new_node, value_of

aten = torch.ops.aten
ssm = torch.ops.ssmshard


def _is_weight(node) -> bool:
    value = value_of(node)
    return node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() == 2


def _transposed_placement(placement, ndim: int):
    """``placement`` (None: unsharded) of a tensor seen with its last two dims swapped."""
    dim = getattr(placement, "dim", None)
    if dim is None or dim < ndim - 2:
        return placement
    return placement.with_dim(2 * ndim - 3 - dim)


def _node(graph, target, args, like, placement):
    """``new_node`` (``like``'s tags and source, the value from its inputs) with ``placement``."""
    node = new_node(graph, target, args, like)
    if placement is not None:
        node.meta["placement"] = placement
    return node


def _retarget_linear(graph, node) -> bool:
    x, weight, bias = (list(node.args) + [None])[:3]
    if node.kwargs or not _is_weight(weight):
        return False
    with graph.inserting_before(node):
        new = _node(graph, ssm.decode_linear.default, (x, weight, bias), node, node.meta.get("placement"))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _retarget_weight_matmul(graph, node) -> bool:
    """``weight @ x`` (x (..., k, l)) as ``decode_linear(x.mT, weight).mT``."""
    weight, x = node.args
    x_val = value_of(x)
    if node.kwargs or not _is_weight(weight) or not isinstance(x_val, torch.Tensor) or x_val.dim() < 3:
        return False
    ndim = x_val.dim()
    placement = node.meta.get("placement")
    with graph.inserting_before(node):
        rows = _node(graph, aten.transpose.int, (x, -2, -1), node,
                     _transposed_placement(x.meta.get("placement"), ndim))
        linear = _node(graph, ssm.decode_linear.default, (rows, weight, None), node,
                       _transposed_placement(placement, ndim))
        back = _node(graph, aten.transpose.int, (linear, -2, -1), node, placement)
    node.replace_all_uses_with(back)
    graph.erase_node(node)
    return True


@register("decode_gemv")
def decode_gemv(program, ctx):
    """Put every linear layer of a decode program on ``ssmshard.decode_linear`` (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    report = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default:
            done = _retarget_linear(graph, node)
        elif node.target is aten.matmul.default and len(node.args) == 2:
            done = _retarget_weight_matmul(graph, node)
        else:
            continue
        if done:
            report.append(node.name)
    program.gemv_report = report
    return program
