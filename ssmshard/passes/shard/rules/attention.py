"""Attention: heads split across ranks, keys/values shared by the query heads that read them."""

from __future__ import annotations

import torch

from ....placement import REPLICATE, Segment, Shard
from ..context import hint, shape
from . import rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention.default)
def sdpa(cx, node):
    q, k, v = node.args[:3]
    pq, pk, pv = (cx.placement(t) for t in (q, k, v))
    if not (isinstance(pq, Shard) and pq.dim == 1):
        cx.fail(node, "queries must be split by heads")
    heads = pq.segments[0]
    if pk != pv:
        cx.fail(node, "keys and values placed differently")
    kv = pk.segments[0] if isinstance(pk, Shard) else Segment(hint(shape(k)[1]), 1, cx.tp)
    # Query head i reads key/value head i // (heads / kv_heads): this rank's query heads must
    # read exactly the key/value heads it holds.
    group = heads.size // kv.size
    first_kv = heads.offset(cx.rank) // group
    if kv.offset(cx.rank) != first_kv or heads.local // group not in (kv.local, 0) and kv.local != 1:
        cx.fail(node, f"key/value heads {pk} do not serve query heads {pq} on rank {cx.rank}")
    if not node.kwargs.get("enable_gqa") and heads.local != kv.local:
        node.kwargs = {**node.kwargs, "enable_gqa": True}
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node) and cx.placement(mask) != REPLICATE:
        cx.fail(node, f"attention mask placed {cx.placement(mask)}")
    return pq
