"""Linear layers of a decode step that read the same input, as one launch: the grouped one-row
kernel (``kernels/gemv.py``, on Triton's CPU interpreter here) against float64 products, and the
``group_decode_linears`` pass against the decode program without it and against Hugging Face.

Dimension letters: n output features of a weight, k input features."""

import operator

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.kernels import gemv as kgemv
from ssmshard.passes import group_decode_linears as gdl, run_pipeline
from ssmshard.testing import rel_err

from conftest import pipeline_steps, simulated_gpu_plan_generation, small_model
from test_decode_passes import INFERENCE_PASSES, decode_step_by_step, greedy_tokens_and_hf
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

ssm = torch.ops.ssmshard
# Small tiles on the interpreter, so that every weight spans several programs and the last is partial.
CONFIG = dict(BLOCK_N=4, BLOCK_K=64, num_warps=4, num_stages=1)


@pytest.mark.parametrize("sizes", [(37, 5), (37, 5, 64), (37, 5, 64, 19)])
def test_grouped_gemv_equals_float64_products(sizes, fresh_seed):
    k = 300
    x = torch.randn(1, 1, k)
    weights = [torch.randn(n, k) for n in sizes]
    outs = kgemv.grouped_gemv(to_device(x)[0], to_device(*weights), config=CONFIG)
    for out, weight in zip(to_cpu(*outs), weights):
        assert out.shape == (1, 1, weight.shape[0])
        assert rel_err(out.double(), x.double() @ weight.double().T) < 1e-6, (sizes, fresh_seed)


def test_grouped_gemv_in_bfloat16_with_the_default_tiling(fresh_seed):
    x = torch.randn(1, 300, dtype=torch.bfloat16)
    weights = [torch.randn(n, 300, dtype=torch.bfloat16) for n in (40, 24)]
    for out, weight in zip(to_cpu(*kgemv.decode_linear_group(to_device(x)[0], to_device(*weights))), weights):
        # float32 sums rounded to bfloat16 (2^-8 relative); the interpreter truncates (2^-7)
        assert rel_err(out.double(), x.double() @ weight.double().T) < 2 ** -7, fresh_seed


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_grouped_gemv_of_several_rows_equals_float64_products(rows, fresh_seed):
    """The tensor-core path (rows padded to 16 or a power of two) over a group: q/k/v-like widths."""
    k = 200
    x = torch.randn(rows, 1, k)
    weights = [torch.randn(n, k) for n in (37, 5, 19)]
    config = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1)
    outs = kgemv.grouped_gemv(to_device(x)[0], to_device(*weights), config=config)
    for out, weight in zip(to_cpu(*outs), weights):
        assert out.shape == (rows, 1, weight.shape[0])
        assert rel_err(out.double(), x.double() @ weight.double().T) < 1e-6, (rows, fresh_seed)


def test_wide_groups_few_rows_or_the_row_limit_take_the_per_weight_path(monkeypatch):
    x = torch.randn(kgemv.GROUPED_MIN_ROWS, 1, 40)
    narrow = [torch.randn(7, 40), torch.randn(9, 40)]
    wide = [torch.randn(kgemv.MAX_GROUPED_FEATURES, 40), torch.randn(9, 40)]
    calls = []
    grouped = kgemv.grouped_gemv
    monkeypatch.setattr(kgemv, "grouped_gemv", lambda *a, **kw: calls.append(1) or grouped(*a, **kw))
    for weights, launches in ((narrow, 1), (wide, 0)):
        x_dev, *weights = to_device(x, *weights)
        before = len(calls)
        outs = kgemv.decode_linear_group(x_dev, weights)
        assert len(calls) - before == launches
        for out, w in zip(outs, weights):
            assert rel_err(out.double().cpu(), x.double() @ w.double().cpu().T) < 1e-6
    monkeypatch.setenv(kgemv.GROUP_ROWS_ENV, "1")  # grouped launches at batch 1 only
    before = len(calls)
    kgemv.decode_linear_group(*to_device(x), to_device(*narrow))
    assert len(calls) == before
    monkeypatch.delenv(kgemv.GROUP_ROWS_ENV)
    kgemv.decode_linear_group(*to_device(x[:kgemv.GROUPED_MIN_ROWS - 1]), to_device(*narrow))  # too few rows
    assert len(calls) == before
    with pytest.raises(ValueError, match="2 to 4 weights"):
        kgemv.grouped_gemv(x[:1], weights * 3)
    with pytest.raises(ValueError, match="2 to 4 weights"):
        kgemv.grouped_gemv(x[:1], [weights[0], weights[1].double()])
    assert gdl.MAX_GROUP == kgemv.MAX_GROUP


def test_chunks_split_evenly():
    assert [len(c) for c in gdl._chunks(list(range(6)), 4)] == [3, 3]
    assert [len(c) for c in gdl._chunks(list(range(5)), 4)] == [3, 2]
    assert [len(c) for c in gdl._chunks(list(range(4)), 4)] == [4]


def _groups(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is ssm.decode_linear_group.default]


# Sizes of the groups each layer gets. Llama: q/k/v and gate/up. Zamba2's hybrid layers (the small
# config has attention adapters): q/k/v and their adapters' first projections, six readers of one
# input as two groups of three, then the MLP's gate_up with its adapter; its Mamba layers, none.
GROUP_SIZES = {"llama": lambda config: [3, 2] * config.num_hidden_layers,
               "zamba2": lambda config: [3, 3, 2] * config.layers_block_type.count("hybrid")}


@pytest.mark.parametrize("family", sorted(GROUP_SIZES))
def test_grouping_keeps_logits_and_tokens(family, fresh_seed):
    model = small_model(family)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), ["decode_gemv", *INFERENCE_PASSES])
    grouped = run_pipeline(ssmshard.capture(model, mode="decode"), ["decode_gemv", "group_decode_linears",
                                                                     *INFERENCE_PASSES])
    groups = _groups(grouped)
    assert [len(group.args[1]) for group in groups] == GROUP_SIZES[family](model.config), family
    assert len(groups) == len(grouped.linear_group_report), family
    for group in groups:
        x, weights = group.args
        assert 2 <= len(weights) <= gdl.MAX_GROUP and all(w.op == "placeholder" for w in weights)
        assert all(u.target is operator.getitem for u in group.users)
    linears = sum(len(names) for names in grouped.linear_group_report)
    assert (grouped.op_counts()["ssmshard.decode_linear"]
            == plain.op_counts()["ssmshard.decode_linear"] - linears), family
    where = f"{family} (seed {fresh_seed})"
    for got, expected in decode_step_by_step(model, plain, grouped, fresh_seed)[0]:
        assert rel_err(got, expected) < 1e-6, where  # the same products on the reference op
    tokens, hf = greedy_tokens_and_hf(model, grouped, fresh_seed)
    assert torch.equal(tokens, hf), where


def test_mamba_has_nothing_to_group_and_other_programs_are_left_alone():
    mamba = run_pipeline(ssmshard.capture(small_model("mamba"), mode="decode"), ["decode_gemv"])
    before = mamba.op_counts()
    assert run_pipeline(mamba, ["group_decode_linears"]).op_counts() == before and mamba.linear_group_report == []
    prefill = ssmshard.capture(small_model("llama"), mode="prefill")
    before = prefill.op_counts()
    assert run_pipeline(prefill, ["group_decode_linears"]).op_counts() == before


def test_plan_runs_it_before_the_kernel_swap_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("decode_gemv") < decode.index("group_decode_linears") < decode.index("swap_kernels")
    assert "group_decode_linears" not in pipeline_steps(ssmshard.Plan(skip_passes=["group_decode_linears"]))


def test_sharded_generation_with_groups_equals_hf(monkeypatch, fresh_seed):
    """tp=2 with the GPU plan's decode passes: each group holds the rank's shards of q/k/v (and of
    gate/up), the group keeps their placements."""
    model = small_model("llama")
    tokens, expected, mesh = simulated_gpu_plan_generation(model, fresh_seed, monkeypatch)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    program = mesh.ranks[0]._generation["decode"]
    groups = [n for n in program.graph.nodes if "decode_linear_group" in getattr(n.target, "__name__", "")]
    assert len(groups) == 2 * model.config.num_hidden_layers
    for group in groups:
        assert len(group.meta["placement"]) == len(group.args[1])
        assert all(u.meta["placement"] == p for u, p in zip(sorted(group.users, key=lambda u: u.args[1]),
                                                           group.meta["placement"]))
