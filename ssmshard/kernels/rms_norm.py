"""RMSNorm as one Triton kernel: the plain norm, the residual add fused before it, and Mamba-2's
gated norm.

Semantics: those of ``ssmshard.kernels.reference`` (``rms_norm``, ``add_rms_norm``,
``gated_rms_norm``), which are Hugging Face's modules' arithmetic, cast for cast:
    summed = (residual + x)                       in the promoted dtype (add_rms_norm only)
    h      = float32(summed.to(norm_dtype))       (or float32(x)), times silu(float32(gate))
    y      = (h * rsqrt(mean(h^2) + eps)).to(the norm input's dtype)
    out    = weight * y                           in the promoted dtype of weight and y
The mean runs over groups of ``group_size`` channels (all channels but for the gated norm).

One program per (row, group): a row is one token (batch * sequence flattened), a group at most
``MAX_WIDTH`` channels held in registers at once. Inputs whose rows are evenly spaced with
contiguous channels (slices of a wider tensor) are read in place; outputs are contiguous.
Decode reads a few rows of a few thousand channels: the kernel replaces the 6-8 small kernels
(and the separate residual add) torch launches per norm.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.rounding import TL_DTYPES, round_to

MAX_WIDTH = 8192  # channels per group held in registers by one program


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, gate_ptr, weight_ptr, summed_ptr, out_ptr,
    eps, d, group_size, x_row_stride, residual_row_stride, gate_row_stride,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, NORM_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependents_then_wait(PDL)  # kernels/pdl.py: x and the residual come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    mask = lane < group_size
    cols = tl.program_id(1) * group_size + lane
    offs = row * d + cols  # the outputs are contiguous
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # torch adds in float32 and rounds once to the promoted dtype
        summed = round_to(residual.to(tl.float32) + x.to(tl.float32), summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + offs, summed, mask=mask)
        x = round_to(summed.to(tl.float32), NORM_DTYPE)
    h = x.to(tl.float32)
    if HAS_GATE:
        gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = h * (gate * tl.sigmoid(gate))
    variance = tl.sum(h * h, axis=0) / group_size
    y = round_to(h * tl.math.rsqrt(variance + eps), NORM_DTYPE)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + offs, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _as_rows(t: Tensor, d: int) -> Tensor:
    """``t`` (..., d) as (rows, d) with unit channel stride: a view when its rows are evenly spaced
    (a channel slice of a packed projection's output, like Mamba-2's gate), so the kernel reads
    them in place instead of after a copy; otherwise a contiguous copy."""
    if t.stride(-1) == 1:
        try:
            return t.view(-1, d)
        except RuntimeError:  # rows not evenly spaced
            pass
    return t.contiguous().view(-1, d)


def _launch(x: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], weight: Tensor, eps: float,
            group_size: int, norm_dtype: torch.dtype, summed_dtype: Optional[torch.dtype]):
    d = x.shape[-1]
    if group_size > MAX_WIDTH or d % group_size:
        raise ValueError(f"rms_norm kernel: group of {group_size} channels over rows of {d}: groups must divide "
                         f"the row and hold at most {MAX_WIDTH} channels (use the reference op)")
    if norm_dtype not in TL_DTYPES:
        raise ValueError(f"rms_norm kernel: norm input dtype {norm_dtype} is not one of {list(TL_DTYPES)}")
    if weight.shape != (d,):
        raise ValueError(f"rms_norm kernel: weight of shape {tuple(weight.shape)} for rows of {d} channels")
    rows = x.numel() // d if d else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    summed = None if summed_dtype is None else torch.empty(x.shape, dtype=summed_dtype, device=x.device)
    if rows and d:
        block = next_power_of_2(group_size)
        x_rows = _as_rows(x, d)
        residual_rows = x_rows if residual is None else _as_rows(residual, d)
        gate_rows = x_rows if gate is None else _as_rows(gate, d)
        _rms_norm_kernel[(rows, d // group_size)](
            x_rows, residual_rows, gate_rows, weight.contiguous(), summed if summed is not None else out, out,
            float(eps), d, group_size, x_rows.stride(0), residual_rows.stride(0), gate_rows.stride(0),
            HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, NORM_DTYPE=TL_DTYPES[norm_dtype],
            BLOCK=block, num_warps=_num_warps(block), **launch_options(x.device),
        )
    return summed, out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``ssmshard.rms_norm`` on the kernel. x: (..., d), d <= MAX_WIDTH; weight: (d,)."""
    return _launch(x, None, None, weight, eps, x.shape[-1], x.dtype, None)[1]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 norm_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``ssmshard.add_rms_norm`` on the kernel: (residual + x, its norm), one pass over the row."""
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm kernel: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    return _launch(x, residual, None, weight, eps, x.shape[-1], norm_dtype,
                   torch.promote_types(x.dtype, residual.dtype))


def gated_rms_norm(x: Tensor, gate: Optional[Tensor], weight: Tensor, eps: float, group_size: int) -> Tensor:
    """``ssmshard.gated_rms_norm`` on the kernel: the norm of x * silu(gate) per group of channels."""
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm kernel: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    return _launch(x, None, gate, weight, eps, int(group_size), x.dtype, None)[1]
