"""Skinny matmul for decode: ``y = x @ weight.T (+ bias)`` with few rows, at the weight-read speed.

Dimension letters: m rows of x (the decode batch, at most ``MAX_ROWS``), n output features
(weight rows), k input features.

A decode step reads each projection's weight once for a handful of rows: the work is the bytes
of the weight. cuBLAS serves these shapes with split-K kernels followed by a reduce kernel, and
on an H200 its batch-1 GEMVs of the Mamba-2.8B projections stream their weights at 0.6-3.5 TB/s of the
4.1 TB/s a copy reaches (benchmarks/results/decode_profile/). Here one program owns ``BLOCK_N``
whole output features and walks all of k: no partial sums leave a program, so there is no
second kernel, and enough programs run at once to keep the memory system busy.

One row (batch 1) reduces ``weight tile * x`` along k in registers; 2 to 64 rows use ``tl.dot``
with the rows padded to 16 or the next power of two (the tensor cores' smallest tile; the
padding costs no weight bytes). Narrow weights (few output features, or a long k) split k over
``SPLIT_K`` programs per block of features, the last of them to finish adding the partials
(``_split_k_kernel``): still one kernel. Accumulation is float32; the output has x's dtype. On
Hopper and later each program loads its first weight tile before waiting for the kernel that
wrote x (programmatic dependent launch, ``kernels/pdl.py``), so the weight stream starts while
that kernel finishes. ``decode_linear``, the kernel of the ``ssmshard.decode_linear`` op, uses
it where it was measured faster than cuBLAS (``prefers_cublas``); benchmarks/bench_gemv.py
measures both. ``grouped_gemv`` runs the rows against up to ``MAX_GROUP`` weights of the same k
(q/k/v, gate/up) in one launch, each program computing output features of one of them: the
kernel of ``ssmshard.decode_linear_group``.
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait

MAX_ROWS = 64  # more rows than this are a matmul, which cuBLAS does well


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
def _partial_product(x_ptr, w_ptr, pid, M, N, k_lo, k_hi, sx_m, sx_k, sw_n, sw_k,
                     USE_DOT: tl.constexpr, PDL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output features ``pid * BLOCK_N ...`` of ``x[:, k_lo:k_hi] @ w[:, k_lo:k_hi].T`` in float32:
    (BLOCK_M, BLOCK_N) with the dot, (BLOCK_N,) for one row. ``k_lo`` is a multiple of BLOCK_K."""
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
    kk = k_lo + tl.arange(0, BLOCK_K)
    k_mask = kk < k_hi
    w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    start_dependents_then_wait(PDL)
    acc = _accumulate(acc, w, x_ptr, mm, m_mask, kk, k_mask, sx_m, sx_k, USE_DOT)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_hi
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _accumulate(acc, w, x_ptr, mm, m_mask, kk, k_mask, sx_m, sx_k, USE_DOT)
    return acc


@triton.jit
def _store_product(acc, bias_ptr, y_ptr, pid, M, N, sy_m, sy_n,
                   HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc`` (+ bias) into y's rows, cast to y's dtype."""
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    if USE_DOT:
        mm = tl.arange(0, BLOCK_M)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + mm[:, None] * sy_m + nn[None, :] * sy_n
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(mm < M)[:, None] & n_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + nn * sy_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_block(x_ptr, w_ptr, bias_ptr, y_ptr, pid, M, N, K,
                sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output features ``pid * BLOCK_N ...`` of ``x @ w.T (+ bias)``: one program's work."""
    acc = _partial_product(x_ptr, w_ptr, pid, M, N, 0, K, sx_m, sx_k, sw_n, sw_k, USE_DOT, PDL,
                           BLOCK_M, BLOCK_N, BLOCK_K)
    _store_product(acc, bias_ptr, y_ptr, pid, M, N, sy_m, sy_n, HAS_BIAS, USE_DOT, BLOCK_M, BLOCK_N)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
                 sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                 HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gemv_block(x_ptr, w_ptr, bias_ptr, y_ptr, tl.program_id(0), M, N, K, sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                HAS_BIAS, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                    sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Several rows, k split over SPLIT_K programs per block of output features (grid: feature
    blocks x SPLIT_K), so that narrow weights (few output features, long k) still start enough
    programs to stream them. Each program writes its float32 partial to ``part``; the last of a
    block's programs to arrive (a counter per block, ``count``) adds the partials in split order,
    stores y and resets the counter to 0 for the next launch. No second kernel, and the sum is
    the same whichever program arrives last."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    acc = _partial_product(x_ptr, w_ptr, pid, M, N, k_lo, tl.minimum(K, k_lo + k_per_split),
                           sx_m, sx_k, sw_n, sw_k, True, PDL, BLOCK_M, BLOCK_N, BLOCK_K)
    tile = BLOCK_M * BLOCK_N
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    block_parts = part_ptr + pid.to(tl.int64) * SPLIT_K * tile + offsets
    tl.store(block_parts + pid_k * tile, acc)
    # Every thread's partial is written before one thread announces it (a release at GPU scope);
    # the last arrival's acquire makes all partials visible, read past L1 (.cg).
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(block_parts + s * tile, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0)
        _store_product(total, bias_ptr, y_ptr, pid, M, N, sy_m, sy_n, HAS_BIAS, True, BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_kernel(x_ptr, w0, w1, w2, w3, y0, y1, y2, y3, n0, n1, n2, n3, end0, end1, end2, M, K, sx_m, sx_k,
                    sw0_n, sw0_k, sw1_n, sw1_k, sw2_n, sw2_k, sw3_n, sw3_k,
                    GROUP: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows of x times up to four weights of the same k: programs ``[end(i-1), end(i))`` compute
    weight i's output features, so one launch serves them all. Output i is contiguous (rows, n_i)."""
    pid = tl.program_id(0)
    if pid < end0:
        _gemv_block(x_ptr, w0, w0, y0, pid, M, n0, K, sx_m, sx_k, sw0_n, sw0_k, n0, 1,
                    False, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)
    elif pid < end1:
        _gemv_block(x_ptr, w1, w1, y1, pid - end0, M, n1, K, sx_m, sx_k, sw1_n, sw1_k, n1, 1,
                    False, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        if GROUP > 2:
            if pid < end2:
                _gemv_block(x_ptr, w2, w2, y2, pid - end1, M, n2, K, sx_m, sx_k, sw2_n, sw2_k, n2, 1,
                            False, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                if GROUP > 3:
                    _gemv_block(x_ptr, w3, w3, y3, pid - end2, M, n3, K, sx_m, sx_k, sw3_n, sw3_k, n3, 1,
                                False, USE_DOT, PDL, BLOCK_M, BLOCK_N, BLOCK_K)


def default_config(rows: int, n: int, k: int) -> dict:
    """Block sizes, warps and split-k for ``rows`` x ``k`` times a (``n``, ``k``) weight.

    From sweeps over the projections of Mamba-2.8B, Mamba2-2.7B and Llama-3-8B on an H200
    (benchmarks/results/gemv/). One row: a short k (Mamba's dt_proj) takes all of it in one
    step; few output features (x_proj, Llama's k/v) want one feature per program so that enough
    programs run; otherwise two features per program stream long rows of k. Several rows
    (``tl.dot``): few output features or a long k over fewer than ~8192 features split k over
    4-8 programs per block (x_proj at 16 rows: 7.51 us with cuBLAS, 4.25 split 8 ways)."""
    if rows == 1:
        if k <= 512:
            return dict(BLOCK_N=8, BLOCK_K=next_power_of_2(k), num_warps=4, num_stages=1)
        if n <= 1024:
            return dict(BLOCK_N=1, BLOCK_K=2048, num_warps=8, num_stages=1)
        return dict(BLOCK_N=2, BLOCK_K=2048 if k >= 4096 else 1024, num_warps=2, num_stages=1)
    if k <= 512:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if n <= 1024:
        if rows > 16:
            return dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=8 if n <= 256 else 4)
        return dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, SPLIT_K=8)
    if rows > 16:
        return dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    if n < 8192 and k >= 4096:
        return dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, SPLIT_K=4)
    return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def prefers_cublas(rows: int, n: int, k: int) -> bool:
    """Whether cuBLAS was faster than the kernel's ``default_config`` for this shape on an H200
    (benchmarks/results/gemv/, each call alone in a CUDA graph): above 16 rows everywhere but few
    output features or a short k (cuBLAS's tensor-core tiles then win: Mamba-2.8B in_proj at 64
    rows 17.6 us against 19.3); at 2-16 rows on 8192-16384 features of a short k (Mamba's
    in_proj: 16.2 against 17.1 us at 16 rows; gate_proj, with k 4096, stays on the kernel)."""
    if rows == 1:
        return False
    if rows > 16:
        return not (n <= 1024 or k <= 512)
    return 8192 <= n <= 16384 and k < 4096


# One counter per block of output features for the split-k kernel, per (device, stream): every
# launch leaves its counters at 0, so launches on one stream can share them. Allocated once and
# kept (a CUDA graph captured with a launch holds their address). Graphs captured on one stream
# share that stream's counters: they must not be replayed at the same time on two streams.
_SPLIT_COUNTERS: dict = {}
MAX_SPLIT_BLOCKS = 1 << 16


def _split_counters(device: torch.device) -> Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _SPLIT_COUNTERS:
        _SPLIT_COUNTERS[key] = torch.zeros(MAX_SPLIT_BLOCKS, dtype=torch.int32, device=device)
    return _SPLIT_COUNTERS[key]


def block_m(rows: int) -> int:
    """Rows of the kernel's tile: 1 for one row, else the tensor cores' 16 or the next power of two."""
    return 1 if rows == 1 else max(16, next_power_of_2(rows))


def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, config: Optional[dict] = None) -> Tensor:
    """``x @ weight.T + bias`` for x (..., k) with at most ``MAX_ROWS`` rows in all; weight (n, k).
    ``config``: BLOCK_N, BLOCK_K, num_warps, num_stages and, for more than one row, SPLIT_K
    (programs sharing one block's k; default 1)."""
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
    block_n = cfg.pop("BLOCK_N")
    split_k = cfg.pop("SPLIT_K", 1)
    blocks = cdiv(n, block_n)
    args = (x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1))
    bias_arg = bias if bias is not None else weight
    if split_k > 1 and rows > 1 and blocks <= MAX_SPLIT_BLOCKS:
        k_per_split = cdiv(cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        split_k = cdiv(k, k_per_split)
        bm = block_m(rows)
        part = torch.empty(blocks * split_k * bm * block_n, dtype=torch.float32, device=x.device)
        _split_k_kernel[(blocks, split_k)](
            x2, weight, bias_arg, y, part, _split_counters(x.device), rows, n, k, k_per_split, *args,
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=bm, BLOCK_N=block_n, **cfg,
            **launch_options(x.device))
    else:
        _gemv_kernel[(blocks,)](
            x2, weight, bias_arg, y, rows, n, k, *args,
            HAS_BIAS=bias is not None, USE_DOT=rows > 1, BLOCK_M=block_m(rows), BLOCK_N=block_n, **cfg,
            **launch_options(x.device))
    return y.reshape(*x.shape[:-1], n)


ROWS_ENV = "SSMSHARD_GEMV_ROWS"


def kernel_max_rows() -> int:
    """The most rows ``decode_linear`` gives the kernel: ``MAX_ROWS``, or ``SSMSHARD_GEMV_ROWS``
    (1: batch 1 only, as before the multi-row sweep; 0: cuBLAS always). Read at each call, so a
    CUDA graph keeps what was chosen when it was captured."""
    value = os.environ.get(ROWS_ENV, "")
    if not value:
        return MAX_ROWS
    if not value.isdigit():
        raise ValueError(f"{ROWS_ENV}={value!r}: expected a row count (0 to {MAX_ROWS}; 1 = batch 1 only)")
    return min(MAX_ROWS, int(value))


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` for a decode step: the kernel for up to ``kernel_max_rows()`` rows (the decode
    batch) of the weight's dtype where it was measured faster than cuBLAS (``prefers_cublas``),
    cuBLAS for anything else."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 1 <= rows <= kernel_max_rows() or x.dtype != weight.dtype or weight.dim() != 2
            or (bias is not None and bias.dtype != x.dtype) or prefers_cublas(rows, weight.shape[0], k)):
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias)


MAX_GROUP = 4  # weights one grouped launch serves
GROUP_ROWS_ENV = "SSMSHARD_GROUP_ROWS"
# Grouped launches above one row only from GROUPED_MIN_ROWS rows and where the group's output
# features sum to at most MAX_GROUPED_FEATURES: an attention block's q/k/v (Llama-3-8B: 6144),
# not an MLP's gate/up (28672), whose large weights cuBLAS streams near the copy bandwidth one by
# one. In a Llama-3-8B-sized graphed step on an H200 the grouped q/k/v took the step from 6.36 to
# 6.07 ms at 64 rows; with an earlier tiling it was slower at 4 and 16 rows (5.87 against 5.59 ms,
# 5.88 against 5.69), where the per-weight path splits k, although faster alone: not explained,
# so those rows stay per weight (benchmarks/results/gemv/, "Grouped launches of several rows").
GROUPED_MIN_ROWS = 17
MAX_GROUPED_FEATURES = 8192


def group_max_rows() -> int:
    """The most rows ``decode_linear_group`` runs as one grouped launch: ``kernel_max_rows()``,
    or fewer with ``SSMSHARD_GROUP_ROWS`` (1: batch 1 only, as before grouped launches took
    several rows). Read at each call, like ``kernel_max_rows``."""
    value = os.environ.get(GROUP_ROWS_ENV, "")
    if value and not value.isdigit():
        raise ValueError(f"{GROUP_ROWS_ENV}={value!r}: expected a row count (0 to {MAX_ROWS}; 1 = batch 1 only)")
    return min(kernel_max_rows(), int(value)) if value else kernel_max_rows()


def grouped_config(rows: int, n: int, k: int) -> dict:
    """Tiling of a grouped launch of ``rows`` rows against weights of ``n`` output features in all:
    ``default_config``'s for one row; for several, blocks of 64 features and no split k (the
    group's blocks together give the launch its programs). From a sweep of Llama-3-8B's q/k/v
    on an H200 (benchmarks/results/gemv/grouped_rows.json): at 64 rows 17.9 us with these tiles
    against 27.1 us for the three weights one by one."""
    if rows == 1:
        return default_config(1, n, k)
    return dict(BLOCK_N=64, BLOCK_K=128 if rows > 16 else 256, num_warps=4, num_stages=4)


def grouped_gemv(x: Tensor, weights: list[Tensor], config: Optional[dict] = None) -> list[Tensor]:
    """``[x @ w.T for w in weights]`` for x (..., k) of at most ``MAX_ROWS`` rows and 2 to
    ``MAX_GROUP`` weights (n_i, k) of x's dtype, in one kernel launch: each program computes
    ``BLOCK_N`` output features of one weight (``grouped_config`` unless ``config`` is given)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 1 <= rows <= MAX_ROWS or not 2 <= len(weights) <= MAX_GROUP
            or any(w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype for w in weights)):
        raise ValueError(f"grouped_gemv: 1 to {MAX_ROWS} rows x {tuple(x.shape)} {x.dtype} and 2 to {MAX_GROUP} "
                         f"weights (n, {k}) of its dtype; got {[(tuple(w.shape), w.dtype) for w in weights]}")
    x2 = x.reshape(rows, k)
    outs = [torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    cfg = dict(config or grouped_config(rows, sum(w.shape[0] for w in weights), k))
    block_n = cfg.pop("BLOCK_N")
    ends = list(itertools.accumulate(cdiv(w.shape[0], block_n) for w in weights))
    padding = MAX_GROUP - len(weights)
    ws, ys = weights + [weights[0]] * padding, outs + [outs[0]] * padding
    ns = [w.shape[0] for w in weights] + [0] * padding
    ends_arg = (ends + [ends[-1]] * padding)[:MAX_GROUP - 1]
    if ends[-1]:
        _grouped_kernel[(ends[-1],)](
            x2, *ws, *ys, *ns, *ends_arg, rows, k, x2.stride(0), x2.stride(1),
            *(st for w in ws for st in w.stride()),
            GROUP=len(weights), USE_DOT=rows > 1, BLOCK_M=block_m(rows), BLOCK_N=block_n, **cfg,
            **launch_options(x.device))
    return outs


def decode_linear_group(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """``[F.linear(x, w) for w in weights]`` for a decode step (the ``group_decode_linears`` pass):
    one launch of ``grouped_gemv`` for one row, and for ``GROUPED_MIN_ROWS`` to ``group_max_rows()``
    rows where the weights' output features sum to at most ``MAX_GROUPED_FEATURES``;
    ``decode_linear``'s per-weight path otherwise."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    several = rows > 1
    if (not 1 <= rows <= group_max_rows() or not 2 <= len(weights) <= MAX_GROUP
            or any(w.dim() != 2 or w.dtype != x.dtype or w.shape[1] != k for w in weights)
            or (several and (rows < GROUPED_MIN_ROWS or sum(w.shape[0] for w in weights) > MAX_GROUPED_FEATURES))):
        return [decode_linear(x, w) for w in weights]
    return grouped_gemv(x, weights)
