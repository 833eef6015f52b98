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
``program.cache_write_report`` counts the fused layers. ``Plan(skip_passes=["fuse_cache_write"])``
turns it off.
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
    """What ``kernels.rotary.rotary_into_cache`` serves, known from the fake values: caches of the
    keys' dtype and head dim, the head dim contiguous, values of the same head dim."""
    key_cache, value_cache, k, v = (value_of(n) for n in (match["key"][0], match["value"][0],
                                                          match["key"][2], match["value"][2]))
    if not all(isinstance(t, torch.Tensor) for t in (key_cache, value_cache, k, v)):
        return False
    head_dim = k.shape[-1]
    return (all(t.shape[-1] == head_dim and t.dtype == k.dtype for t in (key_cache, value_cache, v))
            and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1)


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


def _safe(match, order) -> bool:
    """Whether moving both writes (and the rotation) to the later write's place changes nothing
    any other node reads."""
    writes = (match["key_write"], match["value_write"])
    at = max(map(order.__getitem__, writes))
    if any(order[u] <= at for u in match["q"].users):
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
    previous = fused
    for i, old in enumerate((match["q"], *writes)):
        with graph.inserting_after(previous):
            out = graph.call_function(operator.getitem, (fused, i))
        out.meta.update(old.meta)
        old.replace_all_uses_with(out)
        previous = out
    placements = [n.meta.get("placement") for n in (match["q"], *writes)]
    if all(p is not None for p in placements):
        fused.meta["placement"] = tuple(placements)
    for node in (*writes, match["k_rot"], match["q"], match["rotary"]):
        graph.erase_node(node)


@register("fuse_cache_write")
def fuse_cache_write(program, ctx):
    """Fuse each static-K/V layer's rotary embedding and cache writes (module docstring)."""
    fused = 0
    if program.mode == "decode":
        graph = program.graph
        adapter = KERNELS[ssm.rotary.default][0]
        for rotary in [n for n in graph.nodes if calls(n, adapter)]:
            match = _match(rotary)
            order = node_order(graph)
            if match is not None and _writable(match) and _safe(match, order):
                _fuse(graph, match, order)
                fused += 1
    program.cache_write_report = {"layers": fused}
    return program
