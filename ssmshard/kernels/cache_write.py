"""A static-K/V decode step's key and value cache writes as one Triton kernel launch.

Semantics: ``key_cache.index_copy_(2, slot, k)`` then ``value_cache.index_copy_(2, slot, v)``,
the same bits. An attention layer without a rotary embedding (Zamba's and Zamba2's shared
attention) writes its new keys and values with those two copies: two launches of a few KiB
each, 2.9 us apiece in a Zamba2-2.7B step on an H200 (benchmarks/results/decode_profile/). With
a rotary embedding the keys' write is fused into the rotation instead (``kernels/rotary.py``,
``rotary_into_cache``).

Dimension letters: b batch, h heads, l new positions, s cache slots, p head dim; a row is one
(b, h, l), written at slot ``slot[l]`` of its (b, h) cache row. The grid covers the keys' blocks
of rows, then the values'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait
from ssmshard.kernels.rotary import BLOCK_ROWS, _copy_block


@triton.jit
def _kv_into_cache_kernel(slot_ptr,
                          k_ptr, key_ptr, k_rows, k_H, k_L, k_sb, k_sh, k_sl, key_sb, key_sh, key_sl,
                          v_ptr, value_ptr, v_rows, v_H, v_L, v_sb, v_sh, v_sl, value_sb, value_sh, value_sl,
                          key_blocks,
                          PK: tl.constexpr, PV: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_PK: tl.constexpr, BLOCK_PV: tl.constexpr, PDL: tl.constexpr):
    start_dependents_then_wait(PDL)  # kernels/pdl.py: k, v and the slot come from kernels before
    block = tl.program_id(0)
    if block < key_blocks:
        _copy_block(k_ptr, key_ptr, slot_ptr, block, k_rows, k_H, k_L, k_sb, k_sh, k_sl, key_sb, key_sh, key_sl,
                    PK, BLOCK_R, BLOCK_PK)
    else:
        _copy_block(v_ptr, value_ptr, slot_ptr, block - key_blocks, v_rows, v_H, v_L, v_sb, v_sh, v_sl,
                    value_sb, value_sh, value_sl, PV, BLOCK_R, BLOCK_PV)


def _check(name: str, x: Tensor, cache: Tensor) -> None:
    if (x.dim() != 4 or cache.dim() != 4 or cache.shape[:2] != x.shape[:2] or cache.shape[3] != x.shape[3]
            or cache.dtype != x.dtype or cache.stride(-1) != 1):
        raise ValueError(f"kv_into_cache: the {name} cache {tuple(cache.shape)} ({cache.dtype}) must be (b, h, s, p) "
                         f"with unit-stride p for {name}s {tuple(x.shape)} ({x.dtype}) of its b, h, p and dtype")


def kv_into_cache(k: Tensor, v: Tensor, slot: Tensor, key_cache: Tensor, value_cache: Tensor) -> None:
    """k (b, h, l, p) written to ``key_cache[:, :, slot]`` and v (b, h, l, pv) to
    ``value_cache[:, :, slot]`` (caches (b, h, s, p), ``slot`` (l,) int64), in place, in one
    launch. The slots are not checked against s on the device (a check would read them on the
    host inside a CUDA graph): the static-K/V runtime checks the positions a generation writes
    before it starts (``runtime/static_kv.py``)."""
    _check("key", k, key_cache)
    _check("value", v, value_cache)
    if slot.dtype != torch.int64 or slot.shape != (k.shape[2],) or v.shape[2] != k.shape[2]:
        raise ValueError(f"kv_into_cache: slot must be int64 ({k.shape[2]},) for {k.shape[2]} positions, "
                         f"got {slot.dtype} {tuple(slot.shape)} (values of {v.shape[2]} positions)")
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    key_blocks, value_blocks = (cdiv(x.shape[0] * x.shape[1] * x.shape[2], BLOCK_ROWS) for x in (k, v))
    if key_blocks + value_blocks == 0:
        return
    per_tensor = [[x, cache, x.shape[0] * x.shape[1] * x.shape[2], x.shape[1], x.shape[2], *x.stride()[:3],
                   *cache.stride()[:3]] for x, cache in ((k, key_cache), (v, value_cache))]
    _kv_into_cache_kernel[(key_blocks + value_blocks,)](
        slot.contiguous(), *per_tensor[0], *per_tensor[1], key_blocks,
        PK=k.shape[3], PV=v.shape[3], BLOCK_R=BLOCK_ROWS, BLOCK_PK=next_power_of_2(k.shape[3]),
        BLOCK_PV=next_power_of_2(v.shape[3]), num_warps=4, **launch_options(k.device))
