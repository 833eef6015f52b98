"""An experiment, not used by ssmshard: the Mamba-1 scan forward with the state indices split
over lanes, one pass over the whole row (no segments), for batch-1 rows that leave most of the
GPU idle at one channel per thread (README.md beside this file has the measurements).

Dimension letters: d channels, n state size (NJ * LANES, padded to a power of two), l tokens,
T tokens of one tile. A program owns BLOCK_D channels of one batch row; its tiles are
(LANES, BLOCK_D, NJ, T): a channel's n states sit on LANES lanes, NJ in each lane's registers,
with the tile's T tokens in-thread (the B / C loads, 16-byte vectors along the tokens, give
that layout; the axes are in the order Triton 3.6 fills lanes, dimension 0 first after the
vector's: README.md, "Two layouts"). y sums the states (NJ in-thread, then LANES by shuffles).

SPREAD (T == LANES): the per-(channel, token) work (softplus of delta, D * u, the z gate) runs
once per channel and token, token t0 + lane on each state lane, instead of on every lane; the
tokens then move into every lane's registers by a permute and reshape (a layout conversion
through shared memory). ``scan_fwd_lanes_pf_kernel`` is the SPREAD form with the next tile's loads issued
before the current tile's arithmetic. Unpacked rows, no checkpoints, inference only.
"""
import triton
import triton.language as tl
from ssmshard.kernels.scan_common import LOG2E, channel_block, discretise, linear_recurrence_combine, tile_phase, token_mask


@triton.jit
def _tokens_in_thread(per_lane, BLOCK_D: tl.constexpr, T: tl.constexpr):
    """(LANES, BLOCK_D, 1, 1) values, token t0 + lane on each lane, as (1, BLOCK_D, 1, T) tokens."""
    return tl.reshape(tl.permute(per_lane, (1, 2, 3, 0)), (1, BLOCK_D, 1, T))


@triton.jit
def _token_per_lane(in_thread):
    """(1, BLOCK_D, 1, T) back to (T, BLOCK_D, 1, 1): token t0 + lane on each lane."""
    return tl.permute(in_thread, (3, 1, 2, 0))


@triton.jit
def _program_setup(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, e, n,
    su_b, su_d, sdl_b, sdl_d, sA_d, sA_n, sB_b, sB_g, sC_b, sC_g, sz_b, sz_d, sy_b, sy_d, si_s, si_d, si_n,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, LANES: tl.constexpr, NJ: tl.constexpr,
):
    """What both kernels set up once per program (one channel block of one batch row): the
    (LANES, BLOCK_D, NJ, 1) state indices, mask, A * log2(e) and starting state; the per-channel
    bias and D; the row pointers of the per-token tensors and of B and C."""
    pid_blk = tl.program_id(0)
    grp, _, _, ch_mask, ch64 = channel_block(pid_blk, tl.cdiv(e, BLOCK_D), e, BLOCK_D)
    b64 = tl.program_id(1).to(tl.int64)
    ch4 = ch64[None, :, None, None]
    cm4 = ch_mask[None, :, None, None]
    lane4 = tl.arange(0, LANES)[:, None, None, None]
    n4 = tl.arange(0, NJ)[None, None, :, None] * LANES + lane4
    state_mask = cm4 & (n4 < n)  # (LANES, BLOCK_D, NJ, 1)
    A2 = tl.load(A_ptr + ch4 * sA_d + n4 * sA_n, mask=state_mask, other=0.0).to(tl.float32) * LOG2E
    bias4 = tl.zeros((1, BLOCK_D, 1, 1), dtype=tl.float32)
    if HAS_BIAS:
        bias4 = tl.load(bias_ptr + ch4, mask=cm4, other=0.0).to(tl.float32)
    D4 = tl.zeros((1, BLOCK_D, 1, 1), dtype=tl.float32)
    if HAS_D:
        D4 = tl.load(D_ptr + ch4, mask=cm4, other=0.0).to(tl.float32)
    state = tl.zeros((LANES, BLOCK_D, NJ, 1), dtype=tl.float32)
    if HAS_INIT:
        state = tl.load(init_ptr + b64 * si_s + ch4 * si_d + n4 * si_n, mask=state_mask, other=0.0).to(tl.float32)
    rows = (u_ptr + b64 * su_b + ch4 * su_d, delta_ptr + b64 * sdl_b + ch4 * sdl_d,
            z_ptr + b64 * sz_b + ch4 * sz_d, y_ptr + b64 * sy_b + ch4 * sy_d,
            B_ptr + b64 * sB_b + grp * sB_g, C_ptr + b64 * sC_b + grp * sC_g)
    return b64, ch4, cm4, lane4, n4, state_mask, A2, bias4, D4, state, rows


@triton.jit
def scan_fwd_lanes_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, final_ptr,
    d, l, e, n,
    su_b, su_d, su_l, sdl_b, sdl_d, sdl_l, sA_d, sA_n, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
    sz_b, sz_d, sz_l, sy_b, sy_d, sy_l, si_s, si_d, si_n, sf_s, sf_d, sf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    BLOCK_D: tl.constexpr, LANES: tl.constexpr, NJ: tl.constexpr, T: tl.constexpr, SPREAD: tl.constexpr,
):
    b64, ch4, cm4, lane4, n4, state_mask, A2, bias4, D4, state, rows = _program_setup(
        u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, e, n,
        su_b, su_d, sdl_b, sdl_d, sA_d, sA_n, sB_b, sB_g, sC_b, sC_g, sz_b, sz_d, sy_b, sy_d, si_s, si_d, si_n,
        HAS_D, HAS_BIAS, HAS_INIT, BLOCK_D, LANES, NJ)
    u_rows, delta_rows, z_rows, y_rows, B_row, C_row = rows
    tv = tl.arange(0, T)
    tv4 = tv[None, None, None, :]
    num_tiles = tl.cdiv(l, T)
    num_whole = l // T
    for phase in tl.static_range(2):
        first, count = tile_phase(phase, num_whole, num_tiles)
        for k in range(count):
            t0 = tl.multiple_of((first + k) * T, T)
            t4 = (t0 + tv)[None, None, None, :]
            tm4 = token_mask(t0 + tv, l, phase == 0)[None, None, None, :]
            if SPREAD:
                # The per-token work (softplus, gating) once per (channel, token): token t0 + lane
                # on each state lane, then the tokens moved into every lane's registers.
                tp = t0 + lane4  # (LANES, 1, 1, 1), LANES == T
                pm = cm4 & token_mask(tp, l, phase == 0)
                u_p = tl.load(u_rows + tp * su_l, mask=pm, other=0.0).to(tl.float32)
                delta_p = tl.load(delta_rows + tp * sdl_l, mask=pm, other=0.0).to(tl.float32)
                dt_p = tl.where(pm, discretise(delta_p, bias4, SOFTPLUS), 0.0)
                dt = _tokens_in_thread(dt_p, BLOCK_D, T)
                dtu = _tokens_in_thread(dt_p * u_p, BLOCK_D, T)
            else:
                tile_mask = cm4 & tm4 & (lane4 >= 0)
                u = tl.load(u_rows + t4 * su_l + 0 * lane4, mask=tile_mask, other=0.0).to(tl.float32)
                delta = tl.load(delta_rows + t4 * sdl_l + 0 * lane4, mask=tile_mask, other=0.0).to(tl.float32)
                dt = tl.where(tile_mask, discretise(delta, bias4, SOFTPLUS), 0.0)
                dtu = dt * u
            bc_mask = state_mask & tm4
            B = tl.load(B_row + 0 * ch4 + n4 * sB_n + t4, mask=bc_mask, other=0.0)
            decay = tl.exp2(dt * A2)
            x = dtu * B
            x = tl.where(tv4 == 0, x + decay * state, x)
            _, h = tl.associative_scan((decay, x), 3, linear_recurrence_combine)
            state = tl.sum(tl.where(tv4 == T - 1, h, -0.0), axis=3, keep_dims=True)
            C = tl.load(C_row + 0 * ch4 + n4 * sC_n + t4, mask=bc_mask, other=0.0)
            y = tl.sum(tl.sum(h * C, axis=2, keep_dims=True), axis=0, keep_dims=True)  # (1, BLOCK_D, 1, T)
            if SPREAD:
                y = _token_per_lane(y)
                if HAS_D:
                    y += D4 * u_p
                if HAS_Z:
                    z = tl.load(z_rows + tp * sz_l, mask=pm, other=0.0).to(tl.float32)
                    y = y * (z * tl.sigmoid(z))
                tl.store(y_rows + tp * sy_l, y, mask=pm)
            else:
                if HAS_D:
                    y += D4 * u
                if HAS_Z:
                    z = tl.load(z_rows + t4 * sz_l + 0 * lane4, mask=tile_mask, other=0.0).to(tl.float32)
                    y = y * (z * tl.sigmoid(z))
                tl.store(y_rows + t4 * sy_l + 0 * lane4, y, mask=tile_mask & (lane4 == 0))
    if STORE_FINAL:
        tl.store(final_ptr + b64 * sf_s + ch4 * sf_d + n4 * sf_n, state, mask=state_mask)


def launch(u, delta, A, B32, C32, D, z, bias, softplus, init, y, final, block_d=8, lanes=4, tokens=4, num_warps=1, spread=False, prefetch=False):
    from triton import cdiv, next_power_of_2
    bsz, d, l = u.shape
    g, n = B32.shape[1], A.shape[1]
    e = d // g
    n_pad = next_power_of_2(n)
    lanes = min(lanes, n_pad)
    nj = n_pad // lanes
    dummy = y
    opt = lambda t: t if t is not None else dummy
    zs = z.stride() if z is not None else (0, 0, 0)
    ist = init.stride() if init is not None else (0, 0, 0)
    fst = final.stride() if final is not None else (0, 0, 0)
    kernel = scan_fwd_lanes_pf_kernel if prefetch else scan_fwd_lanes_kernel
    kernel[(g * cdiv(e, block_d), bsz)](
        u, delta, A, B32, C32, opt(D), opt(z), opt(bias), opt(init), y, opt(final),
        d, l, e, n, *u.stride(), *delta.stride(), *A.stride(), *B32.stride()[:3], *C32.stride()[:3], *zs,
        *y.stride(), *ist, *fst,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=bias is not None, SOFTPLUS=softplus,
        HAS_INIT=init is not None, STORE_FINAL=final is not None,
        BLOCK_D=block_d, LANES=lanes, NJ=nj, T=tokens, SPREAD=spread, num_warps=num_warps)


@triton.jit
def _tile_loads(t0, go, lane4, tv4, cm4, state_mask, n4, ch4, l, u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l,
                B_row, C_row, sB_n, sC_n, HAS_Z: tl.constexpr, WHOLE: tl.constexpr):
    tp = t0 + lane4
    pm = tl.where(go, cm4 & token_mask(tp, l, WHOLE), False)
    t4 = t0 + tv4
    bc_mask = tl.where(go, state_mask & token_mask(t4, l, WHOLE), False)
    u_p = tl.load(u_rows + tp * su_l, mask=pm, other=0.0)
    delta_p = tl.load(delta_rows + tp * sdl_l, mask=pm, other=0.0)
    z_p = u_p
    if HAS_Z:
        z_p = tl.load(z_rows + tp * sz_l, mask=pm, other=0.0)
    B = tl.load(B_row + 0 * ch4 + n4 * sB_n + t4, mask=bc_mask, other=0.0)
    C = tl.load(C_row + 0 * ch4 + n4 * sC_n + t4, mask=bc_mask, other=0.0)
    return u_p, delta_p, z_p, B, C


@triton.jit
def scan_fwd_lanes_pf_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, final_ptr,
    d, l, e, n,
    su_b, su_d, su_l, sdl_b, sdl_d, sdl_l, sA_d, sA_n, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
    sz_b, sz_d, sz_l, sy_b, sy_d, sy_l, si_s, si_d, si_n, sf_s, sf_d, sf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    BLOCK_D: tl.constexpr, LANES: tl.constexpr, NJ: tl.constexpr, T: tl.constexpr, SPREAD: tl.constexpr,
):
    b64, ch4, cm4, lane4, n4, state_mask, A2, bias4, D4, state, rows = _program_setup(
        u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, e, n,
        su_b, su_d, sdl_b, sdl_d, sA_d, sA_n, sB_b, sB_g, sC_b, sC_g, sz_b, sz_d, sy_b, sy_d, si_s, si_d, si_n,
        HAS_D, HAS_BIAS, HAS_INIT, BLOCK_D, LANES, NJ)
    u_rows, delta_rows, z_rows, y_rows, B_row, C_row = rows
    tv4 = tl.arange(0, T)[None, None, None, :]
    num_tiles = tl.cdiv(l, T)
    num_whole = l // T
    for phase in tl.static_range(2):
        first, count = tile_phase(phase, num_whole, num_tiles)
        nu, nd, nz, nB, nC = _tile_loads(tl.multiple_of(first * T, T), count > 0, lane4, tv4, cm4, state_mask, n4, ch4, l,
                                         u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l, B_row, C_row, sB_n, sC_n,
                                         HAS_Z, phase == 0)
        for k in range(count):
            u_p, delta_p, z_p, B, C = nu, nd, nz, nB, nC
            t0 = tl.multiple_of((first + k) * T, T)
            nu, nd, nz, nB, nC = _tile_loads(tl.multiple_of((first + k + 1) * T, T), k + 1 < count, lane4, tv4, cm4,
                                             state_mask, n4, ch4, l, u_rows, su_l, delta_rows, sdl_l, z_rows, sz_l,
                                             B_row, C_row, sB_n, sC_n, HAS_Z, phase == 0)
            tp = t0 + lane4
            pm = cm4 & token_mask(tp, l, phase == 0)
            u_p = u_p.to(tl.float32)
            dt_p = tl.where(pm, discretise(delta_p.to(tl.float32), bias4, SOFTPLUS), 0.0)
            dt = _tokens_in_thread(dt_p, BLOCK_D, T)
            dtu = _tokens_in_thread(dt_p * u_p, BLOCK_D, T)
            decay = tl.exp2(dt * A2)
            x = dtu * B
            x = tl.where(tv4 == 0, x + decay * state, x)
            _, h = tl.associative_scan((decay, x), 3, linear_recurrence_combine)
            state = tl.sum(tl.where(tv4 == T - 1, h, -0.0), axis=3, keep_dims=True)
            y = tl.sum(tl.sum(h * C, axis=2, keep_dims=True), axis=0, keep_dims=True)
            y = _token_per_lane(y)
            if HAS_D:
                y += D4 * u_p
            if HAS_Z:
                z = z_p.to(tl.float32)
                y = y * (z * tl.sigmoid(z))
            tl.store(y_rows + tp * sy_l, y, mask=pm)
    if STORE_FINAL:
        tl.store(final_ptr + b64 * sf_s + ch4 * sf_d + n4 * sf_n, state, mask=state_mask)
