"""Attention of a decode step: one query position per row against the whole key/value cache, in
one Triton launch that reads each cached key and value once.

Semantics: ``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=...)`` for a
query of one position (no dropout, not causal):

    out[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, kv(h), s] + mask[b, h, s]) * v[b, kv(h), s]

with ``kv(h) = h // g``. Scores, softmax and sums are float32; the softmax weights are rounded to
the values' dtype for the product with the values, as flash attention and cuDNN do. An additive
mask is added; a boolean one keeps the positions where it is True (PyTorch's two conventions). A
row whose positions are all masked out gives zeros, as PyTorch's SDPA does.

Why a kernel of its own: PyTorch picks cuDNN for a bf16 decode step with a mask, and at a head dim
cuDNN pads (Zamba2's 160, padded to 256) its call took 157.7 us where the bytes of the batch-64
cache take 25.3 us at the H200's copy bandwidth (benchmarks/results/decode_profile/). Each
program holds one key/value head's group of query heads (zero rows pad it to the 16 a
tensor-core product takes), streams that head's keys and values in blocks of positions and keeps
the running softmax (maximum, sum, weighted values) in float32 registers.

When batch x key/value heads gives fewer programs than the GPU has multiprocessors, the positions
are also split across programs (flash-decoding): each writes its partial maximum, sum and
weighted values, and a second small launch combines them.

Dimension letters: b batch, h query heads, k key/value heads, g query heads per key/value head
(h = k * g), s cache positions, p head dim, n splits of the positions.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2, sm_count
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.rounding import TL_DTYPES, round_to
from ssmshard.kernels.ssd_triton_common import dot_modes, mma

# Launch shape: positions one program reads per step of its loop, warps, software-pipeline
# stages, and whether to launch with programmatic dependent launch where kernels/pdl.py allows it.
# ``SSMSHARD_DECODE_ATTENTION="block_s=32,num_warps=4,num_stages=1,pdl=0"`` overrides them (read at
# each call, so at graph capture for a graphed step; for benchmarks).
LAUNCH = {"block_s": 64, "num_warps": 4, "num_stages": 2, "pdl": 1}
ENV = "SSMSHARD_DECODE_ATTENTION"
MIN_DOT_ROWS = 16  # tensor-core products (tl.dot) take 16 rows at least
# Positions one split covers at least: below it a split's partial results cost more than the
# parallelism gains.
MIN_SPLIT_POSITIONS = 128


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, partial_ptr, stats_ptr,
                   S, KV, scale, positions_per_split, splits,
                   q_sb, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, m_sb, m_sh, m_ss, o_sb, o_sh,
                   G: tl.constexpr, P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_S: tl.constexpr, MASK: tl.constexpr, SPLIT: tl.constexpr, DTYPE: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """One (batch row, key/value head, split): the running softmax over the split's positions.
    ``MASK``: 0 none, 1 additive, 2 boolean. Without ``SPLIT`` the normalised output is stored; with
    it the float32 partial (maximum and sum in ``stats``, weighted values in ``partial``)."""
    start_dependents_then_wait(PDL)  # kernels/pdl.py: q and the cache come from kernels before
    row = tl.program_id(0)
    split = tl.program_id(1)
    batch = (row // KV).to(tl.int64)
    kv = (row % KV).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    p = tl.arange(0, BLOCK_P)
    head = kv * G + g
    live_g, live_p = g < G, p < P
    # Tensor-core products need 16 query rows at least: a group of fewer heads is padded with
    # zero rows (masked loads, never stored); the products cost nothing next to the cache's bytes.
    q = tl.load(q_ptr + batch * q_sb + head[:, None] * q_sh + p[None, :],
                mask=live_g[:, None] & live_p[None, :], other=0.0)
    start = split * positions_per_split
    end = tl.minimum(start + positions_per_split, S)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_P], tl.float32)
    k_base = k_ptr + batch * k_sb + kv * k_sh
    v_base = v_ptr + batch * v_sb + kv * v_sh
    for first in range(start, end, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        live_s = s < end
        tile = live_s[:, None] & live_p[None, :]
        keys = tl.load(k_base + s[:, None] * k_ss + p[None, :], mask=tile, other=0.0)
        scores = mma(q, tl.trans(keys), tl.zeros([BLOCK_G, BLOCK_S], tl.float32), DOT_PRECISION, UPCAST) * scale
        if MASK != 0:
            at = mask_ptr + batch * m_sb + head[:, None] * m_sh + s[None, :] * m_ss
            live = live_g[:, None] & live_s[None, :]
            if MASK == 1:
                scores += tl.load(at, mask=live, other=0.0).to(tl.float32)
            else:
                scores = tl.where(tl.load(at, mask=live, other=0) != 0, scores, float("-inf"))
        scores = tl.where(live_s[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing unmasked yet
        alpha = tl.exp(m_i - m_safe)
        weights = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(weights, axis=1)
        values = tl.load(v_base + s[:, None] * v_ss + p[None, :], mask=tile, other=0.0)
        # The weights in the values' dtype for the product, as flash attention and cuDNN do.
        acc = mma(weights.to(values.dtype), values, acc * alpha[:, None], DOT_PRECISION, UPCAST)
        m_i = m_new
    if SPLIT:
        at = (row * splits + split) * BLOCK_G + g
        tl.store(stats_ptr + 2 * at, m_i)
        tl.store(stats_ptr + 2 * at + 1, l_i)
        tl.store(partial_ptr + at[:, None] * BLOCK_P + p[None, :], acc)
    else:
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + batch * o_sb + head[:, None] * o_sh + p[None, :], round_to(out, DTYPE),
                 mask=live_g[:, None] & live_p[None, :])


@triton.jit
def _combine_kernel(partial_ptr, stats_ptr, out_ptr, KV, splits, o_sb, o_sh,
                    G: tl.constexpr, P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr):
    """One (batch row, key/value head): the splits' partial softmaxes rescaled to their common maximum."""
    start_dependents_then_wait(PDL)
    row = tl.program_id(0)
    batch = (row // KV).to(tl.int64)
    kv = (row % KV).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    p = tl.arange(0, BLOCK_P)
    at = (row * splits + n[:, None]) * BLOCK_G + g[None, :]  # (n, g)
    live_n = (n < splits)[:, None]
    m = tl.load(stats_ptr + 2 * at, mask=live_n, other=float("-inf"))
    l = tl.load(stats_ptr + 2 * at + 1, mask=live_n, other=0.0)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    scale = tl.exp(m - m_safe[None, :])  # (n, g); 0 for a split with nothing unmasked
    total = tl.sum(scale * l, axis=0)
    partial = tl.load(partial_ptr + at[:, :, None] * BLOCK_P + p[None, None, :], mask=live_n[:, :, None], other=0.0)
    acc = tl.sum(scale[:, :, None] * partial, axis=0)  # (g, p)
    out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    head = kv * G + g
    tl.store(out_ptr + batch * o_sb + head[:, None] * o_sh + p[None, :], round_to(out, DTYPE),
             mask=(g < G)[:, None] & (p < P)[None, :])


def _check(q: Tensor, k: Tensor, v: Tensor, attn_mask, enable_gqa: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"decode_attention: q must be (b, h, 1, p) and k, v (b, k, s, p), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (more query positions: use "
                         f"scaled_dot_product_attention)")
    b, h, _, p = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != p:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (b, k, s, p) "
                         f"for q {tuple(q.shape)}")
    if h % k.shape[1] or (h != k.shape[1] and not enable_gqa):
        raise ValueError(f"decode_attention: {h} query heads over {k.shape[1]} key/value heads needs "
                         f"enable_gqa=True and a whole number of query heads per key/value head")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in TL_DTYPES:
        raise ValueError(f"decode_attention: q, k and v must share one of {list(TL_DTYPES)}, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: the key and value caches need a unit-stride head dim")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in TL_DTYPES:
            raise ValueError(f"decode_attention: attn_mask must be boolean or float, got {attn_mask.dtype}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, h, 1, k.shape[2]))
        except RuntimeError:
            raise ValueError(f"decode_attention: attn_mask {tuple(attn_mask.shape)} does not broadcast to the "
                             f"scores (b, h, 1, s) = {(b, h, 1, k.shape[2])}") from None


@functools.lru_cache(maxsize=None)
def _launch(setting: str) -> dict:
    launch = dict(LAUNCH)
    for item in filter(None, setting.split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in LAUNCH or not value.strip().isdigit():
            raise ValueError(f"{ENV}={setting!r}: expected comma-separated name=integer with names from {list(LAUNCH)}")
        launch[name.strip()] = int(value)
    return launch


def splits_for(programs: int, positions: int, device: torch.device) -> int:
    """How many programs share one (batch row, key/value head)'s positions: enough to give every
    multiprocessor two programs, each split covering ``MIN_SPLIT_POSITIONS`` at least."""
    if programs >= sm_count(device):
        return 1
    return max(1, min(cdiv(2 * sm_count(device), programs), positions // MIN_SPLIT_POSITIONS))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                     scale: float | None = None, enable_gqa: bool = False, *,
                     splits: int | None = None, block_s: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> Tensor:
    """``scaled_dot_product_attention`` of a one-position query q (b, h, 1, p) over k, v (b, k, s, p)
    (module docstring). Returns (b, h, 1, p) in q's dtype. ``splits``, ``block_s``, ``num_warps``
    and ``num_stages`` override the launch shape (for benchmarks; ``splits_for`` and ``LAUNCH``
    choose it otherwise)."""
    _check(q, k, v, attn_mask, enable_gqa)
    b, h, _, p = q.shape
    kv, s = k.shape[1], k.shape[2]
    group = h // kv
    scale = p ** -0.5 if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(b, h, 1, p, device=q.device, dtype=q.dtype)
    block_g, block_p = max(MIN_DOT_ROWS, next_power_of_2(group)), max(16, next_power_of_2(p))
    launch = _launch(os.environ.get(ENV, ""))
    block_s, num_warps, num_stages = (block_s or launch["block_s"], num_warps or launch["num_warps"],
                                      num_stages or launch["num_stages"])
    programs = b * kv
    splits = splits or splits_for(programs, s, q.device)
    per_split = cdiv(max(s, 1), splits)
    splits = cdiv(max(s, 1), per_split)
    mask_kind, mask, mask_strides = 0, q, (0, 0, 0)
    if attn_mask is not None:
        mask = attn_mask.expand(b, h, 1, s)
        mask_kind = 2 if attn_mask.dtype == torch.bool else 1
        mask_strides = (mask.stride(0), mask.stride(1), mask.stride(3))
    partial = stats = out
    if splits > 1:
        partial = torch.empty(programs * splits * block_g, block_p, device=q.device, dtype=torch.float32)
        stats = torch.empty(programs * splits * block_g, 2, device=q.device, dtype=torch.float32)
    dtype, pdl = TL_DTYPES[q.dtype], launch_options(q.device) if launch["pdl"] else {"PDL": False}
    _attend_kernel[(programs, splits)](
        q, k, v, mask, out, partial, stats, s, kv, float(scale), per_split, splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *mask_strides, out.stride(0), out.stride(1),
        G=group, P=p, BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_S=block_s, MASK=mask_kind, SPLIT=splits > 1,
        DTYPE=dtype, **dot_modes(q.dtype), num_warps=num_warps, num_stages=num_stages, **pdl)
    if splits > 1:
        _combine_kernel[(programs,)](partial, stats, out, kv, splits, out.stride(0), out.stride(1),
                                     G=group, P=p, BLOCK_G=block_g, BLOCK_P=block_p,
                                     BLOCK_N=next_power_of_2(splits), DTYPE=dtype, num_warps=num_warps, **pdl)
    return out
