"""View-like ops: the cut moves with its dim; size arguments on the cut become local sizes.

A reshape may merge or split the sharded dim (Mamba-2's ``(b, l, h*p) -> (b, l, h, p)``,
Zamba's interleaved in_proj rows): ``reshape_cut`` works out where the cut lands, or fails
when ranks' data would interleave.
"""

from __future__ import annotations

import math
import sys

import torch

from ....placement import Partial, SeqShard, Segment, Shard, normalize
from ..context import hint, leave_for_localize, local_size_edit, shape
from . import rule

aten = torch.ops.aten


@rule(aten.transpose.int, linear=True)
def transpose(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        return p  # linear: a partial sum stays one (when the policy keeps it)
    nd = len(shape(node))
    d0, d1 = node.args[1] % nd, node.args[2] % nd
    return p.with_dim({d0: d1, d1: d0}.get(p.dim, p.dim))


@rule(aten.unsqueeze.default, linear=True)
def unsqueeze(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        return p  # linear: a partial sum stays one (when the policy keeps it)
    d = node.args[1] % len(shape(node))
    return p.with_dim(p.dim + 1 if d <= p.dim else p.dim)


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, linear=True)
def squeeze(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        return p  # linear: a partial sum stays one (when the policy keeps it)
    in_shape = shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [i for i, n in enumerate(in_shape) if hint(n) == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [d % len(in_shape) for d in dims if hint(in_shape[d % len(in_shape)]) == 1]
    if p.dim in dims:
        cx.fail(node, "squeezes the sharded dim")
    return p.with_dim(p.dim - sum(1 for d in dims if d < p.dim))


def _is_full_slice(node, size=None) -> bool:
    """``x[..., 0:end]`` with ``end`` past the dim's ``size`` (``None``: a size only known at run
    time, so only an open end, ``None`` or ``sys.maxsize``, counts)."""
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    open_end = end is None or (isinstance(end, int) and end >= sys.maxsize)
    ends_at_size = open_end or (size is not None and isinstance(end, int) and end >= size)
    return start in (0, None) and ends_at_size and step == 1


@rule(aten.slice.Tensor, aten.select.int)
def slice_select(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        return p  # linear: a partial sum stays one (when the policy keeps it)
    d = node.args[1] % len(shape(node.args[0]))
    if d == p.dim:
        if node.target is aten.slice.Tensor and isinstance(p, SeqShard) and _is_full_slice(node):
            return p
        if node.target is aten.slice.Tensor and isinstance(p, Shard) and _is_full_slice(node, p.global_size):
            if len(node.args) >= 4 and node.args[3] is not None:
                leave_for_localize(node, _slice_end_edit(p.local_size))
            return p
        cx.fail(node, "slices the sharded dim")
    if node.target is aten.select.int:
        return p.with_dim(p.dim - 1 if d < p.dim else p.dim)
    return p


def _slice_end_edit(local):
    def edit(lcx, node):
        node.args = (*node.args[:3], local, *node.args[4:])
    return edit


def _split_segments(cx, node, p, sizes):
    """Give each split piece the segments it covers; split sizes become local sizes."""
    pieces, local_sizes, i = [], [], 0
    segs = list(p.segments)
    for size in sizes:
        taken, total = [], 0
        while total < size and i < len(segs):
            taken.append(segs[i])
            total += segs[i].size
            i += 1
        if total != size:
            cx.fail(node, f"split size {size} cuts through a packed segment of {p}")
        # A piece every rank holds whole (Mamba-2's B and C with one group) becomes R~.
        pieces.append(normalize(Shard(p.dim, tuple(taken))))
        local_sizes.append(sum(t.local for t in taken))
    return tuple(pieces), local_sizes


@rule(aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default)
def split(cx, node):
    x = node.args[0]
    p = cx.placement(x)
    nd = len(shape(x))
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    count = node.args[1] if node.target is aten.chunk.default else len(node.args[1])
    if dim != p.dim:
        return tuple(p for _ in range(count))
    if not isinstance(p, Shard):
        cx.fail(node, "splits the sequence-sharded dim")
    if node.target is aten.chunk.default:
        pieces, local = _split_segments(cx, node, p, [p.global_size // count] * count)
        if len(set(local)) != 1:
            cx.fail(node, "chunks of unequal local size")
        return pieces
    pieces, local = _split_segments(cx, node, p, list(node.args[1]))

    def edit(lcx, n):
        n.args = (n.args[0], local, *n.args[2:])
    leave_for_localize(node, edit)
    return pieces


def view_groups(in_shape, out_shape):
    """Pairs (input dims, output dims) whose sizes multiply to the same (on example sizes)."""
    ins, outs = [hint(x) for x in in_shape], [hint(x) for x in out_shape]
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj = [], []
        pi = pj = 1
        if i < len(ins):
            gi.append(i); pi *= ins[i]; i += 1
        if j < len(outs):
            gj.append(j); pj *= outs[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(ins):
                gi.append(i); pi *= ins[i]; i += 1
            elif j < len(outs):
                gj.append(j); pj *= outs[j]; j += 1
            else:
                break
        # trailing size-1 dims join the current group
        while i < len(ins) and ins[i] == 1 and (j >= len(outs) or outs[j] != 1):
            gi.append(i); i += 1
        while j < len(outs) and outs[j] == 1 and (i >= len(ins) or ins[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, linear=True)
def view(cx, node):
    x = node.args[0]
    p = cx.placement(x)
    if isinstance(p, Partial):
        return p  # linear: a partial sum stays one (when the policy keeps it)
    in_shape, out_shape = shape(x), shape(node)
    for gi, gj in view_groups(in_shape, out_shape):
        if p.dim not in gi:
            continue
        if len(gi) == 1 and len(gj) == 1:
            return p.with_dim(gj[0])
        if not isinstance(p, Shard):
            cx.fail(node, f"reshapes the sequence-sharded dim {p.dim} together with others")
        placement = reshape_cut(cx, node, p, [hint(in_shape[d]) for d in gi], gi.index(p.dim),
                                [hint(out_shape[d]) for d in gj])
        target = gj[placement.dim]
        _local_view_size(cx, node, target, placement.local_size)
        return placement.with_dim(target)
    return p


def _local_view_size(cx, node, dim, local):
    if isinstance(node.args[1][dim], torch.fx.Node):
        cx.fail(node, "symbolic size on the sharded dim")
    leave_for_localize(node, local_size_edit(1, dim, local))


def reshape_cut(cx, node, p, in_sizes, position, out_sizes) -> Shard:
    """Where the cut of ``p`` lands when dims ``in_sizes`` (the sharded one at ``position``) are
    reshaped into ``out_sizes``; the result's ``dim`` indexes ``out_sizes``.

    The flattened group is ``outer`` repeats of the sharded dim's segments, each scaled by the
    dims inside it. An output dim can carry that cut when the dims before it count whole
    repeats of a segment pattern and the dims after it divide every segment and every rank's
    chunk: a split of Zamba's interleaved in_proj rows (d_inner * 2 -> d_inner, 2) keeps the
    cut on d_inner, and (heads * head_dim -> heads, head_dim) with one segment per head moves
    it to head_dim. Anything else would interleave ranks' data and fails.
    """
    outer = math.prod(in_sizes[:position])
    inner = math.prod(in_sizes[position + 1:])
    if outer > 1 and len(p.segments) * outer > 4096:
        cx.fail(node, f"view merges {outer} unsharded outer elements into the sharded dim of {p}")
    flat = [seg.scaled(inner) for seg in p.segments] * outer
    before = 1
    for t, size in enumerate(out_sizes):
        after = math.prod(out_sizes[t + 1:])
        if len(flat) % before == 0:
            pattern = flat[:len(flat) // before]
            repeats = pattern * before == flat
            fits = all(seg.size % after == 0 and seg.local % after == 0 for seg in pattern)
            if repeats and fits and sum(seg.size for seg in pattern) == size * after:
                return Shard(t, tuple(Segment(seg.size // after, seg.pieces, seg.stride) for seg in pattern))
        before *= size
    cx.fail(node, f"view cannot keep the cut of {p} when reshaping {in_sizes} into {out_sizes}")


@rule(aten.expand.default)
def expand(cx, node):
    p = cx.placement(node.args[0])
    if isinstance(p, Partial):
        cx.fail(node, "expand of a partial sum")
    offset = len(shape(node)) - len(shape(node.args[0]))
    out = p.with_dim(p.dim + offset)
    if isinstance(p, Shard):
        _local_view_size(cx, node, out.dim, p.local_size)
    elif not isinstance(node.args[1][out.dim], torch.fx.Node) and node.args[1][out.dim] != -1:
        cx.fail(node, "expands the sequence-sharded dim to a fixed size")
    return out


def _common_placement(cx, node, tensors):
    """The one placement every input of a cat/stack has (anything else would mix ranks' data)."""
    placements = {cx.placement(t) for t in tensors}
    if len(placements) != 1:
        cx.fail(node, f"joins differently placed tensors {placements}")
    return next(iter(placements))


@rule(aten.cat.default, aten.concatenate.default)
def cat(cx, node):
    # torch.cat skips 1-D empty tensors (an HF cache's "no keys yet" placeholder): so do we.
    tensors = [t for t in node.args[0] if shape(t) != (0,)]
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape(node))
    p = _common_placement(cx, node, tensors)
    if isinstance(p, Partial):
        cx.fail(node, "joins partial sums")
    if p.dim == dim:
        if not isinstance(p, Shard):
            cx.fail(node, "concatenates along the sequence-sharded dim")
        # Zamba's per-head scan outputs, concatenated by head: each input's segments in order.
        return Shard(dim, p.segments * len(tensors))
    return p


@rule(aten.stack.default)
def stack(cx, node):
    """Stacking equally placed tensors (Zamba's per-head states) adds an unsharded dim."""
    p = _common_placement(cx, node, node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape(node))
    return p.with_dim(p.dim + 1 if dim <= p.dim else p.dim)


@rule(aten.constant_pad_nd.default, aten.pad.default)
def pad(cx, node):
    """A constant pad along dims the split does not cut: HF pads a prompt shorter than the conv
    kernel along the length to fill the conv state (a pad sized by a symbolic length is a ``cat``
    by then, ``canonicalize.pad_as_cat``). Each rank pads its own channels."""
    p = cx.placement(node.args[0])
    widths = node.args[1]
    if node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        if mode != "constant":
            cx.fail(node, f"pads in mode {mode!r} (only constant pads are split)")
    if isinstance(p, Partial):
        cx.fail(node, "pads a partial sum")
    rank = len(shape(node.args[0]))
    if p.dim >= rank - len(widths) // 2:
        cx.fail(node, f"pads along dim {p.dim}, which {p} splits")
    return p
