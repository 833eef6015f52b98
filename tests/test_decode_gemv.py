"""The decode GEMV: the skinny-matmul kernel (``kernels/gemv.py``, on Triton's CPU interpreter here)
against a float64 product, and the ``decode_gemv`` pass, which puts every linear layer of a
decode program on it: logits and greedy tokens against the program without it and Hugging Face."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.kernels import gemv as kgemv
from ssmshard.passes import run_pipeline
from ssmshard.testing import rel_err

from conftest import small_model
from test_decode_passes import INFERENCE_PASSES, decode_step_by_step, greedy_tokens_and_hf
from test_kernel_selective_scan import to_device  # the GPU where there is one, else the interpreter

aten, ssm = torch.ops.aten, torch.ops.ssmshard


def _float64_linear(x, weight, bias):
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


# Rows 2-16 take the tensor-core path, which Triton's interpreter runs in float32 only; one row
# (the batch-1 path) is checked in bfloat16 as well. Sizes not multiples of any block size.
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (1, torch.bfloat16), (3, torch.float32),
                                        (16, torch.float32)])
def test_gemv_equals_a_float64_product(rows, dtype, fresh_seed):
    n, k = 37, 300
    x = torch.randn(rows, 1, k, dtype=dtype)  # (b, 1, k): a decode step's activations
    weight, bias = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    for b in (None, bias):
        got = kgemv.gemv(*to_device(x, weight, b), config=dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1))
        got = got.cpu()
        assert got.shape == (rows, 1, n) and got.dtype == dtype
        # float32 accumulation; the bfloat16 output is within one bfloat16 step (2^-7 relative):
        # Triton's interpreter truncates float32 to bfloat16 where a GPU rounds to nearest.
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert rel_err(got.double(), _float64_linear(x, weight, b)) < tolerance, (rows, dtype, fresh_seed)


# One shape per branch of the one-row default configuration: short k, few output features, the rest.
@pytest.mark.parametrize("n,k", [(37, 300), (37, 1030), (1100, 1030)])
def test_one_row_in_each_default_configuration_equals_a_float64_product(n, k, fresh_seed):
    x, weight, bias = torch.randn(1, 1, k), torch.randn(n, k), torch.randn(n)
    got = kgemv.decode_linear(*to_device(x, weight, bias)).cpu()
    assert rel_err(got.double(), _float64_linear(x, weight, bias)) < 1e-6, (n, k, fresh_seed)


def test_decode_linear_hands_more_rows_and_mixed_dtypes_to_torch():
    weight = torch.randn(24, 40)
    for rows in (2, kgemv.MAX_ROWS + 1):  # the op's kernel serves one row (kernels/gemv.py says why)
        x = torch.randn(rows, 1, 40)
        assert torch.equal(kgemv.decode_linear(x, weight), F.linear(x, weight))
    many = torch.randn(kgemv.MAX_ROWS + 1, 40)
    mixed = torch.randn(2, 40, dtype=torch.float64)  # a dtype the weight does not have: F.linear's promotion rules
    with pytest.raises(RuntimeError):
        F.linear(mixed, weight)
    with pytest.raises(RuntimeError):
        kgemv.decode_linear(mixed, weight)
    with pytest.raises(ValueError, match="at most 16 rows"):
        kgemv.gemv(many, weight)


@pytest.mark.parametrize("family", ["mamba", "mamba2", "llama"])
def test_decode_gemv_puts_every_linear_on_the_op_and_keeps_logits_and_tokens(family, fresh_seed):
    model = small_model(family)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), INFERENCE_PASSES)
    projections = plain.op_counts().get("linear", 0) + plain.op_counts().get("matmul", 0)
    passed = run_pipeline(ssmshard.capture(model, mode="decode"), ["decode_gemv", *INFERENCE_PASSES])
    targets = [n.target for n in passed.graph.nodes if n.op == "call_function"]
    assert aten.linear.default not in targets and aten.matmul.default not in targets, family
    assert targets.count(ssm.decode_linear.default) == projections == len(passed.gemv_report), family
    where = f"{family} (seed {fresh_seed})"
    for got, expected in decode_step_by_step(model, plain, passed, fresh_seed)[0]:
        # The same float32 products; Mamba's dt_proj (``weight @ x``) becomes ``(x.mT @ weight.T).mT``.
        assert rel_err(got, expected) < 1e-6, where
    tokens, hf = greedy_tokens_and_hf(model, passed, fresh_seed)
    assert torch.equal(tokens, hf), where


def test_decode_gemv_leaves_other_programs_alone():
    program = ssmshard.capture(small_model("mamba"), mode="prefill")
    before = program.op_counts()
    assert run_pipeline(copy.deepcopy(program), ["decode_gemv"]).op_counts() == before


def test_plan_runs_it_on_decode_programs_under_the_triton_kernels():
    def steps(plan, mode, kernels):
        return [s if isinstance(s, str) else s[0]
                for s in plan.pipeline(mode, placements={}, rank=0, group="g", kernels=kernels)]

    plan = ssmshard.Plan()
    decode = steps(plan, "decode", "triton")
    assert decode.index("decode_gemv") < decode.index("swap_kernels")
    assert "decode_gemv" not in steps(plan, "prefill", "triton") + steps(plan, "decode", "reference")
    assert "decode_gemv" not in steps(ssmshard.Plan(skip_passes=["decode_gemv"]), "decode", "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's compiled path needs a GPU")
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_gemv_on_a_gpu_in_bfloat16(rows, fresh_seed):
    n, k = 2560 + 37, 5120 + 24
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = _float64_linear(x, weight, bias)
    got = kgemv.gemv(x, weight, bias)  # the shape's default configuration
    cublas = F.linear(x, weight, bias)
    assert torch.equal(kgemv.decode_linear(x, weight, bias), got if rows == 1 else cublas)
    # Both round float32 sums to bfloat16 (2^-8 relative): as close to the float64 product as cuBLAS.
    assert rel_err(got.double(), expected) < 4e-3, (rows, fresh_seed)
    assert rel_err(got.double(), expected) <= 1.5 * rel_err(cublas.double(), expected), (rows, fresh_seed)
