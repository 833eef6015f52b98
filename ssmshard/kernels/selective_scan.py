"""Triton kernels for the Mamba-1 selective scan (forward and backward, packed sequences) and
for the one-token decode step.

Dimension letters (shape comments, names):
    b  batch                       d  channels
    l  tokens (sequence length)    n  SSM state size
    g  groups of B / C             e  channels per group (d // g)
    S  packed sequences            T  chunk length in tokens (one tile along l)
    K  chunks (ceil(l / T))        i  state index inside the n loop
    h  heads, p head dim           (decode kernel, Mamba-2 layout)

Recurrence, per channel c and state index i (A[c, i] < 0):
    dt_t = softplus(delta_t + bias)          (or delta_t + bias)
    a_t  = exp(dt_t * A)                      decay
    h_t  = a_t * h_{t-1} + dt_t * u_t * B_t   state; h_{-1} = initial state (0 by default)
    y_t  = sum_i C_t * h_t  (+ D * u_t), times silu(z_t) if z is given.
With packed sequences (``cu_seqlens``) h_{t-1} is replaced by the sequence's initial state
(or 0) at every sequence start, so nothing crosses a boundary.

How the work is split, and why (bytes counted for bf16, B=8, d=5120, L=2048, N=16):
    A program owns (batch row, block of channels inside one B/C group) and walks the whole
    sequence chunk by chunk (T tokens), carrying the (channels, n) state in registers. Inside
    a chunk it loops over the n state indices; each is an independent linear recurrence,
    solved over the T tokens with ``tl.associative_scan``. u, delta, z are read once and y
    written once: 3 * 168 MB + 168 MB = 671 MB, 0.16 ms at the 4.25 TB/s copy roofline, while
    the b*d*l*n = 1.3 G exponentials alone take ~0.3 ms on the SFUs. The scan is therefore
    compute bound, not memory bound, and the design goal is one pass over memory with little
    extra arithmetic. The grid (b * d / BLOCK_D programs) has >= 640 programs for every
    benchmark shape (B=1 with d=5120 included), several per SM, so no second pass to carry
    states across sequence chunks is needed: it would cost a second exp-heavy pass over the
    data for parallelism the grid already has. A tensor-parallel shard with b * d below ~2k
    channels would want that split; it is not implemented (the grid still runs, just with
    idle SMs).
    The forward, when gradients are needed, also stores the state at every chunk start
    ("checkpoints", (b, K, n, d) fp32: b*d*l*n*4/T bytes = 84 MB at T=64, 1/8 of the bf16
    traffic). The backward walks the chunks in reverse, recomputes the states of one chunk
    from its checkpoint in registers, and runs the adjoint recurrence
        lam_t = C_t * dy_t + a_{t+1} * lam_{t+1}
    as a reverse associative scan. The decays a_{t+1} come from a second exponential of
    delta loaded one token later, which is cheaper than shuffling the a_t tile by one token.
    dB and dC sum over channels: each program writes its per-block partial sums
    (b, g, blocks, n, l) fp32 and torch sums the blocks (deterministic, no atomics). That
    costs 8 * b * n * l bytes per channel block (335 MB at BLOCK_D=32 for the shape above),
    which is why the backward uses wider channel blocks than the forward. dA, dD and
    d(delta_bias) are summed per program over time, written per batch row and summed by torch.

Numerics: everything is computed in fp32 whatever the input dtypes; exp(x) is evaluated as
exp2(x * log2(e)) with log2(e) folded into A once per state index.

Triton features used (all present in triton 3.6): tl.associative_scan with a tuple of
operands and ``reverse=True``, scalar ``if`` on a runtime value, tl.exp2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = tl.constexpr(1.4426950408889634)
# torch.nn.functional.softplus returns x itself above this threshold.
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


# --- small jit helpers -----------------------------------------------------------------


@triton.jit
def _linear_recurrence_combine(a_first, x_first, a_second, x_second):
    # (a, x) stands for the affine map h -> a * h + x. Applying "first" then "second" gives
    # h -> a_second * (a_first * h + x_first) + x_second. For a reverse scan Triton passes the
    # later (already accumulated) element as "first", which gives lam_t = x_t + a_t * lam_{t+1}.
    return a_first * a_second, x_first * a_second + x_second


@triton.jit
def _discretise(delta, bias, SOFTPLUS: tl.constexpr):
    dt = delta + bias
    if SOFTPLUS:
        dt = tl.where(dt > _SOFTPLUS_THRESHOLD, dt, tl.log(1.0 + tl.exp(dt)))
    return dt


@triton.jit
def _column(tile, cols, i):
    # Column i of a (rows, cols) register tile, as a (rows,) vector.
    return tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)


@triton.jit
def _set_column(tile, cols, i, values):
    return tl.where(cols[None, :] == i, values[:, None], tile)


@triton.jit
def _set_row(tile, rows, i, values):
    return tl.where(rows[:, None] == i, values[None, :], tile)


@triton.jit
def _boundaries(seq_ptr, t, l, PACKED: tl.constexpr):
    """Which tokens of the chunk start / end a sequence, and which sequence each belongs to.

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
def _per_sequence_ptrs(base, seq64, ch64, s_seq, s_ch, offset):
    # (BLOCK_D, T) pointers into a (sequences, d, n) state tensor: the sequence of each token.
    # Built only inside the branches that need them, so no 64-bit tile stays live in the loop.
    return base + seq64[None, :] * s_seq + ch64[:, None] * s_ch + offset


@triton.jit
def _chunk_states(decay, x, h_in, is_start, has_start, init_ptr, seq64, ch64, ch_mask,
                  si_s, si_d, init_offset, HAS_INIT: tl.constexpr):
    """States h over one chunk for one state index, from the state h_in carried into it.

    decay, x: (BLOCK_D, T); h_in: (BLOCK_D,). At sequence starts the carried state is
    replaced by the sequence's initial state (or 0): the decay is cut to 0 and the initial
    state's decayed contribution moves into x.
    """
    decay_eff = decay
    x_eff = x
    if has_start:
        decay_eff = tl.where(is_start[None, :], 0.0, decay)
        if HAS_INIT:
            init_ptrs = _per_sequence_ptrs(init_ptr, seq64, ch64, si_s, si_d, init_offset)
            init_mask = ch_mask[:, None] & is_start[None, :]
            init = tl.load(init_ptrs, mask=init_mask, other=0.0).to(tl.float32)
            x_eff = x + decay * init
    cum_decay, cum_x = tl.associative_scan((decay_eff, x_eff), 1, _linear_recurrence_combine)
    return cum_x + cum_decay * h_in[:, None]


# --- forward -----------------------------------------------------------------------------


@triton.jit
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, init_ptr,
    y_ptr, final_ptr, ckpt_ptr,
    d, l, e, n, num_chunks,
    su_b, su_d, su_l,
    sdl_b, sdl_d, sdl_l,
    sA_d, sA_n,
    sB_b, sB_g, sB_n, sB_l,
    sC_b, sC_g, sC_n, sC_l,
    sz_b, sz_d, sz_l,
    sy_b, sy_d, sy_l,
    si_s, si_d, si_n,
    sf_s, sf_d, sf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    PACKED: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    STORE_CKPT: tl.constexpr,
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PAD: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    pid_b = tl.program_id(1)
    blocks_per_group = tl.cdiv(e, BLOCK_D)
    grp = pid_blk // blocks_per_group
    in_group = (pid_blk % blocks_per_group) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_mask = in_group < e
    ch = grp * e + in_group  # (BLOCK_D,) channel indices
    ch64 = ch.to(tl.int64)
    b64 = pid_b.to(tl.int64)
    tt = tl.arange(0, T)
    cols = tl.arange(0, N_PAD)

    u_rows = u_ptr + b64 * su_b + ch64[:, None] * su_d  # (BLOCK_D, 1) row pointers
    delta_rows = delta_ptr + b64 * sdl_b + ch64[:, None] * sdl_d
    z_rows = z_ptr + b64 * sz_b + ch64[:, None] * sz_d
    y_rows = y_ptr + b64 * sy_b + ch64[:, None] * sy_d
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    C_row = C_ptr + b64 * sC_b + grp * sC_g
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)

    state = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)  # carried h, (channels, n)
    for k in range(num_chunks):
        t = k * T + tt
        t_mask = t < l
        tile_mask = ch_mask[:, None] & t_mask[None, :]
        if STORE_CKPT:
            # ckpt[b, k, i, c] = state carried into chunk k.
            ckpt_ptrs = ckpt_ptr + ((b64 * num_chunks + k) * n + cols[None, :]) * d + ch64[:, None]
            tl.store(ckpt_ptrs, state, mask=ch_mask[:, None] & (cols[None, :] < n))

        u = tl.load(u_rows + t[None, :] * su_l, mask=tile_mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_rows + t[None, :] * sdl_l, mask=tile_mask, other=0.0).to(tl.float32)
        dt = _discretise(delta, bias[:, None], SOFTPLUS)
        dtu = dt * u
        seq, is_start, is_end = _boundaries(seq_ptr, t, l, PACKED)
        seq64 = seq.to(tl.int64) + b64  # sequence index of each token: batch row when unpacked
        has_start = tl.max(is_start.to(tl.int32), axis=0) > 0
        has_end = tl.max(is_end.to(tl.int32), axis=0) > 0

        y = tl.zeros((BLOCK_D, T), dtype=tl.float32)
        for i in range(n):
            A_i = tl.load(A_ptr + ch * sA_d + i * sA_n, mask=ch_mask, other=0.0).to(tl.float32)
            B_i = tl.load(B_row + i * sB_n + t * sB_l, mask=t_mask, other=0.0).to(tl.float32)
            C_i = tl.load(C_row + i * sC_n + t * sC_l, mask=t_mask, other=0.0).to(tl.float32)
            decay = tl.exp2(dt * (A_i * _LOG2E)[:, None])
            h = _chunk_states(
                decay, dtu * B_i[None, :], _column(state, cols, i), is_start, has_start,
                init_ptr, seq64, ch64, ch_mask, si_s, si_d, i * si_n, HAS_INIT,
            )
            y += h * C_i[None, :]
            state = _set_column(state, cols, i, tl.sum(tl.where(tt[None, :] == T - 1, h, 0.0), axis=1))
            if STORE_FINAL:
                if has_end:
                    final_ptrs = _per_sequence_ptrs(final_ptr, seq64, ch64, sf_s, sf_d, i * sf_n)
                    tl.store(final_ptrs, h, mask=ch_mask[:, None] & is_end[None, :])

        if HAS_D:
            D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
            y += D[:, None] * u
        if HAS_Z:
            z = tl.load(z_rows + t[None, :] * sz_l, mask=tile_mask, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        tl.store(y_rows + t[None, :] * sy_l, y, mask=tile_mask)


# --- backward ----------------------------------------------------------------------------


@triton.jit
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, init_ptr,
    dy_ptr, dfinal_ptr, ckpt_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_part_ptr, dC_part_ptr, dA_part_ptr, dD_part_ptr,
    dbias_part_ptr, dinit_ptr,
    d, l, e, n, num_chunks, blocks_per_group,
    su_b, su_d, su_l,
    sdl_b, sdl_d, sdl_l,
    sA_d, sA_n,
    sB_b, sB_g, sB_n, sB_l,
    sC_b, sC_g, sC_n, sC_l,
    sz_b, sz_d, sz_l,
    sdy_b, sdy_d, sdy_l,
    si_s, si_d, si_n,
    sdf_s, sdf_d, sdf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    PACKED: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PAD: tl.constexpr,
):
    # Output layouts (all contiguous): du, ddelta, dz (b, d, l) in the inputs' dtypes;
    # dB_part, dC_part (b, g, blocks_per_group, n, l), dA_part (b, d, n), dD_part and
    # dbias_part (b, d), dinit (S or b, d, n), all fp32.
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

    u_rows = u_ptr + b64 * su_b + ch64[:, None] * su_d
    delta_rows = delta_ptr + b64 * sdl_b + ch64[:, None] * sdl_d
    z_rows = z_ptr + b64 * sz_b + ch64[:, None] * sz_d
    dy_rows = dy_ptr + b64 * sdy_b + ch64[:, None] * sdy_d
    out_rows = (b64 * d + ch64[:, None]) * l  # du / ddelta / dz are contiguous (b, d, l)
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    C_row = C_ptr + b64 * sC_b + grp * sC_g
    part_row = ((b64 * (d // e) + grp) * blocks_per_group + blk) * n * l  # into (b, g, blocks, n, l)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)

    rows_n = tl.arange(0, N_PAD)
    lam_next = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)  # lam at the first token of the later chunk
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
        dt = _discretise(delta, bias[:, None], SOFTPLUS)
        dt_next = _discretise(delta_next, bias[:, None], SOFTPLUS)
        dtu = dt * u
        seq, is_start, is_end = _boundaries(seq_ptr, t, l, PACKED)
        seq64 = seq.to(tl.int64) + b64
        has_start = tl.max(is_start.to(tl.int32), axis=0) > 0
        has_end = tl.max(is_end.to(tl.int32), axis=0) > 0
        # State carried into this chunk, read one state index at a time: a (channels, n) tile
        # loaded here would impose its own register layout on the states computed from it.
        ckpt_row = ckpt_ptr + (b64 * num_chunks + k) * n * d + ch64

        y = tl.zeros((BLOCK_D, T), dtype=tl.float32)
        dB_tile = tl.zeros((N_PAD, T), dtype=tl.float32)
        dC_tile = tl.zeros((N_PAD, T), dtype=tl.float32)
        lam_B = tl.zeros((BLOCK_D, T), dtype=tl.float32)  # sum_i lam * B_i
        lam_Ah = tl.zeros((BLOCK_D, T), dtype=tl.float32)  # sum_i A_i * lam * a_t * h_{t-1}
        for i in range(n):
            A_i = tl.load(A_ptr + ch * sA_d + i * sA_n, mask=ch_mask, other=0.0).to(tl.float32)
            B_i = tl.load(B_row + i * sB_n + t * sB_l, mask=t_mask, other=0.0).to(tl.float32)
            C_i = tl.load(C_row + i * sC_n + t * sC_l, mask=t_mask, other=0.0).to(tl.float32)
            A2 = (A_i * _LOG2E)[:, None]
            decay = tl.exp2(dt * A2)
            x = dtu * B_i[None, :]
            h = _chunk_states(
                decay, x, tl.load(ckpt_row + i * d, mask=ch_mask, other=0.0), is_start, has_start,
                init_ptr, seq64, ch64, ch_mask, si_s, si_d, i * si_n, HAS_INIT,
            )
            y += h * C_i[None, :]

            # Adjoint: lam_t = C_t dy_t + a_{t+1} lam_{t+1}; no flow from a sequence's end
            # into the token after it (a new sequence, or past l).
            source = dy_ssm * C_i[None, :]
            if HAS_DFINAL:
                if has_end:
                    dfinal_ptrs = _per_sequence_ptrs(dfinal_ptr, seq64, ch64, sdf_s, sdf_d, i * sdf_n)
                    end_mask = ch_mask[:, None] & is_end[None, :]
                    source += tl.load(dfinal_ptrs, mask=end_mask, other=0.0).to(tl.float32)
            decay_next = tl.where(is_end[None, :], 0.0, tl.exp2(dt_next * A2))
            cum_decay, cum_source = tl.associative_scan(
                (decay_next, source), 1, _linear_recurrence_combine, reverse=True
            )
            lam = cum_source + cum_decay * _column(lam_next, cols, i)[:, None]
            lam_next = _set_column(lam_next, cols, i, tl.sum(tl.where(tt[None, :] == 0, lam, 0.0), axis=1))

            lam_B += lam * B_i[None, :]
            # a_t * h_{t-1} = h_t - x_t (h_{t-1} being the initial state at a start).
            lam_ah = lam * (h - x)
            lam_Ah += A_i[:, None] * lam_ah
            dA_acc = _set_column(dA_acc, cols, i, _column(dA_acc, cols, i) + tl.sum(dt * lam_ah, axis=1))
            # Partial sums over this block's channels (masked channels and tokens hold zeros),
            # gathered as rows of (n, T) tiles: one store per chunk, in the tiles' own layout.
            dB_tile = _set_row(dB_tile, rows_n, i, tl.sum(lam * dtu, axis=0))
            dC_tile = _set_row(dC_tile, rows_n, i, tl.sum(dy_ssm * h, axis=0))
            if HAS_INIT:
                if has_start:
                    dinit_ptrs = _per_sequence_ptrs(dinit_ptr, seq64, ch64, d * n, n, i)
                    start_mask = ch_mask[:, None] & is_start[None, :]
                    tl.store(dinit_ptrs, decay * lam, mask=start_mask)

        part_ptrs = part_row + rows_n[:, None] * l + t[None, :]
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

    dA_ptrs = dA_part_ptr + (b64 * d + ch64[:, None]) * n + cols[None, :]
    tl.store(dA_ptrs, dA_acc, mask=ch_mask[:, None] & (cols[None, :] < n))
    tl.store(dD_part_ptr + b64 * d + ch64, dD_acc, mask=ch_mask)
    tl.store(dbias_part_ptr + b64 * d + ch64, dbias_acc, mask=ch_mask)


# --- launch configuration ------------------------------------------------------------------


@dataclass(frozen=True)
class ScanConfig:
    """Tile shapes. ``chunk`` is shared by the forward and the backward (the backward
    recomputes states from checkpoints taken every ``chunk`` tokens)."""

    chunk: int = 64
    fwd_block_d: int = 16
    fwd_warps: int = 4
    bwd_block_d: int = 32
    bwd_warps: int = 8

    def __post_init__(self):
        for name in ("chunk", "fwd_block_d", "bwd_block_d", "fwd_warps", "bwd_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ScanConfig.{name} must be a power of two, got {value}")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _widest_block(rows: int, blocks: tuple[int, ...], min_programs: int) -> int:
    # The widest channel block that still gives min_programs programs (or the narrowest).
    for block in sorted(blocks, reverse=True):
        if rows / block >= min_programs:
            return block
    return min(blocks)


def default_config(b: int, d: int, device: torch.device) -> ScanConfig:
    """Tiles for b * d channels: the forward wants several programs per SM; the backward wants
    wide channel blocks (its dB / dC partials shrink with them) but at least 2 programs per SM."""
    sms = _sm_count(device)
    chunk = 64
    fwd_block = _widest_block(b * d, (4, 8, 16), 4 * sms)
    bwd_block = _widest_block(b * d, (8, 16, 32), 2 * sms)
    # About 8 fp32 values per thread per (channels, chunk) tile.
    warps = lambda block: max(1, min(8, block * chunk // 256))  # noqa: E731
    return ScanConfig(chunk, fwd_block, warps(fwd_block), bwd_block, warps(bwd_block))


# --- argument checks ---------------------------------------------------------------------


def _check_scan_args(u, delta, A, B, C, D, z, delta_bias, cu_seqlens, initial_state):
    if u.dim() != 3:
        raise ValueError(f"u must be (b, d, l), got shape {tuple(u.shape)}")
    bsz, d, l = u.shape
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.shape != u.shape:
            raise ValueError(f"{name} must have u's shape {tuple(u.shape)}, got {tuple(t.shape)}")
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must be (d={d}, n), got shape {tuple(A.shape)}")
    if A.is_complex():
        raise ValueError("complex A is not supported: pass a real (d, n) A")
    n = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if t.dim() not in (3, 4) or t.shape[0] != bsz or t.shape[-2:] != (n, l):
            raise ValueError(
                f"{name} must be (b={bsz}, n={n}, l={l}) or (b, g, n, l), got {tuple(t.shape)}"
            )
    if B.shape != C.shape:
        raise ValueError(f"B and C must have one shape, got {tuple(B.shape)} and {tuple(C.shape)}")
    g = B.shape[1] if B.dim() == 4 else 1
    if d % g:
        raise ValueError(f"channels ({d}) must be a multiple of B/C groups ({g})")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and t.shape != (d,):
            raise ValueError(f"{name} must be (d={d},), got {tuple(t.shape)}")
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("delta_bias", delta_bias), ("initial_state", initial_state)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != u.device:
            raise ValueError(f"{name} is on {t.device}, u on {u.device}: move them to one device")
    num_seqs = bsz
    if cu_seqlens is not None:
        if bsz != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along l, so b must be 1, got {bsz}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be an int32 (S + 1,) tensor of offsets, got {cu_seqlens.dtype} "
                f"{tuple(cu_seqlens.shape)}"
            )
        num_seqs = cu_seqlens.numel() - 1
        _check_offsets(cu_seqlens, l)
    if initial_state is not None and initial_state.shape != (num_seqs, d, n):
        what = "S" if cu_seqlens is not None else "b"
        raise ValueError(
            f"initial_state must be ({what}={num_seqs}, d={d}, n={n}), got {tuple(initial_state.shape)}"
        )
    return bsz, d, l, n, g, num_seqs


def _check_offsets(cu_seqlens: Tensor, l: int) -> None:
    # Reading the offsets costs a device sync; skip it while a CUDA graph is being captured.
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != l or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to l={l} without decreasing, got {offsets[:8]}"
            f"{'...' if len(offsets) > 8 else ''} (last {offsets[-1]})"
        )


def _sequence_index(cu_seqlens: Tensor, l: int) -> Tensor:
    # seq[t] = s for cu_seqlens[s] <= t < cu_seqlens[s + 1]; empty sequences own no token.
    tokens = torch.arange(l, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).to(torch.int32)


# --- launches ------------------------------------------------------------------------------


def _bc4(t: Tensor) -> Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)  # (b, n, l) -> (b, 1, n, l)


def _state_strides(t: Optional[Tensor]) -> tuple[int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0)


def _launch_forward(u, delta, A, B4, C4, D, z, delta_bias, softplus, seq_idx, initial_state,
                    final, ckpt, y, cfg: ScanConfig):
    bsz, d, l = u.shape
    g, n = B4.shape[1], A.shape[1]
    e = d // g
    num_chunks = triton.cdiv(l, cfg.chunk)
    grid = (g * triton.cdiv(e, cfg.fwd_block_d), bsz)
    dummy = y  # any tensor, for pointers of absent operands (never read)
    zs = z.stride() if z is not None else (0, 0, 0)
    _scan_fwd_kernel[grid](
        u, delta, A, B4, C4, D if D is not None else dummy, z if z is not None else dummy,
        delta_bias if delta_bias is not None else dummy, seq_idx if seq_idx is not None else dummy,
        initial_state if initial_state is not None else dummy,
        y, final if final is not None else dummy, ckpt if ckpt is not None else dummy,
        d, l, e, n, num_chunks,
        *u.stride(), *delta.stride(), *A.stride(), *B4.stride(), *C4.stride(), *zs, *y.stride(),
        *_state_strides(initial_state), *_state_strides(final),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus, PACKED=seq_idx is not None, HAS_INIT=initial_state is not None,
        STORE_FINAL=final is not None, STORE_CKPT=ckpt is not None,
        BLOCK_D=cfg.fwd_block_d, T=cfg.chunk, N_PAD=triton.next_power_of_2(n),
        num_warps=cfg.fwd_warps,
    )


def _new_states(num_seqs, d, n, like: Tensor, initial_state: Optional[Tensor]) -> Tensor:
    # Sequences with no token keep their initial state (or 0): the kernel never writes them.
    if initial_state is not None:
        return initial_state.detach().to(torch.float32).clone()
    return torch.zeros(num_seqs, d, n, device=like.device, dtype=torch.float32)


def _forward(u, delta, A, B, C, D, z, delta_bias, softplus, cu_seqlens, initial_state,
             return_final_state, out_dtype, cfg, keep_checkpoints):
    bsz, d, l, n, g, num_seqs = _check_scan_args(u, delta, A, B, C, D, z, delta_bias, cu_seqlens,
                                                 initial_state)
    seq_idx = _sequence_index(cu_seqlens, l) if cu_seqlens is not None else None
    y = torch.empty(bsz, d, l, device=u.device, dtype=out_dtype or u.dtype)
    final = _new_states(num_seqs, d, n, u, initial_state) if return_final_state else None
    ckpt = None
    if keep_checkpoints:
        ckpt = torch.empty(bsz, triton.cdiv(l, cfg.chunk), n, d, device=u.device, dtype=torch.float32)
    _launch_forward(u, delta, A.float(), _bc4(B), _bc4(C), D, z, delta_bias, softplus, seq_idx,
                    initial_state, final, ckpt, y, cfg)
    return y, final, seq_idx, ckpt


class _SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, cu_seqlens,
                return_final_state, out_dtype, cfg):
        y, final, seq_idx, ckpt = _forward(u, delta, A, B, C, D, z, delta_bias, softplus, cu_seqlens,
                                           initial_state, return_final_state, out_dtype, cfg, True)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, ckpt)
        ctx.softplus, ctx.cfg = softplus, cfg
        return (y, final) if return_final_state else y

    @staticmethod
    def backward(ctx, dy, dfinal=None):
        u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, ckpt = ctx.saved_tensors
        grads = _backward(u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, ckpt,
                          dy, dfinal, ctx.softplus, ctx.cfg)
        needed = ctx.needs_input_grad
        return tuple(gr if needed[i] else None for i, gr in enumerate(grads)) + (None,) * 5


def _backward(u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, ckpt, dy, dfinal,
              softplus, cfg: ScanConfig):
    bsz, d, l = u.shape
    B4, C4 = _bc4(B), _bc4(C)
    g, n = B4.shape[1], A.shape[1]
    e = d // g
    num_seqs = initial_state.shape[0] if initial_state is not None else (
        dfinal.shape[0] if dfinal is not None else bsz)
    if dy is None:
        dy = torch.zeros((), device=u.device, dtype=u.dtype).expand(bsz, d, l)
    blocks_per_group = triton.cdiv(e, cfg.bwd_block_d)
    num_chunks = ckpt.shape[1]
    f32 = dict(device=u.device, dtype=torch.float32)
    du = torch.empty(bsz, d, l, device=u.device, dtype=u.dtype)
    ddelta = torch.empty(bsz, d, l, device=u.device, dtype=delta.dtype)
    dz = torch.empty(bsz, d, l, device=u.device, dtype=z.dtype) if z is not None else None
    dB_part = torch.empty(bsz, g, blocks_per_group, n, l, **f32)
    dC_part = torch.empty(bsz, g, blocks_per_group, n, l, **f32)
    dA_part = torch.empty(bsz, d, n, **f32)
    dD_part = torch.empty(bsz, d, **f32)
    dbias_part = torch.empty(bsz, d, **f32)
    dinit = None
    if initial_state is not None:
        # A sequence with no token passes its final-state gradient straight to its initial state.
        dinit = dfinal.float().clone() if dfinal is not None else torch.zeros(num_seqs, d, n, **f32)
    dummy = du
    A32 = A.float()
    _scan_bwd_kernel[(g * blocks_per_group, bsz)](
        u, delta, A32, B4, C4, D if D is not None else dummy, z if z is not None else dummy,
        delta_bias if delta_bias is not None else dummy, seq_idx if seq_idx is not None else dummy,
        initial_state if initial_state is not None else dummy,
        dy, dfinal if dfinal is not None else dummy, ckpt,
        du, ddelta, dz if dz is not None else dummy, dB_part, dC_part, dA_part, dD_part,
        dbias_part, dinit if dinit is not None else dummy,
        d, l, e, n, num_chunks, blocks_per_group,
        *u.stride(), *delta.stride(), *A32.stride(), *B4.stride(), *C4.stride(),
        *(z.stride() if z is not None else (0, 0, 0)), *dy.stride(),
        *_state_strides(initial_state), *_state_strides(dfinal),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus, PACKED=seq_idx is not None, HAS_INIT=initial_state is not None,
        HAS_DFINAL=dfinal is not None,
        BLOCK_D=cfg.bwd_block_d, T=cfg.chunk, N_PAD=triton.next_power_of_2(n),
        num_warps=cfg.bwd_warps,
    )
    dB = dB_part.sum(2)  # (b, g, blocks, n, l) -> (b, g, n, l)
    dC = dC_part.sum(2)
    if B.dim() == 3:
        dB, dC = dB.squeeze(1), dC.squeeze(1)  # (b, 1, n, l) -> (b, n, l)
    return (
        du,
        ddelta,
        dA_part.sum(0).to(A.dtype),
        dB.to(B.dtype),
        dC.to(C.dtype),
        dD_part.sum(0).to(D.dtype) if D is not None else None,
        dz,
        dbias_part.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
        dinit.to(initial_state.dtype) if dinit is not None else None,
    )


# --- public functions ------------------------------------------------------------------------


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    delta_bias: Optional[Tensor] = None,
    delta_softplus: bool = False,
    *,
    cu_seqlens: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    return_final_state: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[ScanConfig] = None,
):
    """Mamba-1 selective scan on Triton kernels (layouts of mamba_ssm's ``selective_scan_fn``).

    u, delta, z: (b, d, l), any float dtype; A: (d, n) real; B, C: (b, n, l) or (b, g, n, l)
    (channel c reads group c // (d // g)); D, delta_bias: (d,). All arithmetic is fp32.
    cu_seqlens: int32 (S + 1,) offsets of packed sequences along l (then b must be 1); the
    state restarts at every sequence start. initial_state: (b, d, n), or (S, d, n) with
    cu_seqlens. Returns y (b, d, l) in ``out_dtype`` (default u's dtype, as mamba_ssm; pass
    torch.float32 to get what ``torch.ops.ssmshard.selective_scan`` returns), and with
    ``return_final_state`` also the final states (b or S, d, n) fp32.
    Differentiable in every tensor argument; the backward is a Triton kernel too.
    """
    cfg = config or default_config(u.shape[0], u.shape[1], u.device)
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _SelectiveScanFn.apply(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                      delta_softplus, cu_seqlens, return_final_state, out_dtype, cfg)
    y, final, _, _ = _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens,
                              initial_state, return_final_state, out_dtype, cfg, False)
    return (y, final) if return_final_state else y


def selective_scan_as_op(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    """Drop-in for ``torch.ops.ssmshard.selective_scan`` (same arguments, same outputs:
    (y, final_state), both fp32), for the kernel-swap pass."""
    return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                          initial_state=initial_state, return_final_state=True,
                          out_dtype=torch.float32)
