"""Attention's rotary embedding as one launch: the kernel (``kernels/rotary.py``, on Triton's CPU
interpreter here) against Hugging Face's ``apply_rotary_pos_emb`` bit for bit, and the
``fuse_rotary`` pass against the decode program without it and against Hugging Face.

Dimension letters: b batch, h heads, l positions, p head dim."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import ssmshard
from ssmshard.kernels import rotary as krotary
from ssmshard.passes import fuse_rotary as fr, run_pipeline
from ssmshard.testing import rel_err

from conftest import pipeline_steps, simulated_gpu_plan_generation, small_model
from test_decode_passes import INFERENCE_PASSES, assert_same_logits_and_hf_tokens
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

ssm = torch.ops.ssmshard
aten = torch.ops.aten


def _tables(b, l, p, dtype, generator):
    """cos and sin (b, l, p) as Llama's rotary module makes them: angles repeated over both halves."""
    angles = torch.rand(b, l, p // 2, generator=generator) * 100
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l", [1, 3])
def test_kernel_equals_hf_bit_for_bit(dtype, l, fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    b, p = 3, 16
    # As attention hands them over: (b, l, h, p) projections viewed as (b, h, l, p).
    q = torch.randn(b, l, 5, p, generator=generator).to(dtype).transpose(1, 2)
    k = torch.randn(b, l, 2, p, generator=generator).to(dtype).transpose(1, 2)
    cos, sin = _tables(b, l, p, dtype, generator)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_dev, k_dev, cos_dev, sin_dev = to_device(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    outs = to_cpu(*krotary.rotary([q_dev, k_dev], cos_dev, sin_dev))
    for got, expected in zip(outs, (q_hf, k_hf)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), (dtype, l, fresh_seed, (got.float() - expected.float()).abs().max())
        # the layout eager gives too (a stride of a size-1 dim means nothing)
        assert [s for s, n in zip(got.stride(), got.shape) if n > 1] == \
            [s for s, n in zip(expected.stride(), expected.shape) if n > 1]


def test_one_three_and_unequal_tensors(fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    cos, sin = (t.unsqueeze(1) for t in _tables(2, 1, 8, torch.float32, generator))
    xs = [torch.randn(2, h, 1, 8, generator=generator) for h in (4, 1, 3)]
    expected = ssm.rotary(xs, cos, sin)  # the reference op
    for chosen in ([0], [0, 1, 2]):
        picked = [xs[i] for i in chosen]
        outs = to_cpu(*krotary.rotary(to_device(*picked), *to_device(cos, sin)))
        assert all(torch.equal(o, expected[i]) for o, i in zip(outs, chosen)), chosen
    with pytest.raises(ValueError, match="even head dim"):
        krotary.rotary(to_device(torch.randn(1, 2, 1, 5)), *to_device(torch.ones(1, 1, 1, 5), torch.ones(1, 1, 1, 5)))
    with pytest.raises(ValueError, match="share one of"):
        krotary.rotary(to_device(torch.randn(1, 2, 1, 4)), *to_device(cos[:1, :, :, :4].double(), sin[:1, :, :, :4]))


def _rotary_nodes(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is ssm.rotary.default]


# Attention blocks per decode step: Llama's layers; the small Zamba2's hybrid layers (shared
# attention with use_mem_rope).
ATTENTION_BLOCKS = {"llama": lambda config: config.num_hidden_layers,
                    "zamba2": lambda config: config.layers_block_type.count("hybrid")}


@pytest.mark.parametrize("static_kv", [False, True])
@pytest.mark.parametrize("family", sorted(ATTENTION_BLOCKS))
def test_fusion_keeps_logits_and_tokens(family, static_kv, fresh_seed):
    model = small_model(family)
    options = {"static_kv": True} if static_kv else {}
    plain = run_pipeline(ssmshard.capture(model, mode="decode", **options), INFERENCE_PASSES)
    fused = run_pipeline(ssmshard.capture(model, mode="decode", **options), ["fuse_rotary", *INFERENCE_PASSES])
    nodes = _rotary_nodes(fused)
    assert len(nodes) == ATTENTION_BLOCKS[family](model.config), family
    assert all(len(node.args[0]) == 2 for node in nodes)  # q and k in one launch
    assert [len(group) for group in fused.rotary_report] == [2] * len(nodes)
    counts, before = fused.op_counts(), plain.op_counts()
    assert counts.get("neg", 0) == before.get("neg", 0) - 2 * len(nodes)
    assert counts.get("cat", 0) == before.get("cat", 0) - 2 * len(nodes)
    where = f"{family} static_kv={static_kv} (seed {fresh_seed})"
    if static_kv:
        # The static step takes other inputs; its tokens with this pass are checked against HF in
        # tests/test_fold_cache_positions.py (static-K/V generation under the GPU plan's passes).
        return
    # Equal logits: the reference op is the captured ops themselves.
    assert_same_logits_and_hf_tokens(model, plain, fused, fresh_seed, where)


def test_prefill_and_models_without_rotary_are_left_alone():
    prefill = ssmshard.capture(small_model("llama"), mode="prefill")
    before = prefill.op_counts()
    assert run_pipeline(prefill, ["fuse_rotary"]).op_counts() == before
    mamba = ssmshard.capture(small_model("mamba2"), mode="decode")
    before = mamba.op_counts()
    assert run_pipeline(mamba, ["fuse_rotary"]).op_counts() == before and mamba.rotary_report == []


def test_plan_runs_it_before_the_kernel_swap_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("group_decode_linears") < decode.index("fuse_rotary") < decode.index("swap_kernels")
    assert "fuse_rotary" not in pipeline_steps(ssmshard.Plan(skip_passes=["fuse_rotary"]))


def test_sharded_generation_with_the_fusion_equals_hf(monkeypatch, fresh_seed):
    """tp=2 with the GPU plan's decode passes: each rank rotates its own heads of q and k; the
    fused node keeps their placements."""
    model = small_model("llama")
    tokens, expected, mesh = simulated_gpu_plan_generation(model, fresh_seed, monkeypatch)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    program = mesh.ranks[0]._generation["decode"]
    nodes = [n for n in program.graph.nodes if "rotary" in getattr(n.target, "__name__", "")]
    assert len(nodes) == model.config.num_hidden_layers
    for node in nodes:
        assert len(node.meta["placement"]) == 2 and all(p is not None for p in node.meta["placement"])
    assert fr.MAX_GROUP == krotary.MAX_TENSORS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the adapter calls the kernel on CUDA tensors only")
def test_adapter_runs_the_kernel_on_cuda_tensors(monkeypatch):
    """The adapter's first argument is a list of tensors: it must still see them as CUDA tensors
    and call the kernel, not the reference ops."""
    from ssmshard.passes import swap_kernels

    calls = []
    kernel = krotary.rotary

    def recorded(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(krotary, "rotary", recorded)
    xs = [torch.randn(2, 4, 1, 8, device="cuda"), torch.randn(2, 2, 1, 8, device="cuda")]
    cos, sin = torch.randn(2, 1, 1, 8, device="cuda"), torch.randn(2, 1, 1, 8, device="cuda")
    with torch.no_grad():
        outs = swap_kernels.rotary_kernel(xs, cos, sin)
    assert len(calls) == 1
    assert all(torch.equal(o, e) for o, e in zip(outs, ssm.rotary(xs, cos, sin)))
