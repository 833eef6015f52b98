"""The boolean attention mask made additive once a decode step (``hoist_attention_mask``): every
attention reads the one converted mask, and the logits are those of the program without the pass
(PyTorch converts a boolean mask to the same values inside each call), the tokens HF's."""

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.testing import masked_decode_attention

from conftest import pipeline_steps, small_model
from test_decode_passes import INFERENCE_PASSES, assert_same_logits_and_hf_tokens
from test_fuse_rotary import ATTENTION_BLOCKS

aten = torch.ops.aten


def _attention_masks(program):
    return [n.args[3] for n in program.graph.nodes
            if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("family", sorted(ATTENTION_BLOCKS))
def test_every_attention_reads_one_additive_mask_and_logits_are_unchanged(family, fresh_seed):
    model = small_model(family)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), INFERENCE_PASSES)
    hoisted = run_pipeline(ssmshard.capture(model, mode="decode"), ["hoist_attention_mask", *INFERENCE_PASSES])
    blocks = ATTENTION_BLOCKS[family](model.config)
    assert hoisted.attention_mask_report == {"attention_calls": blocks, "masks": 1}
    masks = _attention_masks(hoisted)
    assert len(masks) == blocks and len(set(masks)) == 1
    assert masks[0].target is aten.masked_fill.Scalar and masks[0].meta["val"].dtype == model.dtype
    assert all(m.meta["val"].dtype == torch.bool for m in _attention_masks(plain))
    where = f"{family} (seed {fresh_seed})"
    assert_same_logits_and_hf_tokens(model, plain, hoisted, fresh_seed, where)


def test_programs_without_a_boolean_mask_are_left_alone():
    prefill = ssmshard.capture(small_model("llama"), mode="prefill")
    before = prefill.op_counts()
    assert run_pipeline(prefill, ["hoist_attention_mask"]).op_counts() == before
    mamba = run_pipeline(ssmshard.capture(small_model("mamba2"), mode="decode"), ["hoist_attention_mask"])
    assert mamba.attention_mask_report == {"attention_calls": 0, "masks": 0}


def test_plan_runs_it_before_the_kernel_swap_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("fold_cache_positions") < decode.index("hoist_attention_mask") < decode.index("swap_kernels")
    assert "hoist_attention_mask" not in pipeline_steps(ssmshard.Plan(skip_passes=["hoist_attention_mask"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's attention kernels")
@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_attention_with_the_additive_mask_equals_the_boolean_one(batch, gqa, fresh_seed):
    """A decode step's attention (bf16, one query; grouped key/value heads or as many as the
    queries) with the hoisted mask: PyTorch picks the same kernel as for the boolean mask, the math
    kernel gives the same bits, and the picked kernel agrees to one bf16 rounding. Not the same
    bits there: on an H200 with torch 2.11 the pick is cuDNN's, whose decode attention does not
    repeat its own bits from call to call at batch 16 and above, boolean mask or not
    (benchmarks/results/gpu_suite/mask_bits.py and its log)."""
    q, k, v, mask, additive = masked_decode_attention(fresh_seed, batch, gqa)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=gqa)
    where = f"batch {batch}, gqa {gqa}, seed {fresh_seed}"
    picked = [SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=m, enable_gqa=gqa)) for m in (mask, additive)]
    assert picked[0] == picked[1], f"{where}: kernels (boolean, additive) {picked}"
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(sdpa(attn_mask=additive), sdpa(attn_mask=mask)), f"{where}: the math kernel"
    # One bf16 rounding of the value: the spread of the picked kernel's own calls.
    torch.testing.assert_close(sdpa(attn_mask=additive), sdpa(attn_mask=mask), rtol=2**-7, atol=1e-6,
                               msg=lambda m: f"{where}, kernel {picked[0].name}: {m}")
