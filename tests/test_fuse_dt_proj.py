"""Mamba-1's ``dt_proj`` folded into the decode step's state update: the kernel's folded path
(``kernels/state_update.py``, on Triton's CPU interpreter here) against a float64 step, and the
``fuse_dt_proj`` pass against the decode program without it and against Hugging Face.

Dimension letters: b batch, d channels, n state size, r dt rank, g groups of B / C."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.kernels import reference
from ssmshard.kernels import state_update as ksu
from ssmshard.passes import run_pipeline
from ssmshard.testing import rel_err

from conftest import pipeline_steps, simulated_gpu_plan_generation, small_model
from test_decode_passes import INFERENCE_PASSES, decode_step_by_step, greedy_tokens_and_hf
from test_kernel_selective_scan import DEVICE, FP32_TOL, to_cpu, to_device
from test_ops import seq_state_update

aten, ssm = torch.ops.aten, torch.ops.ssmshard
FUSED = ["decode_gemv", "fuse_dt_proj", *INFERENCE_PASSES]


def _mamba1_step(b, d, n, r, g=None, dtype=torch.float32):
    """A Mamba-1 step's inputs: state, x, dt_proj's input and weight, A, B, C, D, z, dt_bias."""
    bc = (b, n) if g is None else (b, g, n)
    return (torch.randn(b, d, n), torch.randn(b, d, dtype=dtype), torch.randn(b, r, dtype=dtype) * 0.5,
            (torch.randn(d, r) / r ** 0.5).to(dtype), -torch.exp(torch.randn(d, n) * 0.5),
            torch.randn(bc, dtype=dtype), torch.randn(bc, dtype=dtype), torch.randn(d), torch.randn(b, d, dtype=dtype),
            torch.randn(d))


def _float64_step(state, x, low, weight, A, B, C, D, z, dt_bias):
    """The step in float64 on the Mamba-2 layout (one head of d channels per group)."""
    g = 1 if B.dim() == 2 else B.shape[1]
    dt = (low.double() @ weight.double().T).to(x.dtype).double()  # rounded as the projection's output
    heads = lambda t: t.double().unflatten(1, (g, -1))  # noqa: E731  (b, d, ...) -> (b, g, e, ...)
    out, new = seq_state_update(heads(state), heads(x), heads(dt), A.double().unflatten(0, (g, -1)),
                                B.double().reshape(B.shape[0], g, -1), C.double().reshape(C.shape[0], g, -1),
                                D.double().unflatten(0, (g, -1)), heads(z), dt_bias.double().unflatten(0, (g, -1)),
                                True)
    return out.flatten(1, 2), new.flatten(1, 2)


# Batch 3 runs the folded kernel; batch FUSED_DT_MAX_BATCH + 1 projects first (the docstring says why).
@pytest.mark.parametrize("b", [1, 3, ksu.FUSED_DT_MAX_BATCH + 1])
@pytest.mark.parametrize("grouped", [False, True])
def test_folded_state_update_equals_a_float64_step(b, grouped, fresh_seed):
    d, n, r = 12, 16, 10  # r not a power of two: masked lanes of the rank
    args = _mamba1_step(b, d, n, r, g=3 if grouped else None)
    state, x, low, weight, A, B, C, D, z, dt_bias = args
    config = dict(BLOCK_P=2, num_warps=1) if DEVICE == "cpu" else None  # p = d / g leaves partial blocks
    out, new = to_cpu(*ksu.selective_state_update(*to_device(state, x, low, A, B, C, D, z, dt_bias), True,
                                                  dt_proj_weight=to_device(weight)[0], config=config))
    out_ref, new_ref = _float64_step(*args)
    where = f"b {b}, grouped {grouped}, seed {fresh_seed}"
    assert rel_err(out, out_ref) <= FP32_TOL and rel_err(new, new_ref) <= FP32_TOL, where
    if grouped:
        return  # the reference op takes Mamba-1's B and C as (b, n) only
    # The reference op projects dt first, as the unfused program did.
    out_op, new_op = reference.selective_state_update(state, x, low, A, B, C, D, z, dt_bias, True, weight)
    out_unfused, new_unfused = reference.selective_state_update(state, x, F.linear(low, weight), A, B, C, D, z,
                                                                dt_bias, True)
    assert torch.equal(out_op, out_unfused) and torch.equal(new_op, new_unfused), where


def test_folded_state_update_in_bfloat16_rounds_dt_as_the_projection_did(fresh_seed):
    # bf16 activations and weight, float32 state: dt is rounded to bf16 before the softplus, as
    # the projection's bf16 output was. Against float64 with that rounding: the bf16 output's
    # own rounding (the interpreter truncates: a full ulp, 2^-7; a GPU rounds, 2^-8), plus what a
    # one-ulp flip of one channel's dt does (dt is rounded from float32 here, from float64 there):
    # it moves that channel's state, and so the output, by about 2^-8 relative (seed 2838535213:
    # 0.0083 on the interpreter, above 2^-7 alone).
    args = _mamba1_step(2, 16, 16, 8, dtype=torch.bfloat16)
    state, x, low, weight, A, B, C, D, z, dt_bias = args
    out, new = to_cpu(*ksu.selective_state_update(*to_device(state, x, low, A, B, C, D, z, dt_bias), True,
                                                  dt_proj_weight=to_device(weight)[0]))
    out_ref, new_ref = _float64_step(*args)
    own_rounding = 2.0**-8 if DEVICE == "cuda" else 2.0**-7
    assert out.dtype == torch.bfloat16 and rel_err(out, out_ref) <= own_rounding + 2.0**-8, fresh_seed
    assert rel_err(new, new_ref) <= 2.0**-7, fresh_seed


def test_folded_state_update_refuses_what_it_cannot_fold():
    state, x, low, weight, A, B, C, D, z, dt_bias = _mamba1_step(2, 12, 16, 10)
    with pytest.raises(ValueError, match=r"dt must be \(b, r\)"):
        ksu.selective_state_update(state, x, low[:, None], A, B, C, D, z, dt_bias, True, dt_proj_weight=weight)
    with pytest.raises(ValueError, match="Mamba-1's"):
        ksu.selective_state_update(state[:, None], x[:, None], low, A[None], B[:, None], C[:, None], None, None,
                                   None, True, dt_proj_weight=weight)
    with pytest.raises(ValueError, match="Mamba-1's"):
        reference.selective_state_update(state[:, None], x[:, None], low, A[None], B[:, None], C[:, None],
                                         None, None, None, True, weight)


def _updates(program):
    """The state update nodes, on the op or (after ``inplace_decode_states``) its state writer."""
    return [n for n in program.graph.nodes if n.op == "call_function"
            and "selective_state_update" in getattr(n.target, "__name__", str(n.target))]


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_fuse_dt_proj_folds_every_layer_and_keeps_logits_and_tokens(family, fresh_seed):
    model = small_model(family)
    plain = run_pipeline(ssmshard.capture(model, mode="decode"), ["decode_gemv", *INFERENCE_PASSES])
    fused = run_pipeline(ssmshard.capture(model, mode="decode"), FUSED)
    layers = model.config.num_hidden_layers
    assert len(fused.dt_proj_fusion_report) == len(_updates(fused)) == layers, family
    for update in _updates(fused):
        weight = update.args[10]
        assert weight.op == "placeholder" and weight.meta["val"].shape[0] == model.config.intermediate_size
    counts = fused.op_counts()["ssmshard.decode_linear"], plain.op_counts()["ssmshard.decode_linear"]
    assert counts[0] == counts[1] - layers, counts  # one projection fewer per layer
    where = f"{family} (seed {fresh_seed})"
    for got, expected in decode_step_by_step(model, plain, fused, fresh_seed)[0]:
        assert rel_err(got, expected) < 1e-6, where  # the same float32 products, summed in another order
    tokens, hf = greedy_tokens_and_hf(model, fused, fresh_seed)
    assert torch.equal(tokens, hf), where


def test_fuse_dt_proj_leaves_mamba2_and_other_programs_alone():
    mamba2 = run_pipeline(ssmshard.capture(small_model("mamba2"), mode="decode"), ["decode_gemv"])
    before = mamba2.op_counts()
    assert run_pipeline(mamba2, ["fuse_dt_proj"]).op_counts() == before and mamba2.dt_proj_fusion_report == []
    prefill = ssmshard.capture(small_model("mamba"), mode="prefill")
    before = prefill.op_counts()
    assert run_pipeline(copy.deepcopy(prefill), ["fuse_dt_proj"]).op_counts() == before
    # Without decode_gemv, dt_proj is still a matmul: nothing to fold.
    decode = ssmshard.capture(small_model("mamba"), mode="decode")
    before = decode.op_counts()
    assert run_pipeline(decode, ["fuse_dt_proj"]).op_counts() == before


def test_plan_runs_it_after_decode_gemv_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan(), "decode")
    assert decode.index("decode_gemv") + 1 == decode.index("fuse_dt_proj") < decode.index("swap_kernels")
    assert "fuse_dt_proj" not in pipeline_steps(ssmshard.Plan(), "prefill")
    assert "fuse_dt_proj" not in pipeline_steps(ssmshard.Plan(skip_passes=["fuse_dt_proj"]), "decode")


def test_sharded_generation_with_the_fold_equals_hf(monkeypatch, fresh_seed):
    """tp=2 with the GPU plan's decode passes (the adapters run the reference op on the CPU): the
    fold runs on each rank's shard of dt_proj (its channels) after sharding."""
    model = small_model("mamba")
    tokens, expected, mesh = simulated_gpu_plan_generation(model, fresh_seed, monkeypatch)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    decode = mesh.ranks[0]._generation["decode"]
    assert len(decode.dt_proj_fusion_report) == model.config.num_hidden_layers
    weights = [u.args[10].meta["val"] for u in _updates(decode)]
    assert weights and all(w.shape[0] == model.config.intermediate_size // 2 for w in weights)
