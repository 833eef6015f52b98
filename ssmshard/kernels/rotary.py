"""The rotary position embedding of queries and keys as one Triton kernel launch.

Semantics: ``ssmshard.kernels.reference.rotary``, which is Hugging Face's ``apply_rotary_pos_emb``
op for op. Per tensor x (b, h, l, p) and its cos, sin (broadcast to x), with the two halves of
the head dim written lo = x[..., :p/2] and hi = x[..., p/2:]:

    out[..., :p/2] = round(round(lo * cos_lo) + round(-hi * sin_lo))
    out[..., p/2:] = round(round(hi * cos_hi) + round(lo * sin_hi))

where ``round`` is the cast to x's dtype torch makes after each op (``kernels/rounding.py``). The
product of two bfloat16 or float16 values is exact in float32, so each rounded product is
torch's bit for bit; float32 products are not fused into the sum (``enable_fp_fusion=False``).

Dimension letters: b batch, h heads, l positions, p head dim; a row is one (b, h, l).

One launch serves up to two tensors (a layer's queries and keys, which share cos and sin):
the grid covers the first tensor's blocks of rows, then the second's. A decode step rotates a
few rows of a few dozen heads, so what the kernel saves is launches: the captured chain is
five kernels per tensor (two products, the negation, the concatenation, the sum).
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.rounding import TL_DTYPES, round_to

MAX_TENSORS = 2  # tensors one launch rotates
BLOCK_ROWS = 16  # rows per program


@triton.jit
def _rotate_block(x_ptr, out_ptr, cos_ptr, sin_ptr, block, rows, H, L,
                  x_sb, x_sh, x_sl, o_sb, o_sh, o_sl, c_sb, c_sh, c_sl, s_sb, s_sh, s_sl,
                  HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``block * BLOCK_R`` onwards of one tensor; every head dim has unit stride."""
    row = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pos = row % L
    head = (row // L) % H
    batch = row // (L * H)
    col = tl.arange(0, BLOCK_HALF)
    mask = (row < rows)[:, None] & (col < HALF)[None, :]
    x_at = (batch * x_sb + head * x_sh + pos * x_sl)[:, None] + col[None, :]
    c_at = (batch * c_sb + head * c_sh + pos * c_sl)[:, None] + col[None, :]
    s_at = (batch * s_sb + head * s_sh + pos * s_sl)[:, None] + col[None, :]
    o_at = (batch * o_sb + head * o_sh + pos * o_sl)[:, None] + col[None, :]
    lo = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    cos_lo = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + s_at, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + s_at + HALF, mask=mask, other=0.0).to(tl.float32)
    out_lo = round_to(lo * cos_lo, DTYPE).to(tl.float32) + round_to(-hi * sin_lo, DTYPE).to(tl.float32)
    out_hi = round_to(hi * cos_hi, DTYPE).to(tl.float32) + round_to(lo * sin_hi, DTYPE).to(tl.float32)
    tl.store(out_ptr + o_at, round_to(out_lo, DTYPE), mask=mask)
    tl.store(out_ptr + o_at + HALF, round_to(out_hi, DTYPE), mask=mask)


@triton.jit
def _rotary_kernel(
    cos_ptr, sin_ptr,
    x0_ptr, out0_ptr, rows0, H0, L0, x0_sb, x0_sh, x0_sl, o0_sb, o0_sh, o0_sl,
    c0_sb, c0_sh, c0_sl, s0_sb, s0_sh, s0_sl,
    x1_ptr, out1_ptr, rows1, H1, L1, x1_sb, x1_sh, x1_sl, o1_sb, o1_sh, o1_sl,
    c1_sb, c1_sh, c1_sl, s1_sb, s1_sh, s1_sl,
    blocks0,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependents_then_wait(PDL)  # kernels/pdl.py: x, cos and sin all come from kernels before
    block = tl.program_id(0)
    if block < blocks0:
        _rotate_block(x0_ptr, out0_ptr, cos_ptr, sin_ptr, block, rows0, H0, L0,
                      x0_sb, x0_sh, x0_sl, o0_sb, o0_sh, o0_sl, c0_sb, c0_sh, c0_sl, s0_sb, s0_sh, s0_sl,
                      HALF, BLOCK_R, BLOCK_HALF, DTYPE)
    else:
        _rotate_block(x1_ptr, out1_ptr, cos_ptr, sin_ptr, block - blocks0, rows1, H1, L1,
                      x1_sb, x1_sh, x1_sl, o1_sb, o1_sh, o1_sl, c1_sb, c1_sh, c1_sl, s1_sb, s1_sh, s1_sl,
                      HALF, BLOCK_R, BLOCK_HALF, DTYPE)


def _check(xs: List[Tensor], cos: Tensor, sin: Tensor) -> None:
    if not 1 <= len(xs) <= MAX_TENSORS:
        raise ValueError(f"rotary kernel: 1 to {MAX_TENSORS} tensors a launch, got {len(xs)}")
    dtype = cos.dtype
    for x in xs:
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"rotary kernel: x must be (b, h, l, p) with an even head dim p, got {tuple(x.shape)}")
        if x.dtype != dtype or sin.dtype != dtype or dtype not in TL_DTYPES:
            raise ValueError(f"rotary kernel: x, cos and sin must share one of {list(TL_DTYPES)}, got "
                             f"{x.dtype}, {cos.dtype}, {sin.dtype} (use the reference op)")
        if torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape:
            raise ValueError(f"rotary kernel: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must broadcast "
                             f"to x {tuple(x.shape)}")


def _unit_head_dim(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tensor_args(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor) -> list:
    """One tensor's arguments of ``_rotary_kernel``: pointers, rows, sizes and the (b, h, l) strides
    of x, out and of cos and sin broadcast to x (stride 0 where they broadcast)."""
    b, h, l, _ = x.shape
    cos_b, sin_b = cos.expand(x.shape), sin.expand(x.shape)
    return [x, out, b * h * l, h, l, *x.stride()[:3], *out.stride()[:3], *cos_b.stride()[:3], *sin_b.stride()[:3]]


def rotary(xs: List[Tensor], cos: Tensor, sin: Tensor) -> List[Tensor]:
    """``ssmshard.rotary`` on the kernel: each x (b, h, l, p) rotated by cos and sin (broadcast to
    it), in one launch per two tensors. Outputs have their inputs' layouts."""
    xs = list(xs)
    if len(xs) > MAX_TENSORS:
        return [out for i in range(0, len(xs), MAX_TENSORS) for out in rotary(xs[i:i + MAX_TENSORS], cos, sin)]
    _check(xs, cos, sin)
    cos, sin = _unit_head_dim(cos), _unit_head_dim(sin)
    xs = [_unit_head_dim(x) for x in xs]
    outs = [torch.empty_like(x) for x in xs]
    half = xs[0].shape[-1] // 2
    if any(x.shape[-1] != 2 * half for x in xs):
        return [out for x in xs for out in rotary([x], cos, sin)]
    per_tensor = [_tensor_args(x, out, cos, sin) for x, out in zip(xs, outs)]
    blocks = [cdiv(args[2], BLOCK_ROWS) for args in per_tensor]
    if sum(blocks) == 0:
        return outs
    second = per_tensor[-1]  # with one tensor the grid ends at its blocks: the second slot is never read
    block_half = max(next_power_of_2(half), 1)
    _rotary_kernel[(sum(blocks),)](
        cos, sin, *per_tensor[0], *second, blocks[0],
        HALF=half, BLOCK_R=BLOCK_ROWS, BLOCK_HALF=block_half, DTYPE=TL_DTYPES[cos.dtype],
        num_warps=4, enable_fp_fusion=False, **launch_options(xs[0].device),
    )
    return outs
