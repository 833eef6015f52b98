"""Backward kernel of the Mamba-1 selective scan.

Dimension letters: b batch, d channels, l tokens, n state size, g groups of B / C,
e channels per group, T tokens of one chunk (the forward's checkpoint spacing).

A program owns (batch row, block of BLOCK_D channels inside one group) and walks the chunks
from last to first. For each chunk and state index it recomputes the states from the
checkpoint the forward stored at the chunk start (a forward associative scan over the chunk),
then runs the adjoint recurrence
    lam_t = C_t * dy_t + a_{t+1} * lam_{t+1}
as a reverse associative scan, the decays a_{t+1} coming from delta loaded one token later
(cheaper than moving the a_t tile by one token across threads). Tiles are (BLOCK_D, T) with
tokens spread over threads, unlike the forward: dB and dC sum over channels, and spreading
channels over threads would make those sums cost a cross-thread reduction per element.

dB and dC: per-block partial sums (b, g, blocks, n, l) fp32, summed over blocks by torch
(deterministic, no atomics); their size, 8 * b * n * l bytes per block, is why the blocks
are wide. dA, dD, d(delta_bias): summed over time in registers, written per batch row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ssmshard.kernels.scan_common import (
    LOG2E,
    boundaries,
    column,
    discretise,
    linear_recurrence_combine,
    load_state_tile,
    per_sequence_ptrs,
    restart_at_sequence_starts,
    set_column,
    set_row,
    store_state_tile,
)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _one_state_index_bwd(
    i, y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile,
    cols, rows_n, tt, t, t_mask, ch, ch64, ch_mask, dt, dt_next, dtu, dy_ssm,
    A_ptr, sA_d, sA_n, B_row, C_row, sB_n, sC_n, ckpt_row, d,
    is_start, has_start, is_end, has_end, seq64, n,
    init_ptr, si_s, si_d, si_n, dfinal_ptr, sdf_s, sdf_d, sdf_n, dinit_ptr,
    T: tl.constexpr, PACKED: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    A_i = tl.load(A_ptr + ch * sA_d + i * sA_n, mask=ch_mask, other=0.0).to(tl.float32)
    B_i = tl.load(B_row + i * sB_n + t, mask=t_mask, other=0.0)
    C_i = tl.load(C_row + i * sC_n + t, mask=t_mask, other=0.0)
    A2 = (A_i * LOG2E)[:, None]
    decay = tl.exp2(dt * A2)
    x = dtu * B_i[None, :]
    # States over the chunk, from the state carried into it (read per state index: a
    # (channels, n) tile loaded here would impose its own register layout on the states).
    decay_eff = decay
    x_eff = x
    if PACKED:
        decay_eff, x_eff = restart_at_sequence_starts(
            decay, x, is_start, has_start, init_ptr, seq64, ch64, ch_mask, si_s, si_d, i * si_n, HAS_INIT
        )
    cum_decay, cum_x = tl.associative_scan((decay_eff, x_eff), 1, linear_recurrence_combine)
    h_in = tl.load(ckpt_row + i * d, mask=ch_mask, other=0.0)
    h = cum_x + cum_decay * h_in[:, None]
    y += h * C_i[None, :]

    # Adjoint. Packed: no flow from a sequence's last token into the next sequence, and the
    # final-state gradient enters at the last token. Unpacked: the tokens past l are identity
    # steps (dt = 0), so the final-state gradient simply starts the chain (lam_next).
    source = dy_ssm * C_i[None, :]
    decay_next = tl.exp2(dt_next * A2)
    if PACKED:
        decay_next = tl.where(is_end[None, :], 0.0, decay_next)
        if HAS_DFINAL:
            if has_end:
                dfinal_ptrs = per_sequence_ptrs(dfinal_ptr, seq64, ch64, sdf_s, sdf_d, i * sdf_n)
                end_mask = ch_mask[:, None] & is_end[None, :]
                source += tl.load(dfinal_ptrs, mask=end_mask, other=0.0).to(tl.float32)
    cum_decay_next, cum_source = tl.associative_scan(
        (decay_next, source), 1, linear_recurrence_combine, reverse=True
    )
    lam = cum_source + cum_decay_next * column(lam_next, cols, i)[:, None]
    lam_next = set_column(lam_next, cols, i, tl.sum(tl.where(tt[None, :] == 0, lam, -0.0), axis=1))

    lam_B += lam * B_i[None, :]
    # a_t * h_{t-1} = h_t - x_t (h_{t-1} being the initial state at a sequence start).
    lam_ah = lam * (h - x)
    lam_Ah += A_i[:, None] * lam_ah
    dA_acc = set_column(dA_acc, cols, i, column(dA_acc, cols, i) + tl.sum(dt * lam_ah, axis=1))
    # Sums over this block's channels (masked channels and tokens hold zeros), kept as rows
    # of (n, T) tiles and stored once per chunk.
    # One two-operand reduction, so the two sums share their cross-warp barriers.
    dB_i, dC_i = tl.reduce((lam * dtu, dy_ssm * h), 0, _add_pairs)
    dB_tile = set_row(dB_tile, rows_n, i, dB_i)
    dC_tile = set_row(dC_tile, rows_n, i, dC_i)
    if PACKED and HAS_INIT:
        if has_start:
            dinit_ptrs = per_sequence_ptrs(dinit_ptr, seq64, ch64, d * n, n, i)
            tl.store(dinit_ptrs, decay * lam, mask=ch_mask[:, None] & is_start[None, :])
    return y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile


@triton.jit
def scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, init_ptr,
    dy_ptr, dfinal_ptr, ckpt_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_part_ptr, dC_part_ptr, dA_part_ptr, dD_part_ptr,
    dbias_part_ptr, dinit_ptr,
    d, l, e, n, num_chunks, blocks_per_group, row_len,
    su_b, su_d, su_l,
    sdl_b, sdl_d, sdl_l,
    sA_d, sA_n,
    sB_b, sB_g, sB_n,
    sC_b, sC_g, sC_n,
    sz_b, sz_d, sz_l,
    sdy_b, sdy_d, sdy_l,
    si_s, si_d, si_n,
    sdf_s, sdf_d, sdf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    PACKED: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PAD: tl.constexpr, N_STATIC: tl.constexpr,
):
    """Outputs: du, ddelta, dz (b, d, l) in the inputs' dtypes and dB_part, dC_part
    (b, g, blocks_per_group, n, l) fp32, all in rows of ``row_len`` >= l elements (aligned rows,
    see ``selective_scan._row_buffer``); dA_part (b, d, n), dD_part and dbias_part (b, d), dinit
    (S or b, d, n), all contiguous fp32. B and C are fp32 with unit stride along l; checkpoints
    are (b, num_chunks, n, d) fp32."""
    pid_blk = tl.program_id(0)
    pid_b = tl.program_id(1)
    grp = pid_blk // blocks_per_group
    blk = pid_blk % blocks_per_group
    in_group = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_mask = in_group < e
    ch = grp * e + in_group
    ch64 = ch.to(tl.int64)
    b64 = pid_b.to(tl.int64)
    tt = tl.arange(0, T)
    cols = tl.arange(0, N_PAD)
    rows_n = tl.arange(0, N_PAD)

    u_rows = u_ptr + b64 * su_b + ch64[:, None] * su_d
    delta_rows = delta_ptr + b64 * sdl_b + ch64[:, None] * sdl_d
    z_rows = z_ptr + b64 * sz_b + ch64[:, None] * sz_d
    dy_rows = dy_ptr + b64 * sdy_b + ch64[:, None] * sdy_d
    out_rows = (b64 * d + ch64[:, None]) * row_len  # du / ddelta / dz: (b, d, l) in rows of row_len
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    C_row = C_ptr + b64 * sC_b + grp * sC_g
    part_row = ((b64 * (d // e) + grp) * blocks_per_group + blk) * n * row_len  # into (b, g, blocks, n, l)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)

    lam_next = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)  # lam at the first token of the later chunk
    if HAS_DFINAL and not PACKED:
        lam_next = load_state_tile(dfinal_ptr + b64 * sdf_s + ch64 * sdf_d, sdf_n, ch_mask, n, cols,
                                   BLOCK_D, N_PAD)
    dA_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for kk in range(num_chunks):
        k = num_chunks - 1 - kk
        t = k * T + tt
        t_mask = t < l
        tile_mask = ch_mask[:, None] & t_mask[None, :]
        next_mask = ch_mask[:, None] & ((t + 1) < l)[None, :]
        u = tl.load(u_rows + t[None, :] * su_l, mask=tile_mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_rows + t[None, :] * sdl_l, mask=tile_mask, other=0.0).to(tl.float32)
        delta_next = tl.load(delta_rows + (t + 1)[None, :] * sdl_l, mask=next_mask, other=0.0).to(tl.float32)
        dy_ssm = tl.load(dy_rows + t[None, :] * sdy_l, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_rows + t[None, :] * sz_l, mask=tile_mask, other=0.0).to(tl.float32)
            dy_ssm = dy_ssm * (z * tl.sigmoid(z))  # gradient reaching the ungated output
        # Tokens past l are identity steps (dt = 0: decay 1, input 0).
        dt = tl.where(tile_mask, discretise(delta, bias[:, None], SOFTPLUS), 0.0)
        dt_next = tl.where(next_mask, discretise(delta_next, bias[:, None], SOFTPLUS), 0.0)
        dtu = dt * u
        seq, is_start, is_end = boundaries(seq_ptr, t, l, PACKED)
        seq64 = seq.to(tl.int64) + b64
        has_start = tl.max(is_start.to(tl.int32), axis=0) > 0
        has_end = tl.max(is_end.to(tl.int32), axis=0) > 0
        ckpt_row = ckpt_ptr + (b64 * num_chunks + k) * n * d + ch64

        y = tl.zeros((BLOCK_D, T), dtype=tl.float32)
        lam_B = tl.zeros((BLOCK_D, T), dtype=tl.float32)  # sum_i lam * B_i
        lam_Ah = tl.zeros((BLOCK_D, T), dtype=tl.float32)  # sum_i A_i * lam * a_t * h_{t-1}
        dB_tile = tl.zeros((N_PAD, T), dtype=tl.float32)
        dC_tile = tl.zeros((N_PAD, T), dtype=tl.float32)
        # Unrolled (compile-time i: the state-tile column selects fold away) for small n,
        # a loop otherwise; the two calls differ only in the loop around them.
        if N_STATIC > 0:
            for i in tl.static_range(N_STATIC):
                y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile = _one_state_index_bwd(
                    i, y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile,
                    cols, rows_n, tt, t, t_mask, ch, ch64, ch_mask, dt, dt_next, dtu, dy_ssm,
                    A_ptr, sA_d, sA_n, B_row, C_row, sB_n, sC_n, ckpt_row, d,
                    is_start, has_start, is_end, has_end, seq64, n,
                    init_ptr, si_s, si_d, si_n, dfinal_ptr, sdf_s, sdf_d, sdf_n, dinit_ptr,
                    T, PACKED, HAS_INIT, HAS_DFINAL,
                )
        else:
            for i in range(n):
                y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile = _one_state_index_bwd(
                    i, y, lam_B, lam_Ah, dA_acc, lam_next, dB_tile, dC_tile,
                    cols, rows_n, tt, t, t_mask, ch, ch64, ch_mask, dt, dt_next, dtu, dy_ssm,
                    A_ptr, sA_d, sA_n, B_row, C_row, sB_n, sC_n, ckpt_row, d,
                    is_start, has_start, is_end, has_end, seq64, n,
                    init_ptr, si_s, si_d, si_n, dfinal_ptr, sdf_s, sdf_d, sdf_n, dinit_ptr,
                    T, PACKED, HAS_INIT, HAS_DFINAL,
                )

        part_ptrs = part_row + rows_n[:, None] * row_len + t[None, :]
        part_mask = (rows_n[:, None] < n) & t_mask[None, :]
        tl.store(dB_part_ptr + part_ptrs, dB_tile, mask=part_mask)
        tl.store(dC_part_ptr + part_ptrs, dC_tile, mask=part_mask)
        # Reload what the n loop did not need rather than keep it in registers through it.
        u = tl.load(u_rows + t[None, :] * su_l, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_D:
            D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
            y += D[:, None] * u
            dD_acc += tl.sum(dy_ssm * u, axis=1)
            du = lam_B * dt + dy_ssm * D[:, None]
        else:
            du = lam_B * dt
        ddt = lam_B * u + lam_Ah
        if SOFTPLUS:
            delta = tl.load(delta_rows + t[None, :] * sdl_l, mask=tile_mask, other=0.0).to(tl.float32)
            ddt = ddt * tl.sigmoid(delta + bias[:, None])
        ddt = tl.where(tile_mask, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=1)
        out_ptrs = out_rows + t[None, :]
        tl.store(du_ptr + out_ptrs, du, mask=tile_mask)
        tl.store(ddelta_ptr + out_ptrs, ddt, mask=tile_mask)
        if HAS_Z:
            dy = tl.load(dy_rows + t[None, :] * sdy_l, mask=tile_mask, other=0.0).to(tl.float32)
            z = tl.load(z_rows + t[None, :] * sz_l, mask=tile_mask, other=0.0).to(tl.float32)
            z_sig = tl.sigmoid(z)
            tl.store(dz_ptr + out_ptrs, dy * y * z_sig * (1.0 + z * (1.0 - z_sig)), mask=tile_mask)

    store_state_tile(dA_part_ptr + (b64 * d + ch64) * n, 1, ch_mask, dA_acc, n, cols)
    if HAS_INIT and not PACKED:
        # The initial state fed token 0 through its decay: d(init) = a_0 * lam_0.
        delta_0 = tl.load(delta_rows, mask=ch_mask[:, None], other=0.0).to(tl.float32)  # (BLOCK_D, 1)
        dt_0 = discretise(delta_0, bias[:, None], SOFTPLUS)
        A_tile = load_state_tile(A_ptr + ch64 * sA_d, sA_n, ch_mask, n, cols, BLOCK_D, N_PAD)
        dinit = tl.exp2(dt_0 * A_tile * LOG2E) * lam_next
        store_state_tile(dinit_ptr + (b64 * d + ch64) * n, 1, ch_mask, dinit, n, cols)
    tl.store(dD_part_ptr + b64 * d + ch64, dD_acc, mask=ch_mask)
    tl.store(dbias_part_ptr + b64 * d + ch64, dbias_acc, mask=ch_mask)
