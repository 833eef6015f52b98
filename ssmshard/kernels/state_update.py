"""One-token decode step of a selective SSM (Mamba-1 and Mamba-2 layouts) as a Triton kernel.

Dimension letters: b batch, h heads, p head dim, n state size, g groups of B / C,
d channels (Mamba-1), e channels per group (d // g), r dt_proj's input features (Mamba-1's dt rank).

Semantics: those of ``ssmshard.kernels.reference.selective_state_update``:
    dt   = dt @ dt_proj_weight.T, rounded to dt's dtype   (only with ``dt_proj_weight``, Mamba-1)
    dt'  = softplus(dt + dt_bias)             (or dt + dt_bias)
    new  = state * exp(dt' * A) + dt' * x * B   (B, C of the head's group)
    out  = sum_n new * C (+ D * x), times silu(z) if z is given
math in fp32, out in x's dtype, the new state in state's dtype. Mamba-1 (state (b, d, n)) is
run as the Mamba-2 layout with one head per B/C group (h = g, p = d // g).

``out_state`` receives the new state in place (preallocated buffers, CUDA-graph decode);
``out_state=state`` is safe: every program reads its whole (p-block, n) tile of the state
before writing the same tile, element by element in the same thread.

With ``dt_proj_weight`` (Mamba-1's ``dt_proj``, folded in by the ``fuse_dt_proj`` pass) each
program also computes its channels' dt from the low-rank input: one kernel fewer per layer of a
decode step, whose kernels cost a dependent launch each whatever they move
(benchmarks/results/decode_profile/). The weight tile is loaded before waiting for the kernel
before (it is a weight: nothing in the step writes it). Each batch row's programs read the
weight again (from L2), so batches above ``FUSED_DT_MAX_BATCH`` run the projection as a matmul
first, with the same rounding.

Speed: the kernel is bound by the state it reads and writes once. Two things keep it there
at large batches (benchmarks/bench_state_update.py, results in benchmarks/results/state_update/):
small (p-block, n) tiles, so that many programs stream the state (``default_config``), and, where A is one value per head (Mamba-2's stride-0 expansion), one
exponential per channel instead of one per state element.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.scan_common import discretise


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, new_ptr, w_ptr,
    p, n, heads_per_group, r,
    ss_b, ss_h, ss_p, ss_n,
    sx_b, sx_h, sx_p,
    sdt_b, sdt_h, sdt_p,
    sA_h, sA_p, sA_n,
    sB_b, sB_g, sB_n,
    sC_b, sC_g, sC_n,
    sD_h, sD_p,
    sz_b, sz_h, sz_p,
    sbias_h, sbias_p,
    so_b, so_h, so_p,
    sn_b, sn_h, sn_p, sn_n,
    sw_h, sw_p, sw_r,
    DT_PROJ: tl.constexpr, R_PAD: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    A_PER_HEAD: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    grp = head // heads_per_group
    pp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, N_PAD)
    p_mask = pp < p
    tile_mask = p_mask[:, None] & (nn[None, :] < n)
    rr = tl.arange(0, R_PAD)
    if DT_PROJ:  # a weight: loaded before waiting for the kernel that wrote the activations
        w = tl.load(w_ptr + head * sw_h + pp[:, None] * sw_p + rr[None, :] * sw_r,
                    mask=p_mask[:, None] & (rr[None, :] < r), other=0.0)
    start_dependents_then_wait(PDL)  # kernels/pdl.py

    state_ptrs = state_ptr + b64 * ss_b + head * ss_h + pp[:, None] * ss_p + nn[None, :] * ss_n
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b64 * sx_b + head * sx_h + pp * sx_p, mask=p_mask, other=0.0).to(tl.float32)
    if DT_PROJ:  # dt (b, r) is dt_proj's input; its output is rounded to dt's dtype as a GEMV's would be
        low = tl.load(dt_ptr + b64 * sdt_b + rr * sdt_p, mask=rr < r, other=0.0).to(tl.float32)
        dt = tl.sum(w.to(tl.float32) * low[None, :], axis=1).to(dt_ptr.dtype.element_ty).to(tl.float32)
    else:
        dt = tl.load(dt_ptr + b64 * sdt_b + head * sdt_h + pp * sdt_p, mask=p_mask, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_P,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + head * sbias_h + pp * sbias_p, mask=p_mask, other=0.0).to(tl.float32)
    dt = discretise(dt, bias, SOFTPLUS)
    if A_PER_HEAD:  # one decay per channel: exp over (BLOCK_P,), not over the tile
        decay = tl.exp(dt * tl.load(A_ptr + head * sA_h).to(tl.float32))[:, None]
    else:
        A = tl.load(A_ptr + head * sA_h + pp[:, None] * sA_p + nn[None, :] * sA_n, mask=tile_mask,
                    other=0.0).to(tl.float32)
        decay = tl.exp(dt[:, None] * A)
    B = tl.load(B_ptr + b64 * sB_b + grp * sB_g + nn * sB_n, mask=nn < n, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + b64 * sC_b + grp * sC_g + nn * sC_n, mask=nn < n, other=0.0).to(tl.float32)

    new = state * decay + (dt * x)[:, None] * B[None, :]
    out = tl.sum(new * C[None, :], axis=1)
    if HAS_D:
        D = tl.load(D_ptr + head * sD_h + pp * sD_p, mask=p_mask, other=0.0).to(tl.float32)
        out += D * x
    if HAS_Z:
        z = tl.load(z_ptr + b64 * sz_b + head * sz_h + pp * sz_p, mask=p_mask, other=0.0).to(tl.float32)
        out = out * (z * tl.sigmoid(z))
    new_ptrs = new_ptr + b64 * sn_b + head * sn_h + pp[:, None] * sn_p + nn[None, :] * sn_n
    tl.store(new_ptrs, new, mask=tile_mask)
    tl.store(out_ptr + b64 * so_b + head * so_h + pp * so_p, out, mask=p_mask)


def _as_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Mamba-1 tensors as the Mamba-2 layout with h = g heads of p = d // g channels (views)."""
    d = state.shape[1]
    if B.dim() not in (2, 3) or B.shape != C.shape:
        raise ValueError(f"Mamba-1 B and C must both be (b, n) or (b, g, n), got {tuple(B.shape)}, {tuple(C.shape)}")
    g = 1 if B.dim() == 2 else B.shape[1]
    if d % g:
        raise ValueError(f"channels ({d}) must be a multiple of B/C groups ({g})")
    split = lambda t, dim: None if t is None else t.unflatten(dim, (g, d // g))  # noqa: E731
    B3 = B if B.dim() == 3 else B.unsqueeze(1)  # (b, n) -> (b, 1, n)
    C3 = C if C.dim() == 3 else C.unsqueeze(1)
    # (b, d, n) -> (b, g, e, n); (b, d) -> (b, g, e); (d, n) -> (g, e, n); (d,) -> (g, e)
    return (split(state, 1), split(x, 1), split(dt, 1), split(A, 0), B3, C3, split(D, 0),
            split(z, 1), split(dt_bias, 0))


def default_config(p: int, n: int, batch: int, state_dtype: torch.dtype = torch.float32) -> dict:
    """Channels per program (``BLOCK_P``) and warps for a batch of heads of ``p`` channels, ``n`` states.

    From a sweep on an H200 with float32 states, as decode programs hold them by default
    (benchmarks/results/state_update/: Mamba-1 n = 16, Mamba-2 n = 128, Zamba2 n = 64, batch
    1, 16, 64, 256), within 7% of the best tiling at every shape and batch there: two warps on a
    (channels x states) tile of 1024 elements (16 per thread) for batches; at batch 1, whose grid
    is small, one warp on 256 elements, so that four times as many programs share the work.
    The earlier choice, 64 channels x all states on 4 warps, took 1.25-1.41x the best time on
    the Mamba-2 layouts from batch 16 in that sweep.
    States of two bytes (``Plan(ssm_state_dtype=torch.bfloat16)``) with 64 or more states a channel
    (the Mamba-2 layouts), from the same sweep with bfloat16 states: for batches one warp on up to
    2048 elements and at most 32 channels, the best tiling for Mamba2-2.7B at batch 16-256 and
    within 14% of it for Zamba2-2.7B (6% from batch 64), where the float32 rule took up to 1.17x
    the best; in the graphed step (benchmarks/results/state_dtype/) it took Mamba2-2.7B's from 6.51
    to 5.97 ms at batch 64. For Mamba-1's 16 states the sweep's best (32 channels, one warp) was
    slower in the graphed step than the float32 rule (Mamba-2.8B at batch 64: 4.14 against 3.90 ms;
    at 256: 8.13 against 6.91): they keep it."""
    if batch > 1 and state_dtype.itemsize == 2 and n >= 64:
        return dict(BLOCK_P=max(1, min(next_power_of_2(p), 32, 2048 // next_power_of_2(n))), num_warps=1)
    elements, warps = (256, 1) if batch == 1 else (1024, 2)
    return dict(BLOCK_P=max(1, min(next_power_of_2(p), elements // next_power_of_2(n))), num_warps=warps)


# Above this batch dt_proj runs as a matmul first (module docstring). On an H200, Mamba-2.8B's
# layer (d 5120, r 160, n 16; benchmarks/results/decode_profile/dt_proj_fold.json), the folded
# kernel against the decode GEMV or cuBLAS then the state update: 2.25 / 3.38 us at batch 1,
# 2.69 / 6.68 at 2, 3.89 / 7.09 at 4, 7.05 / 7.96 at 8 (best tiling), 13.1 / 9.2 at 16.
FUSED_DT_MAX_BATCH = 4


def fused_dt_config(p: int, batch: int) -> dict:
    """Tiling of the folded kernel: from the sweep above, the best at batch 1 (16 channels a
    program) and within 4% of the best at 2 and 4 (32), four warps, whose threads share the
    (channels x rank) weight tile."""
    return dict(BLOCK_P=min(next_power_of_2(p), 16 if batch == 1 else 32), num_warps=4)


def _dt_projection(state, dt, dt_proj_weight):
    """Check Mamba-1's folded ``dt_proj`` inputs: dt (b, r), dt_proj_weight (d, r)."""
    if state.dim() != 3:
        raise ValueError(f"dt_proj_weight is Mamba-1's (state (b, d, n)); got state {tuple(state.shape)}")
    bsz, d = state.shape[:2]
    if dt.dim() != 2 or dt.shape[0] != bsz or tuple(dt_proj_weight.shape) != (d, dt.shape[1]):
        raise ValueError(f"with dt_proj_weight, dt must be (b, r) = ({bsz}, r) and dt_proj_weight (d, r) = "
                         f"({d}, r); got {tuple(dt.shape)} and {tuple(dt_proj_weight.shape)}")


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           dt_proj_weight: Optional[Tensor] = None, *,
                           out_state: Optional[Tensor] = None,
                           config: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """One decode step (layouts of mamba_ssm's ``selective_state_update``).

    Mamba-2: state (b, h, p, n); x, dt, z (b, h, p) (dt may be a stride-0 view of per-head
    values); A (h, p, n) (expanded views welcome); B, C (b, g, n); D, dt_bias (h, p).
    Mamba-1: state (b, d, n); x, dt, z (b, d); A (d, n); B, C (b, n) or (b, g, n); D, dt_bias (d,);
    with ``dt_proj_weight`` (d, r), dt is its input (b, r) and the kernel projects it.
    Returns (out in x's dtype, new state in state's dtype); with ``out_state`` the new state is
    written there (``out_state=state`` updates in place) and returned. ``config`` overrides
    ``default_config`` (``BLOCK_P``, ``num_warps``; benchmarks sweep it).
    """
    if state.dim() not in (3, 4):
        raise ValueError(f"state must be (b, d, n) or (b, h, p, n), got shape {tuple(state.shape)}")
    if out_state is not None and (out_state.shape != state.shape or out_state.dtype != state.dtype
                                  or out_state.device != state.device):
        raise ValueError(
            f"out_state must match state ({tuple(state.shape)}, {state.dtype}, {state.device}), got "
            f"({tuple(out_state.shape)}, {out_state.dtype}, {out_state.device})"
        )
    if dt_proj_weight is not None:
        _dt_projection(state, dt, dt_proj_weight)
        if state.shape[0] > FUSED_DT_MAX_BATCH or dt.dtype != dt_proj_weight.dtype:
            dt, dt_proj_weight = F.linear(dt, dt_proj_weight), None
    fused = dt_proj_weight is not None
    new_state = out_state if out_state is not None else torch.empty_like(state)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if state.dim() == 3:
        # With dt_proj folded in, dt is (b, r): x stands in for it in the channel split.
        state4, x3, dt3, A3, B3, C3, D2, z3, bias2 = _as_heads(state, x, x if fused else dt, A, B, C, D, z, dt_bias)
        new4, out3 = new_state.unflatten(1, (B3.shape[1], -1)), out.unflatten(1, (B3.shape[1], -1))
    else:
        state4, x3, dt3, A3, B3, C3, D2, z3, bias2 = state, x, dt, A, B, C, D, z, dt_bias
        new4, out3 = new_state, out
    bsz, h, p, n = state4.shape
    g = B3.shape[1]
    if h % g:
        raise ValueError(f"heads ({h}) must be a multiple of B/C groups ({g})")
    expected = {"x": (x3, (bsz, h, p)), "dt": (dt3, (bsz, h, p)), "A": (A3, (h, p, n)),
                "B": (B3, (bsz, g, n)), "C": (C3, (bsz, g, n)), "z": (z3, (bsz, h, p))}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape} for state {tuple(state.shape)}, got {tuple(t.shape)}")
    if fused:  # dt read as (b, r) through its (batch, -, feature) strides; the weight as (h, p, r)
        w3, r = dt_proj_weight.unflatten(0, (h, p)), dt.shape[1]
        dt_strides, w_strides = (dt.stride(0), 0, dt.stride(1)), w3.stride()
    else:
        w3, r, dt_strides, w_strides = out3, 1, dt3.stride(), (0, 0, 0)
    # D and dt_bias: per (head, channel), possibly given per head and expanded.
    D2 = torch.broadcast_to(D2, (h, p)) if D2 is not None else None
    bias2 = torch.broadcast_to(bias2, (h, p)) if bias2 is not None else None
    none2, none3 = (0, 0), (0, 0, 0)
    config = config or (fused_dt_config(p, bsz) if fused else default_config(p, n, bsz, state.dtype))
    block_p = config["BLOCK_P"]
    _state_update_kernel[(cdiv(p, block_p), h, bsz)](
        state4, x3, dt if fused else dt3, A3, B3, C3, D2 if D2 is not None else out3,
        z3 if z3 is not None else out3, bias2 if bias2 is not None else out3, out3, new4, w3,
        p, n, h // g, r,
        *state4.stride(), *x3.stride(), *dt_strides, *A3.stride(), *B3.stride(), *C3.stride(),
        *(D2.stride() if D2 is not None else none2), *(z3.stride() if z3 is not None else none3),
        *(bias2.stride() if bias2 is not None else none2), *out3.stride(), *new4.stride(), *w_strides,
        DT_PROJ=fused, R_PAD=next_power_of_2(r),
        HAS_D=D2 is not None, HAS_Z=z3 is not None, HAS_BIAS=bias2 is not None, SOFTPLUS=dt_softplus,
        A_PER_HEAD=all(A3.shape[i] == 1 or A3.stride(i) == 0 for i in (1, 2)),
        BLOCK_P=block_p, N_PAD=next_power_of_2(n), num_warps=config["num_warps"], **launch_options(x.device),
    )
    return out, new_state
