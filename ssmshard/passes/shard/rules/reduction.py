"""Reductions over dims other than the cut (norms reduce over features, not over ranks)."""

from __future__ import annotations

import torch

from ....placement import Partial
from ..context import shape
from . import rule

aten = torch.ops.aten


@rule(aten.mean.dim, aten.sum.dim_IntList)
def reduce(cx, node):
    """mean/sum over dims: the cut moves to its new index; over the cut itself it would be a
    partial sum per rank, which no model op here needs (gated norms are one op, see ssm.py)."""
    x = node.args[0]
    p = cx.placement(x)
    nd = len(shape(x))
    dims = node.args[1] if len(node.args) > 1 else list(range(nd))
    dims = [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if isinstance(p, Partial):
        if node.target is aten.sum.dim_IntList:
            return p  # a sum of partial sums
        cx.fail(node, "mean of a partial sum")
    if p.dim in dims:
        cx.fail(node, "reduces over the sharded dim")
    return p if keepdim else p.with_dim(p.dim - sum(1 for d in dims if d < p.dim))
