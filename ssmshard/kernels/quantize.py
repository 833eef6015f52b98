"""Triton kernels of the block-scaled quantized all-reduce (``ssmshard.comm.quantized``).

Three kernels, one per local step of the two-shot all-reduce; each computes bit for bit what
the torch codec of ``ssmshard.comm.quantized`` computes (the tests check it), so a rank on the
GPU and a rank on the CPU put the same bytes on the wire:

* :func:`quantize`: a value vector (any float dtype; zero past its end) -> one code byte per
  value and one float32 scale per block of ``block`` values;
* :func:`reduce_requantize`: the N ranks' codes and scales of one slice -> their float32 sum
  (in rank order) -> codes and scales of that sum;
* :func:`dequantize`: codes and scales -> values in the output dtype (float32 and bfloat16
  written by the kernel, rounding to nearest even), trimmed to its length.

Codes: ``int8`` is a two's-complement byte of round-half-even(x / s) in [-127, 127] with
s = block max / 127; ``fp8`` is the float8 e4m3fn byte (round to nearest even, as torch's
cast) of x / s with s = block max / 448. Triton's own float8 cast is not used: its rounding
differs between Triton's CPU interpreter and GPUs, so both codes are built from float32 bits
here. Divisions are IEEE (``div_rn``) and launches disable FMA contraction
(``enable_fp_fusion=False``): products and sums round exactly as torch's separate ops do.

Layout: codes are (rows, chunk) uint8 and scales (rows, chunk / block) float32, both given as
row-strided views (they live inside one wire buffer per collective).

Dimension letters: g blocks of one program, b values of one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.interpreter import INTERPRETER_LOCK
from ssmshard.kernels.launch_math import cdiv

QMAX = {"int8": 127.0, "fp8": 448.0}
_VALUES_PER_PROGRAM = 2048  # g * b: enough work per program, few programs at small sizes


@triton.jit
def _round_half_even(m):
    """Round non-negative float32 ``m`` (< 2**23) to the nearest integer, ties to even."""
    whole = tl.floor(m)
    frac = m - whole  # exact
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole)


@triton.jit
def _encode(y, FP8: tl.constexpr):
    """Code bytes of ``y`` (float32, already divided by its block's scale: |y| <= QMAX)."""
    negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 encodes as torch encodes it
    magnitude = tl.abs(y)
    if FP8:
        magnitude = tl.minimum(magnitude, 448.0)
        # e: the binary exponent of the magnitude, at least -6 (below it e4m3 is subnormal with
        # the fixed step 2**-9). One mantissa step is 2**(e-3): count steps, round to even.
        e = tl.maximum((magnitude.to(tl.int32, bitcast=True) >> 23) - 127, -6)
        per_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e), exact scaling
        steps = _round_half_even(magnitude * per_step).to(tl.int32)  # 8..16 (0..8 when subnormal)
        # e4m3 codes are contiguous in magnitude: exponent field e + 7, mantissa steps - 8; 16 steps
        # carry into the next exponent and a subnormal's code is its step count, both by the same sum.
        code = ((e + 7) << 3) + steps - 8
        code = tl.where(negative, code | 0x80, code)
    else:
        steps = tl.minimum(_round_half_even(magnitude), 127.0).to(tl.int32)
        code = tl.where(negative, -steps, steps) & 0xFF
    return code.to(tl.uint8)


@triton.jit
def _decode(code, FP8: tl.constexpr):
    """float32 values of code bytes (exact)."""
    c = code.to(tl.int32)
    if FP8:
        magnitude = c & 0x7F
        field = magnitude >> 3
        steps = (magnitude & 7) + tl.where(field > 0, 8, 0)
        step = ((tl.maximum(field, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2**(max(field, 1) - 10)
        value = steps.to(tl.float32) * step
        return tl.where(c >= 0x80, -value, value)
    else:
        return tl.where(c >= 128, c - 256, c).to(tl.float32)


@triton.jit
def _scaled_codes(values, QMAX: tl.constexpr, FP8: tl.constexpr):
    """(codes, scales) of a (g, b) tile of float32 values: one scale per row (block)."""
    scale = tl.math.div_rn(tl.max(tl.abs(values), axis=1), QMAX)
    divisor = tl.where(scale > 0, scale, 1.0)  # an all-zero block: its values pass as zeros
    return _encode(tl.math.div_rn(values, divisor[:, None]), FP8), scale


@triton.jit
def _quantize_kernel(x_ptr, n, codes_ptr, code_row_stride, scales_ptr, scale_row_stride, blocks, blocks_per_row,
                     QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    block = tl.program_id(0) * GROUP + tl.arange(0, GROUP)  # (g,) blocks of the padded vector
    col = tl.arange(0, BLOCK)
    index = block[:, None] * BLOCK + col[None, :]  # (g, b)
    values = tl.load(x_ptr + index, mask=index < n, other=0.0).to(tl.float32)
    codes, scales = _scaled_codes(values, QMAX, FP8)
    row, within = block // blocks_per_row, block % blocks_per_row
    live = block < blocks
    tl.store(codes_ptr + row[:, None] * code_row_stride + within[:, None] * BLOCK + col[None, :], codes,
             mask=live[:, None])
    tl.store(scales_ptr + row * scale_row_stride + within, scales, mask=live)


@triton.jit
def _reduce_requantize_kernel(codes_ptr, code_row_stride, scales_ptr, scale_row_stride, world, out_codes_ptr,
                              out_scales_ptr, blocks, QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
                              GROUP: tl.constexpr):
    block = tl.program_id(0) * GROUP + tl.arange(0, GROUP)  # (g,) blocks of this rank's slice
    col = tl.arange(0, BLOCK)
    live = block < blocks
    offset = block[:, None] * BLOCK + col[None, :]  # (g, b)
    total = tl.zeros((GROUP, BLOCK), dtype=tl.float32)
    for k in range(world):  # rank order, as the torch codec sums
        codes = tl.load(codes_ptr + k * code_row_stride + offset, mask=live[:, None], other=0)
        scales = tl.load(scales_ptr + k * scale_row_stride + block, mask=live, other=0.0)
        total = total + _decode(codes, FP8) * scales[:, None]
    codes, scales = _scaled_codes(total, QMAX, FP8)
    tl.store(out_codes_ptr + offset, codes, mask=live[:, None])
    tl.store(out_scales_ptr + block, scales, mask=live)


@triton.jit
def _bfloat16_bits(values):
    """int16 bits of float32 ``values`` rounded to bfloat16, to nearest even (as torch casts;
    Triton's interpreter truncates instead)."""
    bits = values.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _dequantize_kernel(codes_ptr, code_row_stride, scales_ptr, scale_row_stride, blocks_per_row, out_ptr, n, blocks,
                       FP8: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    block = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    col = tl.arange(0, BLOCK)
    row, within = block // blocks_per_row, block % blocks_per_row
    live = block < blocks
    codes = tl.load(codes_ptr + row[:, None] * code_row_stride + within[:, None] * BLOCK + col[None, :],
                    mask=live[:, None], other=0)
    scales = tl.load(scales_ptr + row * scale_row_stride + within, mask=live, other=0.0)
    values = _decode(codes, FP8) * scales[:, None]
    index = block[:, None] * BLOCK + col[None, :]
    if BF16_BITS:  # out_ptr: a bfloat16 output viewed as int16
        tl.store(out_ptr + index, _bfloat16_bits(values), mask=index < n)
    else:  # float32
        tl.store(out_ptr + index, values, mask=index < n)


# ----------------------------------------------------------------------------- host side
def _launch(kernel, blocks: int, block: int, *args, **constants):
    group = max(1, _VALUES_PER_PROGRAM // block)
    with INTERPRETER_LOCK:  # interpreted launches from simulated ranks' threads must not overlap
        kernel[(max(1, cdiv(blocks, group)),)](*args, BLOCK=block, GROUP=group, enable_fp_fusion=False, **constants)


def _check_views(codes: Tensor, scales: Tensor, block: int):
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32 or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("codes must be uint8 and scales float32 views with contiguous rows")
    if codes.shape[-1] != scales.shape[-1] * block:
        raise ValueError(f"{codes.shape[-1]} codes per row do not make {scales.shape[-1]} blocks of {block}")


def quantize(flat: Tensor, codes: Tensor, scales: Tensor, fmt: str, block: int) -> None:
    """Write into ``codes`` (rows, chunk) and ``scales`` (rows, chunk / block) the codes of
    ``flat`` (1-D, contiguous) padded with zeros to rows * chunk values."""
    _check_views(codes, scales, block)
    blocks = scales.numel()
    _launch(_quantize_kernel, blocks, block, flat, flat.numel(), codes, codes.stride(0), scales, scales.stride(0),
            blocks, scales.shape[-1], QMAX=QMAX[fmt], FP8=fmt == "fp8")


def reduce_requantize(codes: Tensor, scales: Tensor, out_codes: Tensor, out_scales: Tensor, fmt: str,
                      block: int) -> None:
    """Sum the N rows of ``codes``/``scales`` (one slice from every rank) in float32 and write
    the codes and scales of the sum into ``out_codes`` (chunk,) and ``out_scales`` (chunk / block,)."""
    _check_views(codes, scales, block)
    blocks = scales.shape[-1]
    _launch(_reduce_requantize_kernel, blocks, block, codes, codes.stride(0), scales, scales.stride(0),
            codes.shape[0], out_codes, out_scales, blocks, QMAX=QMAX[fmt], FP8=fmt == "fp8")


def dequantize(codes: Tensor, scales: Tensor, out: Tensor, fmt: str, block: int) -> None:
    """Write the values of ``codes``/``scales`` (rows, ...) into ``out`` (1-D, contiguous, any
    float dtype), the first ``out.numel()`` values in row order. float32 and bfloat16 outputs are
    written by the kernel; others through a float32 buffer and torch's cast."""
    _check_views(codes, scales, block)
    blocks = scales.numel()
    target = out if out.dtype == torch.float32 else out.view(torch.int16) if out.dtype == torch.bfloat16 else \
        torch.empty(out.shape, dtype=torch.float32, device=out.device)
    _launch(_dequantize_kernel, blocks, block, codes, codes.stride(0), scales, scales.stride(0), scales.shape[-1],
            target, out.numel(), blocks, FP8=fmt == "fp8", BF16_BITS=out.dtype == torch.bfloat16)
    if out.dtype not in (torch.float32, torch.bfloat16):
        out.copy_(target)
