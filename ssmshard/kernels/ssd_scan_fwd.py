"""Triton forward kernels of the Mamba-2 SSD chunked scan.

Four kernels, on the flattened token axis and the chunk table of ssd_triton_common:

0. ``ssd_dt_cumsum_kernel``, one program per (chunk, block of heads): discretised dt and the
   cumulative log-decay cs since the chunk start, stored per (head, chunk slot, position) in
   float32 (rows of decay_stride, see ssd_triton_common.decay_row) so
   every later kernel (forward and backward) reads the same values.
1. ``ssd_chunk_states_kernel``, one program per (sequence, head, block of (p, n)): walks the
   sequence's chunks in order, stores the state entering each chunk and carries it
   through the chunk (decay, plus the chunk's inputs as a tensor-core product
   (x * w)^T B). Fusing the chunk states with the passing between chunks means the
   per-chunk states are written once and never read back by this kernel. One loop runs
   over every token block of every chunk, so loads are pipelined across chunk edges.
2. ``ssd_chunk_cb_kernel``, one program per (chunk, group, block of rows), only where
   several heads share a group: the products C_i . B_j (j <= i) of each chunk, in float32.
   Every head of the group needs the same products; computed inside the output kernel
   they would be computed once per head (heads_per_group times the tensor-core work of
   the quadratic form's first product).
3. ``ssd_chunk_output_kernel``, one program per (chunk, head, block of rows): the
   carried-in state read out through C, plus the causal quadratic form inside the chunk
   (C_i . B_j read from kernel 2 or computed in place), plus D x, gated by silu(z).

Dimension letters as in ssd_triton_common (t token, h head, g group, p head dim,
n state, k chunk, s sequence, i row / j column inside a chunk).

Per token t of a sequence (state reset at the sequence start to its initial state):
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T        (p, n)
    y_t     = state_t C_t + D x_t;   out_t = y_t * silu(z_t)
Inside a chunk, with cs the cumulative log-decay since the chunk start:
    y_i = exp(cs_i) S_in C_i + sum_{j <= i} exp(cs_i - cs_j) (C_i . B_j) dt_j x_j + D x_i
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.ssd_triton_common import (
    ChunkTable,
    TunableKernel,
    chunk_block,
    dot_modes,
    decay_row,
    load_chunk_decay,
    load_chunk_dt_heads,
    load_tile,
    mma,
    next_pow2,
    state_coords,
)


@triton.jit
def ssd_dt_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, dtd_ptr, cs_ptr, chunk_start_ptr, chunk_len_ptr,
    n_slots, n_heads, stride_dt_t, stride_dt_h, dt_min, dt_max,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rows of chunk k for a block of BLOCK_H heads (decay_row, CHUNK_PAD long): dtd =
    discretised dt, cs = sum of dt A over the chunk's tokens up to each position (both fp32).
    Whole rows are written: past the chunk's length dt is 0 and cs stays at its last value (up
    to rounding: the cumsum may add in another order), so readers need no length mask."""
    k = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < n_heads
    tok0 = tl.load(chunk_start_ptr + k).to(tl.int64)
    offs, unused_mask, dt, unused_slope = load_chunk_dt_heads(
        dt_ptr, dt_bias_ptr, heads, head_mask, tok0, tl.load(chunk_len_ptr + k),
        stride_dt_t, stride_dt_h, dt_min, dt_max, HAS_BIAS, SOFTPLUS, CHUNK_PAD)
    A = tl.load(A_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[None, :], 0)  # (t, heads)
    row = offs[:, None]  # (t, 1): position inside each head's row
    tl.store(decay_row(dtd_ptr, heads, k, n_slots, CHUNK_PAD)[None, :] + row, dt, mask=head_mask[None, :])
    tl.store(decay_row(cs_ptr, heads, k, n_slots, CHUNK_PAD)[None, :] + row, cs, mask=head_mask[None, :])


@triton.jit
def ssd_chunk_states_kernel(
    x_ptr, dtd_ptr, cs_ptr, B_ptr, init_ptr, states_ptr, final_ptr,
    seq_first_chunk_ptr, chunk_start_ptr, chunk_len_ptr,
    n_slots, decay_stride, heads_per_group, headdim, dstate, chunk_size, tune_bucket,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    HAS_INIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """states[k, h] = state entering chunk k (x's dtype); final[s, h] = state after sequence s (fp32).

    S_out = exp(cs_L) S_in + sum_j exp(cs_L - cs_j) dt_j x_j B_j^T, L the chunk's last
    position; every exponent is <= 0 for A <= 0.
    """
    s = tl.program_id(0)
    h = tl.program_id(1)
    n_blocks_n = tl.cdiv(dstate, BLOCK_N)
    pb = tl.program_id(2) // n_blocks_n
    nb = tl.program_id(2) % n_blocks_n
    n_heads = tl.num_programs(1)
    g = h // heads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = offs_p < headdim
    mask_n = offs_n < dstate
    mask_pn = mask_p[:, None] & mask_n[None, :]
    offs_pn = offs_p[:, None] * dstate + offs_n[None, :]  # (p, n) inside one (h, p, n) state
    state_size = headdim * dstate

    head_seq = tl.cast(s, tl.int64) * n_heads + h
    if HAS_INIT:
        state = tl.load(init_ptr + head_seq * state_size + offs_pn, mask=mask_pn, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)

    # The sequence's chunks are consecutive slots and consecutive runs of chunk_size tokens
    # from its first token; all are full but the last.
    first = tl.load(seq_first_chunk_ptr + s)
    n_chunks = tl.load(seq_first_chunk_ptr + s + 1) - first
    has_chunks = n_chunks > 0
    seq_tok0 = tl.load(chunk_start_ptr + first, mask=has_chunks, other=0).to(tl.int64)
    last_len = tl.load(chunk_len_ptr + first + n_chunks - 1, mask=has_chunks, other=0)
    blocks_per_chunk = tl.cdiv(chunk_size, BLOCK_T)
    n_blocks = tl.maximum(n_chunks - 1, 0) * blocks_per_chunk + tl.cdiv(last_len, BLOCK_T)
    x_seq = x_ptr + h * stride_x_h + seq_tok0 * stride_x_t
    B_seq = B_ptr + g * stride_B_g + seq_tok0 * stride_B_t
    # One loop over every block of every chunk, not a loop over chunks around a loop over
    # blocks: Triton pipelines a loop's loads across its own iterations only, so the next
    # chunk's x and B now load while this chunk's products run. With the weights decayed to
    # the chunk's end (not the block's) and tile offsets that do not move with the loop,
    # 0.262 -> 0.222 ms at B=1 x 16384 and 0.034 -> 0.027 ms at B=1 x 2048 (H200).
    for i in range(0, n_blocks):
        kk = i // blocks_per_chunk  # chunk of the sequence
        t0 = (i - kk * blocks_per_chunk) * BLOCK_T  # block start inside the chunk
        k = first + kk
        cs_row = decay_row(cs_ptr, h, k, n_slots, decay_stride)
        dtd_row = decay_row(dtd_ptr, h, k, n_slots, decay_stride)
        length = tl.minimum(chunk_size, last_len + (n_chunks - 1 - kk) * chunk_size)
        # cs at the chunk's last position itself: the row's end holds the same value only up
        # to rounding, and at |cs| ~ 500 (strong decay) one rounding is 3e-5 of exp(cs) (H200).
        cs_last = tl.load(cs_row + length - 1)
        if t0 == 0:
            slot = tl.cast(k, tl.int64) * n_heads + h
            tl.store(states_ptr + slot * state_size + offs_pn, state.to(states_ptr.dtype.element_ty), mask=mask_pn)
            state = state * tl.exp(cs_last)
        # Scalar offsets move the pointers; the tiles' element offsets stay loop-invariant.
        rows, cs, dt = load_chunk_decay(cs_row + t0, dtd_row + t0, 0, decay_stride - t0, BLOCK_T)
        weight = tl.exp(cs_last - cs) * dt  # decay to the chunk end, times dt_j (0 past the length)
        mask_t = rows < length - t0
        tok = tl.cast(kk * chunk_size + t0, tl.int64)  # the block's first token, from the sequence's first
        x = load_tile(x_seq + tok * stride_x_t, rows, mask_t, stride_x_t, offs_p, mask_p, stride_x_p)
        Bt = load_tile(B_seq + tok * stride_B_t, rows, mask_t, stride_B_t, offs_n, mask_n, stride_B_n)
        xw = (x.to(tl.float32) * weight[:, None]).to(Bt.dtype)  # (t, p)
        state = mma(tl.trans(xw), Bt, state, DOT_PRECISION, UPCAST)
    tl.store(final_ptr + head_seq * state_size + offs_pn, state, mask=mask_pn)


@triton.jit
def ssd_chunk_cb_kernel(
    B_ptr, C_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr, n_slots, dstate, chunk_size,
    stride_cb_k, stride_cb_g, cb_row,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """cb[k, g, i, j] = C_i . B_j (fp32) for rows i of one block and every column j up to the
    block's last row, rounded up to BLOCK_M (0 past the chunk's end). Columns past that stay
    unwritten: the output kernel reads whole tiles and zeroes every j > i itself. Rows hold
    cb_row = next_pow2(chunk_size) columns, so whole tiles are stored with a row mask only
    (a mask that varies along the row likely keeps Triton from storing vectors)."""
    k, tok0, length, row0, offs_i, mask_i = chunk_block(chunk_start_ptr, chunk_len_ptr, n_slots, chunk_size,
                                                        BLOCK_M, False)
    g = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < dstate
    C_i = load_tile(C_ptr + tok0 * stride_C_t + g * stride_C_g, offs_i, mask_i, stride_C_t, offs_n, mask_n,
                    stride_C_n)
    B_chunk = B_ptr + tok0 * stride_B_t + g * stride_B_g
    cb_chunk = cb_ptr + tl.cast(k, tl.int64) * stride_cb_k + g * stride_cb_g
    j_end = tl.where(row0 < length, tl.minimum(row0 + BLOCK_M, length), 0)
    for j0 in range(0, j_end, BLOCK_M):
        offs_j = j0 + tl.arange(0, BLOCK_M)
        B_j = load_tile(B_chunk, offs_j, offs_j < length, stride_B_t, offs_n, mask_n, stride_B_n)
        cb = mma(C_i, tl.trans(B_j), tl.zeros((BLOCK_M, BLOCK_M), tl.float32), DOT_PRECISION, UPCAST)
        tl.store(cb_chunk + offs_i[:, None] * cb_row + offs_j[None, :], cb, mask=mask_i[:, None])


@triton.jit
def ssd_chunk_output_kernel(
    x_ptr, dtd_ptr, cs_ptr, B_ptr, C_ptr, D_ptr, z_ptr, states_ptr, cb_ptr, out_ptr, ypre_ptr,
    chunk_start_ptr, chunk_len_ptr,
    n_slots, decay_stride, heads_per_group, headdim, dstate, chunk_size, tune_bucket,
    stride_cb_k, stride_cb_g, cb_row,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_z_t, stride_z_h, stride_z_p,
    stride_out_t, stride_out_h, stride_out_p,
    HAS_D: tl.constexpr, D_PER_P: tl.constexpr, HAS_Z: tl.constexpr, STORE_YPRE: tl.constexpr,
    CB_STORED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out for a block of BLOCK_M rows i of chunk k, head h; ypre = out before the gate.

    CB_STORED: C_i . B_j comes from ``ssd_chunk_cb_kernel``'s cb[k, g] instead of a product here."""
    k, tok0, length, row0, offs_i, mask_i = chunk_block(chunk_start_ptr, chunk_len_ptr, n_slots, chunk_size,
                                                        BLOCK_M, True)
    if row0 >= length:
        return  # rows past a short chunk's end, or a slot past the table's last chunk: no output
    h = tl.program_id(1)
    n_heads = tl.num_programs(1)
    g = h // heads_per_group
    # (The state load needs no empty-slot mask: an empty slot returned above.)
    offs_p, mask_p, offs_n, mask_n, unused_mask_p_state = state_coords(headdim, dstate, length, BLOCK_P, BLOCK_N)
    # Pointers to the chunk's first token; offsets inside the chunk stay int32.
    x_chunk = x_ptr + tok0 * stride_x_t + h * stride_x_h
    B_chunk = B_ptr + tok0 * stride_B_t + g * stride_B_g
    cs_row = decay_row(cs_ptr, h, k, n_slots, decay_stride)
    dtd_row = decay_row(dtd_ptr, h, k, n_slots, decay_stride)

    cs_i = tl.load(cs_row + offs_i, mask=mask_i, other=0.0)
    C_i = load_tile(C_ptr + tok0 * stride_C_t + g * stride_C_g, offs_i, mask_i, stride_C_t, offs_n, mask_n,
                    stride_C_n)
    slot = tl.cast(k, tl.int64) * n_heads + h
    state_in = load_tile(states_ptr + slot * headdim * dstate, offs_p, mask_p, dstate,
                         offs_n, mask_n, 1)  # (p, n)
    if CB_STORED:  # (cb_ptr is None otherwise)
        cb_chunk = cb_ptr + tl.cast(k, tl.int64) * stride_cb_k + g * stride_cb_g
    # Carried-in state, read out through C and decayed to row i.
    acc = mma(C_i, tl.trans(state_in), tl.zeros((BLOCK_M, BLOCK_P), tl.float32), DOT_PRECISION, UPCAST)
    acc = acc * tl.exp(cs_i)[:, None]

    # Causal quadratic form over the columns up to this block's last row.
    for j0 in range(0, tl.minimum(row0 + BLOCK_M, length), BLOCK_K):
        # Vector loads of cs and dt: the loop body of the 64 x 32 config went from 408 to
        # 357 sm_90 instructions; with the single select, the kernel from 0.510 to
        # 0.430-0.454 ms at B=8 x 2048 (H200).
        offs_j, cs_j, dt_j = load_chunk_decay(cs_row, dtd_row, j0, decay_stride, BLOCK_K)
        mask_j = offs_j < length
        x_j = load_tile(x_chunk, offs_j, mask_j, stride_x_t, offs_p, mask_p, stride_x_p)
        # No "& mask_j": for a row i that is stored (i < length), j <= i already implies
        # j < length, and rows past the end are never stored (the product keeps rows apart).
        # The second select per element was 36 of the 444 sm_90 instructions of the loop.
        causal = offs_i[:, None] >= offs_j[None, :]
        if CB_STORED:
            # Whole rows of the tile: a mask that varies along the row made the loads 4 bytes
            # wide, likely (0.673 against 0.514 ms, H200). The tile stays inside the row
            # because BLOCK_K divides BLOCK_M <= cb_row (``_clamp_output``). Columns past the
            # causal part may hold anything (unwritten memory, NaN included).
            cb = tl.load(cb_chunk + offs_i[:, None] * cb_row + offs_j[None, :], mask=mask_i[:, None], other=0.0)
        else:
            B_j = load_tile(B_chunk, offs_j, mask_j, stride_B_t, offs_n, mask_n, stride_B_n)
            cb = mma(C_i, tl.trans(B_j), tl.zeros((BLOCK_M, BLOCK_K), tl.float32), DOT_PRECISION, UPCAST)
        # For j > i the exponent is >= 0 and may overflow, and a stored cb may be garbage:
        # one select on the product discards both (a select never propagates the other
        # operand's inf or NaN).
        decay = tl.exp(cs_i[:, None] - cs_j[None, :])
        w = tl.where(causal, cb * decay * dt_j[None, :], 0.0)
        acc = mma(w.to(x_j.dtype), x_j, acc, DOT_PRECISION, UPCAST)

    if HAS_D:
        x_i = load_tile(x_chunk, offs_i, mask_i, stride_x_t, offs_p, mask_p, stride_x_p).to(tl.float32)
        if D_PER_P:
            acc += x_i * tl.load(D_ptr + h * headdim + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
        else:
            acc += x_i * tl.load(D_ptr + h).to(tl.float32)
    mask_ip = mask_i[:, None] & mask_p[None, :]
    out_chunk = tok0 * stride_out_t + h * stride_out_h  # out and ypre share their layout
    out_offs = offs_i[:, None] * stride_out_t + offs_p[None, :] * stride_out_p
    if STORE_YPRE:
        tl.store(ypre_ptr + out_chunk + out_offs, acc.to(ypre_ptr.dtype.element_ty), mask=mask_ip)
    if HAS_Z:
        z = load_tile(z_ptr + tok0 * stride_z_t + h * stride_z_h, offs_i, mask_i, stride_z_t, offs_p, mask_p,
                      stride_z_p).to(tl.float32)
        acc = acc * z * tl.sigmoid(z)
    tl.store(out_ptr + out_chunk + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_ip)


# --- launchers --------------------------------------------------------------------------


def _tune_bucket(n: int) -> int:
    # Autotune key for the amount of parallel work: one config per power-of-two range.
    return max(int(n), 1).bit_length()


def _states_tune_bucket(table: ChunkTable, h: int) -> int:
    """Autotune key of the chunk states: the programs (sequences x heads) and how many chunks
    each walks, one power-of-two range of each. Keyed on programs alone, B=1 x 2048 chose
    for B=1 x 16384 too, and its pick took 0.297 ms there against 0.212 ms (H200)."""
    return _tune_bucket(table.n_seqs * h) * 64 + _tune_bucket(-(-table.n_slots // max(table.n_seqs, 1)))


def _clamp_states(kw, args):
    kw["BLOCK_P"] = min(kw["BLOCK_P"], next_pow2(args["headdim"]))
    kw["BLOCK_T"] = min(kw["BLOCK_T"], next_pow2(args["chunk_size"]))
    kw["BLOCK_N"] = min(kw["BLOCK_N"], next_pow2(args["dstate"]))
    return kw


def _clamp_output(kw, args):
    kw["BLOCK_M"] = min(kw["BLOCK_M"], next_pow2(args["chunk_size"]))
    kw["BLOCK_K"] = min(kw["BLOCK_K"], kw["BLOCK_M"])
    # Powers of two, so BLOCK_K divides BLOCK_M: a stored C.B^T tile never crosses its row.
    assert kw["BLOCK_M"] % kw["BLOCK_K"] == 0, kw
    return kw


# Configs: none spills registers for sm_90 at Mamba2-2.7B sizes (compiled offline, cuobjdump).
_C = triton.Config
chunk_states = TunableKernel(
    ssd_chunk_states_kernel,
    [
        # BLOCK_P = 128 means the whole head dim for every supported head dim.
        _C({"BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
        _C({"BLOCK_P": 128, "BLOCK_T": 128, "BLOCK_N": 64}, num_warps=4, num_stages=2),
        _C({"BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        _C({"BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
        # Few sequences x heads (one long sequence): more, smaller programs.
        _C({"BLOCK_P": 32, "BLOCK_T": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
        # Three stages: the flat loop (see the kernel) lets loads run ahead across chunk edges.
        _C({"BLOCK_P": 128, "BLOCK_T": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        _C({"BLOCK_P": 128, "BLOCK_T": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    ],
    key=["headdim", "dstate", "chunk_size", "tune_bucket"],
    clamp=_clamp_states,
)
chunk_output = TunableKernel(
    ssd_chunk_output_kernel,
    [
        _C({"BLOCK_M": 64, "BLOCK_K": 64}, num_warps=4, num_stages=2),
        _C({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=8, num_stages=2),
        _C({"BLOCK_M": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        _C({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        # 32-row blocks: 12% of the causal quadratic form's tiles lie above the diagonal,
        # against 25% for 64-row blocks (chunk 256). Picked at B=8 x 2048 and B=1 x 2048
        # (H200); 5 stages or 4 warps never were, at any shape.
        _C({"BLOCK_M": 32, "BLOCK_K": 32}, num_warps=2, num_stages=3),
    ],
    key=["headdim", "dstate", "chunk_size", "tune_bucket", "CB_STORED"],
    clamp=_clamp_output,
)

# Store C_i . B_j once per group (ssd_chunk_cb_kernel) when at least this many heads share
# a group; with one head per group the product would only make a float32 round trip. At 80
# heads per group (Mamba2-2.7B, B=8 x 2048, H200) the output kernel went from 0.588 ms
# (computed per head, one call) to 0.514 ms (another call); counts between 2 and 80 were not
# timed. The buffer holds chunk_size * next_pow2(chunk_size) floats per (chunk, group):
# 16 MiB at B=8 x 2048, one group, chunk 256, i.e. 8 / heads_per_group times x's bytes at
# head dim 64 (bf16), so 4x x at the threshold.
CB_STORED_MIN_HEADS_PER_GROUP = 2
# Rows and columns per C.B^T tile: (64 x n) C and B tiles fit the tensor cores with no spill
# at n = 128 (compiled offline, cuobjdump); the kernel takes about 1% of the forward.
_CB_BLOCK = 64


# Heads per dt-kernel program: a token's heads are adjacent in a (t, h) dt. One head per
# program took 0.0106 ms at B=1 x 16384 and B=8 x 2048 (h=80, H200), 8 heads 0.0060, 16 heads
# 0.0066 (fewer programs); at B=1 x 2048, 8 heads 0.0025 against 0.0027 for one.
_DT_BLOCK_H = 8


def dt_kwargs(dt_bias, dt_softplus: bool, dt_min: float, dt_max: float) -> dict:
    return {
        "dt_bias_ptr": dt_bias, "HAS_BIAS": dt_bias is not None, "SOFTPLUS": bool(dt_softplus),
        "dt_min": float(dt_min), "dt_max": float(dt_max),
    }


def run_dt_cumsum(dt, A, table: ChunkTable, dt_args: dict, block_h: int | None = None):
    """(dtd, cs): discretised dt and in-chunk cumulative log-decay, (h, slot, table.decay_stride)
    float32 each (rows: decay_row). block_h: heads per program (default _DT_BLOCK_H; for sweeps).

    h * n_slots * next_pow2(T) floats each, against h * n_tokens for a per-token layout: the
    same for full chunks, up to next_pow2(T) times more where sequences are far shorter than a chunk
    (still a small fraction of the chunk states, p * n values per slot and head)."""
    h = dt.shape[1]
    dtd = torch.empty(h, table.n_slots, table.decay_stride, device=dt.device, dtype=torch.float32)
    cs = torch.empty_like(dtd)
    chunk_start, chunk_len, _ = table.tensors()
    block_h = min(block_h or _DT_BLOCK_H, next_power_of_2(h))
    ssd_dt_cumsum_kernel[(table.n_slots, cdiv(h, block_h))](
        dt, A, dt_args["dt_bias_ptr"], dtd, cs, chunk_start, chunk_len,
        table.n_slots, h, dt.stride(0), dt.stride(1), dt_args["dt_min"], dt_args["dt_max"],
        HAS_BIAS=dt_args["HAS_BIAS"], SOFTPLUS=dt_args["SOFTPLUS"],
        CHUNK_PAD=table.decay_stride, BLOCK_H=block_h, num_warps=4,
    )
    return dtd, cs


def run_chunk_states(x, dtd, cs, B, init, table: ChunkTable):
    """states (n_slots, h, p, n) in x's dtype (state entering each chunk) and final (S, h, p, n) fp32.

    x: (t, h, p); dtd, cs: (h, slot, decay_stride); B: (t, g, n); init: (S, h, p, n) or None.
    """
    h, p = x.shape[1:]
    g, n = B.shape[1], B.shape[2]
    states = torch.empty(table.n_slots, h, p, n, device=x.device, dtype=x.dtype)
    final = torch.empty(table.n_seqs, h, p, n, device=x.device, dtype=torch.float32)
    chunk_start, chunk_len, seq_first_chunk = table.tensors()
    chunk_states(
        lambda meta: (table.n_seqs, h, cdiv(p, meta["BLOCK_P"]) * cdiv(n, meta["BLOCK_N"])),
        x_ptr=x, dtd_ptr=dtd, cs_ptr=cs, B_ptr=B, init_ptr=init, states_ptr=states, final_ptr=final,
        seq_first_chunk_ptr=seq_first_chunk, chunk_start_ptr=chunk_start, chunk_len_ptr=chunk_len,
        n_slots=table.n_slots, decay_stride=table.decay_stride, heads_per_group=h // g, headdim=p, dstate=n,
        chunk_size=table.chunk_size, tune_bucket=_states_tune_bucket(table, h),
        stride_x_t=x.stride(0), stride_x_h=x.stride(1), stride_x_p=x.stride(2),
        stride_B_t=B.stride(0), stride_B_g=B.stride(1), stride_B_n=B.stride(2),
        HAS_INIT=init is not None, **dot_modes(x.dtype),
    )
    return states, final


def run_chunk_cb(B, C, table: ChunkTable):
    """cb (n_slots, g, T, next_pow2(T)) float32: C_i . B_j for j <= i of each chunk (further
    columns: see ssd_chunk_cb_kernel). B, C: (t, g, n)."""
    g, n = B.shape[1], B.shape[2]
    T = table.chunk_size
    cb = torch.empty(table.n_slots, g, T, next_pow2(T), device=B.device, dtype=torch.float32)
    chunk_start, chunk_len, _ = table.tensors()
    block = min(_CB_BLOCK, next_pow2(T))
    ssd_chunk_cb_kernel[(table.n_slots * cdiv(T, block), g)](
        B, C, cb, chunk_start, chunk_len, table.n_slots, n, T, cb.stride(0), cb.stride(1), cb.stride(2),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        BLOCK_M=block, BLOCK_N=next_pow2(n), num_warps=4, **dot_modes(B.dtype),
    )
    return cb


def run_chunk_output(x, dtd, cs, B, C, D, z, states, table: ChunkTable, out_dtype: torch.dtype, store_ypre: bool):
    """out (t, h, p) in out_dtype; ypre (out before the z gate, x's dtype) when store_ypre."""
    n_tok, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    out = torch.empty(n_tok, h, p, device=x.device, dtype=out_dtype)
    ypre = torch.empty(n_tok, h, p, device=x.device, dtype=x.dtype) if store_ypre else None
    chunk_start, chunk_len, _ = table.tensors()
    zs = z.stride() if z is not None else (0, 0, 0)
    cb = run_chunk_cb(B, C, table) if h // g >= CB_STORED_MIN_HEADS_PER_GROUP else None
    cb_strides = cb.stride()[:3] if cb is not None else (0, 0, 0)
    chunk_output(
        lambda meta: (table.n_slots * cdiv(table.chunk_size, meta["BLOCK_M"]), h),
        x_ptr=x, dtd_ptr=dtd, cs_ptr=cs, B_ptr=B, C_ptr=C, D_ptr=D, z_ptr=z, states_ptr=states, cb_ptr=cb,
        out_ptr=out, ypre_ptr=ypre, chunk_start_ptr=chunk_start, chunk_len_ptr=chunk_len,
        n_slots=table.n_slots, decay_stride=table.decay_stride, heads_per_group=h // g, headdim=p, dstate=n,
        chunk_size=table.chunk_size,
        tune_bucket=_tune_bucket(table.n_slots * h),
        stride_cb_k=cb_strides[0], stride_cb_g=cb_strides[1], cb_row=cb_strides[2],
        stride_x_t=x.stride(0), stride_x_h=x.stride(1), stride_x_p=x.stride(2),
        stride_B_t=B.stride(0), stride_B_g=B.stride(1), stride_B_n=B.stride(2),
        stride_C_t=C.stride(0), stride_C_g=C.stride(1), stride_C_n=C.stride(2),
        stride_z_t=zs[0], stride_z_h=zs[1], stride_z_p=zs[2],
        stride_out_t=out.stride(0), stride_out_h=out.stride(1), stride_out_p=out.stride(2),
        HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2,
        HAS_Z=z is not None, STORE_YPRE=store_ypre, CB_STORED=cb is not None,
        BLOCK_P=next_pow2(p), BLOCK_N=next_pow2(n), **dot_modes(x.dtype),
    )
    return out, ypre


def ssd_forward(x, dt, A, B, C, D, z, init, table: ChunkTable, dt_args: dict,
                out_dtype: torch.dtype, store_ypre: bool):
    """Forward on flattened tokens: (out, final_states, ypre or None)."""
    dtd, cs = run_dt_cumsum(dt, A, table, dt_args)
    states, final = run_chunk_states(x, dtd, cs, B, init, table)
    out, ypre = run_chunk_output(x, dtd, cs, B, C, D, z, states, table, out_dtype, store_ypre)
    return out, final, ypre
