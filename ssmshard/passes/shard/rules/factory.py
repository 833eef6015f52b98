"""Allocations, in-place copies into them, and sizes.

HF's state caches allocate buffers with ``zeros``/``new_zeros`` and copy new states into
them: a buffer that receives a sharded state is allocated at its local size (``localize``). A
tensor allocated after a split tensor's own size (a pad of it) is split alike.
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


# Fresh tensors shaped after a tensor ``x`` (``x.new_full(sizes, value)``): ``x`` gives the dtype
# and device, ``sizes`` the shape.
NEW_LIKE = (aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default)


def _is_own_size(size, source, dim) -> bool:
    """Whether ``size`` is ``source.size(dim)`` read in the graph (at run time: the local size)."""
    return (isinstance(size, torch.fx.Node) and size.target is aten.sym_size.int and size.args[0] is source
            and size.args[1] % len(shape(source)) == dim)


@rule(*NEW_LIKE)
def new_like(cx, node):
    """``x.new_full(sizes, v)`` with ``x`` split: HF pads a prompt shorter than the conv kernel
    with ``x.new_full((b, x.size(1), k - l), 0)`` (``F.pad``), then concatenates it with ``x``
    along the length. Sized by ``x``'s own split dim, the pad is read at the local size on each
    rank and is split as ``x`` is; sized otherwise, it is the same constant on every rank."""
    source, sizes = node.args[0], node.args[1]
    p = cx.placement(source)
    if isinstance(p, Shard) and len(sizes) == len(shape(source)) and _is_own_size(sizes[p.dim], source, p.dim):
        if isinstance(sizes[p.dim].meta.get("val"), int):
            # A static size: written as the local size (the read then goes unused), as copy_
            # allocates its buffers, rather than left to the read at run time.
            def edit(lcx, n):
                local = list(n.args[1])
                local[p.dim] = p.local_size
                n.args = (n.args[0], local, *n.args[2:])
            leave_for_localize(node, edit)
        return p
    if isinstance(p, Shard) and any(_is_own_size(size, source, p.dim) for size in sizes):
        cx.fail(node, f"allocates with the size of {p}'s split dim along another dim")
    return Replicate()


@rule(aten.sym_size.int)
def sym_size(cx, node):
    p = placement_of(node.args[0])
    if isinstance(p, Shard) and node.args[1] % len(shape(node.args[0])) == p.dim:
        # Read only to allocate a tensor split alike (``new_like``): each rank reads its local size.
        if not all(u.target in NEW_LIKE and u.args[0] is node.args[0] and len(u.args[1]) > p.dim
                   and u.args[1][p.dim] is node for u in node.users):
            cx.fail(node, "reads the size of a sharded dim")
