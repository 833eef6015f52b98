"""The ``token_major_in_proj`` pass: Mamba-1's ``in_proj`` computed in the layout its readers want.

Dimension letters: b batch, l tokens, h hidden size, f in_proj's features (2 d: the conv's input
x and the gate z).

Hugging Face's Mamba mixer projects and then transposes::

    xz = linear(hidden, in_proj_weight)        # (b, l, f), features contiguous
    xz = transpose(xz, 1, 2)                   # (b, f, l): a view, features still contiguous
    x, z = chunk(xz, 2, 1)                     # the conv reads x, the scan z

so the conv, its output (the scan's u) and z all reach the scan channel-contiguous, where the
scan kernel walks each channel's tokens: reading them token-contiguous is faster (on an H200
at Mamba-2.8B's width, 8 x 2048 tokens: 1.238 ms against 1.428 ms a layer,
benchmarks/results/compile/scan_delta_layout_probe.log). The pass computes the same product
with its operands swapped, which lays the output out token-contiguous at no extra pass over
memory::

    xz = matmul(in_proj_weight, transpose(hidden, 1, 2))    # (f, h) @ (b, h, l) -> (b, f, l)

Then x and z are token-contiguous views, and so is the conv's output (its kernel writes the
layout of its input). The products are the same sums; only the GEMM's order of accumulation
may differ (float32 accumulation either way).

Where it applies: a ``linear`` without bias whose only reader is ``transpose(., 1, 2)`` of its
3-D output, whose data reaches a ``causal_conv1d`` node through views and splits alone (Mamba and
Falcon-Mamba; Zamba's mixer reads its projection per head, which this does not match). The plan
runs it on inference programs only (a forward that does not train, prefill, chunk): with a
weight that requires grad, ATen's matmul folds the transposed operand into rows with a copy.
``program.token_major_report`` lists the projections rewritten.
``Plan(skip_passes=["token_major_in_proj"])`` turns it off.
"""

from __future__ import annotations

import torch

from .manager import register
from .shard.context import new_node, single_user, view_source

aten = torch.ops.aten
ssm = torch.ops.ssmshard


def _is_projection(node) -> bool:
    """A ``linear`` without bias of a 3-D input."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return False
    value = node.meta.get("val")
    return (len(node.args) < 3 or node.args[2] is None) and value is not None and value.dim() == 3


def _transposed_projection(conv):
    """The ``transpose(linear, 1, 2)`` that ``conv``'s input is a view of (through views and
    splits), the linear read by it alone; or None."""
    node = conv.args[0]
    while node is not None:
        if (node.target is aten.transpose.int and sorted(node.args[1:3]) == [1, 2]
                and _is_projection(node.args[0]) and single_user(node.args[0]) is node):
            return node
        node = view_source(node)
    return None


@register("token_major_in_proj")
def token_major_in_proj(program, ctx):
    graph, report = program.graph, []
    convs = [n for n in graph.nodes if n.op == "call_function" and n.target is ssm.causal_conv1d.default]
    for conv in convs:
        transposed = _transposed_projection(conv)
        if transposed is None:
            continue
        linear = transposed.args[0]
        hidden, weight = linear.args[:2]
        with graph.inserting_before(transposed):
            swapped = new_node(graph, aten.transpose.int, (hidden, 1, 2), linear)
            product = new_node(graph, aten.matmul.default, (weight, swapped), linear)
        transposed.replace_all_uses_with(product)
        graph.erase_node(transposed)
        graph.erase_node(linear)
        report.append({"node": product.name, "weight": getattr(weight, "name", str(weight))})
    program.token_major_report = report
    return program
