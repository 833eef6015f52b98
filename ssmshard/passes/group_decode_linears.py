"""The ``group_decode_linears`` pass: a decode step's linear layers that read the same input, as
one ``ssmshard.decode_linear_group`` node (one kernel launch at batch 1).

Attention blocks project one normed input three times (q, k, v) and gated MLPs twice (gate,
up); Zamba2's shared MLP adds its adapter's first projection to those. After ``decode_gemv`` each
is an ``ssmshard.decode_linear`` node, run as its own kernel at batch 1, and in a CUDA-graphed
step every kernel costs a dependent launch whatever it moves (benchmarks/results/decode_profile/).
Up to ``kernels.gemv.MAX_GROUP`` of them that read the same node, have no bias, and whose
weights (placeholders) share the input's dtype and width become one node returning their outputs
in order; each original node becomes ``getitem(group, i)`` with its own tags and placement. The
group node stands where the first of them stood: its input is computed by then, and the weights
are program inputs. ``swap_kernels`` puts it on ``kernels/gemv.py``'s grouped kernel (one row),
or on ``decode_linear``'s per-weight path for larger batches.

Runs on decode programs after ``decode_gemv`` (and after the sharding passes: each weight is the
rank's shard), before ``swap_kernels``. ``program.linear_group_report`` lists the groups by their
nodes' names. ``Plan(skip_passes=["group_decode_linears"])`` turns it off.
"""

from __future__ import annotations

import operator

import torch

from ..kernels.launch_math import cdiv
from .manager import register
from .shard.context import new_node, node_order, value_of

ssm = torch.ops.ssmshard
MAX_GROUP = 4  # kernels.gemv.MAX_GROUP (not imported: that module needs Triton)


def _groupable(linear, x) -> bool:
    """Whether ``linear`` is ``decode_linear(x, weight)`` without bias, weight a 2-D input of x's
    dtype and width."""
    args = list(linear.args) + [None] * (3 - len(linear.args))
    weight, bias = args[1], args[2]
    w, xv = value_of(weight), value_of(x)
    return (linear.target is ssm.decode_linear.default and args[0] is x and bias is None and not linear.kwargs
            and isinstance(weight, torch.fx.Node) and weight.op == "placeholder" and isinstance(w, torch.Tensor) and isinstance(xv, torch.Tensor)
            and w.dim() == 2 and w.dtype == xv.dtype and w.shape[1] == xv.shape[-1])


def _chunks(items: list, size: int) -> list:
    """``items`` in consecutive chunks of at most ``size``, as even as that allows (5 -> 3 + 2)."""
    count = cdiv(len(items), size)
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def _group(graph, x, linears) -> torch.fx.Node:
    weights = [linear.args[1] for linear in linears]
    with graph.inserting_before(linears[0]):
        group = new_node(graph, ssm.decode_linear_group.default, (x, weights), linears[0])
        if all("placement" in linear.meta for linear in linears):
            group.meta["placement"] = tuple(linear.meta["placement"] for linear in linears)
        for i, linear in enumerate(linears):
            out = new_node(graph, operator.getitem, (group, i), linear)
            if "placement" in linear.meta:
                out.meta["placement"] = linear.meta["placement"]
            linear.replace_all_uses_with(out)
    for linear in linears:
        graph.erase_node(linear)
    return group


@register("group_decode_linears")
def group_decode_linears(program, ctx):
    """Group each decode step's linear layers that share their input (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    order = node_order(graph)
    report = []
    for x in list(graph.nodes):
        linears = sorted((u for u in x.users if _groupable(u, x)), key=order.__getitem__)
        if len(linears) < 2:
            continue
        for chunk in _chunks(linears, MAX_GROUP):
            if len(chunk) > 1:
                report.append([linear.name for linear in chunk])
                _group(graph, x, chunk)
    program.linear_group_report = report
    return program
