"""A static-K/V decode step's rotary embedding and key/value cache writes as one launch: the
kernels (``kernels.rotary.rotary_into_cache``, and ``kernels.cache_write.kv_into_cache`` for a
layer without a rotary embedding; on Triton's CPU interpreter here) against the reference ops bit
for bit, and the ``fuse_cache_write`` pass, which must leave a layer alone where moving the writes
would change what another node reads. Its tokens against HF at tp 1 and
2 under the GPU plan: tests/test_fold_cache_positions.py.

Dimension letters: b batch, h heads, l new positions, s cache slots, p head dim."""

import operator
import types

import pytest
import torch

import ssmshard
from ssmshard.kernels import cache_write as kcache_write, rotary as krotary
from ssmshard.passes import fuse_cache_write as fcw
from ssmshard.passes.manager import PassContext
from ssmshard.passes.swap_kernels import KERNELS

from conftest import pipeline_steps
from test_fuse_rotary import _tables
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

ssm = torch.ops.ssmshard
aten = torch.ops.aten


def _layer(b, hq, h, l, p, s, dtype, generator, value_head_dim=None):
    """q, k, v as attention hands them ((b, l, h, p) projections viewed as (b, h, l, p)), cos, sin,
    distinct slots and two caches (values of ``value_head_dim``, default p)."""
    pv = value_head_dim or p
    q, k, v = (torch.randn(b, l, heads, dim, generator=generator).to(dtype).transpose(1, 2)
               for heads, dim in ((hq, p), (h, p), (h, pv)))
    cos, sin = (t.unsqueeze(1) for t in _tables(b, l, p, dtype, generator))
    slot = torch.randperm(s, generator=generator)[:l]
    caches = [torch.randn(b, h, s, dim, generator=generator).to(dtype) for dim in (p, pv)]
    return [q, k, v, cos, sin, slot, *caches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l", [1, 3])
def test_kernel_equals_the_reference_ops_bit_for_bit(dtype, l, fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    q, k, v, cos, sin, slot, key_cache, value_cache = _layer(3, 5, 2, l, 16, 9, dtype, generator)
    q_rot, k_rot = ssm.rotary([q, k], cos, sin)
    expected = (q_rot, key_cache.clone().index_copy_(2, slot, k_rot), value_cache.clone().index_copy_(2, slot, v))
    args = to_device(q, k, v, cos, sin, slot, key_cache, value_cache)
    out = krotary.rotary_into_cache(*args)
    got = to_cpu(out, args[6], args[7])
    for name, g, e in zip(("q", "key cache", "value cache"), got, expected):
        assert torch.equal(g, e), (name, dtype, l, fresh_seed)


def test_kernel_rejects_caches_and_slots_it_cannot_write():
    q, k, v, cos, sin, slot, key_cache, value_cache = _layer(1, 2, 1, 1, 8, 4, torch.float32, torch.Generator())
    with pytest.raises(ValueError, match="key cache"):
        krotary.rotary_into_cache(*to_device(q, k, v, cos, sin, slot, key_cache.double(), value_cache))
    with pytest.raises(ValueError, match="value cache"):
        krotary.rotary_into_cache(*to_device(q, k, v, cos, sin, slot, key_cache, value_cache[:, :, :, :4]))
    with pytest.raises(ValueError, match="slot must be int64"):
        krotary.rotary_into_cache(*to_device(q, k, v, cos, sin, slot.int(), key_cache, value_cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l", [1, 3])
def test_writes_without_rotary_equal_index_copy_bit_for_bit(dtype, l, fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    _, k, v, _, _, slot, key_cache, value_cache = _layer(3, 2, 2, l, 16, 9, dtype, generator, value_head_dim=8)
    expected = (key_cache.clone().index_copy_(2, slot, k), value_cache.clone().index_copy_(2, slot, v))
    args = to_device(k, v, slot, key_cache, value_cache)
    kcache_write.kv_into_cache(*args)
    for name, g, e in zip(("key cache", "value cache"), to_cpu(args[3], args[4]), expected):
        assert torch.equal(g, e), (name, dtype, l, fresh_seed)


def test_writes_without_rotary_reject_caches_and_slots_they_cannot_write():
    _, k, v, _, _, slot, key_cache, value_cache = _layer(1, 2, 1, 1, 8, 4, torch.float32, torch.Generator())
    with pytest.raises(ValueError, match="key cache"):
        kcache_write.kv_into_cache(*to_device(k, v, slot, key_cache.double(), value_cache))
    with pytest.raises(ValueError, match="value cache"):
        kcache_write.kv_into_cache(*to_device(k, v, slot, key_cache, value_cache[:, :, :, :4]))
    with pytest.raises(ValueError, match="slot must be int64"):
        kcache_write.kv_into_cache(*to_device(k, v, slot.int(), key_cache, value_cache))


def _layer_graph(read_between: str | None):
    """One attention layer as the pipeline leaves it before this pass: the rotary adapter, the
    two cache writes and the attention. ``read_between``: a sum of the key cache between the
    writes (``"cache"``), or of a view of it taken before the key write (``"view"``); either sees
    the new key, which the fused call would write only after it."""
    graph = torch.fx.Graph()
    names = ["q", "k", "v", "cos", "sin", "slot", "key_cache", "value_cache"]
    q, k, v, cos, sin, slot, key_cache, value_cache = (graph.placeholder(n) for n in names)
    rotary = graph.call_function(KERNELS[ssm.rotary.default][0], ([q, k], cos, sin))
    q_rot, k_rot = (graph.call_function(operator.getitem, (rotary, i)) for i in (0, 1))
    read = key_cache if read_between != "view" else graph.call_function(aten.select.int, (key_cache, 1, 0))
    key_write = graph.call_function(aten.index_copy_.default, (key_cache, 2, slot, k_rot))
    outputs = []
    if read_between:
        outputs.append(graph.call_function(aten.sum.default, (read,)))
    value_write = graph.call_function(aten.index_copy_.default, (value_cache, 2, slot, v))
    attention = graph.call_function(aten.scaled_dot_product_attention.default, (q_rot, key_write, value_write),
                                    {"enable_gqa": True})
    graph.output((attention, key_write, value_write, *outputs))
    return graph


def _annotated(graph, inputs):
    """``graph`` in a GraphModule whose nodes carry their values from one run (the pass reads them)."""
    module = torch.fx.GraphModule(torch.nn.Module(), graph)

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            node.meta["val"] = out
            return out

    Recorder(module).run(*[t.clone() for t in inputs])
    return module


@pytest.mark.parametrize("case", ["fused", "cache_read_between", "view_read_between", "other_value_head_dim"])
def test_pass_fuses_the_layer_only_where_the_kernel_writes_the_same(case, fresh_seed):
    """Fused: the same outputs. Left alone: the key cache, or a view of it, read between the
    writes; values of another head dim than the keys (the rotary kernel copies them with the keys'
    head dim), whose writes alone are fused."""
    inputs = _layer(2, 4, 2, 1, 8, 6, torch.float32, torch.Generator().manual_seed(fresh_seed),
                    value_head_dim=4 if case == "other_value_head_dim" else None)
    read_between = {"cache_read_between": "cache", "view_read_between": "view"}.get(case)
    expected = _annotated(_layer_graph(read_between), inputs)(*[t.clone() for t in inputs])
    module = _annotated(_layer_graph(read_between), inputs)
    program = types.SimpleNamespace(mode="decode", graph=module.graph)
    fcw.fuse_cache_write(program, None)
    module.recompile()
    fused = [n for n in module.graph.nodes if n.target is fcw.rotary_into_cache_kernel]
    # Values of another head dim: the rotation stays its own launch, the two writes become one.
    writes_only = case == "other_value_head_dim"
    assert program.cache_write_report == {"layers": int(case == "fused" or writes_only), "writes_only": int(writes_only)}
    assert len(fused) == (case == "fused")
    assert [n.target for n in module.graph.nodes].count(fcw.kv_into_cache_kernel) == writes_only
    got = module(*[t.clone() for t in inputs])
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (case, fresh_seed)


def _plain_layer_graph(read_between: bool):
    """An attention layer without a rotary embedding: the two cache writes and the attention;
    ``read_between``: a sum of the key cache between the writes (it sees the new key)."""
    graph = torch.fx.Graph()
    q, k, v, slot, key_cache, value_cache = (graph.placeholder(n) for n in ("q", "k", "v", "slot", "kc", "vc"))
    key_write = graph.call_function(aten.index_copy_.default, (key_cache, 2, slot, k))
    outputs = [graph.call_function(aten.sum.default, (key_cache,))] if read_between else []
    value_write = graph.call_function(aten.index_copy_.default, (value_cache, 2, slot, v))
    attention = graph.call_function(aten.scaled_dot_product_attention.default, (q, key_write, value_write),
                                    {"enable_gqa": True})
    graph.output((attention, key_write, value_write, *outputs))
    return graph


@pytest.mark.parametrize("case", ["fused", "cache_read_between", "compiled"])
def test_pass_fuses_writes_without_rotary_where_the_kernel_writes_the_same(case, fresh_seed):
    """Fused: the same outputs, no ``index_copy_`` left. Left alone: the key cache read between
    the writes; a plan that compiles (Inductor takes the writes as they are)."""
    q, k, v, _, _, slot, key_cache, value_cache = _layer(2, 4, 2, 1, 8, 6, torch.float32,
                                                         torch.Generator().manual_seed(fresh_seed))
    inputs = [q, k, v, slot, key_cache, value_cache]
    read_between = case == "cache_read_between"
    expected = _annotated(_plain_layer_graph(read_between), inputs)(*[t.clone() for t in inputs])
    module = _annotated(_plain_layer_graph(read_between), inputs)
    program = types.SimpleNamespace(mode="decode", graph=module.graph)
    fcw.fuse_cache_write(program, PassContext(options={"compile": case == "compiled"}))
    module.recompile()
    fused = [n for n in module.graph.nodes if n.target is fcw.kv_into_cache_kernel]
    copies = [n for n in module.graph.nodes if n.target is aten.index_copy_.default]
    assert program.cache_write_report == {"layers": int(case == "fused"), "writes_only": int(case == "fused")}
    assert (len(fused), len(copies)) == ((1, 0) if case == "fused" else (0, 2))
    got = module(*[t.clone() for t in inputs])
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (case, fresh_seed)


def test_plan_runs_it_after_the_in_place_states_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("swap_kernels") < decode.index("inplace_decode_states") < decode.index("fuse_cache_write")
    assert "fuse_cache_write" not in pipeline_steps(ssmshard.Plan(skip_passes=["fuse_cache_write"]))
    assert "fuse_cache_write" not in pipeline_steps(ssmshard.Plan(), kernels="reference")
