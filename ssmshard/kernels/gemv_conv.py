"""Batch-1 projection with the causal conv's decode step in its epilogue: one launch for a Mamba
layer's ``in_proj`` and conv update.

Dimension letters: n output features of the projection (weight rows), k input features, d conv
channels (the projection's features ``lo .. lo + d``), s conv state slots (the last s inputs), w
conv taps.

In a Mamba or Mamba-2 decode step the conv reads a contiguous range of ``in_proj``'s outputs (x
for Mamba, xBC for Mamba-2), and channel c of that depthwise conv needs only feature ``lo + c``,
its w taps and bias and its own row of the conv state. The GEMV kernel (``kernels/gemv.py``)
gives each program whole output features, so the program that computes feature ``lo + c`` can
finish channel c's conv too: no other program's output is needed, and the conv's launch (one of
five or six a layer at batch 1, each costing about a launch's latency, not its bytes) goes.

Semantics are those of the two kernels one after the other: the projection's float32 sum (+ bias)
rounded to y's dtype and stored in full (every feature, the conv's range included); that rounded
value is the conv's new input: the taps summed in float32 in the order ``causal_conv1d_update``'s
kernel sums them, + bias, SiLU if asked, rounded to y's dtype into ``conv_out`` (1, d), and the
state shifted by one slot with the new input (rounded to the state's dtype) in the last. The
state row is read before it is written by the same program, so it is updated in place.

The conv's reads (its taps, bias and state row) are issued right after the PDL wait, before the
projection's loop over k, so that their latency hides behind the weight stream; read after the
loop, they kept each program waiting at its end and the fused launch gained nothing on Mamba-2.8B
(benchmarks/results/decode_profile/README.md).

One row only: at several rows the projection runs on cuBLAS or the tensor-core path of the GEMV
kernel, which ``prefers_cublas`` picks per shape (``passes/fuse_gemv_conv.py`` falls back to the
two launches there).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.gemv import _accumulate, default_config
from ssmshard.kernels.interpreter import INTERPRETER_LOCK
from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait


@triton.jit
def _gemv_conv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, sx_k, sw_n, sw_k,
                      st_ptr, ss_d, ss_s, cw_ptr, scw_d, scw_w, cb_ptr, out_ptr, LO, D, S,
                      HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SILU: tl.constexpr,
                      PDL: tl.constexpr, TAPS: tl.constexpr, SLOTS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    # This program's conv channels (none outside lo .. lo + d: every conv load and store masked off).
    c = nn - LO
    on = n_mask & (c >= 0) & (c < D)
    c64 = c.to(tl.int64)
    row = st_ptr + c64 * ss_d
    taps = cw_ptr + c64 * scw_d
    slot = tl.arange(0, SLOTS)[None, :]
    in_state = on[:, None] & (slot < S)
    # Weights only before the wait (kernels/pdl.py): the first weight tile, the conv's last tap.
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * sw_n
    kk = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
    last_tap = tl.load(taps + (TAPS - 1) * scw_w, mask=on, other=0.0).to(tl.float32)
    start_dependents_then_wait(PDL)
    # The conv's reads issued before the projection's loop, so that their latency hides in it:
    # the taps on the state's last w - 1 inputs, summed in causal_conv1d_update's order, and the
    # state shifted by one slot (read in full before any of it is written).
    conv = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.static_range(TAPS - 1):
        tap = tl.load(taps + i * scw_w, mask=on, other=0.0).to(tl.float32)
        old = tl.load(row + (S - (TAPS - 1) + i) * ss_s, mask=on, other=0.0).to(tl.float32)
        conv += tap * old
    kept = tl.load(row[:, None] + (slot + 1) * ss_s, mask=in_state & (slot + 1 < S), other=0.0)
    if HAS_CONV_BIAS:
        conv_bias = tl.load(cb_ptr + c, mask=on, other=0.0).to(tl.float32)
    # The projection, as the GEMV kernel's one-row path computes it.
    acc = _accumulate(tl.zeros((BLOCK_N,), dtype=tl.float32), w, x_ptr, 0, True, kk, kk < K, 0, sx_k, False)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
        acc = _accumulate(acc, w, x_ptr, 0, True, kk, kk < K, 0, sx_k, False)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + nn, y, mask=n_mask)
    # The new input is y as stored: the last tap, + bias, SiLU if asked.
    new_input = y.to(tl.float32)
    conv += last_tap * new_input
    if HAS_CONV_BIAS:
        conv += conv_bias
    if SILU:
        conv = conv * tl.sigmoid(conv)
    shifted = tl.where(slot + 1 < S, kept, new_input[:, None].to(st_ptr.dtype.element_ty))
    tl.debug_barrier()
    tl.store(row[:, None] + slot * ss_s, shifted, mask=in_state)
    tl.store(out_ptr + c64, conv.to(out_ptr.dtype.element_ty), mask=on)


def gemv_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_state: Tensor, conv_weight: Tensor,
              conv_bias: Optional[Tensor], activation: Optional[str], lo: int,
              config: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """``y = x @ weight.T (+ bias)`` for one row x (..., k), and the conv's decode step on
    ``y[..., lo:lo + d]``: returns ``(y, conv_out)``, conv_out (1, d) in y's dtype, and writes the
    new state into ``conv_state`` (1, d, s). ``conv_weight`` (d, w) with s >= w - 1; ``activation``
    None or ``"silu"``. ``config``: the GEMV's one-row tiling (``gemv.default_config``)."""
    k, n = x.shape[-1], weight.shape[0]
    d, taps = conv_weight.shape if conv_weight.dim() == 2 else (-1, -1)
    if x.numel() != k or weight.dim() != 2 or weight.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"gemv_conv: one row x {tuple(x.shape)} {x.dtype} and a weight (n, {k}) of its dtype; "
                         f"got weight {tuple(weight.shape)} {weight.dtype}")
    if (conv_state.dim() != 3 or conv_state.shape[:2] != (1, d) or conv_state.shape[2] < taps - 1
            or not 0 <= lo <= n - d or (conv_bias is not None and conv_bias.shape != (d,))):
        raise ValueError(f"gemv_conv: conv_weight (d, w) {tuple(conv_weight.shape)}, conv_state (1, d, s >= w - 1) "
                         f"{tuple(conv_state.shape)}, conv_bias (d,) and channels lo={lo} .. lo + d within the "
                         f"{n} output features")
    if activation not in (None, "silu"):
        raise ValueError(f"gemv_conv: activation {activation!r}; expected None or 'silu'")
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    conv_out = torch.empty(1, d, dtype=x.dtype, device=x.device)
    cfg = dict(config or default_config(1, n, k))
    block_n = cfg.pop("BLOCK_N")
    x_row = x.reshape(k)
    with INTERPRETER_LOCK:  # interpreted launches from simulated ranks' threads must not overlap
        _gemv_conv_kernel[(cdiv(n, block_n),)](
            x_row, weight, bias if bias is not None else weight, y, n, k, x_row.stride(0), *weight.stride(),
            conv_state, conv_state.stride(1), conv_state.stride(2), conv_weight, *conv_weight.stride(),
            conv_bias if conv_bias is not None else conv_weight, conv_out, lo, d, conv_state.shape[2],
            HAS_BIAS=bias is not None, HAS_CONV_BIAS=conv_bias is not None, SILU=activation == "silu",
            TAPS=taps, SLOTS=next_power_of_2(conv_state.shape[2]), BLOCK_N=block_n, **cfg,
            **launch_options(x.device))
    return y, conv_out
