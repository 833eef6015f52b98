"""A decode step's attention on its own kernel (``kernels.decode_attention``, on Triton's CPU
interpreter here, the GPU where there is one) against PyTorch's ``scaled_dot_product_attention``
in float64, and the ``decode_attention`` pass that retargets a decode program's one-position
attention to it (by default where the head dim is not a power of two; every head dim with
``Plan(add_passes=["decode_attention"])``), and on a GPU the graphed static-K/V decode of a plan
with the pass: the tokens of eager decode and of HF.

Dimension letters: b batch, h query heads, k key/value heads, s cache positions, p head dim."""

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.kernels.decode_attention import decode_attention
from ssmshard.passes import decode_attention as pass_module, run_pipeline

import generate_worker
from conftest import pipeline_steps, small_model
from finishing_rows import check_finishing_rows
from test_decode_passes import INFERENCE_PASSES, assert_same_logits_and_hf_tokens
from test_fuse_rotary import ATTENTION_BLOCKS
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

aten = torch.ops.aten


def _inputs(b, h, kv, s, p, dtype, mask_kind, generator):
    """q (b, h, 1, p) as HF views it, k and v (b, k, s, p), a left-padding mask of ``mask_kind``."""
    q = torch.randn(b, 1, h, p, generator=generator).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv, s, p, generator=generator).to(dtype) for _ in range(2))
    keep = (torch.arange(s)[None, :] >= torch.randint(0, s, (b,), generator=generator)[:, None])[:, None, None, :]
    mask = {"none": None, "boolean": keep,
            "additive": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")),
            "per head": torch.randn(b, h, 1, s, generator=generator).to(dtype)}[mask_kind]
    return q, k, v, mask


def _reference(q, k, v, mask, scale):
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("mask_kind", ["additive", "boolean", "none", "per head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_equals_sdpa_in_float64(mask_kind, dtype, heads, splits, fresh_seed):
    """Float32 scores and sums: the float64 result within float32's accumulation (1e-5 of the
    largest output). In bf16 two roundings add to it: the output's own (2^-9 relative) and the
    softmax weights' before the product with the values (2^-9 relative each, so at most 2^-9 of
    the largest value: the weights sum to 1); both bounds are doubled."""
    generator = torch.Generator().manual_seed(fresh_seed)
    h, kv = heads
    q, k, v, mask = _inputs(3, h, kv, 37, 20, dtype, mask_kind, generator)  # head dim 20: padded to 32
    expected = _reference(q, k, v, mask, 0.3)
    got, = to_cpu(decode_attention(*to_device(q, k, v, mask), scale=0.3, enable_gqa=h != kv, splits=splits))
    assert got.shape == expected.shape and got.dtype == dtype
    bound = 1e-5 * expected.abs().max() + (2 ** -8 * (expected.abs() + v.abs().max()) if dtype == torch.bfloat16 else 0)
    worst = ((got.double() - expected).abs() - bound).max().item()
    assert worst <= 0, (mask_kind, dtype, heads, splits, fresh_seed, worst)


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_with_every_position_masked_give_zeros_as_sdpa_does(splits):
    q, k, v, mask = _inputs(2, 2, 2, 12, 8, torch.float32, "additive", torch.Generator().manual_seed(0))
    mask[0] = float("-inf")
    got, = to_cpu(decode_attention(*to_device(q, k, v, mask), splits=splits))
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0], got[0])
    assert torch.allclose(got[1], F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[1], rtol=1e-5, atol=1e-6)


def test_kernel_names_what_it_cannot_serve():
    q, k, v, mask = _inputs(2, 4, 2, 6, 8, torch.float32, "additive", torch.Generator())
    with pytest.raises(ValueError, match="more query positions"):
        decode_attention(torch.cat([q, q], dim=2), k, v)
    with pytest.raises(ValueError, match="enable_gqa"):
        decode_attention(q, k, v)
    with pytest.raises(ValueError, match="share one of"):
        decode_attention(q, k.double(), v.double(), enable_gqa=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        decode_attention(q, k, v, mask[..., :3], enable_gqa=True)
    with pytest.raises(ValueError, match="unit-stride"):
        decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, enable_gqa=True)


def _attention_nodes(program, target):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


EVERY_HEAD_DIM = ("decode_attention", {"every_head_dim": True})  # as Plan(add_passes=["decode_attention"])


@pytest.mark.parametrize("family", sorted(ATTENTION_BLOCKS))
def test_pass_retargets_every_decode_attention_and_keeps_logits_and_hf_tokens(family, fresh_seed):
    """On the CPU the retargeted nodes run PyTorch's call with the same arguments: logits equal
    the program's without the pass bit for bit."""
    model = small_model(family)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), ["hoist_attention_mask", *INFERENCE_PASSES])
    passed = run_pipeline(ssmshard.capture(model, mode="decode"),
                          ["hoist_attention_mask", *INFERENCE_PASSES, EVERY_HEAD_DIM])
    blocks = ATTENTION_BLOCKS[family](model.config)
    assert passed.decode_attention_report == {"attention_calls": blocks, "left_for_head_dim": 0}
    assert len(_attention_nodes(passed, pass_module.decode_attention_kernel)) == blocks
    assert not _attention_nodes(passed, aten.scaled_dot_product_attention.default)
    assert_same_logits_and_hf_tokens(model, plain, passed, fresh_seed, f"{family} (seed {fresh_seed})")


@pytest.mark.parametrize("head_dim", [16, 20])
def test_by_default_only_head_dims_that_are_not_a_power_of_two_are_retargeted(head_dim, fresh_seed):
    model = small_model("llama", head_dim=head_dim)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), ["hoist_attention_mask", *INFERENCE_PASSES])
    passed = run_pipeline(ssmshard.capture(model, mode="decode"),
                          ["hoist_attention_mask", *INFERENCE_PASSES, "decode_attention"])
    layers = model.config.num_hidden_layers
    retargeted = layers if head_dim == 20 else 0
    assert passed.decode_attention_report == {"attention_calls": retargeted, "left_for_head_dim": layers - retargeted}
    assert len(_attention_nodes(passed, pass_module.decode_attention_kernel)) == retargeted
    assert_same_logits_and_hf_tokens(model, plain, passed, fresh_seed, f"head dim {head_dim} (seed {fresh_seed})")


def test_prefill_programs_are_left_alone():
    prefill = ssmshard.capture(small_model("llama"), mode="prefill")
    before = prefill.op_counts()
    assert run_pipeline(prefill, ["decode_attention"]).op_counts() == before


def test_causal_and_dropout_attention_are_left_alone():
    program = ssmshard.capture(small_model("llama"), mode="decode")
    attention = _attention_nodes(program, aten.scaled_dot_product_attention.default)
    attention[0].kwargs = {**attention[0].kwargs, "dropout_p": 0.1}
    attention[1].args = attention[1].args[:3]  # SDPA takes no mask with is_causal
    attention[1].kwargs = {**attention[1].kwargs, "is_causal": True}
    passed = run_pipeline(program, [EVERY_HEAD_DIM])
    assert passed.decode_attention_report == {"attention_calls": len(attention) - 2, "left_for_head_dim": 0}
    assert _attention_nodes(passed, aten.scaled_dot_product_attention.default) == attention[:2]


def test_compiled_plans_get_the_opaque_op():
    program = run_pipeline(ssmshard.capture(small_model("llama"), mode="decode"),
                           [("decode_attention", {"compile": True, "every_head_dim": True})])
    nodes = _attention_nodes(program, pass_module.decode_attention_op._opoverload)
    assert len(nodes) == program.decode_attention_report["attention_calls"] > 0
    q, k, v, mask = _inputs(2, 4, 2, 6, 8, torch.float32, "additive", torch.Generator().manual_seed(1))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True)
    assert torch.equal(pass_module.decode_attention_op(q, k, v, mask, 0.5, True), expected)


def _decode_attention_options(plan):
    steps = plan.pipeline("decode", placements={}, rank=0, group="g", kernels="triton")
    return [options for step, options in (s if isinstance(s, tuple) else (s, None) for s in steps)
            if step == "decode_attention"]


def test_plan_runs_it_last_on_every_head_dim_only_when_asked():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode[-1] == "decode_attention" and decode.index("fuse_cache_write") < decode.index("decode_attention")
    assert [o["every_head_dim"] for o in _decode_attention_options(ssmshard.Plan())] == [False]
    asked = ssmshard.Plan(add_passes=["decode_attention"])
    assert [o["every_head_dim"] for o in _decode_attention_options(asked)] == [True]
    assert _decode_attention_options(ssmshard.Plan(skip_passes=["decode_attention"])) == []
    assert "decode_attention" not in pipeline_steps(ssmshard.Plan(add_passes=["decode_attention"]), mode="prefill")
    assert "decode_attention" not in pipeline_steps(ssmshard.Plan(), kernels="torch")
    with pytest.raises(ssmshard.PlanError, match="add_passes must list opt-in passes"):
        ssmshard.Plan(add_passes=["fuse_rotary"])
    with pytest.raises(ssmshard.PlanError, match="in both add_passes and skip_passes"):
        ssmshard.Plan(add_passes=["decode_attention"], skip_passes=["decode_attention"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the kernel on a GPU")
@pytest.mark.parametrize("family", sorted(ATTENTION_BLOCKS))
def test_graphed_decode_with_the_pass_generates_the_eager_and_hf_tokens(family, tmp_path, fresh_seed):
    """``dm.generate(cuda_graph=True)`` at tp 1 with the pass: left-padded prompts of different
    lengths, the eager tokens and HF's; rows finishing at different steps stay padded."""
    import json

    out = tmp_path / "tokens.json"
    ssmshard.launch(generate_worker.graphed_vs_eager, 1, family, fresh_seed, str(out), False, None,
                    ("decode_attention",), backend="nccl")
    tokens = json.loads(out.read_text())
    assert tokens["graphed"] == tokens["eager"] and tokens["again"] == tokens["eager"], (family, fresh_seed)
    assert tokens["eager"] == tokens["hf"], (family, fresh_seed)
    check_finishing_rows(tokens["finishing"], f"{family} tp=1 graphed with decode_attention (seed {fresh_seed})")
