"""Triton helpers shared by the selective-scan forward and backward kernels.

Dimension letters: d channels, n SSM state size, T tokens of one tile, S packed sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def linear_recurrence_combine(a_first, x_first, a_second, x_second):
    # (a, x) stands for the affine map h -> a * h + x. Applying "first" then "second" gives
    # h -> a_second * (a_first * h + x_first) + x_second. For a reverse scan Triton passes the
    # later (already accumulated) element as "first", which gives lam_t = x_t + a_t * lam_{t+1}.
    return a_first * a_second, x_first * a_second + x_second


@triton.jit
def log1p_unit(u):
    """log(1 + u) for 0 <= u <= 1, to float32 rounding.

    log(1 + u) as written loses the digits of u that 1 + u rounds away: at u = 1e-3 (dt = 1e-3,
    Mamba's smallest initial step) its relative error reaches 6e-5. With w = fl(1 + u), the
    rounding d = (w - 1) - u is exact in float32 and log(1 + u) = log(w) - d / w to first
    order; 2 - w stands in for 1 / w (off by (w - 1)^2 / w, which only scales the already
    rounding-sized correction), so there is no division.
    """
    w = 1.0 + u
    return tl.log(w) - ((w - 1.0) - u) * (2.0 - w)


@triton.jit
def softplus(v):
    """log(1 + exp(v)) without overflow: max(v, 0) + log1p(exp(-|v|)). Above v = 15 the second
    term is under half an ulp of v, so this returns v there (torch returns v above 20)."""
    return tl.maximum(v, 0.0) + log1p_unit(tl.exp(-tl.abs(v)))


@triton.jit
def discretise(delta, bias, SOFTPLUS: tl.constexpr):
    dt = delta + bias
    if SOFTPLUS:
        dt = softplus(dt)
    return dt


@triton.jit
def channel_block(pid_blk, blocks_per_group, e, BLOCK_D: tl.constexpr):
    """The channels of program ``pid_blk`` when each group of ``e`` channels (the channels that
    read one group of B / C) is split into ``blocks_per_group`` blocks of BLOCK_D:
    (group, block within the group, channel indices, their mask, the indices as int64)."""
    grp = pid_blk // blocks_per_group
    blk = pid_blk % blocks_per_group
    in_group = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    ch = grp * e + in_group
    return grp, blk, ch, in_group < e, ch.to(tl.int64)

@triton.jit
def column(tile, cols, i):
    """Column i of a (rows, cols) register tile, as a (rows,) vector.

    The fill is -0.0, the additive identity (x + -0.0 == x for every x, -0.0 included): when
    the columns live in one thread and i is a compile-time constant, the compiler folds the
    whole sum away and the extraction costs nothing.
    """
    return tl.sum(tl.where(cols[None, :] == i, tile, -0.0), axis=1)


@triton.jit
def set_column(tile, cols, i, values):
    return tl.where(cols[None, :] == i, values[:, None], tile)


@triton.jit
def load_state_tile(rows, s_n, mask, n, cols, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr):
    """Load a (channels, n) fp32 tile one state index at a time: ``rows`` points at index 0 of
    each channel, ``s_n`` steps between indices. A 2-D load would bring its own register
    layout, and the layout engine may then impose it on the whole scan loop."""
    tile = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    for i in range(n):
        tile = set_column(tile, cols, i, tl.load(rows + i * s_n, mask=mask, other=0.0).to(tl.float32))
    return tile


@triton.jit
def store_state_tile(rows, s_n, mask, tile, n, cols):
    """Store a (channels, n) tile one state index at a time (see load_state_tile)."""
    for i in range(n):
        tl.store(rows + i * s_n, column(tile, cols, i), mask=mask)


@triton.jit
def set_row(tile, rows, i, values):
    return tl.where(rows[:, None] == i, values[None, :], tile)


@triton.jit
def token_mask(t, l, WHOLE: tl.constexpr):
    """t < l, or, in a tile the caller knows lies wholly before l, a constant True.

    Why the constant: Triton vectorises a masked access only when it can prove the mask
    constant over each vector, and for ``t < l`` it can only when l is a multiple of 16, which
    packed rows, padded batches and single sequences rarely are. With the comparison, every
    tile of such a row moves its tokens one scalar at a time (seen in the offline sm_90 PTX;
    docs/kernels.md), so callers scan a row's whole tiles with
    WHOLE = True and only its last, partial tile with the comparison.
    """
    if WHOLE:
        return tl.full(t.shape, 1, tl.int1)
    return t < l


@triton.jit
def tile_phase(phase: tl.constexpr, whole, total):
    """(first, count) of the tiles a ``tl.static_range(2)`` phase walks: phase 0 the ``whole``
    tiles lying wholly before l (scanned with ``token_mask(..., WHOLE=True)``), phase 1 the
    remaining ``total - whole``."""
    if phase == 0:
        return 0, whole
    return whole, total - whole


@triton.jit
def boundaries(seq_ptr, t, l, PACKED: tl.constexpr):
    """Which tokens t start / end a sequence, and the sequence each belongs to.

    Tokens past l are neither. Without packing there is one sequence per batch row and the
    returned index is 0 (callers add the batch row).
    """
    valid = t < l
    if PACKED:
        seq = tl.load(seq_ptr + t, mask=valid, other=-1)
        prev = tl.load(seq_ptr + t - 1, mask=valid & (t > 0), other=-1)
        nxt = tl.load(seq_ptr + t + 1, mask=(t + 1) < l, other=-1)
        is_start = valid & (seq != prev)
        is_end = valid & (seq != nxt)
    else:
        seq = tl.zeros(t.shape, dtype=tl.int32)
        is_start = t == 0
        is_end = t == l - 1
    return seq, is_start, is_end


@triton.jit
def any_true(flags):
    return tl.max(flags.to(tl.int32), axis=0) > 0


@triton.jit
def per_sequence_ptrs(base, seq64, ch64, s_seq, s_ch, offset):
    # (channels, T) pointers into a (sequences, d, n) state tensor: the sequence of each token.
    # Built only inside the branches that need them, so no 64-bit tile stays live in a loop.
    return base + seq64[None, :] * s_seq + ch64[:, None] * s_ch + offset


@triton.jit
def restart_at_sequence_starts(decay, x, is_start, has_start, init_ptr, seq64, ch64, ch_mask,
                               si_s, si_d, init_offset, HAS_INIT: tl.constexpr):
    """Packed sequences: cut the recurrence at sequence starts. The decay there becomes 0
    (nothing carried in) and the sequence's initial state, decayed by one step, joins the
    input. (Unpacked rows need none of this: their initial state is simply the state the
    scan starts from.)"""
    decay_eff = tl.where(is_start[None, :], 0.0, decay)
    x_eff = x
    if HAS_INIT:
        if has_start:
            init_ptrs = per_sequence_ptrs(init_ptr, seq64, ch64, si_s, si_d, init_offset)
            init_mask = ch_mask[:, None] & is_start[None, :]
            init = tl.load(init_ptrs, mask=init_mask, other=0.0).to(tl.float32)
            x_eff = x + decay * init
    return decay_eff, x_eff
