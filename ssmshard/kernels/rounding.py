"""Casts from float32 inside Triton kernels that round as torch does.

Kernels that must reproduce an eager op chain bit for bit (the norms, the rotary embedding) keep
each intermediate in float32 and round it to the dtype torch would have stored it in, at the
same places torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype of the floating types the kernels take.
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` to ``DTYPE``, rounding to nearest even as torch does. To bfloat16 the rounding
    is done on the bits first: Triton's interpreter truncates that cast, and the explicit rounding
    makes the truncation exact (on GPUs, where the cast rounds, it changes nothing)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16  # shifts keep it uint32
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
