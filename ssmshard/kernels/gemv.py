"""Skinny matmul for decode: ``y = x @ weight.T (+ bias)`` with few rows, at the weight-read speed.

Dimension letters: m rows of x (the decode batch, at most ``MAX_ROWS``), n output features
(weight rows), k input features.

A decode step reads each projection's weight once for a handful of rows: the work is the bytes
of the weight. cuBLAS serves these shapes with split-K kernels followed by a reduce kernel, and
on an H200 its batch-1 GEMVs of the Mamba-2.8B projections stream their weights at 0.6-3.5 TB/s of the
4.1 TB/s a copy reaches (benchmarks/results/decode_profile/). Here one program owns ``BLOCK_N``
whole output features and walks all of k: no partial sums leave a program, so there is no
second kernel, and enough programs run at once to keep the memory system busy.

One row (batch 1) reduces ``weight tile * x`` along k in registers; 2 to 16 rows use ``tl.dot``
with the rows padded to 16 (the tensor cores' smallest tile; the padding costs no bytes).
Accumulation is float32; the output has x's dtype. On Hopper and later each program loads its
first weight tile before waiting for the kernel that wrote x (programmatic dependent launch,
``kernels/pdl.py``), so the weight stream starts while that kernel finishes. ``decode_linear``, the kernel of the
``ssmshard.decode_linear`` op, uses it for one row only (its docstring says why);
benchmarks/bench_gemv.py measures both paths. ``grouped_gemv`` runs one row against up to
``MAX_GROUP`` weights of the same k (q/k/v, gate/up) in one launch, each program computing
output features of one of them: the kernel of ``ssmshard.decode_linear_group``.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait

MAX_ROWS = 16  # more rows than this are a matmul, which cuBLAS does well


@triton.jit
def _accumulate(acc, w, x_ptr, mm, m_mask, kk, k_mask, sx_m, sx_k, USE_DOT: tl.constexpr):
    """``acc`` plus one k-chunk's products: ``w`` (BLOCK_N, BLOCK_K) times x's chunk ``kk``."""
    if USE_DOT:
        x = tl.load(x_ptr + mm[:, None] * sx_m + kk[None, :] * sx_k, mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if x.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        x = tl.load(x_ptr + kk * sx_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _gemv_block(x_ptr, w_ptr, bias_ptr, y_ptr, pid, M, N, K,
                sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output features ``pid * BLOCK_N ...`` of ``x @ w.T (+ bias)``: one program's work."""
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    mm = tl.arange(0, BLOCK_M)
    m_mask = mm < M
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * sw_n
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # The first weight tile is loaded before waiting for the kernel that wrote x (kernels/pdl.py).
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    start_dependents_then_wait(PDL)
    acc = _accumulate(acc, w, x_ptr, mm, m_mask, kk, k_mask, sx_m, sx_k, USE_DOT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _accumulate(acc, w, x_ptr, mm, m_mask, kk, k_mask, sx_m, sx_k, USE_DOT)
    if USE_DOT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + mm[:, None] * sy_m + nn[None, :] * sy_n
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + nn * sy_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
                 sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                 HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gemv_block(x_ptr, w_ptr, bias_ptr, y_ptr, tl.program_id(0), M, N, K, sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                HAS_BIAS, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _row_block(x_ptr, w_ptr, y_ptr, pid, N, K, sx_k, sw_n, sw_k,
               PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program of a one-row product without bias, y contiguous."""
    _gemv_block(x_ptr, w_ptr, w_ptr, y_ptr, pid, 1, N, K, 0, sx_k, sw_n, sw_k, 0, 1,
                False, False, PDL, 1, BLOCK_N, BLOCK_K)


@triton.jit
def _grouped_row_kernel(x_ptr, w0, w1, w2, w3, y0, y1, y2, y3, n0, n1, n2, n3, end0, end1, end2, K, sx_k,
                        sw0_n, sw0_k, sw1_n, sw1_k, sw2_n, sw2_k, sw3_n, sw3_k,
                        GROUP: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row times up to four weights of the same k: programs ``[end(i-1), end(i))`` compute
    weight i's output features, so one launch serves them all."""
    pid = tl.program_id(0)
    if pid < end0:
        _row_block(x_ptr, w0, y0, pid, n0, K, sx_k, sw0_n, sw0_k, PDL, BLOCK_N, BLOCK_K)
    elif pid < end1:
        _row_block(x_ptr, w1, y1, pid - end0, n1, K, sx_k, sw1_n, sw1_k, PDL, BLOCK_N, BLOCK_K)
    else:
        if GROUP > 2:
            if pid < end2:
                _row_block(x_ptr, w2, y2, pid - end1, n2, K, sx_k, sw2_n, sw2_k, PDL, BLOCK_N, BLOCK_K)
            else:
                if GROUP > 3:
                    _row_block(x_ptr, w3, y3, pid - end2, n3, K, sx_k, sw3_n, sw3_k, PDL, BLOCK_N, BLOCK_K)


def default_config(rows: int, n: int, k: int) -> dict:
    """Block sizes and warps for ``rows`` x ``k`` times a (``n``, ``k``) weight.

    From a sweep over the projections of Mamba-2.8B, Mamba2-2.7B and Llama-3-8B on an H200
    (benchmarks/results/gemv/): within 10% of each shape's best configuration there. A short k
    (Mamba's dt_proj) takes all of it in one step; few output features (x_proj, Llama's k/v) want
    one feature per program so that enough programs run; otherwise two features per program
    stream long rows of k."""
    if rows == 1:
        if k <= 512:
            return dict(BLOCK_N=8, BLOCK_K=next_power_of_2(k), num_warps=4, num_stages=1)
        if n <= 1024:
            return dict(BLOCK_N=1, BLOCK_K=2048, num_warps=8, num_stages=1)
        return dict(BLOCK_N=2, BLOCK_K=2048 if k >= 4096 else 1024, num_warps=2, num_stages=1)
    if k <= 512:
        return dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    if n <= 1024:
        return dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3)
    if n >= 12288:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_N=32, BLOCK_K=512 if k >= 4096 else 128, num_warps=4, num_stages=4)


def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, config: Optional[dict] = None) -> Tensor:
    """``x @ weight.T + bias`` for x (..., k) with at most ``MAX_ROWS`` rows in all; weight (n, k)."""
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.numel() // k if k else 0
    if weight.shape[1] != k or rows > MAX_ROWS or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}: "
                         f"needs the same dtype, x's last dim = weight's second and at most {MAX_ROWS} rows")
    x2 = x.reshape(rows, k)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or default_config(rows, n, k))
    use_dot = rows > 1
    block_n = cfg.pop("BLOCK_N")
    _gemv_kernel[(cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, rows, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, USE_DOT=use_dot, BLOCK_M=16 if use_dot else 1, BLOCK_N=block_n, **cfg,
        **launch_options(x.device))
    return y.reshape(*x.shape[:-1], n)


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` for a decode step: the kernel for one row (batch-1 decode, x and weight of one
    dtype), cuBLAS for anything else.

    Why one row only: on an H200 the kernel beat cuBLAS on every batch-1 projection measured,
    alone and in Llama-3-8B's graphed decode (TPOT 6.37 -> 5.75 ms). With 16 rows it beat cuBLAS
    alone on most shapes, and Llama-3-8B's batch-16 decode gained (6.87 -> 6.40 ms), but
    Mamba-2.8B's batch-16 decode lost (2.27 -> 3.43 ms), for a reason not isolated
    (benchmarks/results/gemv/)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows != 1 or x.dtype != weight.dtype or weight.dim() != 2 or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias)


MAX_GROUP = 4  # weights one grouped launch serves


def grouped_gemv(x: Tensor, weights: list[Tensor], config: Optional[dict] = None) -> list[Tensor]:
    """``[x @ w.T for w in weights]`` for one row x (..., k) and 2 to ``MAX_GROUP`` weights (n_i, k)
    of x's dtype, in one kernel launch: each program computes ``BLOCK_N`` output features of one
    weight. The tiling is ``default_config``'s for the summed output features."""
    k = x.shape[-1]
    if (x.numel() != k or not 2 <= len(weights) <= MAX_GROUP
            or any(w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype for w in weights)):
        raise ValueError(f"grouped_gemv: one row x {tuple(x.shape)} {x.dtype} and 2 to {MAX_GROUP} weights "
                         f"(n, {k}) of its dtype; got {[(tuple(w.shape), w.dtype) for w in weights]}")
    x2 = x.reshape(1, k)
    outs = [torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    cfg = dict(config or default_config(1, sum(w.shape[0] for w in weights), k))
    block_n = cfg.pop("BLOCK_N")
    ends = list(itertools.accumulate(cdiv(w.shape[0], block_n) for w in weights))
    padding = MAX_GROUP - len(weights)
    ws, ys = weights + [weights[0]] * padding, outs + [outs[0]] * padding
    ns = [w.shape[0] for w in weights] + [0] * padding
    ends_arg = (ends + [ends[-1]] * padding)[:MAX_GROUP - 1]
    if ends[-1]:
        _grouped_row_kernel[(ends[-1],)](
            x2, *ws, *ys, *ns, *ends_arg, k, x2.stride(1), *(st for w in ws for st in w.stride()),
            GROUP=len(weights), BLOCK_N=block_n, **cfg, **launch_options(x.device))
    return outs


def decode_linear_group(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """``[F.linear(x, w) for w in weights]`` for a decode step (the ``group_decode_linears`` pass):
    one launch of ``grouped_gemv`` for one row of the weights' dtype, ``decode_linear``'s
    per-weight path otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows != 1 or not 2 <= len(weights) <= MAX_GROUP
            or any(w.dim() != 2 or w.dtype != x.dtype or w.shape[1] != x.shape[-1] for w in weights)):
        return [decode_linear(x, w) for w in weights]
    return grouped_gemv(x, weights)
