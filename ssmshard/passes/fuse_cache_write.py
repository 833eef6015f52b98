"""The ``fuse_cache_write`` pass: a static-K/V decode step's rotary embedding and key/value cache
writes as one kernel launch.

After ``fuse_rotary`` and ``inplace_decode_states`` an attention layer of a static-K/V decode
step runs, per layer::

    q_rot, k_rot = rotary([q, k], cos, sin)          # one launch (kernels/rotary.py)
    key_cache.index_copy_(2, slot, k_rot)            # one launch
    value_cache.index_copy_(2, slot, v)              # one launch
    attention(q_rot, key_cache, value_cache, ...)

The two copies move 128 KiB each at batch 64 of a Llama-3-8B-sized layer and took 2.8 us
apiece on an H200 (benchmarks/results/attention_decode/): launches, not bytes. The pass makes the three one call
of ``rotary_into_cache_kernel``, which on CUDA tensors runs ``kernels.rotary.rotary_into_cache``
(the rotated keys stored straight at their slots, the values copied by a third range of blocks
of the same launch) and elsewhere the reference ops. The values written are the same bits.

Where it applies: a rotary node on the Triton kernel (``swap_kernels``' adapter, not the
reference ``Plan(compile=True)`` leaves to Inductor) rotating two tensors, its second output read
only by an ``index_copy_`` of a 4-D cache along dim 2, and the attention reading that cache also
reading, as its value, an ``index_copy_`` of a cache of the same slot, dtype and head dim (the
head dim contiguous, as the kernel needs). The fused call stands where the later copy stood;
a node reading a cache (or a view of it) between the old and the new write, or the rotated
queries before it, keeps the program as it was. Decode programs under the Triton
kernels, after ``inplace_decode_states`` (which must still see the copies writing into clones).
A layer without a rotary embedding (Zamba's and Zamba2's shared attention) writes its new keys and
values with the two copies alone: they become one call of ``kv_into_cache_kernel``
(``kernels.cache_write.kv_into_cache`` on CUDA tensors, the same copies elsewhere), on the same
conditions (the attention reads both writes, of one slot; nothing reads a cache between them), as
do the writes of a layer whose rotation the rotary kernel cannot take over (values of another
head dim); not under ``Plan(compile=True)``, whose Inductor takes the copies as they are.
``program.cache_write_report`` counts the fused layers (``layers``) and, of them, those whose
writes alone were fused (``writes_only``). ``Plan(skip_passes=["fuse_cache_write"])`` turns it off.
"""

from __future__ import annotations

import operator

import torch

from .manager import register
from .shard.context import aliases, calls, data_readers, node_order, value_of
from .swap_kernels import KERNELS, _on_gpu

aten = torch.ops.aten
ssm = torch.ops.ssmshard


def rotary_into_cache_kernel(q, k, v, cos, sin, slot, key_cache, value_cache):
    """q rotated; k rotated into ``key_cache[:, :, slot]``, v into ``value_cache[:, :, slot]``:
    ``(q_rot, key_cache, value_cache)``. One Triton launch on CUDA tensors, the reference ops elsewhere."""
    if _on_gpu(q) and not torch.is_grad_enabled():
        from ..kernels.rotary import rotary_into_cache

        return rotary_into_cache(q, k, v, cos, sin, slot, key_cache, value_cache), key_cache, value_cache
    q_rot, k_rot = ssm.rotary([q, k], cos, sin)
    key_cache.index_copy_(2, slot, k_rot)
    value_cache.index_copy_(2, slot, v)
    return q_rot, key_cache, value_cache


def kv_into_cache_kernel(k, v, slot, key_cache, value_cache):
    """k into ``key_cache[:, :, slot]``, v into ``value_cache[:, :, slot]``: ``(key_cache,
    value_cache)``. One Triton launch on CUDA tensors, the two ``index_copy_`` elsewhere."""
    if _on_gpu(k) and not torch.is_grad_enabled():
        from ..kernels.cache_write import kv_into_cache

        kv_into_cache(k, v, slot, key_cache, value_cache)
        return key_cache, value_cache
    key_cache.index_copy_(2, slot, k)
    value_cache.index_copy_(2, slot, v)
    return key_cache, value_cache


def _outputs(node) -> dict:
    """{index: getitem node} of a node returning a list."""
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def _cache_write(node):
    """``(cache, slot, x)`` when ``node`` is ``cache.index_copy_(2, slot, x)`` of a 4-D cache, else None."""
    if not calls(node, aten.index_copy_.default) or node.kwargs or len(node.args) != 4:
        return None
    cache, dim, slot, x = node.args
    value = value_of(cache)
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or dim not in (2, -2):
        return None
    return cache, slot, x


def _writable(match) -> bool:
    """What ``kernels.rotary.rotary_into_cache`` serves: what ``_writable_plain`` asks, and values
    of the keys' head dim and dtype (the launch copies them with the keys' head dim)."""
    k, v = value_of(match["key"][2]), value_of(match["value"][2])
    return _writable_plain(match) and v.shape[-1] == k.shape[-1] and v.dtype == k.dtype


def _match(rotary):
    """The layer's nodes around ``rotary`` (module docstring), or None."""
    xs = rotary.args[0]
    outs = _outputs(rotary)
    if len(xs) != 2 or rotary.kwargs or set(outs) != {0, 1} or len(outs[1].users) != 1:
        return None
    key_write = next(iter(outs[1].users))
    key = _cache_write(key_write)
    if key is None or key[2] is not outs[1]:
        return None
    for attention in key_write.users:
        if calls(attention, aten.scaled_dot_product_attention.default) and attention.args[1] is key_write:
            value = _cache_write(attention.args[2])
            if value is not None and value[1] is key[1] and value_of(value[0]).dtype == value_of(key[0]).dtype:
                return {"rotary": rotary, "q": outs[0], "k_rot": outs[1], "key_write": key_write,
                        "value_write": attention.args[2], "key": key, "value": value}
    return None


def _match_plain(attention):
    """The two cache writes an attention reads as its keys and values, of one slot, or None."""
    if len(attention.args) < 3:
        return None
    key, value = _cache_write(attention.args[1]), _cache_write(attention.args[2])
    if key is None or value is None or key[1] is not value[1] or attention.args[1] is attention.args[2]:
        return None
    return {"q": None, "key_write": attention.args[1], "value_write": attention.args[2], "key": key, "value": value}


def _writable_plain(match) -> bool:
    """What ``kernels.cache_write.kv_into_cache`` serves: each cache of its tensor's dtype and head
    dim, the head dim contiguous."""
    for cache, _, x in (match["key"], match["value"]):
        cache, x = value_of(cache), value_of(x)
        if not (isinstance(cache, torch.Tensor) and isinstance(x, torch.Tensor) and x.dim() == 4
                and cache.shape[-1] == x.shape[-1] and cache.dtype == x.dtype and cache.stride(-1) == 1):
            return False
    return True


def _safe(match, order) -> bool:
    """Whether moving both writes (and the rotation) to the later write's place changes nothing
    any other node reads."""
    writes = (match["key_write"], match["value_write"])
    at = max(map(order.__getitem__, writes))
    if match["q"] is not None and any(order[u] <= at for u in match["q"].users):
        return False
    for write in writes:  # a reader between a write's old place and the new one would see the old cache
        shared = {*aliases(write.args[0]), *aliases(write)}  # the cache, the write's result, views of either
        readers = [u for a in shared for u in data_readers(a) if u not in shared and u not in writes]
        if any(order[write] < order[u] <= at for u in readers):
            return False
    return True


def _fuse(graph, match, order) -> None:
    key_cache, slot, _ = match["key"]
    value_cache, _, v = match["value"]
    q, k = match["rotary"].args[0]
    cos, sin = match["rotary"].args[1:3]
    writes = (match["key_write"], match["value_write"])
    later = max(writes, key=order.__getitem__)
    with graph.inserting_after(later):
        fused = graph.call_function(rotary_into_cache_kernel, (q, k, v, cos, sin, slot, key_cache, value_cache))
    fused.meta.update({k: v for k, v in match["rotary"].meta.items() if k not in ("val", "placement")})
    fused.meta["val"] = (value_of(match["q"]), value_of(writes[0]), value_of(writes[1]))
    _replace_outputs(graph, fused, (match["q"], *writes))
    for node in (*writes, match["k_rot"], match["q"], match["rotary"]):
        graph.erase_node(node)


def _fuse_plain(graph, match, order) -> None:
    key_cache, slot, k = match["key"]
    value_cache, _, v = match["value"]
    writes = (match["key_write"], match["value_write"])
    later = max(writes, key=order.__getitem__)
    with graph.inserting_after(later):
        fused = graph.call_function(kv_into_cache_kernel, (k, v, slot, key_cache, value_cache))
    fused.meta.update({name: meta for name, meta in later.meta.items() if name not in ("val", "placement")})
    fused.meta["val"] = tuple(value_of(w) for w in writes)
    _replace_outputs(graph, fused, writes)
    for node in writes:
        graph.erase_node(node)


def _replace_outputs(graph, fused, old_nodes) -> None:
    """Each of ``old_nodes`` replaced by the matching output of ``fused``, which takes over their
    placements."""
    previous = fused
    for i, old in enumerate(old_nodes):
        with graph.inserting_after(previous):
            out = graph.call_function(operator.getitem, (fused, i))
        out.meta.update(old.meta)
        old.replace_all_uses_with(out)
        previous = out
    placements = [n.meta.get("placement") for n in old_nodes]
    if all(p is not None for p in placements):
        fused.meta["placement"] = tuple(placements)


@register("fuse_cache_write")
def fuse_cache_write(program, ctx):
    """Fuse each static-K/V layer's rotary embedding and cache writes, or its cache writes alone
    (module docstring). Option: ``compile`` (leave writes without a rotary embedding to Inductor)."""
    fused = plain = 0
    if program.mode == "decode":
        graph = program.graph
        adapter = KERNELS[ssm.rotary.default][0]
        for rotary in [n for n in graph.nodes if calls(n, adapter)]:
            match = _match(rotary)
            order = node_order(graph)
            if match is not None and _writable(match) and _safe(match, order):
                _fuse(graph, match, order)
                fused += 1
        compiled = ctx is not None and ctx.options.get("compile", False)
        attentions = [] if compiled else [n for n in graph.nodes if calls(n, aten.scaled_dot_product_attention.default)]
        for attention in attentions:
            match = _match_plain(attention)
            if match is None or not _writable_plain(match):
                continue
            order = node_order(graph)  # per match: a fusion moves nodes
            if _safe(match, order):
                _fuse_plain(graph, match, order)
                plain += 1
    program.cache_write_report = {"layers": fused + plain, "writes_only": plain}
    return program
