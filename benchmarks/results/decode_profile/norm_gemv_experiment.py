"""An experiment, kept as the evidence for a negative result: RMSNorm fused into the batch-1 GEMV
that reads it, against the two kernels it would replace (kernels/rms_norm.py then kernels/gemv.py).
Measured slower on every shape: see README.md, "A norm fused into the GEMV".

    PYTHONPATH=$PWD python benchmarks/results/decode_profile/norm_gemv_experiment.py   # one GPU; writes $OUT/norm_gemv_sweep.json

The design tried (dimension letters: n output features, the weight rows; k input features, the
normalised channels):

In a batch-1 decode step each RMSNorm (the block's input norm, with the residual add before it,
or Mamba-2's gated norm before ``out_proj``) is a kernel of its own over one row of a few
thousand channels, and its only reader is the next projection's GEMV. On an H200 the norm took
2.8 us of Mamba2-2.7B's step per call, a fifth of the GEMV it feeds, almost all of it a
dependent kernel's fixed cost. Here every program of the GEMV computes the
norm of the (short) row itself: a first pass over the row for its sum of squares, then the GEMV's
loop normalises each chunk of the row as it multiplies it. The row is re-read by every program,
from L2 (one row is at most tens of KB; the weight is tens of MB from HBM).

Semantics, cast for cast those of the two kernels it replaces (``kernels/rms_norm.py`` then
``kernels/gemv.py``):
    summed = round(residual + x)                  (HAS_RESIDUAL: stored once, for the residual stream)
    h      = float32(round(summed, NORM_DTYPE))   (or float32(x)) times silu(float32(gate)) (HAS_GATE)
    xn     = round(norm_weight * round(h * rsqrt(mean(h^2) + eps), NORM_DTYPE), the GEMV's dtype)
    y      = round(sum_k float32(weight) * float32(xn) (+ bias))
The mean runs over all k channels (one group). Only the summation order of mean(h^2) differs from
the unfused norm (chunks of ``BLOCK_K`` here, one block there).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels import gemv as gv, rms_norm as rn
from ssmshard.kernels.launch_math import cdiv
from ssmshard.kernels.rounding import TL_DTYPES as _TL_DTYPES, round_to as _round

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_gemv import graphed_us  # noqa: E402  (benchmarks/bench_gemv.py)


@triton.jit
def _normalised_chunk(x_ptr, res_ptr, gate_ptr, kk, k_mask,
                      HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                      SUMMED_DTYPE: tl.constexpr):
    """(h, summed) for channels ``kk``: h the float32 norm input before scaling (module docstring)."""
    x = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
    summed = x
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + kk, mask=k_mask, other=0.0)
        summed = _round(residual.to(tl.float32) + x.to(tl.float32), SUMMED_DTYPE)
        x = _round(summed.to(tl.float32), NORM_DTYPE)
    h = x.to(tl.float32)
    if HAS_GATE:
        gate = tl.load(gate_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        h = h * (gate * tl.sigmoid(gate))
    return h, summed


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, gate_ptr, nw_ptr, summed_ptr, w_ptr, bias_ptr, y_ptr, N, K, eps,
                      sw_n, sw_k,
                      HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM_DTYPE: tl.constexpr, SUMMED_DTYPE: tl.constexpr, XN_DTYPE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    # Pass 1: the row's sum of squares (program 0 also stores the residual stream's sum).
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        h, summed = _normalised_chunk(x_ptr, res_ptr, gate_ptr, kk, k_mask, HAS_RESIDUAL, HAS_GATE, NORM_DTYPE,
                                      SUMMED_DTYPE)
        squares += h * h
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(summed_ptr + kk, summed, mask=k_mask)
    rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    # Pass 2: the GEMV over the normalised row, a chunk at a time.
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        h, _ = _normalised_chunk(x_ptr, res_ptr, gate_ptr, kk, k_mask, HAS_RESIDUAL, HAS_GATE, NORM_DTYPE,
                                 SUMMED_DTYPE)
        y = _round(h * rstd, NORM_DTYPE)
        norm_weight = tl.load(nw_ptr + kk, mask=k_mask, other=0.0)
        xn = _round(norm_weight.to(tl.float32) * y.to(tl.float32), XN_DTYPE).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xn[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + nn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _norm_gemv_row_kernel(x_ptr, res_ptr, gate_ptr, nw_ptr, summed_ptr, w_ptr, bias_ptr, y_ptr, N, K, eps,
                          sw_n, sw_k,
                          HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          NORM_DTYPE: tl.constexpr, SUMMED_DTYPE: tl.constexpr, XN_DTYPE: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The whole row at once (BLOCK_K >= K): the weight tile's load is issued before the norm."""
    pid = tl.program_id(0)
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    w = tl.load(w_ptr + nn.to(tl.int64)[:, None] * sw_n + kk[None, :] * sw_k, mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)
    h, summed = _normalised_chunk(x_ptr, res_ptr, gate_ptr, kk, k_mask, HAS_RESIDUAL, HAS_GATE, NORM_DTYPE,
                                  SUMMED_DTYPE)
    if HAS_RESIDUAL:
        if pid == 0:
            tl.store(summed_ptr + kk, summed, mask=k_mask)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    y = _round(h * rstd, NORM_DTYPE)
    norm_weight = tl.load(nw_ptr + kk, mask=k_mask, other=0.0)
    xn = _round(norm_weight.to(tl.float32) * y.to(tl.float32), XN_DTYPE).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * xn[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + nn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + nn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def norm_linear(x: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], norm_weight: Tensor, eps: float,
                norm_dtype: torch.dtype, weight: Tensor, bias: Optional[Tensor], config: dict) -> tuple[Optional[Tensor], Tensor]:
    """``(residual + x or None, linear(rms_norm(...), weight, bias))`` for one row (module docstring).

    x, residual, gate: (..., k) holding one row; norm_weight (k,); weight (n, k) of the norm
    output's dtype (``promote(norm_weight, norm_dtype)``)."""
    k = x.shape[-1]
    n = weight.shape[0]
    xn_dtype = torch.promote_types(norm_weight.dtype, norm_dtype)
    summed_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    if x.numel() != k or weight.shape[1] != k or norm_weight.shape != (k,) or weight.dtype != xn_dtype:
        raise ValueError(f"norm_linear: x {tuple(x.shape)} (one row), norm weight {tuple(norm_weight.shape)} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} (the norm's output dtype {xn_dtype}) do not fit")
    for name, t in (("residual", residual), ("gate", gate)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"norm_linear: {name} {tuple(t.shape)} and x {tuple(x.shape)} differ")
    if norm_dtype not in _TL_DTYPES or summed_dtype not in _TL_DTYPES:
        raise ValueError(f"norm_linear: dtypes {norm_dtype} / {summed_dtype} are not among {list(_TL_DTYPES)}")
    rows = x.reshape(k).contiguous()
    summed = torch.empty(k, dtype=summed_dtype, device=x.device) if residual is not None else None
    y = torch.empty(n, dtype=xn_dtype, device=x.device)
    cfg = dict(config)
    block_n = cfg.pop("BLOCK_N")
    kernel = _norm_gemv_kernel
    if cfg.pop("WHOLE_ROW", False):
        kernel, cfg["BLOCK_K"] = _norm_gemv_row_kernel, triton.next_power_of_2(k)
    if n:
        kernel[(cdiv(n, block_n),)](
            rows, residual.reshape(k).contiguous() if residual is not None else rows,
            gate.reshape(k).contiguous() if gate is not None else rows, norm_weight.contiguous(),
            summed if summed is not None else y, weight, bias if bias is not None else weight, y, n, k, float(eps),
            weight.stride(0), weight.stride(1),
            HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, HAS_BIAS=bias is not None,
            NORM_DTYPE=_TL_DTYPES[norm_dtype], SUMMED_DTYPE=_TL_DTYPES[summed_dtype], XN_DTYPE=_TL_DTYPES[xn_dtype],
            BLOCK_N=block_n, **cfg)
    shape = x.shape[:-1]
    return (summed.reshape(x.shape) if summed is not None else None), y.reshape(*shape, n)


def main():
    dev = "cuda"  # the sweep that wrote norm_gemv_sweep.json
    bf = torch.bfloat16
    SHAPES = [  # name, n, k, residual dtype or None, gated
        ("mamba2 in_proj", 10576, 2560, torch.float32, False),
        ("mamba2 out_proj", 2560, 5120, None, True),
        ("mamba in_proj", 10240, 2560, torch.float32, False),
        ("llama qkv", 6144, 4096, bf, False),
        ("llama gate_up", 28672, 4096, bf, False),
        ("mamba2 lm_head", 50288, 2560, torch.float32, False),
    ]
    res = []
    for name, n, k, rdt, gated in SHAPES:
        g = torch.Generator(dev).manual_seed(0)
        copies = max(2, int(4e8 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=bf, generator=g) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, 1, k, device=dev, dtype=bf, generator=g)
        r = torch.randn(1, 1, k, device=dev, dtype=rdt, generator=g) if rdt else None
        z = torch.randn(1, 1, k, device=dev, dtype=bf, generator=g) if gated else None
        nw = (1 + 0.1 * torch.randn(k, device=dev, dtype=bf, generator=g))

        def unfused(x, w):
            if r is not None:
                s, h = rn.add_rms_norm(x, r, nw, 1e-5, bf)
            elif z is not None:
                h = rn.gated_rms_norm(x, z, nw, 1e-5, k)
            else:
                h = rn.rms_norm(x, nw, 1e-5)
            return gv.gemv(h, w)

        def fused(cfg):
            return lambda x, w: norm_linear(x, r, z, nw, 1e-5, bf, w, None, config=cfg)[1]
        ref = unfused(x, ws[0]).float()
        base = graphed_us(unfused, ws, x)
        gemv_only = graphed_us(lambda x, w: gv.gemv(x, w), ws, x)
        row = {"shape": name, "n": n, "k": k, "unfused_us": base, "gemv_only_us": gemv_only, "bytes": n * k * 2, "fused": []}
        cands = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw_, num_stages=1) for bn, bk, nw_ in itertools.product((2, 4, 8), (512, 1024), (2, 4))]
        cands += [dict(BLOCK_N=bn, BLOCK_K=0, WHOLE_ROW=True, num_warps=nw_, num_stages=1) for bn, nw_ in itertools.product((1, 2, 4), (2, 4, 8, 16))]
        for cfg in cands:
            try:
                out = fused(dict(cfg))(x, ws[0]).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = graphed_us(fused(dict(cfg)), ws, x)
            except Exception as e:
                print(name, cfg, "failed", repr(e)[:200]); continue
            row["fused"].append({**cfg, "us": us, "max_rel_diff": err})
        best = min(row["fused"], key=lambda c: c["us"])
        bestrow = min((c for c in row["fused"] if c.get("WHOLE_ROW")), key=lambda c: c["us"], default=None)
        print("   whole-row best", bestrow)
        print(f"{name}: unfused {base:.2f} us (gemv alone {gemv_only:.2f}), fused best {best['us']:.2f} us {best}, "
              f"fused at 4/1024/4: {[c['us'] for c in row['fused'] if c['BLOCK_N']==4 and c['BLOCK_K']==1024 and c['num_warps']==4]}", flush=True)
        res.append(row)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "norm_gemv_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
