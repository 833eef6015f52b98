"""Allocations, in-place copies into them, and sizes.

HF's state caches allocate buffers with ``zeros``/``new_zeros`` and copy new states into
them: a buffer that receives a sharded state is allocated at its local size (``localize``).
A static cache writes each new token's keys/values into its buffers at the cache position
(``index_copy``).
"""

from __future__ import annotations

import torch

from ....placement import Replicate, Shard, same_data
from ..context import hint, leave_for_localize, placement_of, shape
from . import rule

aten = torch.ops.aten

# Fresh tensors from a size list: index of the size argument.
FACTORIES = {aten.zeros.default: 0, aten.empty.memory_format: 0, aten.ones.default: 0, aten.full.default: 0,
             aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.new_ones.default: 1,
             aten.new_full.default: 1}


@rule(aten.copy_.default)
def copy_(cx, node):
    """``dst.copy_(src)``: HF writes new states into freshly allocated cache buffers."""
    dst, src = node.args[:2]
    pd, ps = cx.placement(dst), cx.placement(src)
    if same_data(pd, ps):
        return ps
    if isinstance(pd, Replicate) and isinstance(ps, Shard) and dst.target in FACTORIES:
        index = FACTORIES[dst.target]
        sizes = list(dst.args[index])
        if hint(sizes[ps.dim]) != ps.global_size:
            cx.fail(dst, f"allocates {sizes[ps.dim]} where {ps} needs {ps.global_size}")

        def edit(lcx, n):
            local = list(n.args[index])
            local[ps.dim] = ps.local_size
            n.args = (*n.args[:index], local, *n.args[index + 1:])
        leave_for_localize(dst, edit)
        dst.meta["placement"] = ps  # the buffer holds this rank's part from the start
        cx.want(node, dst, ps)
        return ps
    cx.fail(node, f"copies a {ps} value into a {pd} buffer")


@rule(aten.index_copy_.default, aten.index_copy.default)
def index_copy(cx, node):
    """``dst.index_copy_(dim, index, src)``: a static key/value cache writes the new token at the
    cache position. Each rank writes its own heads: ``dst`` and ``src`` cut alike, never along
    ``dim``, the positions the same on every rank."""
    dst, dim, index, src = node.args[:4]
    pd, ps = cx.placement(dst), cx.placement(src)
    if not isinstance(cx.placement(index), Replicate):
        cx.fail(node, f"the positions written are {cx.placement(index)}, not the same on every rank")
    if isinstance(pd, Shard) and pd.dim == dim % len(shape(dst)):
        cx.fail(node, f"writes along dim {dim}, which {pd} splits")
    if not same_data(pd, ps):
        cx.fail(node, f"writes a {ps} value into a {pd} buffer")
    return pd


@rule(aten.sym_size.int)
def sym_size(cx, node):
    p = placement_of(node.args[0])
    if isinstance(p, Shard) and node.args[1] % len(shape(node.args[0])) == p.dim:
        cx.fail(node, "reads the size of a sharded dim")
