"""Forward kernel of the Mamba-1 selective scan that scans over time in parallel
(``ScanConfig(fwd_variant="parallel")``).

Dimension letters: b batch, d channels, l tokens, n state size (N_PAD: next power of two),
g groups of B / C, e channels per group, T tokens of one tile, G segments of the sequence.

Layout, and why: a program owns BLOCK_D channels of one batch row and walks its stretch of
the sequence T tokens at a time. Each step is one (BLOCK_D, T, N_PAD) tile: every
(channel, token, state) element gets its decay a = exp(dt * A) and input x = dt * u * B at
once (no dependence between them), and ``tl.associative_scan`` along the token axis solves
h_t = a_t * h_{t-1} + x_t for the whole tile, the state carried in from the previous tile
folded into the first token's input. Only the scan's FMA chain is sequential, and a thread
has n such chains side by side, so the exp2 and load latencies overlap.

The register layout comes from the loads (Triton gives a load the layout of its coalesced
access and propagates it): u, delta, z, y move as (BLOCK_D, T, 1) tiles and B, C as
(BLOCK_D, T, N_PAD) tiles with stride 0 over channels, so all of them, and the 3-D
arithmetic, share one layout. Compiled offline for sm_90 (triton 3.6, bf16 u, fp32 B / C),
T = 4 gives one channel per lane with its 4 tokens and all n states in the thread: no
shuffles, no spills, ~12 SASS instructions per (channel, token, state). T = 8 puts the
tokens on 2 lanes (fp32 B loads are 4 wide) and the scan then shuffles. The loop counts steps
rather than ranging over token offsets: with a runtime start, range()'s variable loses the
alignment the 16-byte loads need.

State indices past n read A = 0, B = C = 0: decay 1, input 0, no share of y, so the padding
never changes a result.

Everything the sequential kernel produces, this one produces the same way: y, final states,
the backward's checkpoints ckpt[b, k, i, c] (the state entering checkpoint chunk k, tokens
k * chunk ..), the segment pass (``WITH_OUTPUT`` False: each segment from a zero state,
writing its end state and total decay for ``segment_carry_kernel``), and packed sequences
(the decay is 0 at a sequence start, where the sequence's initial state enters instead).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ssmshard.kernels.scan_common import (LOG2E, boundaries, channel_block, discretise, linear_recurrence_combine, tile_phase,
                                          token_mask)


@triton.jit
def _state_tile_ptrs(base, ch64, nv, s_n):
    # (n, channels) pointers into a (.., n, d) or (.., d, n) state tensor: ``base`` plus
    # ``ch64`` point at each channel's state index 0, ``s_n`` steps between state indices.
    return base + ch64[:, None] + nv[None, :] * s_n


@triton.jit
def load_tokens(rows, s_l, t3, mask):
    """A (BLOCK_D, T, 1) per-token tile (u, delta, z, dy) in fp32."""
    return tl.load(rows + t3 * s_l, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_bc(row, s_n, n3, t3, ch3, mask):
    """B or C as (BLOCK_D, T, N_PAD) through pointers with stride 0 over channels, so that the
    load's layout is the tile arithmetic's."""
    return tl.load(row + 0 * ch3 + n3 * s_n + t3, mask=mask, other=0.0)


@triton.jit
def tile_states(h_in, dt, dtu, A2, B, tv3, seq, is_start, ch3, n3, state_mask, init_ptr, si_s, si_d, si_n,
                PACKED: tl.constexpr, HAS_INIT: tl.constexpr):
    """States h over a (BLOCK_D, T, N_PAD) tile from the state h_in entering it, and the raw
    step input x = dt u B (so h - x = a_t h_{t-1}, the initial state's share at a start).

    Packed sequences cut the recurrence at sequence starts: nothing is carried in, and the
    sequence's own initial state (decayed by one step) joins the input instead."""
    decay = tl.exp2(dt * A2)
    x = dtu * B
    x_eff = x
    if PACKED:
        start3 = is_start[None, :, None]
        if HAS_INIT:
            if tl.max(is_start.to(tl.int32), axis=0) > 0:
                init = tl.load(init_ptr + seq.to(tl.int64)[None, :, None] * si_s + ch3 * si_d + n3 * si_n,
                               mask=state_mask[:, None, :] & start3, other=0.0)
                x_eff = x + decay * init.to(tl.float32)
        decay = tl.where(start3, 0.0, decay)
    # The state carried in enters through the tile's first token.
    x_eff = tl.where(tv3 == 0, x_eff + decay * h_in[:, None, :], x_eff)
    _, h = tl.associative_scan((decay, x_eff), 1, linear_recurrence_combine)
    return h, x


@triton.jit
def _load_u_delta(t0, go, tv, l, ch_mask, u_rows, su_l, delta_rows, sdl_l, WHOLE: tl.constexpr):
    """u and delta of the tile at t0 as (BLOCK_D, T, 1) fp32 tiles; nothing is read unless go."""
    t = t0 + tv
    t3 = t[None, :, None]
    tile_mask = tl.where(go, ch_mask[:, None, None] & token_mask(t, l, WHOLE)[None, :, None], False)
    return load_tokens(u_rows, su_l, t3, tile_mask), load_tokens(delta_rows, sdl_l, t3, tile_mask)


@triton.jit
def _tile_step(
    t0, u, delta, state, dt_sum, restarted, A3, bias3, ch, ch64, ch_mask, nv, n_mask, tv, b64,
    z_rows, sz_l, y_rows, sy_l, B_row, C_row, sB_n, sC_n,
    D_ptr, seq_ptr, l, n, d,
    init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n, ckpt_ptr, ckpt_chunk,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, PACKED: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_CKPT: tl.constexpr,
    WITH_OUTPUT: tl.constexpr, T: tl.constexpr, WHOLE: tl.constexpr,
):
    """Tokens t0 .. t0 + T - 1 for the program's channels and all state indices (WHOLE: all
    of them before l, see ``token_mask``); u and delta are the tile's (``_load_u_delta``)."""
    t = t0 + tv
    t_mask = token_mask(t, l, WHOLE)
    t3 = t[None, :, None]  # (1, T, 1)
    tv3 = tv[None, :, None]
    tile_mask = ch_mask[:, None, None] & t_mask[None, :, None]  # (BLOCK_D, T, 1)
    ch3 = ch64[:, None, None]
    n3 = nv[None, None, :]
    state_mask = ch_mask[:, None] & n_mask[None, :]
    # B and C are read through (BLOCK_D, T, N_PAD) pointers, stride 0 over channels, so that
    # their loads take the per-token tensors' register layout (tokens in-thread).
    bc_mask = state_mask[:, None, :] & t_mask[None, :, None]
    if STORE_CKPT:
        num_ckpt = tl.cdiv(l, ckpt_chunk)
        if t0 % ckpt_chunk == 0:
            # ckpt[b, k, i, c]: the state carried into checkpoint chunk k (the tile starts one).
            rows = ckpt_ptr + (b64 * num_ckpt + t0 // ckpt_chunk) * n * d
            tl.store(_state_tile_ptrs(rows, ch64, nv, d), state, mask=state_mask)

    # Tokens past l become identity steps (dt 0: decay 1, input 0): the state passes through.
    dt = tl.where(tile_mask, discretise(delta, bias3, SOFTPLUS), 0.0)
    B = load_bc(B_row, sB_n, n3, t3, ch3, bc_mask).to(tl.float32)  # (BLOCK_D, T, N_PAD)
    seq, is_start, is_end = boundaries(seq_ptr, t, l, PACKED)
    if not WITH_OUTPUT:
        # Segment pass: the segment's total decay is exp(A * sum dt), or 0 once it restarts.
        # Summed per token position and reduced once after the loop: a reduction per tile
        # costs shuffles. Only packed rows test for restarts (a scalar reduction per tile too):
        # an unpacked row starts only at token 0, and no carry reads segment 0's decay (it
        # multiplies the zero state entering the row).
        dt_sum += dt
        if PACKED:
            restarted = restarted | (tl.max(is_start.to(tl.int32), axis=0) > 0)
    h, _ = tile_states(state, dt, dt * u, A3, B, tv3, seq, is_start, ch3, n3, state_mask,
                       init_ptr, si_s, si_d, si_n, PACKED, HAS_INIT)

    if PACKED and STORE_FINAL:
        has_end = tl.max(is_end.to(tl.int32), axis=0) > 0
        if has_end:
            seq3 = seq.to(tl.int64)[None, :, None]
            tl.store(final_ptr + seq3 * sf_s + ch3 * sf_d + n3 * sf_n, h,
                     mask=state_mask[:, None, :] & is_end[None, :, None])
    if STORE_CKPT:
        if T > ckpt_chunk:
            # Checkpoint chunks that start inside this tile: the state after the token
            # before each start (the chunk starting at t0 was stored above).
            nxt = t3 + 1
            edge = (nxt % ckpt_chunk == 0) & (tv3 < T - 1) & (nxt < l)
            rows = ckpt_ptr + (b64 * num_ckpt + nxt // ckpt_chunk) * n * d
            tl.store(rows + n3 * d + ch3, h, mask=state_mask[:, None, :] & edge)
    # The state after the tile's last token (tokens past l left it unchanged). The -0.0
    # fill is the additive identity, so the sum is exactly that token's value.
    state = tl.sum(tl.where(tv3 == T - 1, h, -0.0), axis=1)

    if WITH_OUTPUT:
        C = load_bc(C_row, sC_n, n3, t3, ch3, bc_mask).to(tl.float32)
        y = tl.sum(h * C, axis=2, keep_dims=True)  # (BLOCK_D, T, N_PAD) -> (BLOCK_D, T, 1)
        if HAS_D:
            D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
            y += D[:, None, None] * u
        if HAS_Z:
            z = load_tokens(z_rows, sz_l, t3, tile_mask)
            y = y * (z * tl.sigmoid(z))
        tl.store(y_rows + t3 * sy_l, y, mask=tile_mask)
    return state, dt_sum, restarted


@triton.jit
def scan_fwd_parallel_kernel(
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
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PAD: tl.constexpr,
):
    """One (channel block, batch row, segment); the arguments are those of
    ``selective_scan_fwd.scan_fwd_kernel`` (same meaning), with the tile shape
    (BLOCK_D, T, N_PAD) as constants. Segments are whole tiles (``seg_len`` a multiple of T).

    ``ckpt_chunk`` is a compile-time constant: as a runtime value, the per-tile checkpoint test
    (t0 % ckpt_chunk, and the in-tile edge test behind ``T > ckpt_chunk``) took the training
    forward's loop to 580 SASS instructions per 16-channel tile (442 now) and to 1,042 with 15
    spills per 32-channel tile (772 now; offline sm_90 SASS, triton 3.6)."""
    pid_blk = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_seg = tl.program_id(2)
    grp, _, ch, ch_mask, ch64 = channel_block(pid_blk, tl.cdiv(e, BLOCK_D), e, BLOCK_D)  # (BLOCK_D,) channels
    b64 = pid_b.to(tl.int64)
    tv = tl.arange(0, T)
    nv = tl.arange(0, N_PAD)
    n_mask = nv < n
    state_mask = ch_mask[:, None] & n_mask[None, :]  # (BLOCK_D, N_PAD)
    seg_offset = (b64 * num_segments + pid_seg) * n * d  # into (b, G, n, d)

    u_rows = u_ptr + b64 * su_b + ch64[:, None, None] * su_d  # (BLOCK_D, 1, 1) row pointers
    delta_rows = delta_ptr + b64 * sdl_b + ch64[:, None, None] * sdl_d
    z_rows = z_ptr + b64 * sz_b + ch64[:, None, None] * sz_d
    y_rows = y_ptr + b64 * sy_b + ch64[:, None, None] * sy_d
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    C_row = C_ptr + b64 * sC_b + grp * sC_g
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
    A_ptrs = A_ptr + ch[:, None] * sA_d + nv[None, :] * sA_n
    A2 = tl.load(A_ptrs, mask=state_mask, other=0.0).to(tl.float32) * LOG2E  # A * log2(e), (BLOCK_D, N_PAD)

    state = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)  # carried h, (channels, n)
    if HAS_CARRY:
        state = tl.load(_state_tile_ptrs(carry_ptr + seg_offset, ch64, nv, d), mask=state_mask, other=0.0)
    if HAS_INIT and not PACKED:
        if pid_seg == 0:
            init_rows = init_ptr + b64 * si_s + ch64 * si_d
            state = tl.load(init_rows[:, None] + nv[None, :] * si_n, mask=state_mask, other=0.0).to(tl.float32)
    dt_sum = tl.zeros((BLOCK_D, T, 1), dtype=tl.float32)
    restarted = pid_seg < 0  # a scalar False
    t_begin = pid_seg * seg_len
    t_stop = tl.minimum(t_begin + seg_len, l)
    if RANGED:  # segment pass on packed rows: only tokens [lo, hi) matter (see the sequential kernel)
        t_begin = tl.load(range_ptr + 2 * pid_seg) // T * T
        t_stop = tl.load(range_ptr + 2 * pid_seg + 1)
    num_tiles = tl.cdiv(t_stop - t_begin, T)
    num_whole = tl.minimum(num_tiles, (l - t_begin) // T)  # tiles wholly before l
    for phase in tl.static_range(2):  # the whole tiles, then the row's partial last tile (if any)
        first, count = tile_phase(phase, num_whole, num_tiles)
        # u and delta are read one tile ahead: their loads then overlap a whole tile's work
        # instead of heading the softplus -> exp2 -> scan chain that each tile waits on
        # (H200, no-grad forward, device time: 1.307 -> 1.242 ms at B=8 L=2048, 0.218 ->
        # 0.214 ms at B=1 L=2048).
        u_next, delta_next = _load_u_delta(tl.multiple_of(t_begin + first * T, T), count > 0, tv, l, ch_mask,
                                           u_rows, su_l, delta_rows, sdl_l, phase == 0)
        for k in range(count):
            # A step count, not range(t_begin, t_stop, T): with a runtime start the loop variable
            # loses its alignment, the hint with it, and the loads their 16-byte vectors.
            u, delta = u_next, delta_next
            u_next, delta_next = _load_u_delta(tl.multiple_of(t_begin + (first + k + 1) * T, T), k + 1 < count, tv, l,
                                               ch_mask, u_rows, su_l, delta_rows, sdl_l, phase == 0)
            state, dt_sum, restarted = _tile_step(
                tl.multiple_of(t_begin + (first + k) * T, T), u, delta, state, dt_sum, restarted,
                A2[:, None, :], bias[:, None, None],
                ch, ch64, ch_mask, nv, n_mask, tv, b64,
                z_rows, sz_l, y_rows, sy_l, B_row, C_row, sB_n, sC_n,
                D_ptr, seq_ptr, l, n, d,
                init_ptr, si_s, si_d, si_n, final_ptr, sf_s, sf_d, sf_n, ckpt_ptr, ckpt_chunk,
                HAS_D, HAS_Z, SOFTPLUS, PACKED, HAS_INIT, STORE_FINAL, STORE_CKPT, WITH_OUTPUT, T, phase == 0,
            )
    if STORE_FINAL and not PACKED:
        if t_stop == l:
            final_rows = final_ptr + b64 * sf_s + ch64 * sf_d
            tl.store(final_rows[:, None] + nv[None, :] * sf_n, state, mask=state_mask)
    if not WITH_OUTPUT:
        tl.store(_state_tile_ptrs(seg_end_ptr + seg_offset, ch64, nv, d), state, mask=state_mask)
        decay = tl.exp2(A2 * tl.sum(tl.sum(dt_sum, axis=2), axis=1)[:, None])
        decay = tl.where(restarted, 0.0, decay)
        tl.store(_state_tile_ptrs(seg_decay_ptr + seg_offset, ch64, nv, d), decay, mask=state_mask)
