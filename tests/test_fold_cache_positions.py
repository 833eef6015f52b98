"""The static-K/V decode step's position arithmetic folded (``fold_cache_positions``): fewer
nodes, the same tokens as Hugging Face, and left alone wherever a counter's advance is read."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ssmshard
from ssmshard.passes import fold_cache_positions as fcp, fuse_cache_write, run_pipeline

from conftest import pipeline_steps, small_model

aten = torch.ops.aten


def _count(program, target):
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("family", ["llama", "zamba2"])
def test_static_decode_loses_four_nodes_per_attention_layer(family):
    model = small_model(family)
    plain = ssmshard.capture(model, mode="decode", static_kv=True)
    folded = run_pipeline(ssmshard.capture(model, mode="decode", static_kv=True), ["fold_cache_positions"])
    layers = sum(1 for spec in plain.state_specs if spec.kind == "key")
    report = folded.cache_position_report
    assert (report["counter_bumps"], report["clones"]) == (layers, layers)
    assert report["slots"] >= layers  # every layer's slot, and the mask's own arange(1) + position
    assert _count(plain, aten.add_.Tensor) - _count(folded, aten.add_.Tensor) == layers
    assert _count(folded, aten.clone.default) == _count(plain, aten.clone.default) - layers
    assert _count(plain, aten.arange.default) - _count(folded, aten.arange.default) == report["slots"]


# Zamba2's shared attention without its rotary embedding (Zamba2-2.7B's config): the cache writes
# are fused alone.
NO_ROTARY = {"zamba2_no_rotary": ("zamba2", {"use_mem_rope": False})}


# Zamba2 at tp = 2 only: its tp-1 program is the same rewrite over unsplit heads (in the slow set).
@pytest.mark.parametrize("family, tp", [("llama", 1), ("llama", 2), pytest.param("zamba2", 1, marks=pytest.mark.slow),
                                        ("zamba2", 2), ("zamba2_no_rotary", 2)])
def test_static_kv_generation_with_the_gpu_plan_equals_hf(family, tp, monkeypatch, fresh_seed):
    """The GPU plan's static decode program, the one CUDA graphs replay (``fold_cache_positions``,
    ``fuse_rotary``, ``hoist_attention_mask`` and ``fuse_cache_write`` among its passes; the kernel adapters run the reference ops on CPU
    tensors), from left-padded prompts."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    name, overrides = NO_ROTARY.get(family, (family, {}))
    model = small_model(name, **overrides)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(1, model.config.vocab_size, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    with torch.no_grad():
        tokens = mesh.generate(ids, attention_mask=mask, max_new_tokens=6, static_kv=True)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected), f"{family} tp={tp} seed {fresh_seed}"
    program = mesh.ranks[0]._generation["static_decode"]
    attention_layers = sum(1 for spec in program.state_specs if spec.kind == "key")
    assert program.cache_position_report["counter_bumps"] == attention_layers
    assert program.attention_mask_report == {"attention_calls": attention_layers, "masks": 1}
    # q and k's rotary embedding and the two cache writes, or the writes alone, one call a layer
    # (fuse_rotary, fuse_cache_write).
    rotary = family not in NO_ROTARY
    fused = [n for n in program.graph.nodes if n.target is (fuse_cache_write.rotary_into_cache_kernel if rotary
                                                             else fuse_cache_write.kv_into_cache_kernel)]
    assert len(fused) == attention_layers
    assert program.cache_write_report == {"layers": attention_layers, "writes_only": 0 if rotary else attention_layers}
    assert not any(n.target is aten.index_copy_.default for n in program.graph.nodes)
    # Each layer's (Llama) or shared block's (Zamba2) MLP: its activation and product one call.
    assert program.gated_activation_report == {"silu" if family == "llama" else "gelu": attention_layers}
    # Zamba2's Mamba-2 layers: in_proj and the conv update one call (fuse_gemv_conv; at 3 rows the
    # call runs the two adapters).
    conv_layers = sum(1 for spec in program.state_specs if spec.kind == "conv")
    assert len(program.gemv_conv_report) == conv_layers and (conv_layers > 0) == (family != "llama")


def _traced(fn, *inputs):
    """``fn`` as an FX graph of ATen ops (in-place ones kept, as export keeps the cache's) whose
    nodes carry their values (``meta["val"]``) from one run."""
    gm = make_fx(fn)(*[t.clone() for t in inputs])

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            node.meta["val"] = out.clone() if isinstance(out, torch.Tensor) else out
            return out

    Recorder(gm).run(*[t.clone() for t in inputs])
    return gm


def _slot_then_bump(position, cache, k):
    counter = position.clone()
    slot = torch.arange(1) + counter
    counter.add_(1)
    return cache.index_copy_(0, slot, k)


def _slot_then_bump_then_read(position, cache, k):
    counter = position.clone()
    slot = torch.arange(1) + counter
    counter.add_(1)
    return cache.index_copy_(0, slot, k), counter * 2  # the advanced counter is read


def _slot_then_bump_then_input_written(position, cache, k):
    counter = position.clone()
    slot = torch.arange(1) + counter
    counter.add_(1)
    position.add_(5)  # the input itself changes after the clone: the clone must stay a copy
    return cache.index_copy_(0, slot, k)


# (bumps, clones, slots) folded
@pytest.mark.parametrize("fn, folds", [(_slot_then_bump, (1, 1, 1)), (_slot_then_bump_then_read, (0, 0, 0)),
                                       (_slot_then_bump_then_input_written, (1, 0, 1))])
def test_folds_only_unread_advances_and_unwritten_inputs(fn, folds):
    inputs = (torch.tensor(2), torch.zeros(5, 3), torch.randn(1, 3))
    expected = fn(*[t.clone() for t in inputs])
    gm = _traced(fn, *inputs)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    bumps, clones = fcp._drop_counter_bumps(gm.graph, order)
    slots = fcp._slots_as_views(gm.graph)
    gm.recompile()
    assert (bumps, clones, slots) == folds
    got = gm(*[t.clone() for t in inputs])
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert torch.equal(g, e)


def test_plan_runs_it_before_the_kernel_swap_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("fuse_rotary") < decode.index("fold_cache_positions") < decode.index("swap_kernels")
    assert "fold_cache_positions" not in pipeline_steps(ssmshard.Plan(skip_passes=["fold_cache_positions"]))
