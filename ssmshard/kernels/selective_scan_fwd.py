"""Forward kernels of the Mamba-1 selective scan: the scan itself and the pass that hands
states from one sequence segment to the next.

Dimension letters: b batch, d channels, l tokens, n state size, g groups of B / C,
e channels per group, V tokens one thread advances per step, G segments of the sequence.

Layout, and why: a program owns BLOCK_D channels (one per thread: 32 * num_warps) and walks
its stretch of the sequence V tokens at a time, V being one 16-byte vector of the inputs. The
(BLOCK_D, V) tiles then sit with all V tokens of a channel in one thread, so the recurrence
h_t = a_t * h_{t-1} + x_t is a plain sequential chain in registers (tl.associative_scan over
an axis that lives in one thread needs no shuffles), and with the n state indices unrolled
the (channels, n) state tile is read and written by constant register selects. The work per
(channel, token, state) is then one exp2 and four FP32 instructions (d * A, d * u * B folded
into the chain's FMA, the chain FMA, y += h * C), so the kernel is bound by the SFU's exp2
throughput, not by memory: it reads u, delta, z once and writes y once.

With one channel per thread, the grid has b * d / 32 warps; for small b * d (B=1, d=5120:
160 warps) that leaves most of the GPU idle, so the sequence is also split into G segments
(multiples of the checkpoint chunk): pass 1 runs each segment from a zero state and keeps
its end state and total decay, a short sequential pass over segments turns those into each
segment's true starting state, and pass 2 reruns the segments from those states, writing y.
That costs one extra exp2 per element, and buys G times the parallelism.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ssmshard.kernels.scan_common import (
    LOG2E,
    boundaries,
    channel_block,
    column,
    discretise,
    linear_recurrence_combine,
    load_state_tile,
    per_sequence_ptrs,
    restart_at_sequence_starts,
    set_column,
    store_state_tile,
)


@triton.jit
def _one_state_index(
    i, y, state, A2, cols, dt, dtu, tv, t, t_mask,
    B_row, C_row, sB_n, sC_n,
    is_start, has_start, is_end, has_end, seq64, ch64, ch_mask,
    init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n,
    V: tl.constexpr, MASK_T: tl.constexpr, PACKED: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, WITH_OUTPUT: tl.constexpr,
):
    """Advance state index i over V tokens and add its share of y. No branch here unless the
    sequences are packed: branches inside the unrolled loop cost the scheduler dearly."""
    if MASK_T:
        B_i = tl.load(B_row + i * sB_n + t, mask=t_mask, other=0.0)
    else:
        B_i = tl.load(B_row + i * sB_n + t)
    decay = tl.exp2(dt * column(A2, cols, i)[:, None])
    x = dtu * B_i[None, :]
    if PACKED:
        decay, x = restart_at_sequence_starts(
            decay, x, is_start, has_start, init_ptr, seq64, ch64, ch_mask, si_s, si_d, i * si_n, HAS_INIT
        )
    # The state carried in enters through the first token.
    x = tl.where(tv[None, :] == 0, x + decay * column(state, cols, i)[:, None], x)
    _, h = tl.associative_scan((decay, x), 1, linear_recurrence_combine)
    if WITH_OUTPUT:
        if MASK_T:
            C_i = tl.load(C_row + i * sC_n + t, mask=t_mask, other=0.0)
        else:
            C_i = tl.load(C_row + i * sC_n + t)
        y += h * C_i[None, :]
    if PACKED and STORE_FINAL:
        if has_end:
            final_ptrs = per_sequence_ptrs(final_ptr, seq64, ch64, sf_s, sf_d, i * sf_n)
            tl.store(final_ptrs, h, mask=ch_mask[:, None] & is_end[None, :])
    h_last = tl.sum(tl.where(tv[None, :] == V - 1, h, -0.0), axis=1)
    return y, set_column(state, cols, i, h_last)


@triton.jit
def _advance(
    t0, state, dt_sum, restarted, A2, cols, tv, ch, ch64, ch_mask, b64,
    u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l, y_rows, sy_l, B_row, C_row, sB_n, sC_n,
    bias, D_ptr, seq_ptr, l, n,
    init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n, ckpt_ptr, ckpt_chunk, d,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, PACKED: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_CKPT: tl.constexpr,
    WITH_OUTPUT: tl.constexpr, N_STATIC: tl.constexpr, V: tl.constexpr, MASK_T: tl.constexpr,
):
    """Tokens t0 .. t0 + V - 1 for the program's channels (all state indices)."""
    t = t0 + tv
    t_mask = t < l
    if MASK_T:
        tile_mask = ch_mask[:, None] & t_mask[None, :]
    else:
        tile_mask = ch_mask[:, None]
    if STORE_CKPT:
        if t0 % ckpt_chunk == 0:
            # ckpt[b, k, i, c]: the state carried into checkpoint chunk k.
            num_ckpt = tl.cdiv(l, ckpt_chunk)
            ckpt_rows = ckpt_ptr + (b64 * num_ckpt + t0 // ckpt_chunk) * n * d + ch64
            store_state_tile(ckpt_rows, d, ch_mask, state, n, cols)
    u = tl.load(u_rows + t[None, :] * su_l, mask=tile_mask, other=0.0).to(tl.float32)
    delta = tl.load(delta_rows + t[None, :] * sdl_l, mask=tile_mask, other=0.0).to(tl.float32)
    dt = discretise(delta, bias[:, None], SOFTPLUS)
    if MASK_T:
        # Tokens past l become identity steps (decay 1, input 0): the state passes through.
        dt = tl.where(tile_mask, dt, 0.0)
    dtu = dt * u
    seq, is_start, is_end = boundaries(seq_ptr, t, l, PACKED)
    seq64 = seq.to(tl.int64) + b64  # sequence of each token: the batch row when unpacked
    has_start = tl.max(is_start.to(tl.int32), axis=0) > 0
    has_end = tl.max(is_end.to(tl.int32), axis=0) > 0
    if not WITH_OUTPUT:
        # Segment pass: the segment's total decay is exp(A * sum dt), or 0 once it restarts.
        dt_sum += tl.sum(dt, axis=1)
        restarted = restarted | has_start

    y = tl.zeros(u.shape, dtype=tl.float32)
    # Unrolled (compile-time i: the state-tile column selects fold away) for small n,
    # a loop otherwise; the two calls differ only in the loop around them.
    if N_STATIC > 0:
        for i in tl.static_range(N_STATIC):
            y, state = _one_state_index(
                i, y, state, A2, cols, dt, dtu, tv, t, t_mask, B_row, C_row, sB_n, sC_n,
                is_start, has_start, is_end, has_end, seq64, ch64, ch_mask,
                init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n,
                V, MASK_T, PACKED, HAS_INIT, STORE_FINAL, WITH_OUTPUT,
            )
    else:
        for i in range(n):
            y, state = _one_state_index(
                i, y, state, A2, cols, dt, dtu, tv, t, t_mask, B_row, C_row, sB_n, sC_n,
                is_start, has_start, is_end, has_end, seq64, ch64, ch_mask,
                init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n,
                V, MASK_T, PACKED, HAS_INIT, STORE_FINAL, WITH_OUTPUT,
            )

    if WITH_OUTPUT:
        if HAS_D:
            D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
            y += D[:, None] * u
        if HAS_Z:
            z = tl.load(z_rows + t[None, :] * sz_l, mask=tile_mask, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        tl.store(y_rows + t[None, :] * sy_l, y, mask=tile_mask)
    return state, dt_sum, restarted


@triton.jit
def scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, init_ptr,
    y_ptr, final_ptr, ckpt_ptr, carry_ptr, seg_end_ptr, seg_decay_ptr, range_ptr,
    d, l, e, n, seg_len, num_segments, ckpt_chunk: tl.constexpr,
    su_b, su_d, su_l,
    sdl_b, sdl_d, sdl_l,
    sA_d, sA_n,
    sB_b, sB_g, sB_n,
    sC_b, sC_g, sC_n,
    sz_b, sz_d, sz_l,
    sy_b, sy_d, sy_l,
    si_s, si_d, si_n,
    sf_s, sf_d, sf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    PACKED: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    STORE_CKPT: tl.constexpr, WITH_OUTPUT: tl.constexpr, HAS_CARRY: tl.constexpr, RANGED: tl.constexpr,
    BLOCK_D: tl.constexpr, V: tl.constexpr, N_PAD: tl.constexpr, N_STATIC: tl.constexpr,
):
    """One (channel block, batch row, segment).

    WITH_OUTPUT: write y (and checkpoints, final states); the segment starts from
    carry[b, G, n, d] when HAS_CARRY, else from 0. Without it (segment pass 1): start from 0
    and write only the segment's end state and total decay, both (b, G, n, d) fp32
    (G = num_segments; pass 1 skips the last segment, whose end nothing reads).
    RANGED (segment pass on packed rows): walk only tokens [lo, hi) of range[G, 2] (see
    ``selective_scan._segment_pass_ranges``), from the tile holding lo.
    B and C are fp32 with unit stride along l.
    """
    pid_blk = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_seg = tl.program_id(2)
    grp, _, ch, ch_mask, ch64 = channel_block(pid_blk, tl.cdiv(e, BLOCK_D), e, BLOCK_D)  # (BLOCK_D,) channels
    b64 = pid_b.to(tl.int64)
    tv = tl.arange(0, V)
    cols = tl.arange(0, N_PAD)
    seg_state_rows = (b64 * num_segments + pid_seg) * n * d + ch64  # into (b, G, n, d)

    u_rows = u_ptr + b64 * su_b + ch64[:, None] * su_d  # (BLOCK_D, 1) row pointers
    delta_rows = delta_ptr + b64 * sdl_b + ch64[:, None] * sdl_d
    z_rows = z_ptr + b64 * sz_b + ch64[:, None] * sz_d
    y_rows = y_ptr + b64 * sy_b + ch64[:, None] * sy_d
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    C_row = C_ptr + b64 * sC_b + grp * sC_g
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
    # A * log2(e) as a (channels, n) tile, built column by column so it shares the layout of
    # the state tile (a 2-D load would bring its own layout).
    A2 = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    for i in range(n):
        A_i = tl.load(A_ptr + ch * sA_d + i * sA_n, mask=ch_mask, other=0.0).to(tl.float32)
        A2 = set_column(A2, cols, i, A_i * LOG2E)

    state = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)  # carried h, (channels, n)
    if HAS_CARRY:
        state = load_state_tile(carry_ptr + seg_state_rows, d, ch_mask, n, cols, BLOCK_D, N_PAD)
    if HAS_INIT and not PACKED:
        if pid_seg == 0:
            init_rows = init_ptr + b64 * si_s + ch64 * si_d
            state = load_state_tile(init_rows, si_n, ch_mask, n, cols, BLOCK_D, N_PAD)
    dt_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    restarted = pid_seg < 0  # a scalar False
    t_begin = pid_seg * seg_len
    t_stop = tl.minimum(t_begin + seg_len, l)
    if RANGED:
        t_begin = tl.load(range_ptr + 2 * pid_seg) // V * V
        t_stop = tl.load(range_ptr + 2 * pid_seg + 1)
    full_steps = (t_stop - t_begin) // V
    for k in range(full_steps):
        # Saying that the first token is a multiple of V lets each channel's (channels, V)
        # tile load be one vector (rows aligned to 16 bytes): that is what puts each channel's
        # V tokens in one thread. (The hint is lost if given inside the helper.)
        state, dt_sum, restarted = _advance(
            tl.multiple_of(t_begin + k * V, V), state, dt_sum, restarted, A2, cols, tv, ch, ch64, ch_mask, b64,
            u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l, y_rows, sy_l, B_row, C_row, sB_n, sC_n,
            bias, D_ptr, seq_ptr, l, n,
            init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n, ckpt_ptr, ckpt_chunk, d,
            HAS_D, HAS_Z, SOFTPLUS, PACKED, HAS_INIT, STORE_FINAL, STORE_CKPT, WITH_OUTPUT,
            N_STATIC, V, False,
        )
    if t_begin + full_steps * V < t_stop:
        state, dt_sum, restarted = _advance(
            tl.multiple_of(t_begin + full_steps * V, V), state, dt_sum, restarted, A2, cols, tv, ch, ch64, ch_mask, b64,
            u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l, y_rows, sy_l, B_row, C_row, sB_n, sC_n,
            bias, D_ptr, seq_ptr, l, n,
            init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n, ckpt_ptr, ckpt_chunk, d,
            HAS_D, HAS_Z, SOFTPLUS, PACKED, HAS_INIT, STORE_FINAL, STORE_CKPT, WITH_OUTPUT,
            N_STATIC, V, True,
        )
    if STORE_FINAL and not PACKED:
        if t_stop == l:
            store_state_tile(final_ptr + b64 * sf_s + ch64 * sf_d, sf_n, ch_mask, state, n, cols)
    if not WITH_OUTPUT:
        store_state_tile(seg_end_ptr + seg_state_rows, d, ch_mask, state, n, cols)
        decay = tl.exp2(A2 * dt_sum[:, None])
        decay = tl.where(restarted, 0.0, decay)
        store_state_tile(seg_decay_ptr + seg_state_rows, d, ch_mask, decay, n, cols)


@triton.jit
def segment_carry_kernel(seg_end_ptr, seg_decay_ptr, carry_ptr, num_segments, per_row,
                         REVERSE: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """carry[s] = the state entering segment s: 0 for s = 0, then end[s-1] + decay[s-1] * carry[s-1].
    REVERSE walks the segments last to first (the backward's adjoint): carry[G-1] = 0, then
    carry[s] = end[s+1] + decay[s+1] * carry[s+1]. The segment the walk ends on is never read
    (the segment passes skip it).

    All three tensors are (b, G, n, d) fp32; one program handles BLOCK of the n * d values of
    one batch row. The chain is sequential, so its loads come UNROLL segments at a time: a
    program then waits one memory latency per UNROLL segments rather than one per segment.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per_row
    b64 = tl.program_id(1).to(tl.int64)
    h = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, num_segments, UNROLL):
        for kk in tl.static_range(UNROLL):
            k = k0 + kk  # the k-th segment of the walk
            s = num_segments - 1 - k if REVERSE else k
            base = (b64 * num_segments + s) * per_row + offs
            tl.store(carry_ptr + base, h, mask=tl.where(k < num_segments, mask, False))
            # Past the walk's last segment: the identity step (end 0, decay 1).
            feeds = tl.where(k < num_segments - 1, mask, False)
            end = tl.load(seg_end_ptr + base, mask=feeds, other=0.0)
            h = end + tl.load(seg_decay_ptr + base, mask=feeds, other=1.0) * h
