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

from conftest import pipeline_steps, small_model
from test_decode_passes import INFERENCE_PASSES, decode_step_by_step, greedy_tokens_and_hf
from test_kernel_selective_scan import to_device  # the GPU where there is one, else the interpreter

aten, ssm = torch.ops.aten, torch.ops.ssmshard


def _float64_linear(x, weight, bias):
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


# Rows 2-64 take the tensor-core path, which Triton's interpreter runs in float32 only; one row
# (the batch-1 path) is checked in bfloat16 as well. Sizes not multiples of any block size; k
# split over 3 programs per block (the last to finish adds the partials) as well as whole.
@pytest.mark.parametrize("rows,dtype,split_k", [(1, torch.float32, 1), (1, torch.bfloat16, 1), (3, torch.float32, 1),
                                                (16, torch.float32, 1), (3, torch.float32, 3), (40, torch.float32, 3)])
def test_gemv_equals_a_float64_product(rows, dtype, split_k, fresh_seed):
    n, k = 37, 300
    x = torch.randn(rows, 1, k, dtype=dtype)  # (b, 1, k): a decode step's activations
    weight, bias = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    config = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1, SPLIT_K=split_k)
    for b in (None, bias):
        got = kgemv.gemv(*to_device(x, weight, b), config=config)
        got = got.cpu()
        assert got.shape == (rows, 1, n) and got.dtype == dtype
        # float32 accumulation; the bfloat16 output is within one bfloat16 step (2^-7 relative):
        # Triton's interpreter truncates float32 to bfloat16 where a GPU rounds to nearest.
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert rel_err(got.double(), _float64_linear(x, weight, b)) < tolerance, (rows, dtype, fresh_seed)


def test_split_k_is_repeatable_and_leaves_its_counters_at_zero(fresh_seed):
    """The last program of a block adds the partials in split order, whichever finished last, and
    resets the block's counter: the next launch (here the same product again) starts from zero."""
    x, weight = to_device(torch.randn(5, 200), torch.randn(70, 200))
    config = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1, SPLIT_K=4)
    first = kgemv.gemv(x, weight, config=config)
    assert torch.equal(kgemv.gemv(x, weight, config=config), first)
    assert not any(counters.count_nonzero() for counters in kgemv._SPLIT_COUNTERS.values())
    assert rel_err(first.cpu().double(), _float64_linear(x.cpu(), weight.cpu(), None)) < 1e-6, fresh_seed


# One shape per branch of the one-row default configuration: short k, few output features, the rest.
@pytest.mark.parametrize("n,k", [(37, 300), (37, 1030), (1100, 1030)])
def test_one_row_in_each_default_configuration_equals_a_float64_product(n, k, fresh_seed):
    x, weight, bias = torch.randn(1, 1, k), torch.randn(n, k), torch.randn(n)
    got = kgemv.decode_linear(*to_device(x, weight, bias)).cpu()
    assert rel_err(got.double(), _float64_linear(x, weight, bias)) < 1e-6, (n, k, fresh_seed)


def test_decode_linear_takes_the_kernel_where_it_was_measured_faster(monkeypatch):
    weight, few = to_device(torch.randn(24, 40), torch.randn(2, 1, 40))
    assert not kgemv.prefers_cublas(2, 24, 40)
    assert torch.equal(kgemv.decode_linear(few, weight), kgemv.gemv(few, weight))
    # Mamba's in_proj shape at a few rows and anything but narrow weights above 16 rows: cuBLAS.
    assert kgemv.prefers_cublas(4, 10240, 2560) and kgemv.prefers_cublas(64, 2560, 5120)
    assert not kgemv.prefers_cublas(64, 192, 5120) and not kgemv.prefers_cublas(16, 4096, 4096)
    wide, many = to_device(torch.randn(8192, 40), torch.randn(kgemv.MAX_ROWS + 1, 40))
    assert torch.equal(kgemv.decode_linear(few, wide), F.linear(few, wide))
    assert torch.equal(kgemv.decode_linear(many, weight), F.linear(many, weight))
    monkeypatch.setenv(kgemv.ROWS_ENV, "1")  # batch 1 only
    assert torch.equal(kgemv.decode_linear(few, weight), F.linear(few, weight))
    mixed = to_device(torch.randn(2, 40, dtype=torch.float64))[0]  # a dtype the weight lacks: F.linear's promotion rules
    with pytest.raises(RuntimeError):
        F.linear(mixed, weight)
    with pytest.raises(RuntimeError):
        kgemv.decode_linear(mixed, weight)
    with pytest.raises(ValueError, match="at most 64 rows"):
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
    plan = ssmshard.Plan()
    decode = pipeline_steps(plan, "decode", "triton")
    assert decode.index("decode_gemv") < decode.index("swap_kernels")
    assert "decode_gemv" not in pipeline_steps(plan, "prefill", "triton") + pipeline_steps(plan, "decode", "reference")
    assert "decode_gemv" not in pipeline_steps(ssmshard.Plan(skip_passes=["decode_gemv"]), "decode", "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's compiled path needs a GPU")
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40, 64])
@pytest.mark.parametrize("n,k", [(2560 + 37, 5120 + 24), (192 + 5, 5120)])  # out_proj-like, x_proj-like (split k)
def test_gemv_on_a_gpu_in_bfloat16(rows, n, k, fresh_seed):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = _float64_linear(x, weight, bias)
    got = kgemv.gemv(x, weight, bias)  # the shape's default configuration
    cublas = F.linear(x, weight, bias)
    assert torch.equal(kgemv.decode_linear(x, weight, bias), cublas if kgemv.prefers_cublas(rows, n, k) else got)
    # Both round float32 sums to bfloat16 (2^-8 relative): as close to the float64 product as cuBLAS.
    assert rel_err(got.double(), expected) < 4e-3, (rows, fresh_seed)
    assert rel_err(got.double(), expected) <= 1.5 * rel_err(cublas.double(), expected), (rows, fresh_seed)
    # Replayed in a CUDA graph (split k: counters shared across launches) it gives the same values.
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kgemv.gemv(static_x, weight, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kgemv.gemv(static_x, weight, bias)
    for _ in range(3):
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(static_y, kgemv.gemv(static_x, weight, bias)), (rows, n, k, fresh_seed)
