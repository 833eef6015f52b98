"""Linear algebra: linear, matmul and the embedding lookup.

Column-parallel (weight rows split, input whole) gives an output split like the rows;
row-parallel (weight columns and input features split alike) gives partial sums, with the
bias added once after they are reduced; a replicated weight keeps a cut on any other dim.
"""

from __future__ import annotations

import torch

from ....placement import PARTIAL, REPLICATE, Replicate, SeqShard, Shard, normalize, same_data
from ..context import leave_for_localize, new_node, shape
from . import rule

aten = torch.ops.aten


def _gather_sequence(cx, node, x):
    """A sequence-sharded input of a weight-sharded op is gathered first (sequence parallelism)."""
    if isinstance(cx.placement(x), SeqShard):
        cx.want(node, x, REPLICATE)


@rule(aten.linear.default)
def linear(cx, node):
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    pw = cx.placement(w)
    if isinstance(pw, Shard):
        _gather_sequence(cx, node, x)
    px = cx.placement(x)
    out_ndim = len(shape(node))
    if isinstance(pw, Shard) and pw.dim == 0 and isinstance(px, Replicate):  # column-parallel
        if bias is not None and not same_data(cx.placement(bias), Shard(0, pw.segments)):
            cx.fail(node, "column-parallel bias must be split like the weight rows")
        return normalize(Shard(out_ndim - 1, pw.segments))
    if isinstance(pw, Shard) and pw.dim == 1 and isinstance(px, Shard) and px.dim == out_ndim - 1 \
            and px.segments == pw.segments:  # row-parallel: partial sums
        if bias is not None:
            return _bias_after_reduction(cx, node, x, w, bias)
        return PARTIAL
    if isinstance(pw, Replicate) and isinstance(px, (Shard, SeqShard)) and px.dim != out_ndim - 1:
        return px  # a replicated weight acting on an unsharded feature dim
    cx.fail(node, f"linear with input {px} and weight {pw}")


def _bias_after_reduction(cx, node, x, w, bias):
    """y = reduce(x W^T) + b: ``node`` becomes the add, its matmul a new partial node before it."""
    with cx.graph.inserting_before(node):
        partial = new_node(cx.graph, aten.linear.default, (x, w), node)
    partial.meta["placement"] = PARTIAL
    partial.meta["input_placements"] = {x.name: cx.placement(x), w.name: cx.placement(w)}
    node.target, node.args, node.kwargs = aten.add.Tensor, (partial, bias), {}
    return cx.revisit(node)


@rule(aten.matmul.default)
def matmul(cx, node):
    a, b = node.args
    pa, pb = cx.placement(a), cx.placement(b)
    na, nb, out_ndim = len(shape(a)), len(shape(b)), len(shape(node))
    if isinstance(pa, Shard) and pa.dim == na - 2 and isinstance(pb, Replicate):
        return Shard(out_ndim - 2, pa.segments)  # rows of the left factor: dt_proj.weight @ x
    if isinstance(pb, Shard) and pb.dim == nb - 1 and isinstance(pa, Replicate):
        return Shard(out_ndim - 1, pb.segments)
    if isinstance(pa, Shard) and isinstance(pb, Shard) and pa.dim == na - 1 and pb.dim == nb - 2 \
            and pa.segments == pb.segments:
        return PARTIAL
    cx.fail(node, f"matmul of {pa} and {pb}")


@rule(aten.embedding.default)
def embedding(cx, node):
    """Vocab-parallel lookup: each rank looks up the ids in its rows, the others give zeros,
    and the partial results add up to every row (the masked lookup is built by ``localize``)."""
    weight = node.args[0]
    pw = cx.placement(weight)
    if not (isinstance(pw, Shard) and pw.dim == 0 and len(pw.segments) == 1 and pw.segments[0].stride == 1):
        cx.fail(node, f"embedding with weight {pw}")
    leave_for_localize(node, _masked_lookup(pw.segments[0]))
    return PARTIAL


def _masked_lookup(seg):
    def edit(lcx, node):
        weight, ids = node.args[0], node.args[1]
        start, rows = seg.offset(lcx.rank), seg.local
        g = lcx.graph
        ids_val = ids.meta["val"]
        with g.inserting_before(node):
            local = new_node(g, aten.sub.Tensor, (ids, start), node, val=ids_val)
            below = new_node(g, aten.lt.Scalar, (local, 0), node, val=ids_val.bool())
            above = new_node(g, aten.ge.Scalar, (local, rows), node, val=ids_val.bool())
            outside = new_node(g, aten.logical_or.default, (below, above), node, val=ids_val.bool())
            safe = new_node(g, aten.masked_fill.Scalar, (local, outside, 0), node, val=ids_val)
            # padding_idx names a global row: this rank's local row (index - start) or none (-1).
            # Left global, rank r would drop the gradient of global row start_r + padding_idx.
            rest = list(node.args[2:])
            if rest and rest[0] >= 0:
                rest[0] = rest[0] - start if 0 <= rest[0] - start < rows else -1
            lookup = new_node(g, aten.embedding.default, (weight, safe, *rest), node)
            keep = new_node(g, aten.unsqueeze.default, (outside, -1), node, val=ids_val.bool()[..., None])
        for n in (local, below, above, outside, safe, keep):
            lcx.record(n, REPLICATE)
        lcx.record(lookup, PARTIAL)
        # The original node becomes the zeroing of the rows outside this rank: its users and
        # their placement records stay as they are.
        node.target, node.args, node.kwargs = aten.masked_fill.Scalar, (lookup, keep, 0.0), {}
        node.meta["input_placements"] = {lookup.name: PARTIAL, keep.name: REPLICATE}
    return edit
