"""A gated MLP's activation and product, ``act(a) * b``, as one Triton kernel launch.

Semantics: ``F.silu(a) * b`` or ``F.gelu(a, approximate=...) * b`` with torch's CUDA formulas:
the activation in float32 from a's values (``a / (1 + exp(-a))``, ``a * 0.5 * (1 + erf(a *
sqrt(1/2)))``, its tanh form), rounded to the dtype where torch stores it, then the product in
float32, rounded again (``kernels/rounding.py``). On GPUs ``exp``, ``erf`` and ``tanh`` are
libdevice's; torch's kernels give other last bits in places (an H200: SiLU in float32, GELU in
float32 and bfloat16, tests/test_fuse_gated_activation.py), so the values are within one rounding
step of torch's, not equal. Under Triton's CPU interpreter, which has no libdevice, ``tl.exp``,
``tl.erf`` and a tanh built from ``tl.exp``. A decode step computes this
on a few rows of a few thousand features, so what the kernel saves is a launch (Llama's SiLU and
product, Zamba2's GELU and product: two a layer as captured).

Dimension letters: r rows (every dimension but the last, collapsed), n features. a and b may be
views with a row stride (the two halves of one tensor, as ``chunk`` gives them); the output is
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from ssmshard.kernels.interpreter import INTERPRET
from ssmshard.kernels.launch_math import cdiv
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.rounding import TL_DTYPES, round_to

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
BLOCK_N = 1024
SQRT_HALF = tl.constexpr(0.7071067811865476)
GELU_TANH_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_TANH_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _erf(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.erf(x)
    return tl.erf(x)


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.tanh(x)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _gated_kernel(a_ptr, b_ptr, out_ptr, N, sa, sb, so,
                  ACT: tl.constexpr, DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    start_dependents_then_wait(PDL)  # kernels/pdl.py: a and b come from the kernels before
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    a = tl.load(a_ptr + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = a / (1.0 + _exp(-a, LIBDEVICE))
    elif ACT == 1:
        act = a * 0.5 * (1.0 + _erf(a * SQRT_HALF, LIBDEVICE))
    else:
        cube = a * a * a
        inner = GELU_TANH_BETA * (a + GELU_TANH_KAPPA * cube)
        act = 0.5 * a * (1.0 + _tanh(inner, LIBDEVICE))
    out = round_to(act, DTYPE).to(tl.float32) * b
    tl.store(out_ptr + row * so + cols, round_to(out, DTYPE), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """x as (r, n) with a unit feature stride: a view where the leading dims collapse, else a copy."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def gated_activation(a: Tensor, b: Tensor, activation: str) -> Tensor:
    """``act(a) * b`` for ``activation`` in ``ACTIVATIONS`` (``"gelu"``: the exact GELU,
    ``"gelu_tanh"``: ``approximate="tanh"``), a and b of one shape and dtype, in one launch."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_activation: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in TL_DTYPES:
        raise ValueError(f"gated_activation: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must share "
                         f"one shape and one of {list(TL_DTYPES)}")
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel() == 0:
        return out
    a2, b2, out2 = _rows(a), _rows(b), out.view(-1, a.shape[-1]) if a.dim() else out.view(1, 1)
    n = a2.shape[-1]
    _gated_kernel[(a2.shape[0], cdiv(n, BLOCK_N))](
        a2, b2, out2, n, a2.stride(0), b2.stride(0), out2.stride(0),
        ACT=ACTIVATIONS[activation], DTYPE=TL_DTYPES[a.dtype], LIBDEVICE=not INTERPRET, BLOCK=BLOCK_N,
        num_warps=4, **launch_options(a.device))
    return out
