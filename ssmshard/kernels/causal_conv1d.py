"""Depthwise causal conv1d in Triton: forward, backward, packed sequences, decode step.

Same function as ``ssmshard.kernels.reference.causal_conv1d`` / ``causal_conv1d_update``
(the ``torch.ops.ssmshard`` conv ops), with what the reference lacks: packed variable-length
sequences (``cu_seqlens``), per-sequence initial / final states, a Triton backward and an
update kernel that can write the rolling state in place.

Dimension letters (shape comments and names):
    b  batch rows                     d  channels
    l  tokens of a row                k  conv width (taps)
    s  sequences in a packed row, or conv-state length in the update kernel
    r  token groups of a tile         c  tokens of a group (one thread's registers)

Conv convention (the reference's): out[t] = bias + sum_i weight[:, i] * input[t - (k-1-i)].
Tap j = k-1-i looks j tokens back. Where a tap reaches back past the start of its sequence
it reads that sequence's initial state (slot k-1-m holds the input m tokens before the
start), or zero without one; never the previous sequence's tokens.

Tiles. A program owns a (channels x tokens) tile, split as BLOCK_D channels x R groups x
C tokens (C tokens per group, consecutive). A tap j < C that needs a token from the
previous group reads it from a second load of the tile shifted back by one whole group.
Both loads are aligned, so they vectorise; the shift by j inside a group is then done on
registers by picking columns: ``tl.sum(tl.where(cols == i, tile, -0.0), axis=COL_AXIS,
keep_dims=True)`` is column i (-0.0 is the exact additive identity, so the pick is exact;
0 for integer tiles). It is written out at each use rather than as a helper because the
CPU interpreter pays heavily for every helper call. With the group axis inside one thread
(the layouts chosen on the host make sure of it), LLVM folds those selects and the adds of
-0.0 away, so the shift costs nothing. This needs C >= k: one shifted load covers every tap, and the backward
uses the C columns of one accumulator as the k per-tap sums of dweight.

Two arrangements of the same tile (``CHANNELS_LAST``):
    tokens contiguous  (x is (b, d, l) contiguous):  tile (d, r, c) with d = 1; a thread
        holds C consecutive tokens as one vector, lanes and warps run along groups.
    channels contiguous (x a transposed (b, l, d) view, as Mamba / Mamba-2 feed it):
        tile (c, r, d) with r = 1; a thread holds a vector of channels for each of C tokens,
        all lanes and warps run along channels. (Lanes left over for the r and c axes would
        go to either one depending on the Triton version's tie-break: 3.6 and 3.9 differ.)
        Programs loop over consecutive tiles so the shifted re-read hits L1.
The layouts were checked by compiling for sm_90 with Triton 3.6 and 3.9: no shuffles or
shared memory in the token loops, k multiply-adds per element in the forward.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.reference import check_activation

MAX_WIDTH = 8  # widest conv supported: the tile's group must hold k tokens
_INT32_LIMIT = 2**31

# --- device helpers -----------------------------------------------------------------------


@triton.jit
def _find_sequence(cu_ptr, n_seqs, token):
    """Index of the sequence holding ``token`` (a scalar): largest s with cu[s] <= token."""
    lo = tl.program_id(0) * 0
    hi = lo + n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= token
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _sequence_of_tokens(cu_ptr, n_seqs, tok, first, last):
    """Per-token sequence index of a tile whose real tokens lie in [first, last].

    Two scalar searches bound the candidates to [s_first, s_last]; the per-token search
    then takes ceil(log2(s_last - s_first + 1)) steps: none when the tile sits inside one
    sequence, the common case. Returns (seq, s_first, s_last).
    """
    s_first = _find_sequence(cu_ptr, n_seqs, first)
    s_last = _find_sequence(cu_ptr, n_seqs, last)
    lo = tok * 0 + s_first
    hi = tok * 0 + s_last + 1
    width = s_last + 1 - s_first
    while width > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= tok
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
        width = (width + 1) // 2
    return lo, s_first, s_last


@triton.jit
def _tile_indices(pid_d, BLOCK_D: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                  CHANNELS_LAST: tl.constexpr):
    """Broadcastable (channel, group, column) index tensors for the tile arrangement."""
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    if CHANNELS_LAST:
        return d[None, None, :], r[None, :, None], c[:, None, None]  # tile (c, r, d)
    else:
        return d[:, None, None], r[None, :, None], c[None, None, :]  # tile (d, r, c)


@triton.jit
def _load_taps(w_ptr, swd, swk, bias_ptr, pid_d, D, K: tl.constexpr, C: tl.constexpr,
               BLOCK_D: tl.constexpr, CHANNELS_LAST: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The weights as a tile whose column i holds weight[:, i] (tap j is column k-1-j), and
    the bias, both float32 and shaped to broadcast against the x tile.

    Loaded once per program, before the token loop, as a plain 2-D (d, i) tile: that load's
    layout does not depend on how the compiler breaks ties between 3-D axes, and the one
    conversion to the x tile's layout stays outside the loop.
    """
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, C)
    taps = tl.load(w_ptr + d.to(tl.int64)[:, None] * swd + i[None, :] * swk,
                   mask=(d[:, None] < D) & (i[None, :] < K), other=0.0).to(tl.float32)  # (d, i)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], tl.float32)
    if CHANNELS_LAST:
        return tl.trans(taps)[:, None, :], bias[None, None, :]  # (i, 1, d), (1, 1, d)
    else:
        return taps[:, None, :], bias[:, None, None]  # (d, 1, i), (d, 1, 1)


@triton.jit
def _silu_grad(y):
    sig = tl.sigmoid(y)
    return sig * (1.0 + y * (1.0 - sig))


@triton.jit
def _conv_preactivation(
    x_rows, sxl, L, taps, bias, init_ptr, sis, sid, sik, cu_ptr, n_seqs,
    b, d3, d_mask, rows, cols, origin,
    K: tl.constexpr, C: tl.constexpr, BLOCK_L: tl.constexpr, COL_AXIS: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
):
    """bias + sum of taps at the tile's tokens origin + r*C + c, in float32, no activation.

    x_rows: per-channel row pointers of x (this batch row); taps, bias: from _load_taps.
    """
    tok = origin + rows * C + cols  # token of every tile position, broadcast over channels
    if PACKED:
        first = tl.minimum(origin, L - 1)
        last = tl.minimum(origin + BLOCK_L, L) - 1
        seq, s_first, s_last = _sequence_of_tokens(cu_ptr, n_seqs, tok, first, last)
        start = tl.load(cu_ptr + seq)
    acc = tl.zeros(tok.shape, tl.float32) + bias
    for q in tl.static_range(2):
        # q = 0: the tile itself; q = 1: shifted back one group, for taps reaching behind.
        src = tok - q * C
        xq = tl.load(x_rows + src * sxl, mask=d_mask & (src >= 0) & (src < L), other=0.0)
        xq = xq.to(tl.float32)
        for j in tl.static_range(K):
            w = tl.sum(tl.where(cols == K - 1 - j, taps, -0.0), axis=COL_AXIS, keep_dims=True)
            for c in tl.static_range(C):
                # Token t - j of column c lies in group ceil((j - c) / C) behind, column c - j + q*C.
                if (C - 1 + j - c) // C == q:
                    x_c = tl.sum(tl.where(cols == c - j + q * C, xq, -0.0), axis=COL_AXIS, keep_dims=True)
                    term = w * x_c
                    if PACKED:
                        # Only taps inside the output token's own sequence; non-packed rows
                        # need no mask, the load above already zeroed tokens before 0.
                        tok_c = origin + rows * C + c
                        start_c = tl.sum(tl.where(cols == c, start, 0), axis=COL_AXIS, keep_dims=True)
                        term = tl.where(tok_c - j >= start_c, term, 0.0)
                    acc += tl.where(cols == c, term, -0.0)
    if HAS_INIT:
        # Taps before a sequence start read its initial state. Only tiles holding one of the
        # first k-1 tokens of a sequence can have such taps: skip the gathers elsewhere.
        if PACKED:
            near_start = (s_last > s_first) | (first - tl.load(cu_ptr + s_first) < K - 1)
            init_rows = init_ptr + seq * sis + d3 * sid
        else:
            near_start = origin < K - 1
            start = 0
            init_rows = init_ptr + b * sis + d3 * sid
        if near_start:
            for j in tl.static_range(1, K):
                w = tl.sum(tl.where(cols == K - 1 - j, taps, -0.0), axis=COL_AXIS, keep_dims=True)
                back = start - (tok - j)  # how far before the start tap j lands (> 0: in init)
                m = d_mask & (back > 0) & (tok < L)
                v = tl.load(init_rows + (K - 1 - back) * sik, mask=m, other=0.0)
                acc += w * v.to(tl.float32)
    return acc


# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _conv_forward_kernel(
    x_ptr, sxb, sxd, sxl, w_ptr, swd, swk, bias_ptr, init_ptr, sis, sid, sik, cu_ptr, n_seqs,
    out_ptr, sob, sod, sol, D, L, TILES,
    K: tl.constexpr, C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    CHANNELS_LAST: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    PACKED: tl.constexpr, SILU: tl.constexpr,
):
    """out for TILES consecutive token tiles (the previous tile's tokens, which the shifted
    load re-reads, are then still in L1)."""
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    d3, rows, cols = _tile_indices(pid_d, BLOCK_D, BLOCK_L // C, C, CHANNELS_LAST)
    COL_AXIS: tl.constexpr = 0 if CHANNELS_LAST else 2
    d_mask = d3 < D
    d64 = d3.to(tl.int64)
    x_rows = x_ptr + b * sxb + d64 * sxd
    out_rows = out_ptr + b * sob + d64 * sod
    taps, bias = _load_taps(w_ptr, swd, swk, bias_ptr, pid_d, D, K, C, BLOCK_D, CHANNELS_LAST, HAS_BIAS)
    for it in range(TILES):
        origin = (pid_l * TILES + it) * BLOCK_L
        y = _conv_preactivation(
            x_rows, sxl, L, taps, bias, init_ptr, sis, sid, sik, cu_ptr, n_seqs,
            b, d3, d_mask, rows, cols, origin,
            K, C, BLOCK_L, COL_AXIS, HAS_INIT, PACKED,
        )
        if SILU:
            y = y * tl.sigmoid(y)
        tok = origin + rows * C + cols
        tl.store(out_rows + tok * sol, y.to(out_ptr.dtype.element_ty), mask=d_mask & (tok < L))


@triton.jit
def _final_states_kernel(
    x_ptr, sxb, sxd, sxl, init_ptr, sis, sid, sik, cu_ptr, fin_ptr, sfs, sfd, sfk, D, L,
    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
):
    """final[s, :, j] = input at end - (k-1) + j, from the initial state where that is
    before the sequence start (sequences shorter than k-1), as a continuous stream."""
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]  # (d, 1)
    slot = tl.arange(0, SLOTS)[None, :]  # (1, k-1 padded)
    if PACKED:
        b = 0
        start = tl.load(cu_ptr + s)
        end = tl.load(cu_ptr + s + 1)
    else:
        b = s.to(tl.int64)
        start = 0
        end = L
    pos = end - (K - 1) + slot
    ok = (d < D) & (slot < K - 1)
    from_x = pos >= start
    v = tl.load(x_ptr + b * sxb + d.to(tl.int64) * sxd + pos * sxl, mask=ok & from_x, other=0.0)
    v = v.to(tl.float32)
    if HAS_INIT:
        back = start - pos
        iv = tl.load(init_ptr + s * sis + d * sid + (K - 1 - back) * sik, mask=ok & ~from_x, other=0.0)
        v += iv.to(tl.float32)
    tl.store(fin_ptr + s * sfs + d * sfd + slot * sfk, v.to(fin_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_backward_kernel(
    x_ptr, sxb, sxd, sxl, w_ptr, swd, swk, bias_ptr, init_ptr, sis, sid, sik, cu_ptr, n_seqs,
    gy_ptr, sgb, sgd, sgl, gfin_ptr, sfs, sfd, sfk,
    dx_ptr, sdb, sdd, sdl, dw_part_ptr, dbias_part_ptr, D, L, TILES,
    K: tl.constexpr, C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    CHANNELS_LAST: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_GFIN: tl.constexpr, PACKED: tl.constexpr, SILU: tl.constexpr,
):
    """dx for TILES consecutive token tiles, and this program's partial dweight / dbias.

    With g = d(out)/d(pre-activation): dx[u] = sum_j w[k-1-j] g[u+j] over u+j inside u's
    sequence, plus d(final) where u is one of the last k-1 inputs of its sequence;
    dweight[k-1-j] gets x[u] g[u+j] over the same pairs (pairs whose input is an initial
    state are summed by ``_initial_state_backward_kernel``). g is recomputed from x.
    Partial sums land in row (b * programs along l + pid_l) of the part buffers; the host
    adds the rows up, so no atomics are needed.
    """
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    R: tl.constexpr = BLOCK_L // C
    d3, rows, cols = _tile_indices(pid_d, BLOCK_D, R, C, CHANNELS_LAST)
    COL_AXIS: tl.constexpr = 0 if CHANNELS_LAST else 2
    d_mask = d3 < D
    d64 = d3.to(tl.int64)
    x_rows = x_ptr + b * sxb + d64 * sxd
    gy_rows = gy_ptr + b * sgb + d64 * sgd
    taps, bias = _load_taps(w_ptr, swd, swk, bias_ptr, pid_d, D, K, C, BLOCK_D, CHANNELS_LAST, HAS_BIAS)
    # Column j of dw_acc accumulates tap j's products; the sum over groups comes at the end.
    zero_tile = tl.zeros(rows.shape, tl.float32) + tl.zeros(cols.shape, tl.float32)
    zero_tile += tl.zeros(d3.shape, tl.float32)
    dw_acc = zero_tile
    dbias_acc = tl.zeros(rows.shape, tl.float32) + tl.zeros(d3.shape, tl.float32)
    for it in range(TILES):
        l0 = (pid_l * TILES + it) * BLOCK_L
        tok = l0 + rows * C + cols
        if PACKED:
            first = tl.minimum(l0, L - 1)
            last = tl.minimum(l0 + BLOCK_L, L) - 1
            seq, s_first, s_last = _sequence_of_tokens(cu_ptr, n_seqs, tok, first, last)
            end = tl.load(cu_ptr + seq + 1)
        x_own = tl.load(x_rows + tok * sxl, mask=d_mask & (tok < L), other=0.0).to(tl.float32)
        dx = zero_tile
        for q in tl.static_range(2):
            # g at the tile's tokens (q = 0) and one group further on (q = 1).
            origin = l0 + q * C
            y = _conv_preactivation(
                x_rows, sxl, L, taps, bias, init_ptr, sis, sid, sik, cu_ptr, n_seqs,
                b, d3, d_mask, rows, cols, origin,
                K, C, BLOCK_L, COL_AXIS, HAS_INIT, PACKED,
            )
            src = tok + q * C
            g = tl.load(gy_rows + src * sgl, mask=d_mask & (src < L), other=0.0).to(tl.float32)
            if SILU:
                g = g * _silu_grad(y)
            for j in tl.static_range(K):
                w = tl.sum(tl.where(cols == K - 1 - j, taps, -0.0), axis=COL_AXIS, keep_dims=True)
                for c in tl.static_range(C):
                    if (c + j) // C == q:
                        # g[u + j] for the tokens u of column c, zero across a sequence end.
                        g_c = tl.sum(tl.where(cols == c + j - q * C, g, -0.0), axis=COL_AXIS, keep_dims=True)
                        tok_c = l0 + rows * C + c
                        if PACKED:
                            end_c = tl.sum(tl.where(cols == c, end, 0), axis=COL_AXIS, keep_dims=True)
                        else:
                            end_c = L
                        g_c = tl.where(tok_c + j < end_c, g_c, 0.0)
                        dx += tl.where(cols == c, w * g_c, -0.0)
                        x_c = tl.sum(tl.where(cols == c, x_own, -0.0), axis=COL_AXIS, keep_dims=True)
                        dw_acc += tl.where(cols == j, x_c * g_c, -0.0)
                        if j == 0:
                            dbias_acc += g_c
        if HAS_GFIN:
            # The last k-1 inputs of each sequence are also its final state.
            if PACKED:
                near_end = (s_last > s_first) | (last >= tl.load(cu_ptr + s_first + 1) - (K - 1))
                fin_rows = gfin_ptr + seq * sfs + d3 * sfd
            else:
                near_end = l0 + BLOCK_L > L - (K - 1)
                end = L
                fin_rows = gfin_ptr + b * sfs + d3 * sfd
            if near_end:
                slot = tok - (end - (K - 1))
                gf = tl.load(fin_rows + slot * sfk, mask=d_mask & (slot >= 0) & (tok < L), other=0.0)
                dx += gf.to(tl.float32)
        dx_out = dx_ptr + b * sdb + d64 * sdd + tok * sdl
        tl.store(dx_out, dx.to(dx_ptr.dtype.element_ty), mask=d_mask & (tok < L))
    part = b * tl.num_programs(0) + pid_l
    dw = tl.sum(dw_acc, axis=1, keep_dims=True)  # per-tap sums: column j is tap j
    tl.store(dw_part_ptr + (part * D + d64) * K + (K - 1 - cols), dw, mask=d_mask & (cols < K))
    if HAS_BIAS:
        tl.store(dbias_part_ptr + part * D + d64, tl.sum(dbias_acc, axis=1, keep_dims=True), mask=d_mask)


@triton.jit
def _initial_state_backward_kernel(
    x_ptr, sxb, sxd, sxl, w_ptr, swd, swk, bias_ptr, init_ptr, sis, sid, sik, cu_ptr,
    gy_ptr, sgb, sgd, sgl, gfin_ptr, sfs, sfd, sfk, dinit_ptr, dw_part_ptr, first_part, D, L,
    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_GFIN: tl.constexpr, PACKED: tl.constexpr, SILU: tl.constexpr,
):
    """Per sequence: d(initial state) and the dweight terms whose input is the initial state.

    Only the first k-1 tokens of a sequence read its initial state, so g is recomputed for
    those alone. d(final) reaches the initial state in sequences shorter than k-1.
    dinit: (S, d, k-1) float32; dweight terms go to row first_part + s of the part buffer.
    """
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]  # (d, 1)
    d_mask = d < D
    d64 = d.to(tl.int64)
    i = tl.arange(0, SLOTS)[None, :]  # (1, first k-1 tokens, padded)
    if PACKED:
        b = 0
        start = tl.load(cu_ptr + s)
        end = tl.load(cu_ptr + s + 1)
    else:
        b = s.to(tl.int64)
        start = 0
        end = L
    t = start + i
    valid = d_mask & (i < K - 1) & (t < end)
    x_rows = x_ptr + b * sxb + d64 * sxd
    init_rows = init_ptr + s * sis + d * sid
    y = tl.zeros([BLOCK_D, SLOTS], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + d64 * swd + (K - 1 - j) * swk, mask=d_mask, other=0.0).to(tl.float32)
        p = t - j
        xv = tl.load(x_rows + p * sxl, mask=valid & (p >= start), other=0.0).to(tl.float32)
        iv = tl.load(init_rows + (K - 1 - (start - p)) * sik, mask=valid & (p < start), other=0.0)
        y += w * (xv + iv.to(tl.float32))
    if HAS_BIAS:
        y += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    g = tl.load(gy_ptr + b * sgb + d64 * sgd + t * sgl, mask=valid, other=0.0).to(tl.float32)
    if SILU:
        g = g * _silu_grad(y)
    dw_row = dw_part_ptr + ((first_part + s) * D + d64) * K
    for j in tl.static_range(K):
        p = t - j
        iv = tl.load(init_rows + (K - 1 - (start - p)) * sik, mask=valid & (p < start), other=0.0)
        tl.store(dw_row + (K - 1 - j), tl.sum(g * iv.to(tl.float32), axis=1, keep_dims=True), mask=d_mask)
    for m in tl.static_range(K - 1):
        # Slot m holds the input k-1-m tokens before the start; token start + i reads it
        # through tap j = k-1-m+i.
        acc = tl.zeros([BLOCK_D, 1], tl.float32)
        for j in tl.static_range(K):
            if m + j - (K - 1) >= 0:
                w = tl.load(w_ptr + d64 * swd + (K - 1 - j) * swk, mask=d_mask, other=0.0)
                g_i = tl.sum(tl.where(i == m + j - (K - 1), g, 0.0), axis=1, keep_dims=True)
                acc += w.to(tl.float32) * g_i
        if HAS_GFIN:
            f = d * 0 + (start + m - end)  # final-state slot of the same input, (d, 1)
            gf = tl.load(gfin_ptr + s * sfs + d * sfd + f * sfk, mask=d_mask & (f >= 0), other=0.0)
            acc += gf.to(tl.float32)
        tl.store(dinit_ptr + (s * D + d64) * (K - 1) + m, acc, mask=d_mask)


@triton.jit
def _conv_update_kernel(
    x_ptr, sxb, sxd, sxl, st_ptr, ssb, ssd, ssk, w_ptr, swd, swk, bias_ptr,
    out_ptr, sob, sod, sol, new_ptr, snb, snd, snk, D, L, S,
    K: tl.constexpr, TOKENS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
):
    """Conv of L new tokens after a state of the last S inputs; new state = last S inputs.

    The window of token t is state[S-(k-1):] then x: window[p] for p = t + i, tap i.
    Everything is read before anything is written (with a barrier between), so the new
    state may overwrite the old one in place: one program owns whole state rows.
    """
    start_dependents_then_wait(PDL)  # kernels/pdl.py
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]  # (d, 1)
    d_mask = d < D
    d64 = d.to(tl.int64)
    x_rows = x_ptr + b * sxb + d64 * sxd
    st_rows = st_ptr + b * ssb + d64 * ssd
    t = tl.arange(0, TOKENS)[None, :]  # (1, l padded)
    t_ok = d_mask & (t < L)
    y = tl.zeros([BLOCK_D, TOKENS], tl.float32)
    for i in tl.static_range(K):
        p = t + i
        w = tl.load(w_ptr + d64 * swd + i * swk, mask=d_mask, other=0.0).to(tl.float32)
        sv = tl.load(st_rows + (S - (K - 1) + p) * ssk, mask=t_ok & (p < K - 1), other=0.0)
        xv = tl.load(x_rows + (p - (K - 1)) * sxl, mask=t_ok & (p >= K - 1), other=0.0)
        y += w * (sv.to(tl.float32) + xv.to(tl.float32))
    if HAS_BIAS:
        y += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    slot = tl.arange(0, SLOTS)[None, :]  # (1, S padded)
    s_ok = d_mask & (slot < S)
    from_state = slot + L < S
    keep = tl.load(st_rows + (slot + L) * ssk, mask=s_ok & from_state, other=0.0)
    new = tl.load(x_rows + (slot + L - S) * sxl, mask=s_ok & ~from_state, other=0.0)
    new = tl.where(from_state, keep, new.to(new_ptr.dtype.element_ty))
    tl.debug_barrier()
    tl.store(out_ptr + b * sob + d64 * sod + t * sol, y.to(out_ptr.dtype.element_ty), mask=t_ok)
    tl.store(new_ptr + b * snb + d64 * snd + slot * snk, new, mask=s_ok)


# --- launch configuration -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How a conv launch tiles (b, d, l). ``group`` is C, the tokens one thread holds."""

    block_d: int
    block_l: int
    group: int
    num_warps: int
    channels_last: bool


def default_tile_config(x: Tensor, width: int, backward: bool = False) -> TileConfig:
    """Tiles whose group axis sits in one thread's registers for x's memory layout."""
    vector = 16 // x.element_size()  # elements of one 16-byte access
    channels_last = x.stride(1) == 1 and x.stride(2) != 1
    if x.device.type != "cuda":
        # Triton's CPU interpreter: layouts don't exist and every op costs the same whatever
        # its size, so few large programs run fastest.
        group = max(4, next_power_of_2(width))
        block_l = group * min(16, next_power_of_2(cdiv(x.shape[2], group)))
        return TileConfig(min(32, next_power_of_2(x.shape[1])), block_l, group, 1, channels_last)
    if channels_last:
        # Channels contiguous: tile (c, r, d) with one group (r = 1) and every lane of every
        # warp along channels, so the group axis c is registers whatever order the compiler
        # gives the other axes. Programs loop over token tiles (see tiles_per_program).
        # Warp count: the one that leaves fewest channel lanes idle.
        group = max(4, next_power_of_2(width))
        d, lanes_d = x.shape[1], 32 * vector
        num_warps = min((4, 2, 1), key=lambda w: (-(-d // (lanes_d * w)) * lanes_d * w - d, -w))
        return TileConfig(lanes_d * num_warps, group, group, num_warps, True)
    # Tokens contiguous (or no unit stride at all): tile (d, r, c) with one channel (d = 1),
    # a thread's group one 16-byte vector of tokens, lanes and warps along groups (again
    # the only axis they can go to), two groups per thread.
    group = max(vector, next_power_of_2(width))
    return TileConfig(1, 2 * 32 * 4 * group, group, 4, False)


def _check_config(config: TileConfig, width: int) -> None:
    if config.group < width or config.block_l % config.group:
        raise ValueError(f"{config}: group must be >= conv width ({width}) and divide block_l")


# --- host side ----------------------------------------------------------------------------


def _require_runnable(t: Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the Triton causal_conv1d kernels need a CUDA tensor (got {t.device}); on CPU set "
            "TRITON_INTERPRET=1 before importing ssmshard, or use ssmshard.kernels.reference"
        )


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_offsets(name: str, t: Tensor) -> None:
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    if reach >= _INT32_LIMIT:
        raise ValueError(f"{name} spans {reach} elements; the causal_conv1d kernels index with 32 bits "
                         f"(at most {_INT32_LIMIT - 1}): pass fewer tokens per call (a long prompt: "
                         "dm.generate(..., prefill_chunk_size=N) or dm.prefill(..., chunk_size=N))")


def _validate(x, weight, bias, activation, cu_seqlens, initial_states) -> int:
    """Checks shapes, dtypes and devices; returns the number of sequences."""
    check_activation(activation)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, channels, length), got shape {tuple(x.shape)}")
    bsz, d, _ = x.shape
    _check_float("x", x)
    _require_runnable(x)
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be (channels={d}, width), got {tuple(weight.shape)}")
    k = weight.shape[1]
    if not 2 <= k <= MAX_WIDTH:
        raise ValueError(f"conv width {k} unsupported: 2 <= width <= {MAX_WIDTH}")
    _check_float("weight", weight)
    tensors = {"weight": weight}
    if bias is not None:
        if bias.shape != (d,):
            raise ValueError(f"bias must be (channels={d},), got {tuple(bias.shape)}")
        _check_float("bias", bias)
        tensors["bias"] = bias
    n_seqs = bsz
    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D int32 tensor of sequence offsets (S + 1,)")
        if bsz != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {bsz}: "
                             "concatenate the sequences along the length axis")
        if cu_seqlens.device.type == "cpu" and x.device.type != "cpu":
            raise ValueError("cu_seqlens must live on x's device (a CPU copy would force a sync)")
        n_seqs = cu_seqlens.numel() - 1
        tensors["cu_seqlens"] = cu_seqlens
        if cu_seqlens.device.type == "cpu":  # checking costs no device sync here
            offsets = cu_seqlens.tolist()
            if offsets[0] != 0 or offsets[-1] != x.shape[2] or any(a > b for a, b in zip(offsets, offsets[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to the length {x.shape[2]}, got {offsets}")
    if initial_states is not None:
        if initial_states.shape != (n_seqs, d, k - 1):
            raise ValueError(
                f"initial_states must be (sequences={n_seqs}, channels={d}, width-1={k - 1}), "
                f"got {tuple(initial_states.shape)}"
            )
        _check_float("initial_states", initial_states)
        tensors["initial_states"] = initial_states
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    _check_offsets("x", x)
    return n_seqs


def _init_args(initial_states: Optional[Tensor], x: Tensor):
    if initial_states is None:
        return x, 0, 0, 0  # never read: HAS_INIT is off
    return (initial_states, *initial_states.stride())


def conv_forward(x, weight, bias, activation, cu_seqlens, initial_states, return_final_states,
                 config: Optional[TileConfig] = None):
    """Forward launch(es); returns (out, final_states or None). No autograd."""
    n_seqs = _validate(x, weight, bias, activation, cu_seqlens, initial_states)
    bsz, d, l = x.shape
    k = weight.shape[1]
    config = config or default_tile_config(x, k)
    _check_config(config, k)
    out = torch.empty_like(x)  # x's layout, as the op's fake implementation promises
    init, sis, sid, sik = _init_args(initial_states, x)
    cu = cu_seqlens if cu_seqlens is not None else x
    # Channels-last tiles are one group long: loop so the shifted re-read hits L1.
    tiles = tiles_per_program(config, bsz, d, l, target_programs=2048) if config.channels_last else 1
    grid = (cdiv(cdiv(l, config.block_l), tiles), cdiv(d, config.block_d), bsz)
    _conv_forward_kernel[grid](
        x, *x.stride(), weight, *weight.stride(), bias if bias is not None else x,
        init, sis, sid, sik, cu, n_seqs, out, *out.stride(), d, l, tiles,
        K=k, C=config.group, BLOCK_D=config.block_d, BLOCK_L=config.block_l,
        CHANNELS_LAST=config.channels_last, HAS_BIAS=bias is not None,
        HAS_INIT=initial_states is not None, PACKED=cu_seqlens is not None,
        SILU=activation is not None, num_warps=config.num_warps,
    )
    final = None
    if return_final_states:
        final = x.new_empty(n_seqs, d, k - 1)
        block_d = 128
        _final_states_kernel[(n_seqs, cdiv(d, block_d))](
            x, *x.stride(), init, sis, sid, sik, cu, final, *final.stride(), d, l,
            K=k, SLOTS=next_power_of_2(k - 1), BLOCK_D=block_d,
            HAS_INIT=initial_states is not None, PACKED=cu_seqlens is not None, num_warps=4,
        )
    return out, final


def tiles_per_program(config: TileConfig, bsz: int, d: int, l: int, target_programs: int) -> int:
    """Token tiles each program loops over: about ``target_programs`` programs in all, and
    the tiles split evenly between the programs of a row."""
    tiles_l = cdiv(l, config.block_l)
    programs_without_loop = tiles_l * bsz * cdiv(d, config.block_d)
    tiles = max(1, min(tiles_l, programs_without_loop // target_programs))
    return cdiv(tiles_l, cdiv(tiles_l, tiles))


def _in_tile_layout(t: Tensor, config: TileConfig) -> Tensor:
    """``t`` with the unit stride on the axis the tile's vectors run along (channels, or tokens).

    The tiles are laid out for x's memory layout; a gradient in the other one turns every
    vector access into one 32-byte sector per element. Mamba's conv gets exactly that: x is a
    channels-contiguous slice of in_proj's output, the scan's du is tokens-contiguous. Measured
    on an H200 (d=4096, one packed row of 8,130 tokens; docs/kernels.md): conv
    forward+backward 9.33 ms as handed in, 0.88 ms with this copy; in a
    Mamba-1.4B-sized training step the conv backward had been 30.6% of the GPU time."""
    unit_axis = 1 if config.channels_last else 2
    if t.stride(unit_axis) == 1:
        return t
    if config.channels_last:
        return t.transpose(1, 2).contiguous().transpose(1, 2)  # (b, l, d) memory, (b, d, l) view
    return t.contiguous()


def conv_backward(x, weight, bias, activation, cu_seqlens, initial_states, grad_out, grad_final,
                  config: Optional[TileConfig] = None):
    """Returns (dx, dweight, dbias or None, dinitial_states or None)."""
    n_seqs = _validate(x, weight, bias, activation, cu_seqlens, initial_states)
    bsz, d, l = x.shape
    k = weight.shape[1]
    config = config or default_tile_config(x, k, backward=True)
    _check_config(config, k)
    grad_out = _in_tile_layout(grad_out, config)
    # Backward programs keep dweight partial sums: looping over tiles keeps their rows few.
    tiles = tiles_per_program(config, bsz, d, l, target_programs=4096)
    programs_l = cdiv(cdiv(l, config.block_l), tiles)
    main_parts = bsz * programs_l
    parts = main_parts + (n_seqs if initial_states is not None else 0)
    dw_part = torch.empty(parts, d, k, device=x.device, dtype=torch.float32)
    dbias_part = dw_part  # never written without a bias
    if bias is not None:
        dbias_part = torch.empty(main_parts, d, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    init, sis, sid, sik = _init_args(initial_states, x)
    cu = cu_seqlens if cu_seqlens is not None else x
    gfin, sfs, sfd, sfk = _init_args(grad_final, x)
    flags = dict(HAS_BIAS=bias is not None, PACKED=cu_seqlens is not None,
                 HAS_GFIN=grad_final is not None, SILU=activation is not None)
    _conv_backward_kernel[(programs_l, cdiv(d, config.block_d), bsz)](
        x, *x.stride(), weight, *weight.stride(), bias if bias is not None else x,
        init, sis, sid, sik, cu, n_seqs, grad_out, *grad_out.stride(), gfin, sfs, sfd, sfk,
        dx, *dx.stride(), dw_part, dbias_part, d, l, tiles,
        K=k, C=config.group, BLOCK_D=config.block_d, BLOCK_L=config.block_l,
        CHANNELS_LAST=config.channels_last, HAS_INIT=initial_states is not None,
        num_warps=config.num_warps, **flags,
    )
    dinit = None
    if initial_states is not None:
        dinit = torch.empty(n_seqs, d, k - 1, device=x.device, dtype=torch.float32)
        block_d = 64
        _initial_state_backward_kernel[(n_seqs, cdiv(d, block_d))](
            x, *x.stride(), weight, *weight.stride(), bias if bias is not None else x,
            init, sis, sid, sik, cu, grad_out, *grad_out.stride(), gfin, sfs, sfd, sfk,
            dinit, dw_part, main_parts, d, l,
            K=k, SLOTS=next_power_of_2(k - 1), BLOCK_D=block_d, num_warps=4, **flags,
        )
        dinit = dinit.to(initial_states.dtype)
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = dbias_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_states, cu_seqlens, activation, return_final_states):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        out, final = conv_forward(x, weight, bias, activation, cu_seqlens, initial_states,
                                  return_final_states)
        ctx.save_for_backward(x, weight, bias, initial_states, cu_seqlens)
        ctx.activation = activation
        return (out, final) if return_final_states else out

    @staticmethod
    def backward(ctx, grad_out, grad_final=None):
        x, weight, bias, initial_states, cu_seqlens = ctx.saved_tensors
        if grad_out is None:  # only the final states were used
            grad_out = torch.zeros_like(x)
        dx, dweight, dbias, dinit = conv_backward(
            x, weight, bias, ctx.activation, cu_seqlens, initial_states, grad_out, grad_final
        )
        needs = ctx.needs_input_grad
        return (dx if needs[0] else None, dweight if needs[1] else None,
                dbias if needs[2] else None, dinit if needs[3] else None, None, None, None)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None, *,
                  cu_seqlens: Optional[Tensor] = None, initial_states: Optional[Tensor] = None,
                  return_final_states: bool = False):
    """Depthwise causal conv1d, differentiable (Triton forward and backward).

    x: (b, d, l), any strides (channels-contiguous views are read in place); weight (d, k);
    bias (d,); activation None / "silu" / "swish". Float32 math; output in x's dtype and
    memory layout. cu_seqlens: int32 (S + 1,) offsets of sequences packed in a batch-1 row,
    on x's device, rising from 0 to l (checked only on CPU: on a GPU that needs a host sync).
    initial_states: (b or S, d, k - 1), the inputs before each sequence, oldest first.
    Returns out, or (out, final_states (b or S, d, k - 1) in x's dtype) with
    return_final_states.
    """
    return _CausalConv1dFunction.apply(
        x, weight, bias, initial_states, cu_seqlens, activation, return_final_states
    )


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         activation: Optional[str] = None, *,
                         out_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Decode step: the conv of l new tokens (x: (b, d, l) or (b, d)) after ``conv_state``
    (b, d, s), s >= k - 1, the last s inputs. Returns (out like x, new_state); the new state
    is written to ``out_state`` when given (``out_state=conv_state`` updates in place, for
    CUDA-graph decode with preallocated buffers), else to a new tensor. Inference only.
    """
    check_activation(activation)
    one_token = x.dim() == 2
    x3 = x.unsqueeze(-1) if one_token else x  # (b, d) -> (b, d, 1)
    if x3.dim() != 3:
        raise ValueError(f"x must be (batch, channels[, length]), got shape {tuple(x.shape)}")
    bsz, d, l = x3.shape
    _check_float("x", x)
    _require_runnable(x)
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be (channels={d}, width), got {tuple(weight.shape)}")
    k = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[:2] != (bsz, d):
        raise ValueError(
            f"conv_state must be (batch={bsz}, channels={d}, length), got {tuple(conv_state.shape)}"
        )
    s = conv_state.shape[2]
    if s < k - 1:
        raise ValueError(f"conv_state length {s} is shorter than conv width - 1 ({k - 1})")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"bias must be (channels={d},), got {tuple(bias.shape)}")
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, conv_state, weight, bias)
    ):
        raise RuntimeError("causal_conv1d_update is inference-only: call it under torch.no_grad()")
    if out_state is None:
        out_state = torch.empty_like(conv_state)
    elif (out_state.shape, out_state.dtype, out_state.device) != (
        conv_state.shape, conv_state.dtype, conv_state.device
    ):
        raise ValueError("out_state must match conv_state's shape, dtype and device")
    out = torch.empty_like(x3)
    block_d = 128
    _conv_update_kernel[(bsz, cdiv(d, block_d))](
        x3, *x3.stride(), conv_state, *conv_state.stride(), weight, *weight.stride(),
        bias if bias is not None else x3, out, *out.stride(), out_state, *out_state.stride(),
        d, l, s, K=k, TOKENS=next_power_of_2(l), SLOTS=next_power_of_2(s), BLOCK_D=block_d,
        HAS_BIAS=bias is not None, SILU=activation is not None, num_warps=4, **launch_options(x.device),
    )
    return (out.squeeze(-1) if one_token else out), out_state
