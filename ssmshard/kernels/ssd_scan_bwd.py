"""Triton backward kernels of the Mamba-2 SSD chunked scan.

Dimension letters as in ssd_triton_common (t token, h head, g group, e head inside a
group, p head dim, n state, k chunk, s sequence, i row / j column inside a chunk).

Per chunk, with S_in the state entering it, S_out the state leaving it, cs the
cumulative log-decay since the chunk start (L its last position), dy = dout * silu(z)
and dS_out the gradient reaching S_out from later chunks (or from the final state):
    dS_in   = exp(cs_L) dS_out + sum_i exp(cs_i) dy_i^T C_i           (passed backwards)
    G_j     = sum_{i >= j} exp(cs_i - cs_j) (C_i . B_j) dy_i + exp(cs_L - cs_j) dS_out B_j
    dx_j    = dt_j G_j + D dy_j;      ddt_j (direct part) = x_j . G_j
    dB_j    = sum_h [ sum_{i >= j} exp(cs_i - cs_j) dt_j (dy_i . x_j) C_i + exp(cs_L - cs_j) dt_j x_j^T dS_out ]
    dC_i    = sum_h [ exp(cs_i) dy_i S_in + sum_{j <= i} exp(cs_i - cs_j) dt_j (dy_i . x_j) B_j ]
da_terms: the gradient of each log-decay a_t = dt_t A. Every exp() above holds the a_t of
a stretch of the chunk, and each term is credited to the a_t of its own stretch:
    da_t = sum_{i >= t} u_i + sum_{j < t <= i} M_ij + exp(cs_L) <dS_out, S_in> + sum_{j < t} w_j,
    u_i  = exp(cs_i) C_i . (dy_i S_in)                     (S_in to output i: a_1..a_i)
    M_ij = exp(cs_i - cs_j) (C_i . B_j) dt_j (dy_i . x_j)    (input j to output i: a_{j+1}..a_i)
    w_j  = exp(cs_L - cs_j) dt_j x_j . (dS_out B_j)          (input j to S_out: a_{j+1}..a_L)
then ddt_t += A da_t and dA = sum_t dt_t da_t; dt's clamp and softplus are undone last.
Why not the shorter identity dcs_t = C_t . dC_t - dt_t ddt_t(direct) + [t = L] <dS_out,
S_out> with da = suffix sums of dcs: it carries every pair (i, j) twice with opposite signs,
and the float32 rounding of those large sums is left behind: on an H200 (fp32, Mamba-2's
regime, 10 seeds) dA erred up to 3.0e-5 of its largest head's value with it, 2.9e-6 with
the form above (benchmarks/results/kernels/ssd_stable_dA.json). The form costs ssd_dx_dB_kernel
about a quarter more time (bf16 Mamba2-2.7B forward+backward at B=8 x 2048: 4.62 -> 5.04 ms).

Kernels (after the forward states are recomputed with ssd_chunk_states_kernel):
1. ``ssd_state_grads_kernel``: dS_out for every chunk by a backward pass over each
   sequence's chunks; also dz, dy, the dD partial sums and exp(cs_L) <dS_out, S_in>.
2. ``ssd_dx_dB_kernel``: dx, direct ddt, w, the sums of M and dB for a block of columns j.
3. ``ssd_dC_kernel``: dC and u for a block of rows i.
4. ``ssd_dt_grads_kernel``: da -> ddt, dA and d dt_bias partial sums.
dB and dC sum over the heads of a group; each program loops over a split of those heads
and writes one partial per split, summed afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmshard.kernels.launch_math import cdiv
from ssmshard.kernels.ssd_scan_fwd import run_chunk_states, run_dt_cumsum
from ssmshard.kernels.ssd_triton_common import (
    ChunkTable,
    TunableKernel,
    chunk_block,
    dot_modes,
    decay_row,
    load_block_decay,
    load_chunk_dt,
    load_tile,
    mma,
    next_pow2,
    state_coords,
)


@triton.jit
def ssd_state_grads_kernel(
    x_ptr, cs_ptr, C_ptr, z_ptr, ypre_ptr, dout_ptr,
    states_ptr, dfinal_ptr,
    dstates_ptr, dinit_ptr, dz_ptr, dy_ptr, dD_part_ptr, ds_part_ptr,
    seq_first_chunk_ptr, chunk_start_ptr, chunk_len_ptr,
    n_tokens, n_slots, decay_stride, ds_slots, heads_per_group, headdim, dstate, chunk_size, tune_bucket,
    stride_x_t, stride_x_h, stride_x_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_z_t, stride_z_h, stride_z_p,
    stride_dout_t, stride_dout_h, stride_dout_p,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (sequence, head, block of n), walking the sequence's chunks backwards.

    dstates[k, h] = dS_out of chunk k; ds_part[nb, k, h] = this n block's share of
    exp(cs_L) <dS_out, S_in> (ds_slots >= the number of n blocks); dinit[s, h] = dS_in of the first
    chunk. The programs of n block 0 also write dz, dy (= dout * silu(z), x's dtype) and
    dD_part[s, h, p] = sum_t dy x. Buffers written here (dz, dy) and ypre are contiguous (t, h, p).
    """
    s = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    n_heads = tl.num_programs(1)
    g = h // heads_per_group
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = offs_p < headdim
    mask_n = offs_n < dstate
    mask_pn = mask_p[:, None] & mask_n[None, :]
    offs_pn = offs_p[:, None] * dstate + offs_n[None, :]
    state_size = headdim * dstate
    # Only n block 0 writes the per-token gradients: p limit headdim there, 0 elsewhere.
    mask_p_token_grads = offs_p < tl.where(nb == 0, headdim, 0)

    head_seq = tl.cast(s, tl.int64) * n_heads + h
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + head_seq * state_size + offs_pn, mask=mask_pn, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    dD_acc = tl.zeros((BLOCK_P,), tl.float32)

    first = tl.load(seq_first_chunk_ptr + s)
    last = tl.load(seq_first_chunk_ptr + s + 1)
    for r in range(last - first):
        k = last - 1 - r
        slot = tl.cast(k, tl.int64) * n_heads + h
        tok0 = tl.load(chunk_start_ptr + k).to(tl.int64)
        length = tl.load(chunk_len_ptr + k)
        cs_chunk = decay_row(cs_ptr, h, k, n_slots, decay_stride)
        decay_all = tl.exp(tl.load(cs_chunk + length - 1))
        # The path S_in -> S_out, whose exponent holds every a_t of the chunk (see da_terms).
        S_in = tl.load(states_ptr + slot * state_size + offs_pn, mask=mask_pn, other=0.0).to(tl.float32)
        tl.store(ds_part_ptr + (nb * n_slots + k) * n_heads + h, decay_all * tl.sum(tl.sum(dS * S_in, 1), 0))
        # Zero the slots of n blocks this launch does not have, so the result does not depend
        # on what an earlier launch with narrower blocks (an autotuning run) left there.
        for unused_nb in range(tl.where(nb == 0, tl.num_programs(2), ds_slots), ds_slots):
            tl.store(ds_part_ptr + (unused_nb * n_slots + k) * n_heads + h, 0.0)
        tl.store(dstates_ptr + slot * state_size + offs_pn, dS.to(dstates_ptr.dtype.element_ty), mask=mask_pn)
        dS = dS * decay_all
        # Pointers to the chunk's first token; offsets inside the chunk stay int32.
        dout_chunk = dout_ptr + tok0 * stride_dout_t + h * stride_dout_h
        C_chunk = C_ptr + tok0 * stride_C_t + g * stride_C_g
        buf_chunk = (tok0 * n_heads + h) * headdim  # into the contiguous (t, h, p) buffers
        for t0 in range(0, length, BLOCK_T):
            # (dt is not needed here: cs stands in for its buffer)
            offs, mask_t, cs, unused_dt = load_block_decay(cs_chunk, cs_chunk, t0, length, BLOCK_T)
            dy = load_tile(dout_chunk, offs, mask_t, stride_dout_t, offs_p, mask_p, stride_dout_p).to(tl.float32)
            mask_token_grads = mask_t[:, None] & mask_p_token_grads[None, :]
            buf_offs = buf_chunk + offs[:, None] * (n_heads * headdim) + offs_p[None, :]
            if HAS_Z:
                z = load_tile(z_ptr + tok0 * stride_z_t + h * stride_z_h, offs, mask_t, stride_z_t, offs_p, mask_p,
                              stride_z_p).to(tl.float32)
                sig = tl.sigmoid(z)
                ypre = tl.load(ypre_ptr + buf_offs, mask=mask_token_grads, other=0.0).to(tl.float32)
                dz = dy * ypre * sig * (1.0 + z * (1.0 - sig))
                tl.store(dz_ptr + buf_offs, dz.to(dz_ptr.dtype.element_ty), mask=mask_token_grads)
                dy = dy * z * sig
                tl.store(dy_ptr + buf_offs, dy.to(dy_ptr.dtype.element_ty), mask=mask_token_grads)
            if HAS_D:
                xt = load_tile(x_ptr + tok0 * stride_x_t + h * stride_x_h, offs, mask_t, stride_x_t, offs_p,
                               mask_p_token_grads, stride_x_p).to(tl.float32)
                dD_acc += tl.sum(dy * xt, 0)
            Ct = load_tile(C_chunk, offs, mask_t, stride_C_t, offs_n, mask_n, stride_C_n)
            dyw = (dy * tl.where(mask_t, tl.exp(cs), 0.0)[:, None]).to(Ct.dtype)
            dS = mma(tl.trans(dyw), Ct, dS, DOT_PRECISION, UPCAST)
    if HAS_INIT:
        tl.store(dinit_ptr + head_seq * state_size + offs_pn, dS, mask=mask_pn)
    if HAS_D:
        tl.store(dD_part_ptr + head_seq * headdim + offs_p, dD_acc, mask=mask_p_token_grads)


@triton.jit
def ssd_dx_dB_kernel(
    x_ptr, dtd_ptr, cs_ptr, B_ptr, C_ptr, D_ptr, dy_ptr, dstates_ptr,
    dx_ptr, ddt_direct_ptr, w_row_ptr, da_part_ptr, dB_part_ptr,
    chunk_start_ptr, chunk_len_ptr,
    n_tokens, n_slots, decay_stride, n_heads, heads_per_group, heads_per_split, headdim, dstate, chunk_size,
    tune_bucket,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_dy_t, stride_dy_h, stride_dy_p,
    HAS_D: tl.constexpr, D_PER_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, PART_TOKENS: tl.constexpr,
):
    """A block of BLOCK columns j of chunk k, group g (axis 1), head split sp (axis 2).

    dx (contiguous (t, h, p)), ddt_direct[h, t] = x_t . G_t, w_row[h, t] = dt_t x_t . G_t's
    share through S_out, da_part[j0 // PART_TOKENS, h, t] = the sums of the pairs M_ij with j
    in this block and j < t <= i (see da_terms), and dB_part[sp, t, g, :].

    The pairs: positions t of the block get those with j < t (an exclusive prefix over the
    rows j, summed over i >= t); positions of a later block I get those of I with i >= t (a
    suffix over i of M's column sums) plus every pair of the blocks after I (``later``: the
    row blocks are walked last to first). da_part rows of other slots that a launch with
    smaller blocks (an autotuning run) would have written are zeroed.
    """
    # Column block 0 has the longest run of rows after it: launch it first.
    k, tok0, length, j0, offs_j, mask_j = chunk_block(chunk_start_ptr, chunk_len_ptr, n_slots, chunk_size,
                                                      BLOCK, False)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    offs_p, mask_p, offs_n, mask_n, mask_p_state = state_coords(headdim, dstate, length, BLOCK_P, BLOCK_N)
    mask_jp = mask_j[:, None] & mask_p[None, :]
    # Pointers to the chunk's first token; offsets inside the chunk stay int32.
    B_chunk = B_ptr + tok0 * stride_B_t + g * stride_B_g
    C_chunk = C_ptr + tok0 * stride_C_t + g * stride_C_g

    B_j = load_tile(B_chunk, offs_j, mask_j, stride_B_t, offs_n, mask_n, stride_B_n)
    dB_acc = tl.zeros((BLOCK, BLOCK_N), tl.float32)
    i_end = tl.where(j0 < length, length, 0)
    e_lo = sp * heads_per_split
    for e in range(e_lo, tl.minimum(e_lo + heads_per_split, heads_per_group)):
        h = g * heads_per_group + e
        x_chunk = x_ptr + tok0 * stride_x_t + h * stride_x_h
        dy_chunk = dy_ptr + tok0 * stride_dy_t + h * stride_dy_h
        cs_chunk = decay_row(cs_ptr, h, k, n_slots, decay_stride)
        dtd_chunk = decay_row(dtd_ptr, h, k, n_slots, decay_stride)
        # An unused slot has length 0: read position 0 instead of -1 (nothing is stored for it).
        cs_last = tl.load(cs_chunk + tl.maximum(length - 1, 0))
        cs_j = tl.load(cs_chunk + offs_j, mask=mask_j, other=0.0)
        dt_j = tl.load(dtd_chunk + offs_j, mask=mask_j, other=0.0)
        x_j = load_tile(x_chunk, offs_j, mask_j, stride_x_t, offs_p, mask_p, stride_x_p)
        slot = tl.cast(k, tl.int64) * n_heads + h
        dS_out = load_tile(dstates_ptr + slot * headdim * dstate, offs_p, mask_p_state, dstate,
                           offs_n, mask_n, 1)  # (p, n)
        # Paths through the state leaving the chunk.
        to_end = tl.where(mask_j, tl.exp(cs_last - cs_j), 0.0)
        G = mma(B_j, tl.trans(dS_out), tl.zeros((BLOCK, BLOCK_P), tl.float32), DOT_PRECISION, UPCAST)
        G = G * to_end[:, None]
        tl.store(w_row_ptr + tl.cast(h, tl.int64) * n_tokens + tok0 + offs_j,
                 dt_j * tl.sum(G * x_j.to(tl.float32), 1), mask=mask_j)
        x_scaled = (x_j.to(tl.float32) * (to_end * dt_j)[:, None]).to(x_j.dtype)
        dB_acc = mma(x_scaled, dS_out, dB_acc, DOT_PRECISION, UPCAST)
        da_row = da_part_ptr + (tl.cast(j0 // PART_TOKENS, tl.int64) * n_heads + h) * n_tokens + tok0
        own = tl.zeros((BLOCK,), tl.float32)  # pair sums for the positions of this block
        later = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
        # Paths through the outputs of rows i >= j of this chunk, last row block first.
        n_rows = tl.cdiv(i_end - j0, BLOCK)
        for r in range(n_rows):
            i0 = j0 + (n_rows - 1 - r) * BLOCK
            # (Triton keeps every name assigned before a loop as a loop variable: no "_" here.)
            offs_i, mask_i, cs_i, unused_dt_i = load_block_decay(cs_chunk, dtd_chunk, i0, length, BLOCK)
            C_i = load_tile(C_chunk, offs_i, mask_i, stride_C_t, offs_n, mask_n, stride_C_n)
            dy_i = load_tile(dy_chunk, offs_i, mask_i, stride_dy_t, offs_p, mask_p, stride_dy_p).to(x_j.dtype)
            causal = (offs_i[None, :] >= offs_j[:, None]) & mask_i[None, :]  # (j, i)
            decay = tl.exp(tl.where(causal, cs_i[None, :] - cs_j[:, None], -float("inf")))
            cb_t = mma(B_j, tl.trans(C_i), tl.zeros((BLOCK, BLOCK), tl.float32), DOT_PRECISION, UPCAST)
            G = mma((cb_t * decay).to(x_j.dtype), dy_i, G, DOT_PRECISION, UPCAST)
            dyx_t = mma(x_j, tl.trans(dy_i), tl.zeros((BLOCK, BLOCK), tl.float32), DOT_PRECISION, UPCAST)
            weight = dyx_t * decay * dt_j[:, None]
            dB_acc = mma(weight.to(C_i.dtype), C_i, dB_acc, DOT_PRECISION, UPCAST)
            pair = tl.where((offs_i[None, :] > offs_j[:, None]) & mask_j[:, None], weight * cb_t, 0.0)  # M^T: (j, i)
            if i0 > j0:
                # Every i of the block is >= every position t here: an exclusive prefix of row sums.
                row_sums = tl.sum(pair, 1)
                own += tl.cumsum(row_sums, 0) - row_sums
                col = tl.sum(pair, 0)  # (i,): every j of this block
                tl.store(da_row + offs_i, tl.cumsum(col, 0, reverse=True) + later, mask=mask_i)
                later += tl.sum(col, 0)
            else:
                before = tl.cumsum(pair, 0) - pair  # [t, i]: the pairs with j < t, t a position of this block
                own += tl.sum(tl.where(offs_i[None, :] >= offs_j[:, None], before, 0.0), 1)
        tl.store(da_row + offs_j, own, mask=mask_j)
        for extra in range(1, BLOCK // PART_TOKENS):
            stale = da_row + extra * n_heads * n_tokens
            for t0 in range(j0, i_end, BLOCK):
                offs_t = t0 + tl.arange(0, BLOCK)
                tl.store(stale + offs_t, tl.zeros((BLOCK,), tl.float32), mask=offs_t < length)
        dx = G * dt_j[:, None]
        if HAS_D:
            dy_j = load_tile(dy_chunk, offs_j, mask_j, stride_dy_t, offs_p, mask_p, stride_dy_p).to(tl.float32)
            if D_PER_P:
                dx += dy_j * tl.load(D_ptr + h * headdim + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
            else:
                dx += dy_j * tl.load(D_ptr + h).to(tl.float32)
        dx_chunk = dx_ptr + (tok0 * n_heads + h) * headdim  # contiguous (t, h, p)
        tl.store(dx_chunk + offs_j[:, None] * (n_heads * headdim) + offs_p[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask_jp)
        tl.store(ddt_direct_ptr + tl.cast(h, tl.int64) * n_tokens + tok0 + offs_j,
                 tl.sum(G * x_j.to(tl.float32), 1), mask=mask_j)
    dB_chunk = dB_part_ptr + ((tl.cast(sp, tl.int64) * n_tokens + tok0) * tl.num_programs(1) + g) * dstate
    tl.store(dB_chunk + offs_j[:, None] * (tl.num_programs(1) * dstate) + offs_n[None, :], dB_acc,
             mask=mask_j[:, None] & mask_n[None, :])


@triton.jit
def ssd_dC_kernel(
    x_ptr, dtd_ptr, cs_ptr, B_ptr, C_ptr, dy_ptr, states_ptr,
    u_row_ptr, dC_part_ptr,
    chunk_start_ptr, chunk_len_ptr,
    n_tokens, n_slots, decay_stride, n_heads, heads_per_group, heads_per_split, headdim, dstate, chunk_size,
    tune_bucket,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_dy_t, stride_dy_h, stride_dy_p,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    """A block of BLOCK rows i of chunk k, group g (axis 1), head split sp (axis 2).

    dC_part[sp, t, g, :] and u_row[h, t] = C_t . (dC_t^(h)'s share through S_in) (see da_terms).
    """
    k, tok0, length, i0, offs_i, mask_i = chunk_block(chunk_start_ptr, chunk_len_ptr, n_slots, chunk_size,
                                                      BLOCK, True)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    offs_p, mask_p, offs_n, mask_n, mask_p_state = state_coords(headdim, dstate, length, BLOCK_P, BLOCK_N)
    # Pointers to the chunk's first token; offsets inside the chunk stay int32.
    B_chunk = B_ptr + tok0 * stride_B_t + g * stride_B_g

    C_i = load_tile(C_ptr + tok0 * stride_C_t + g * stride_C_g, offs_i, mask_i, stride_C_t, offs_n, mask_n,
                    stride_C_n)
    C_i32 = C_i.to(tl.float32)
    dC_acc = tl.zeros((BLOCK, BLOCK_N), tl.float32)
    j_end = tl.where(i0 < length, tl.minimum(i0 + BLOCK, length), 0)
    e_lo = sp * heads_per_split
    for e in range(e_lo, tl.minimum(e_lo + heads_per_split, heads_per_group)):
        h = g * heads_per_group + e
        x_chunk = x_ptr + tok0 * stride_x_t + h * stride_x_h
        cs_chunk = decay_row(cs_ptr, h, k, n_slots, decay_stride)
        dtd_chunk = decay_row(dtd_ptr, h, k, n_slots, decay_stride)
        cs_i = tl.load(cs_chunk + offs_i, mask=mask_i, other=0.0)
        dy_i = load_tile(dy_ptr + tok0 * stride_dy_t + h * stride_dy_h, offs_i, mask_i, stride_dy_t, offs_p, mask_p,
                         stride_dy_p).to(C_i.dtype)
        slot = tl.cast(k, tl.int64) * n_heads + h
        state_in = load_tile(states_ptr + slot * headdim * dstate, offs_p, mask_p_state, dstate,
                             offs_n, mask_n, 1)  # (p, n)
        dC_h = mma(dy_i, state_in, tl.zeros((BLOCK, BLOCK_N), tl.float32), DOT_PRECISION, UPCAST)
        dC_h = dC_h * tl.exp(cs_i)[:, None]
        u = tl.sum(dC_h * C_i32, 1)  # the share through S_in, before the pairs join dC_h
        for j0 in range(0, j_end, BLOCK):
            offs_j, mask_j, cs_j, dt_j = load_block_decay(cs_chunk, dtd_chunk, j0, length, BLOCK)
            x_j = load_tile(x_chunk, offs_j, mask_j, stride_x_t, offs_p, mask_p, stride_x_p)
            B_j = load_tile(B_chunk, offs_j, mask_j, stride_B_t, offs_n, mask_n, stride_B_n)
            dyx = mma(dy_i, tl.trans(x_j.to(C_i.dtype)), tl.zeros((BLOCK, BLOCK), tl.float32), DOT_PRECISION, UPCAST)
            causal = (offs_i[:, None] >= offs_j[None, :]) & mask_j[None, :]
            decay = tl.exp(tl.where(causal, cs_i[:, None] - cs_j[None, :], -float("inf")))
            dC_h = mma((dyx * decay * dt_j[None, :]).to(B_j.dtype), B_j, dC_h, DOT_PRECISION, UPCAST)
        tl.store(u_row_ptr + tl.cast(h, tl.int64) * n_tokens + tok0 + offs_i, u, mask=mask_i)
        dC_acc += dC_h
    dC_chunk = dC_part_ptr + ((tl.cast(sp, tl.int64) * n_tokens + tok0) * tl.num_programs(1) + g) * dstate
    tl.store(dC_chunk + offs_i[:, None] * (tl.num_programs(1) * dstate) + offs_n[None, :], dC_acc,
             mask=mask_i[:, None] & mask_n[None, :])


@triton.jit
def ssd_dt_grads_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, ddt_direct_ptr, u_row_ptr, w_row_ptr, da_part_ptr, ds_ptr,
    ddt_ptr, dA_part_ptr, dbias_part_ptr,
    chunk_start_ptr, chunk_len_ptr,
    n_tokens, n_parts, stride_dt_t, stride_dt_h, dt_min, dt_max,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK_PAD: tl.constexpr,
):
    """One program per (chunk, head): the terms of da (da_terms) -> ddt (contiguous (t, h)), dA,
    d dt_bias."""
    k = tl.program_id(0)
    h = tl.program_id(1)
    n_heads = tl.num_programs(1)
    tok0 = tl.load(chunk_start_ptr + k).to(tl.int64)
    length = tl.load(chunk_len_ptr + k)
    offs, mask, dt, slope = load_chunk_dt(dt_ptr, dt_bias_ptr, h, tok0, length, stride_dt_t, stride_dt_h,
                                          dt_min, dt_max, HAS_BIAS, SOFTPLUS, CHUNK_PAD)
    rows = tl.cast(h, tl.int64) * n_tokens + tok0 + offs
    u = tl.load(u_row_ptr + rows, mask=mask, other=0.0)
    w = tl.load(w_row_ptr + rows, mask=mask, other=0.0)
    pairs = tl.zeros((CHUNK_PAD,), tl.float32)
    for part in range(n_parts):  # the pairs, by block of j (ssd_dx_dB_kernel)
        pairs += tl.load(da_part_ptr + tl.cast(part, tl.int64) * n_heads * n_tokens + rows, mask=mask, other=0.0)
    da = (tl.cumsum(u, 0, reverse=True)  # through S_in: outputs i >= t
          + pairs
          + tl.load(ds_ptr + tl.cast(k, tl.int64) * n_heads + h)  # S_in -> S_out
          + tl.cumsum(w, 0) - w)  # through S_out: inputs j < t
    ddt_direct = tl.load(ddt_direct_ptr + rows, mask=mask, other=0.0)
    ddt = (ddt_direct + tl.load(A_ptr + h).to(tl.float32) * da) * slope
    tl.store(ddt_ptr + (tok0 + offs) * n_heads + h, ddt.to(ddt_ptr.dtype.element_ty), mask=mask)
    tl.store(dA_part_ptr + tl.cast(k, tl.int64) * n_heads + h, tl.sum(dt * da, 0))  # dt is 0 past the chunk
    tl.store(dbias_part_ptr + tl.cast(k, tl.int64) * n_heads + h, tl.sum(ddt, 0))


# --- launchers --------------------------------------------------------------------------


def _clamp_state_grads(kw, args):
    kw["BLOCK_T"] = min(kw["BLOCK_T"], next_pow2(args["chunk_size"]))
    kw["BLOCK_N"] = min(kw["BLOCK_N"], next_pow2(args["dstate"]))
    return kw


def _clamp_block(kw, args):
    kw["BLOCK"] = min(kw["BLOCK"], next_pow2(args["chunk_size"]))
    return kw


# Configs: none spills registers (or only a few bytes) for sm_90 at Mamba2-2.7B sizes
# (compiled offline and read with cuobjdump).
_C = triton.Config
_KEY = ["headdim", "dstate", "chunk_size", "tune_bucket"]
state_grads = TunableKernel(
    ssd_state_grads_kernel,
    [
        _C({"BLOCK_T": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        _C({"BLOCK_T": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        _C({"BLOCK_T": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
        _C({"BLOCK_T": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    ],
    key=_KEY,
    clamp=_clamp_state_grads,
)
dx_dB = TunableKernel(
    ssd_dx_dB_kernel,
    [
        _C({"BLOCK": 32}, num_warps=8, num_stages=2),
        _C({"BLOCK": 64}, num_warps=8, num_stages=2),
        _C({"BLOCK": 32}, num_warps=4, num_stages=2),
    ],
    key=_KEY,
    clamp=_clamp_block,
)
dC = TunableKernel(
    ssd_dC_kernel,
    [
        _C({"BLOCK": 64}, num_warps=8, num_stages=1),
        _C({"BLOCK": 32}, num_warps=8, num_stages=2),
        _C({"BLOCK": 64}, num_warps=8, num_stages=2),
    ],
    key=_KEY,
    clamp=_clamp_block,
)

# State-size block of the dx/dB and dC kernels: at least 64 wide. With bf16 inputs and a
# 32-wide block (dstate 32, Zamba2's layout g = h = 8, p = 64, b=16 x 512, chunk 256, H200,
# Triton 3.6), autotuned runs gave NaN in dC and ddt; forcing config 0 of every kernel (in
# particular ssd_dC_kernel's {BLOCK: 64, num_warps: 8, num_stages: 1}) gave NaN, configs 1
# and 2 were finite; at g = 1 autotuning ssd_dC_kernel hit an illegal memory access. The
# same run at dstate 64 was finite, fp32 inputs were finite, and the CPU interpreter
# computes the 32-wide kernels correctly: a fault of the GPU build at that block width, not
# of the kernels' arithmetic. A 64-wide block compiles the kernels dstate 64 uses; the masks
# on n keep the extra columns zero in loads and out of stores.
MIN_SPLIT_BLOCK_N = 64
# Aim for this many programs in the dx/dB and dC kernels when choosing head splits.
_TARGET_PROGRAMS = 1024
_MAX_HEAD_SPLITS = 16


def _head_splits(table: ChunkTable, n_groups: int, heads_per_group: int) -> int:
    """Heads per split: few enough programs to reuse B / C over heads, enough to fill the GPU."""
    base = table.n_slots * n_groups * cdiv(table.chunk_size, 64)
    splits = min(heads_per_group, _MAX_HEAD_SPLITS, max(1, cdiv(_TARGET_PROGRAMS, base)))
    return cdiv(heads_per_group, splits)


def _strides3(t):
    return t.stride() if t is not None else (0, 0, 0)


def ssd_backward(dout, dfinal, x, dt, A, B, C, D, z, ypre, init, table: ChunkTable, dt_args: dict):
    """Gradients on flattened tokens.

    dout: (t, h, p) or None; dfinal: (S, h, p, n) or None. Returns a dict with dx, ddt,
    dA, dB, dC (token-flat shapes, fp32 for the reduced ones), dD, dz, ddt_bias, dinit
    (None where the input is absent). Forward states are recomputed, not stored.
    """
    n_tok, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dev = x.device
    f32 = torch.float32
    if dout is None:
        dout = torch.zeros(n_tok, h, p, device=dev, dtype=x.dtype)
    dtd, cs = run_dt_cumsum(dt, A, table, dt_args)
    states, _ = run_chunk_states(x, dtd, cs, B, init, table)
    chunk_start, chunk_len, seq_first_chunk = table.tensors()
    modes = dot_modes(x.dtype)
    common = dict(n_tokens=n_tok, n_slots=table.n_slots, decay_stride=table.decay_stride, headdim=p, dstate=n,
                  chunk_size=table.chunk_size,
                  cs_ptr=cs, chunk_start_ptr=chunk_start, chunk_len_ptr=chunk_len, **modes)

    dstates = torch.empty_like(states)
    dinit = torch.empty(table.n_seqs, h, p, n, device=dev, dtype=f32) if init is not None else None
    dz = torch.empty(n_tok, h, p, device=dev, dtype=z.dtype) if z is not None else None
    dy = torch.empty(n_tok, h, p, device=dev, dtype=x.dtype) if z is not None else None
    dD_part = torch.empty(table.n_seqs, h, p, device=dev, dtype=f32) if D is not None else None
    # One slot per possible n block (blocks are >= 16 wide); the kernel zeroes those it does
    # not use, and slots of unused chunks keep these zeros.
    ds_part = torch.zeros(cdiv(n, 16), table.n_slots, h, device=dev, dtype=f32)
    zs = z.stride() if z is not None else (0, 0, 0)
    state_grads(
        lambda meta: (table.n_seqs, h, cdiv(n, meta["BLOCK_N"])),
        x_ptr=x, C_ptr=C, z_ptr=z, ypre_ptr=ypre, dout_ptr=dout,
        states_ptr=states, dfinal_ptr=dfinal,
        dstates_ptr=dstates, dinit_ptr=dinit, dz_ptr=dz, dy_ptr=dy, dD_part_ptr=dD_part, ds_part_ptr=ds_part,
        seq_first_chunk_ptr=seq_first_chunk, ds_slots=ds_part.shape[0], heads_per_group=h // g,
        tune_bucket=(table.n_seqs * h).bit_length(),
        stride_x_t=x.stride(0), stride_x_h=x.stride(1), stride_x_p=x.stride(2),
        stride_C_t=C.stride(0), stride_C_g=C.stride(1), stride_C_n=C.stride(2),
        stride_z_t=zs[0], stride_z_h=zs[1], stride_z_p=zs[2],
        stride_dout_t=dout.stride(0), stride_dout_h=dout.stride(1), stride_dout_p=dout.stride(2),
        HAS_Z=z is not None, HAS_D=D is not None, HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None,
        BLOCK_P=next_pow2(p), **common,
    )

    dy_src = dy if z is not None else dout
    heads_per_split = _head_splits(table, g, h // g)
    n_splits = cdiv(h // g, heads_per_split)
    split_args = dict(
        n_heads=h, heads_per_group=h // g, heads_per_split=heads_per_split, dtd_ptr=dtd,
        tune_bucket=(table.n_slots * g * n_splits).bit_length(),
        x_ptr=x, B_ptr=B, C_ptr=C, dy_ptr=dy_src,
        stride_x_t=x.stride(0), stride_x_h=x.stride(1), stride_x_p=x.stride(2),
        stride_B_t=B.stride(0), stride_B_g=B.stride(1), stride_B_n=B.stride(2),
        stride_C_t=C.stride(0), stride_C_g=C.stride(1), stride_C_n=C.stride(2),
        stride_dy_t=dy_src.stride(0), stride_dy_h=dy_src.stride(1), stride_dy_p=dy_src.stride(2),
        BLOCK_P=next_pow2(p), BLOCK_N=next_pow2(n, floor=MIN_SPLIT_BLOCK_N), **common,
    )

    def split_grid(meta):
        return (cdiv(table.chunk_size, meta["BLOCK"]) * table.n_slots, g, n_splits)

    dx = torch.empty(n_tok, h, p, device=dev, dtype=x.dtype)
    ddt_direct, w_row, u_row = (torch.empty(h, n_tok, device=dev, dtype=f32) for _ in range(3))
    # Pair sums per block of j, in units of the smallest block a config can have (_clamp_block).
    part_tokens = min(32, next_pow2(table.chunk_size))
    da_part = torch.zeros(cdiv(table.chunk_size, part_tokens), h, n_tok, device=dev, dtype=f32)
    dB_part = torch.empty(n_splits, n_tok, g, n, device=dev, dtype=f32)
    dx_dB(
        split_grid, D_ptr=D, dstates_ptr=dstates, dx_ptr=dx, ddt_direct_ptr=ddt_direct, w_row_ptr=w_row,
        da_part_ptr=da_part, dB_part_ptr=dB_part, HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2,
        PART_TOKENS=part_tokens, **split_args,
    )

    dC_part = torch.empty(n_splits, n_tok, g, n, device=dev, dtype=f32)
    dC(split_grid, states_ptr=states, u_row_ptr=u_row, dC_part_ptr=dC_part, **split_args)

    ddt = torch.empty(n_tok, h, device=dev, dtype=dt.dtype)
    dA_part = torch.empty(table.n_slots, h, device=dev, dtype=f32)
    dbias_part = torch.empty(table.n_slots, h, device=dev, dtype=f32)
    ssd_dt_grads_kernel[(table.n_slots, h)](
        dt, A, dt_args["dt_bias_ptr"], ddt_direct, u_row, w_row, da_part, ds_part.sum(0),
        ddt, dA_part, dbias_part, chunk_start, chunk_len,
        n_tok, da_part.shape[0], dt.stride(0), dt.stride(1), dt_args["dt_min"], dt_args["dt_max"],
        HAS_BIAS=dt_args["HAS_BIAS"], SOFTPLUS=dt_args["SOFTPLUS"],
        CHUNK_PAD=next_pow2(table.chunk_size), num_warps=4,
    )
    dD = None
    if D is not None:
        dD = dD_part.sum(0)  # (h, p)
        dD = dD if D.dim() == 2 else dD.sum(-1)
    return {
        "dx": dx, "ddt": ddt, "dA": dA_part.sum(0), "dB": dB_part.sum(0), "dC": dC_part.sum(0),
        "dD": dD, "dz": dz, "ddt_bias": dbias_part.sum(0) if dt_args["HAS_BIAS"] else None,
        "dinit": dinit,
    }
