"""Pointwise ops: the output is placed like its (broadcast) inputs."""

from __future__ import annotations

import torch

from ....placement import PARTIAL, Partial, Replicate, SeqShard, Shard
from ..context import hint, shape
from . import rule

aten = torch.ops.aten

# Element-wise and linear: a partial sum stays one through them (when the policy keeps it).
LINEAR_UNARY = (aten.neg.default, aten.clone.default, aten.contiguous.default, aten.to.dtype,
                aten.to.dtype_layout, aten._to_copy.default, aten.alias.default,
                aten.type_as.default)  # type_as(x, other): x's values, other's dtype
NONLINEAR_UNARY = (aten.exp.default, aten.rsqrt.default, aten.silu.default, aten.gelu.default,
                   aten.pow.Tensor_Scalar, aten.softplus.default, aten.sigmoid.default, aten.tanh.default,
                   aten.relu.default, aten.sqrt.default, aten.reciprocal.default, aten.zeros_like.default,
                   aten.empty_like.default, aten.ones_like.default, aten.full_like.default)
BINARY = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor)


@rule(*LINEAR_UNARY, linear=True)
def linear_unary(cx, node):
    return cx.placement(node.args[0])


@rule(*NONLINEAR_UNARY)
def nonlinear_unary(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        cx.fail(node, "a nonlinear op on a partial sum: the policy must reduce it first")
    return p


@rule(*BINARY)
def binary(cx, node):
    """Sharded operands agree; replicated ones must be broadcast (size 1) along the cut; a
    partial operand (an add of partial sums, see policy.keep_partial) makes a partial sum."""
    out_ndim = len(shape(node))
    operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    sharded, partial = None, False
    for a in operands:
        p = cx.placement(a)
        if isinstance(p, Partial):
            partial = True
        elif isinstance(p, (Shard, SeqShard)):
            candidate = p.with_dim(p.dim + out_ndim - len(shape(a)))
            if sharded is not None and sharded != candidate:
                cx.fail(node, f"operands sharded differently: {sharded} vs {candidate}")
            sharded = candidate
    if partial:
        if sharded is not None:
            cx.fail(node, "mixes Partial and Shard")
        return PARTIAL
    for a in operands:
        if isinstance(cx.placement(a), Replicate):
            operand_shape = shape(a)
            k = sharded.dim - (out_ndim - len(operand_shape))
            if 0 <= k < len(operand_shape) and hint(operand_shape[k]) != 1:
                cx.fail(node, f"replicated operand {a.name} is not broadcast along sharded dim {sharded.dim}")
    return sharded
