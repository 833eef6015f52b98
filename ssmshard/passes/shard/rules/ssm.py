"""SSM ops (``torch.ops.ssmshard.*``): channels or heads split, the rest as the layouts say.

Mamba-1 scans: u, delta, z and the states by channel; A, D, delta_bias by channel; B, C
replicated (x_proj's output is reduced). Mamba-2 (SSD) scans: x, dt and states by head; B and
C by group (split when n_groups % tp == 0, else each rank holds the group its heads read).
Every rank sees every token, so packing boundaries (``cu_seqlens``) are replicated.
"""

from __future__ import annotations

import torch

from ....placement import PARTIAL, REPLICATE, Replicate, Segment, Shard, same_data
from ..context import bound_args, hint, leave_for_localize, new_node, shape
from . import rule

aten = torch.ops.aten
ssm = torch.ops.ssmshard
REPLICATE_PARTIAL_GRAD = Replicate(partial_grad=True)


def _same(cx, node, expected, *args):
    """Every arg holds the same data per rank as ``expected`` (whole-on-every-rank counts as replicated)."""
    for a in args:
        if a is not None and not same_data(cx.placement(a), expected):
            cx.fail(node, f"{a.name} is {cx.placement(a)}, expected {expected}")


def _channels(cx, node, x, dim, what):
    p = cx.placement(x)
    if not (isinstance(p, Shard) and p.dim == dim):
        cx.fail(node, f"{what} must be split along dim {dim}")
    return p


@rule(ssm.causal_conv1d.default)
def conv(cx, node):
    a = bound_args(node)
    p = _channels(cx, node, a["x"], 1, "conv channels")
    _same(cx, node, Shard(0, p.segments), a["weight"], a["bias"])
    _same(cx, node, REPLICATE, a["cu_seqlens"])
    return p


@rule(ssm.causal_conv1d_update.default)
def conv_update(cx, node):
    a = bound_args(node)
    p = cx.placement(a["x"])
    _same(cx, node, p, a["conv_state"])
    _same(cx, node, Shard(0, p.segments), a["weight"], a["bias"])
    return (p, p)


def _split_like(cx, node, a, p, *, alike=(), per_channel=(), replicated=()):
    """Arguments cut like the channels ``p`` (``alike``), per-channel weights cut like their rows
    (``per_channel``), and arguments every rank holds whole (``replicated``), by name."""
    _same(cx, node, p, *(a[k] for k in alike))
    _same(cx, node, Shard(0, p.segments), *(a[k] for k in per_channel))
    _same(cx, node, REPLICATE, *(a[k] for k in replicated))


@rule(ssm.selective_scan.default)
def selective_scan(cx, node):
    a = bound_args(node)
    p = _channels(cx, node, a["u"], 1, "scan channels (u)")
    # dt, B, C are replicated: x_proj's output is reduced.
    _split_like(cx, node, a, p, alike=("delta", "z", "initial_state"), per_channel=("A", "D", "delta_bias"),
                replicated=("B", "C", "cu_seqlens"))
    return (p, p)


def group_placement(groups: int, dim: int, tp: int) -> Shard:
    if groups % tp == 0:
        return Shard(dim, (Segment(groups, tp, 1),))
    return Shard(dim, (Segment(groups, groups, tp // groups),))


@rule(ssm.ssd_scan.default)
def ssd_scan(cx, node):
    a = bound_args(node)
    p = cx.placement(a["x"])
    if not (isinstance(p, Shard) and p.dim == 2 and len(p.segments) == 1):
        cx.fail(node, "SSD heads must be dim 2 of x")
    _same(cx, node, p, a["dt"])
    D = a["D"] if a["D"] is not None and len(shape(a["D"])) == 1 else None
    _same(cx, node, Shard(0, p.segments), a["A"], D, a["dt_bias"])
    _same(cx, node, group_placement(hint(shape(a["B"])[2]), 2, cx.tp), a["B"], a["C"])
    _same(cx, node, Shard(1, p.segments), a["initial_states"])
    _same(cx, node, REPLICATE, a["cu_seqlens"])
    return (p, Shard(1, p.segments))


@rule(ssm.selective_state_update.default)
def state_update(cx, node):
    a = bound_args(node)
    if a["dt_proj_weight"] is not None:
        cx.fail(node, "a state update with dt_proj folded in; run the fuse_dt_proj pass after the sharding passes")
    p = _channels(cx, node, a["x"], 1, "state update channels/heads")
    _split_like(cx, node, a, p, alike=("dt", "z", "state"), per_channel=("A", "D", "dt_bias"))
    if len(shape(a["x"])) == 2:
        _same(cx, node, REPLICATE, a["B"], a["C"])
    else:
        _same(cx, node, group_placement(hint(shape(a["B"])[1]), 1, cx.tp), a["B"], a["C"])
    return (p, p)


@rule(ssm.gated_rms_norm.default)
def gated_norm(cx, node):
    x, gate, weight, eps, group_size = node.args
    p = cx.placement(x)
    if not (isinstance(p, Shard) and p.dim == len(shape(x)) - 1 and len(p.segments) == 1):
        cx.fail(node, "gated norm input must be split along its channels")
    _same(cx, node, p, gate)
    _same(cx, node, Shard(0, p.segments), weight)
    if p.segments[0].local % group_size == 0:
        return p  # whole groups on this rank: nothing to communicate
    return _gated_norm_across_ranks(cx, node, p)


def _gated_norm_across_ranks(cx, node, p):
    """Groups wider than a rank's channels: reduce each token's per-group sum of squares.

    The local partial sum goes into its group's slot of a (..., n_groups) tensor of zeros
    (the slot is rank-dependent: ``localize`` fills it in); the reduction adds the ranks that
    share a group, and each rank reads its group back: one scalar per token and group crosses
    the wire. The gated norm node itself becomes the final scaling, so its users are untouched.
    """
    x, gate, weight, eps, group_size = node.args
    seg = p.segments[0]
    n_groups = seg.size // group_size
    g = cx.graph
    f32 = torch.float32
    with g.inserting_before(node):
        y = new_node(g, aten._to_copy.default, (x,), node, kwargs={"dtype": f32})
        gate32 = new_node(g, aten._to_copy.default, (gate,), node, kwargs={"dtype": f32})
        act = new_node(g, aten.silu.default, (gate32,), node)
        gated = new_node(g, aten.mul.Tensor, (y, act), node)
        square = new_node(g, aten.mul.Tensor, (gated, gated), node)
        partial = new_node(g, aten.sum.dim_IntList, (square, [-1], True), node)
        # A cat of zero pieces, not constant_pad_nd: its fake kernel fixes batch and sequence
        # to their example sizes in every later shape (bytes per token then come out 16x).
        zero = new_node(g, aten.zeros_like.default, (partial,), node)
        slots = new_node(g, aten.cat.default, ([partial] + [zero] * (n_groups - 1), -1), node)
        mine = new_node(g, aten.slice.Tensor, (slots, -1, 0, 1), node)
        var = new_node(g, aten.div.Tensor, (mine, float(group_size)), node)
        var_eps = new_node(g, aten.add.Tensor, (var, float(eps)), node)
        inv = new_node(g, aten.rsqrt.default, (var_eps,), node)
        normed = new_node(g, aten.mul.Tensor, (gated, inv), node)
        back = new_node(g, aten._to_copy.default, (normed,), node, kwargs={"dtype": x.meta["val"].dtype})

    def place_slot(lcx, n):
        group = seg.offset(lcx.rank) // group_size
        slots.args = ([zero] * group + [partial] + [zero] * (n_groups - group - 1), -1)
        mine.args = (slots, -1, group, group + 1)
    leave_for_localize(slots, place_slot)
    for n, placement in ((y, p), (gate32, p), (act, p), (gated, p), (square, p), (partial, PARTIAL),
                         (zero, PARTIAL), (slots, PARTIAL)):
        n.meta["placement"] = placement
        n.meta["input_placements"] = {a.name: a.meta["placement"] if a not in (x, gate) else p
                                      for a in n.all_input_nodes}
    # The slots are reduced, so slot g holds the sum over the ranks of group g. Each rank reads
    # its own group's statistic, which scales only its channels: its gradient is a partial sum
    # per rank (R~), summed slot by slot in backward (a tp_copy on the reduced slots), so ranks
    # of one group add up and other groups' zeros mix in nothing.
    statistic = REPLICATE_PARTIAL_GRAD if cx.options.training else REPLICATE
    mine.meta["placement"] = REPLICATE_PARTIAL_GRAD
    mine.meta["input_placements"] = {slots.name: statistic}
    node.target, node.args, node.kwargs = aten.mul.Tensor, (weight, back), {}
    for n in (var, var_eps, inv, normed, back):
        cx.revisit(n)
    return cx.revisit(node)
