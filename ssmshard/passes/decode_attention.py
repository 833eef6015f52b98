"""The ``decode_attention`` pass: a decode step's attention on a kernel that reads its key/value
cache once.

A decode step's ``scaled_dot_product_attention`` has one query position against the whole cache.
PyTorch hands a bf16 call with a mask to cuDNN, which at head dims it pads (Zamba2's 160, padded
to 256) took 157.7 us a call on an H200 for a batch-64 cache its bandwidth reads in 25.3 us
(benchmarks/results/decode_profile/). The pass retargets each such node to
``decode_attention_kernel``, which on CUDA tensors runs ``kernels.decode_attention`` (one program
per key/value head and batch row, streaming the cache; split over positions when the batch is
small) and elsewhere the same ``scaled_dot_product_attention`` call, so CPU programs and graph
verification are unchanged.

Where it applies: decode programs under the Triton kernels, nodes whose query has one position,
without dropout or ``is_causal`` (a one-row causal mask would see only the first key), keys and
values of one head dim and dtype, the dtype one the kernel serves; by default only head dims that
are not a power of two (the ones cuDNN pads), ``every_head_dim`` (``Plan(add_passes=
["decode_attention"])``) on all. The graphed step on an H200 at batch 64 (one query position
against a 128-position prompt, benchmarks/results/attention_decode/): Zamba2-2.7B, head dim 160,
7.24-7.32 ms with the pass against 7.64-7.72 ms without, in three processes on two hosts;
Llama-3-8B, head dim 128, 5.756 against 5.641 ms, so power-of-two head dims stay on PyTorch's
backend unless asked. The kernel sums in another order than cuDNN (blocks of positions, float32),
so the outputs are close, not equal (tests/test_decode_attention.py bounds them against float64).

Runs last (after ``fuse_cache_write``, which recognises the attention reading the cache it
writes). Under ``Plan(compile=True)`` the target is the opaque op ``ssmshard_kernels::decode_attention``,
which Inductor keeps as it is. ``program.decode_attention_report`` counts the retargeted calls and
those left to PyTorch for their head dim. Off: ``Plan(skip_passes=["decode_attention"])``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .manager import register
from .shard.context import calls, sdpa_arguments, value_of
from .swap_kernels import KERNEL_DTYPES, _on_gpu

aten = torch.ops.aten


def decode_attention_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """``scaled_dot_product_attention`` of a one-position query: ``kernels.decode_attention`` on
    CUDA tensors outside grad mode, PyTorch's call elsewhere. The pass hands it only
    ``dropout_p == 0`` and ``is_causal`` False."""
    if _on_gpu(query) and not torch.is_grad_enabled():
        from ..kernels.decode_attention import decode_attention

        return decode_attention(query, key, value, attn_mask, scale, enable_gqa)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@torch.library.custom_op("ssmshard_kernels::decode_attention", mutates_args=())
def decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``decode_attention_kernel`` as an opaque op: the target under ``Plan(compile=True)``. Its
    output is contiguous, as the fake declares (PyTorch's call may return another layout)."""
    return decode_attention_kernel(query, key, value, attn_mask, scale=scale, enable_gqa=enable_gqa).contiguous()


@decode_attention_op.register_fake
def _(query, key, value, attn_mask, scale, enable_gqa):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _served(a: dict) -> bool:
    """What the kernel serves, known from the fake values (module docstring)."""
    q, k, v = (value_of(a[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if a.get("dropout_p", 0.0) != 0.0 or a.get("is_causal", False) or q.dim() != 4 or q.shape[2] != 1:
        return False
    if k.dim() != 4 or v.dim() != 4 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    mask = value_of(a.get("attn_mask"))
    if a.get("attn_mask") is not None and (mask is None or (mask.dtype != torch.bool and mask.dtype not in KERNEL_DTYPES)):
        return False
    return q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@register("decode_attention")
def decode_attention(program, ctx):
    """Retarget each one-position attention of a decode program (module docstring). Options:
    ``compile`` (the opaque op as the target), ``every_head_dim`` (power-of-two head dims too)."""
    retargeted = left = 0
    if program.mode == "decode":
        for node in program.graph.nodes:
            if not calls(node, aten.scaled_dot_product_attention.default):
                continue
            a = sdpa_arguments(node)
            if not _served(a):
                continue
            if _power_of_two(value_of(a["query"]).shape[-1]) and not ctx.options.get("every_head_dim"):
                left += 1
                continue
            inputs = (a["query"], a["key"], a["value"], a.get("attn_mask"))
            options = {"scale": a.get("scale"), "enable_gqa": a.get("enable_gqa", False)}
            if ctx.options.get("compile"):
                node.target, node.args, node.kwargs = decode_attention_op._opoverload, (*inputs, *options.values()), {}
            else:
                node.target, node.args, node.kwargs = decode_attention_kernel, inputs, options
            retargeted += 1
        program.graph.lint()
    program.decode_attention_report = {"attention_calls": retargeted, "left_for_head_dim": left}
    return program
