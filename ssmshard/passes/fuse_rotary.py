"""The ``fuse_rotary`` pass: attention's rotary embedding of q and k as one ``ssmshard.rotary`` node.

Hugging Face's ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Zamba2 with ``use_mem_rope``)
captures, per tensor, as::

    lo = x[..., :p/2]; hi = x[..., p/2:]
    out = x * cos + cat([-hi, lo], -1) * sin

five kernels on a GPU (two products, the negation, the concatenation, the sum), ten a layer
for q and k: at batch 64 a Llama-3-8B-sized decode step spent about 24 us a layer in them on an
H200 (benchmarks/results/decode_profile/, "Batch 64, kernel by kernel"). Every such chain whose
x is 4-D with an even head dim p, whose cos and sin broadcast to x and share its dtype, becomes
an ``ssmshard.rotary([x], cos, sin)`` output; two chains reading the same cos and sin (a layer's
q and k) share one node, which ``swap_kernels`` puts on one launch of ``kernels/rotary.py``.
The kernel rounds where torch rounds, so the values are eager's bit for bit.

The shared node stands after the last of its inputs; where a reader of the first chain's output
comes before that (no captured model does it), the chains get a node each. A chain whose x is
split along its head dim is left as it is (the halves would be on different ranks).

Runs on decode programs (where launches, not bytes, are the cost) before ``swap_kernels``.
``program.rotary_report`` lists the fused chains by their sum nodes' names, grouped as fused.
``Plan(skip_passes=["fuse_rotary"])`` turns it off.
"""

from __future__ import annotations

import operator

import torch

from ..placement import Shard
from .manager import register
from .shard.context import calls, new_node, node_order, value_of

aten = torch.ops.aten
ssm = torch.ops.ssmshard
MAX_GROUP = 2  # kernels.rotary.MAX_TENSORS (not imported: that module needs Triton)


def _is(node, target) -> bool:
    """``calls(node, target)`` with every argument positional (as export writes these ops)."""
    return calls(node, target) and not node.kwargs


def _half_slice(node, x, start: bool):
    """Whether ``node`` is ``x[..., :p/2]`` (``start``) or ``x[..., p/2:]``."""
    if not _is(node, aten.slice.Tensor) or node.args[0] is not x:
        return False
    dim, begin, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    p = value_of(x).shape[-1]
    if dim not in (-1, value_of(x).dim() - 1) or step != 1:
        return False
    half = p // 2
    return (begin in (0, None) and end == half) if start else (begin == half and (end is None or end >= p))


def _rotated_input(cat):
    """x where ``cat`` is ``cat([-x[..., p/2:], x[..., :p/2]], -1)``, else None."""
    if not _is(cat, aten.cat.default) or len(cat.args) != 2 or len(cat.args[0]) != 2:
        return None
    neg, low = cat.args[0]
    if not _is(neg, aten.neg.default) or not _is(low, aten.slice.Tensor):
        return None
    x = low.args[0]
    value = value_of(x)
    if not isinstance(value, torch.Tensor) or cat.args[1] not in (-1, value.dim() - 1):
        return None
    return x if _half_slice(low, x, True) and _half_slice(neg.args[0], x, False) else None


def _match(add):
    """The chain ending at ``add``: {x, cos, sin, nodes (the chain, sum first)}, or None."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or not all(_is(a, aten.mul.Tensor) for a in add.args):
        return None
    for direct, rotated in (add.args, add.args[::-1]):
        cat, sin = next(((a, b) for a, b in (rotated.args, rotated.args[::-1]) if _rotated_input(a) is not None),
                        (None, None))
        if cat is None:
            continue
        x = _rotated_input(cat)
        if x not in direct.args or direct.args[0] is direct.args[1]:
            continue
        cos = direct.args[1] if direct.args[0] is x else direct.args[0]
        neg, low = cat.args[0]
        return {"x": x, "cos": cos, "sin": sin, "nodes": [add, direct, rotated, cat, neg, neg.args[0], low]}
    return None


def _fusable(match) -> bool:
    x, cos, sin = (value_of(match[k]) for k in ("x", "cos", "sin"))
    if not all(isinstance(v, torch.Tensor) for v in (x, cos, sin)):
        return False
    if x.dim() != 4 or x.shape[-1] % 2 or not (x.dtype == cos.dtype == sin.dtype) or not x.dtype.is_floating_point:
        return False
    try:
        if torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape:
            return False
    except RuntimeError:
        return False
    placement = match["x"].meta.get("placement")
    return not (isinstance(placement, Shard) and placement.dim in (-1, x.dim() - 1))


def _groups(matches, order):
    """Matches sharing (cos, sin), ``MAX_GROUP`` at a time, where one node after their inputs can stand
    before every reader of their outputs; the others alone."""
    by_tables = {}
    for match in matches:
        by_tables.setdefault((match["cos"], match["sin"]), []).append(match)
    groups = []
    for same in by_tables.values():
        same.sort(key=lambda m: order[m["nodes"][0]])
        while same:
            group = same[:MAX_GROUP]
            while len(group) > 1:
                last_input = max(order[n] for m in group for n in (m["x"], m["cos"], m["sin"]))
                if last_input < min(order[u] for m in group for u in m["nodes"][0].users):
                    break
                group = group[:-1]
            groups.append(group)
            same = same[len(group):]
    return groups


def _fuse(graph, group, order) -> None:
    anchor = max((n for m in group for n in (m["x"], m["cos"], m["sin"])), key=order.__getitem__)
    sums = [m["nodes"][0] for m in group]
    with graph.inserting_after(anchor):
        node = new_node(graph, ssm.rotary.default, ([m["x"] for m in group], group[0]["cos"], group[0]["sin"]),
                        sums[0])
    placements = [s.meta.get("placement") for s in sums]
    if all(p is not None for p in placements):
        node.meta["placement"] = tuple(placements)
    previous = node
    for i, total in enumerate(sums):
        with graph.inserting_after(previous):
            out = new_node(graph, operator.getitem, (node, i), total)
        if placements[i] is not None:
            out.meta["placement"] = placements[i]
        total.replace_all_uses_with(out)
        previous = out
    for match in group:
        for chain_node in match["nodes"]:
            if not chain_node.users:
                graph.erase_node(chain_node)


@register("fuse_rotary")
def fuse_rotary(program, ctx):
    """Replace each rotary-embedding chain by an ``ssmshard.rotary`` output (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    matches = [m for m in map(_match, list(graph.nodes)) if m is not None and _fusable(m)]
    order = node_order(graph)
    groups = _groups(matches, order)
    for group in groups:
        _fuse(graph, group, order)
    program.rotary_report = [[m["nodes"][0].name for m in group] for group in groups]
    return program
