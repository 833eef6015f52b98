"""The rotary position embedding of queries and keys as one Triton kernel launch.

Semantics: ``ssmshard.kernels.reference.rotary``, which is Hugging Face's ``apply_rotary_pos_emb``
op for op. Per tensor x (b, h, l, p) and its cos, sin (broadcast to x), with the two halves of
the head dim written lo = x[..., :p/2] and hi = x[..., p/2:]:

    out[..., :p/2] = round(round(lo * cos_lo) + round(-hi * sin_lo))
    out[..., p/2:] = round(round(hi * cos_hi) + round(lo * sin_hi))

where ``round`` is the cast to x's dtype torch makes after each op (``kernels/rounding.py``). The
product of two bfloat16 or float16 values is exact in float32, so each rounded product is
torch's bit for bit; float32 products are not fused into the sum (``enable_fp_fusion=False``).

Dimension letters: b batch, h heads, l positions, p head dim, s cache slots; a row is one (b, h, l).

One launch serves up to two tensors (a layer's queries and keys, which share cos and sin):
the grid covers the first tensor's blocks of rows, then the second's. A decode step rotates a
few rows of a few dozen heads, so what the kernel saves is launches: the captured chain is
five kernels per tensor (two products, the negation, the concatenation, the sum).

``rotary_into_cache`` is the same launch writing the rotated keys, and the values as they are,
into a static key/value cache at the step's slots (``index_copy_`` along the position dim, two
more kernels a layer as captured; the ``fuse_cache_write`` pass): a third range of blocks copies
the values. A cache row is (b, h, s) with s the slot, ``slot[l]`` for the row's position l.
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
def _rows(block, L, H, BLOCK_R: tl.constexpr):
    """Row indices ``block * BLOCK_R`` onwards and their (position, head, batch)."""
    row = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    return row, row % L, (row // L) % H, row // (L * H)


@triton.jit
def _out_position(slot_ptr, pos, live, AT_SLOT: tl.constexpr):
    """Where a row of position ``pos`` is written: ``slot[pos]`` into a cache, else ``pos``."""
    if AT_SLOT:
        out_pos = tl.load(slot_ptr + pos, mask=live, other=0)
    else:
        out_pos = pos
    return out_pos


@triton.jit
def _rotate_block(x_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, block, rows, H, L,
                  x_sb, x_sh, x_sl, o_sb, o_sh, o_sl, c_sb, c_sh, c_sl, s_sb, s_sh, s_sl,
                  HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr,
                  AT_SLOT: tl.constexpr):
    """Rows ``block * BLOCK_R`` onwards of one tensor; every head dim has unit stride."""
    row, pos, head, batch = _rows(block, L, H, BLOCK_R)
    col = tl.arange(0, BLOCK_HALF)
    mask = (row < rows)[:, None] & (col < HALF)[None, :]
    out_pos = _out_position(slot_ptr, pos, row < rows, AT_SLOT)
    x_at = (batch * x_sb + head * x_sh + pos * x_sl)[:, None] + col[None, :]
    c_at = (batch * c_sb + head * c_sh + pos * c_sl)[:, None] + col[None, :]
    s_at = (batch * s_sb + head * s_sh + pos * s_sl)[:, None] + col[None, :]
    o_at = (batch * o_sb + head * o_sh + out_pos * o_sl)[:, None] + col[None, :]
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
def _copy_block(x_ptr, out_ptr, slot_ptr, block, rows, H, L, x_sb, x_sh, x_sl, o_sb, o_sh, o_sl,
                P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rows ``block * BLOCK_R`` onwards of x copied to their slots of the cache ``out``."""
    row, pos, head, batch = _rows(block, L, H, BLOCK_R)
    col = tl.arange(0, BLOCK_P)
    mask = (row < rows)[:, None] & (col < P)[None, :]
    out_pos = _out_position(slot_ptr, pos, row < rows, True)
    values = tl.load(x_ptr + (batch * x_sb + head * x_sh + pos * x_sl)[:, None] + col[None, :], mask=mask)
    tl.store(out_ptr + (batch * o_sb + head * o_sh + out_pos * o_sl)[:, None] + col[None, :], values, mask=mask)


@triton.jit
def _rotary_kernel(
    cos_ptr, sin_ptr, slot_ptr,
    x0_ptr, out0_ptr, rows0, H0, L0, x0_sb, x0_sh, x0_sl, o0_sb, o0_sh, o0_sl,
    c0_sb, c0_sh, c0_sl, s0_sb, s0_sh, s0_sl,
    x1_ptr, out1_ptr, rows1, H1, L1, x1_sb, x1_sh, x1_sl, o1_sb, o1_sh, o1_sl,
    c1_sb, c1_sh, c1_sl, s1_sb, s1_sh, s1_sl,
    v_ptr, v_out_ptr, rows2, H2, L2, v_sb, v_sh, v_sl, vo_sb, vo_sh, vo_sl,
    blocks0, blocks1,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr,
    INTO_CACHE: tl.constexpr, PDL: tl.constexpr,
):
    """Blocks of the first tensor, then of the second (written at the slots when ``INTO_CACHE``),
    then (``INTO_CACHE`` only) of the values copied into their cache."""
    start_dependents_then_wait(PDL)  # kernels/pdl.py: x, cos and sin all come from kernels before
    block = tl.program_id(0)
    if block < blocks0:
        _rotate_block(x0_ptr, out0_ptr, cos_ptr, sin_ptr, slot_ptr, block, rows0, H0, L0,
                      x0_sb, x0_sh, x0_sl, o0_sb, o0_sh, o0_sl, c0_sb, c0_sh, c0_sl, s0_sb, s0_sh, s0_sl,
                      HALF, BLOCK_R, BLOCK_HALF, DTYPE, False)
    elif block < blocks0 + blocks1:
        _rotate_block(x1_ptr, out1_ptr, cos_ptr, sin_ptr, slot_ptr, block - blocks0, rows1, H1, L1,
                      x1_sb, x1_sh, x1_sl, o1_sb, o1_sh, o1_sl, c1_sb, c1_sh, c1_sl, s1_sb, s1_sh, s1_sl,
                      HALF, BLOCK_R, BLOCK_HALF, DTYPE, INTO_CACHE)
    elif INTO_CACHE:
        _copy_block(v_ptr, v_out_ptr, slot_ptr, block - blocks0 - blocks1, rows2, H2, L2,
                    v_sb, v_sh, v_sl, vo_sb, vo_sh, vo_sl, 2 * HALF, BLOCK_R, 2 * BLOCK_HALF)


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
    cos_b, sin_b = cos.expand(x.shape), sin.expand(x.shape)
    return [*_copy_args(x, out), *cos_b.stride()[:3], *sin_b.stride()[:3]]


def _copy_args(x: Tensor, out: Tensor) -> list:
    """Pointers, rows, sizes and (b, h, l) strides of x and out (out's l stride is per slot)."""
    b, h, l, _ = x.shape
    return [x, out, b * h * l, h, l, *x.stride()[:3], *out.stride()[:3]]


_COPY_ARGUMENTS = 11  # len(_copy_args(...))


def _launch(cos, sin, slot, first: list, second: list, values: list, blocks: list, half: int, into_cache: bool):
    _rotary_kernel[(sum(blocks),)](
        cos, sin, slot, *first, *second, *values, blocks[0], blocks[1],
        HALF=half, BLOCK_R=BLOCK_ROWS, BLOCK_HALF=max(next_power_of_2(half), 1), DTYPE=TL_DTYPES[cos.dtype],
        INTO_CACHE=into_cache, num_warps=4, enable_fp_fusion=False, **launch_options(first[0].device),
    )


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
    blocks = [cdiv(args[2], BLOCK_ROWS) for args in per_tensor] + [0] * (3 - len(xs))
    if sum(blocks) == 0:
        return outs
    second = per_tensor[-1]  # one tensor: its arguments again, for a range of no blocks
    slot, values = _unread_cache_arguments(cos, second)
    _launch(cos, sin, slot, per_tensor[0], second, values, blocks, half, into_cache=False)
    return outs


def _unread_cache_arguments(any_tensor: Tensor, tensor_args: list) -> list:
    """The slot pointer and the values' copy arguments of a launch that writes no cache: the grid
    ends before the values' blocks and nothing reads the slot, so any valid pointers and sizes do
    (``any_tensor`` as the slot, a rotated tensor's first copy arguments as the values)."""
    return [any_tensor, tensor_args[:_COPY_ARGUMENTS]]


def rotary_into_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slot: Tensor,
                      key_cache: Tensor, value_cache: Tensor) -> Tensor:
    """q (b, hq, l, p) rotated, returned; k (b, h, l, p) rotated and written to
    ``key_cache[:, :, slot]``, v (b, h, l, p) written to ``value_cache[:, :, slot]`` (caches
    (b, h, s, p), ``slot`` (l,) int64): ``rotary([q, k])`` and the two ``index_copy_(2, slot, ...)``
    in one launch. The slots are not checked against s on the device (a check would read them on
    the host inside a CUDA graph): the static-K/V runtime checks the positions a generation writes
    before it starts (``runtime/static_kv.py``)."""
    _check([q, k], cos, sin)
    for name, cache, x in (("key", key_cache, k), ("value", value_cache, v)):
        if (cache.dim() != 4 or x.dim() != 4 or cache.shape[:2] != x.shape[:2] or cache.shape[3] != k.shape[3]
                or x.shape[3] != k.shape[3] or cache.dtype != k.dtype or x.dtype != k.dtype or cache.stride(-1) != 1):
            raise ValueError(f"rotary_into_cache: the {name} cache {tuple(cache.shape)} ({cache.dtype}) must be "
                             f"(b, h, s, p) with unit-stride p for {name}s {tuple(x.shape)} ({x.dtype}) of keys "
                             f"{tuple(k.shape)} ({k.dtype})")
    if slot.dtype != torch.int64 or slot.shape != (k.shape[2],) or v.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_into_cache: slot must be int64 ({k.shape[2]},) for {k.shape[2]} positions, "
                         f"got {slot.dtype} {tuple(slot.shape)} (values of {v.shape[2]} positions)")
    cos, sin = _unit_head_dim(cos), _unit_head_dim(sin)
    q, k, v = (_unit_head_dim(x) for x in (q, k, v))
    q_out = torch.empty_like(q)
    first, second = _tensor_args(q, q_out, cos, sin), _tensor_args(k, key_cache, cos, sin)
    values = _copy_args(v, value_cache)
    blocks = [cdiv(args[2], BLOCK_ROWS) for args in (first, second, values)]
    if sum(blocks):
        _launch(cos, sin, slot.contiguous(), first, second, values, blocks, k.shape[-1] // 2, into_cache=True)
    return q_out
