"""An experiment, not used by ssmshard (README.md beside this file): the Mamba-1 scan forward's
segment pass on unpacked rows, without a recurrence.

Dimension letters: b batch, d channels, l tokens, n state size (N_PAD: next power of two),
g groups of B / C, e channels per group, T tokens of one tile, G segments of the sequence.

A row split into G segments (``selective_scan._launch_forward``) needs, for every segment but
the last, the state its tokens leave from a zero start and its total decay:

    end[n]   = sum over the segment's tokens t of  exp(A[n] * S_t) * dt_t * u_t * B_t[n]
    decay[n] = exp(A[n] * (sum of the segment's dt))

where S_t is the sum of dt over the segment's tokens after t. That is the recurrence
h_t = exp(A dt_t) h_{t-1} + dt_t u_t B_t unrolled: the product of the decays after t is the
exponential of their summed exponents. The forward kernels get it by scanning the recurrence,
which costs a combine per element on top of the terms; summed as above, an element is an
exponent, an exp2, the input and one add. (The hope was fewer instructions than the scan;
compiled, it took as many: README.md.) The tiles are walked from the segment's end to its start,
so that S_t is known when token t is reached (a running sum of the tiles already walked, plus
the in-tile sum after t) and no exponent is positive: walking forward would need
exp(-A * prefix), which overflows on long segments.

Tiles as in ``selective_scan_fwd_parallel``: (BLOCK_D, T, N_PAD), loaded so as to put one
channel on a lane with the tile's T tokens and all n states in the thread. (Compiled for sm_90,
the loop still has shuffles, 40 a tile at 32 channels; where they come from was not examined.) Segment 0 of a row with an initial state adds that state, decayed over the whole
segment. Packed rows (restarts inside a segment) keep the forward kernels' segment pass.

Rounding differs from the scan's: exp(A * S_t) rounds once where the scan multiplies the decays
one by one, and S_t is a float32 sum. Both errors are of the order of float32 rounding of the
exponent, relative, on the terms that are not negligible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ssmshard.kernels.scan_common import LOG2E, channel_block, discretise, token_mask
from ssmshard.kernels.selective_scan_fwd_parallel import _state_tile_ptrs, load_bc, load_tokens


@triton.jit
def segment_end_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, bias_ptr, init_ptr, seg_end_ptr, seg_decay_ptr,
    d, l, e, n, seg_len, num_segments,
    su_b, su_d, su_l,
    sdl_b, sdl_d, sdl_l,
    sA_d, sA_n,
    sB_b, sB_g, sB_n,
    si_s, si_d, si_n,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PAD: tl.constexpr,
):
    """One (channel block, batch row, segment); the launch skips the last segment. Writes
    seg_end and seg_decay, both (b, G, n, d) fp32, as the forward kernels' segment pass does.
    Segments are whole tiles (``seg_len`` a multiple of T); B is fp32 with unit stride along l."""
    pid_blk = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_seg = tl.program_id(2)
    grp, _, ch, ch_mask, ch64 = channel_block(pid_blk, tl.cdiv(e, BLOCK_D), e, BLOCK_D)
    b64 = pid_b.to(tl.int64)
    tv = tl.arange(0, T)
    nv = tl.arange(0, N_PAD)
    state_mask = ch_mask[:, None] & (nv < n)[None, :]  # (BLOCK_D, N_PAD)
    ch3 = ch64[:, None, None]
    n3 = nv[None, None, :]

    u_rows = u_ptr + b64 * su_b + ch3 * su_d  # (BLOCK_D, 1, 1) row pointers
    delta_rows = delta_ptr + b64 * sdl_b + ch3 * sdl_d
    B_row = B_ptr + b64 * sB_b + grp * sB_g
    bias3 = tl.zeros((BLOCK_D, 1, 1), dtype=tl.float32)
    if HAS_BIAS:
        bias3 = tl.load(bias_ptr + ch3, mask=ch_mask[:, None, None], other=0.0).to(tl.float32)
    A2 = tl.load(A_ptr + ch[:, None] * sA_d + nv[None, :] * sA_n, mask=state_mask, other=0.0).to(tl.float32)
    A3 = A2[:, None, :] * LOG2E  # A * log2(e), (BLOCK_D, 1, N_PAD)

    t_begin = pid_seg * seg_len
    num_tiles = seg_len // T
    end = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    after = tl.zeros((BLOCK_D, 1, 1), dtype=tl.float32)  # dt summed over the tokens already walked
    for k in range(num_tiles):
        t0 = tl.multiple_of(t_begin + (num_tiles - 1 - k) * T, T)  # last tile first
        t = t0 + tv
        t3 = t[None, :, None]
        # Every tile lies wholly before l: only the last segment can reach past it, and the launch
        # skips that one. Saying so lets the loads be vectors (see scan_common.token_mask).
        tile_mask = ch_mask[:, None, None] & token_mask(t, l, True)[None, :, None]
        u = load_tokens(u_rows, su_l, t3, tile_mask)
        delta = load_tokens(delta_rows, sdl_l, t3, tile_mask)
        dt = tl.where(tile_mask, discretise(delta, bias3, SOFTPLUS), 0.0)  # (BLOCK_D, T, 1)
        # dt summed after each token: the tiles already walked, then this tile's later tokens.
        later = after + (tl.cumsum(dt, axis=1, reverse=True) - dt)
        B = load_bc(B_row, sB_n, n3, t3, ch3, state_mask[:, None, :] & tile_mask).to(tl.float32)
        end += tl.sum(tl.exp2(A3 * later) * ((dt * u) * B), axis=1)
        after += tl.sum(dt, axis=1, keep_dims=True)
    decay = tl.exp2(A2 * LOG2E * tl.sum(after, axis=2))  # (BLOCK_D, N_PAD)
    if HAS_INIT:
        if pid_seg == 0:
            init_rows = init_ptr + b64 * si_s + ch64 * si_d
            init = tl.load(init_rows[:, None] + nv[None, :] * si_n, mask=state_mask, other=0.0).to(tl.float32)
            end += decay * init
    seg_offset = (b64 * num_segments + pid_seg) * n * d  # into (b, G, n, d)
    tl.store(_state_tile_ptrs(seg_end_ptr + seg_offset, ch64, nv, d), end, mask=state_mask)
    tl.store(_state_tile_ptrs(seg_decay_ptr + seg_offset, ch64, nv, d), decay, mask=state_mask)
