"""Compiled rank programs (``Plan(compile=True)``): forward, prefill, chunk and decode programs
through torch.compile give Hugging Face eager's logits, gradients and greedy tokens, at tp 1
and 2 (gloo on the CPU; on a GPU the Triton kernels as opaque ops and the compiled decode step
replayed as a CUDA graph)."""

import json

import pytest
import torch

import ssmshard
from ssmshard.plan import PlanError

from conftest import SIX_FAMILIES
import compile_worker
from finishing_rows import check_finishing_rows


def test_compile_must_be_a_bool():
    with pytest.raises(PlanError, match="compile must be True or False"):
        ssmshard.Plan(compile="inductor")


def test_compiled_tsp_is_refused_before_anything_runs():
    with pytest.raises(PlanError, match="tsp=.*compile=True.*not supported.*order their collectives"):
        ssmshard.Plan(tsp=2, compile=True)


def _compiled(world, family, seed, tmp_path, device="cpu"):
    out = tmp_path / "compiled.json"
    ssmshard.launch(compile_worker.compiled_vs_hf, world, family, seed, str(out), device,
                    backend="nccl" if device == "cuda" else "gloo")
    return json.loads(out.read_text())


# On a GPU the gradients come from the Triton backward kernels, whose float32 gradients are
# checked to 3e-5 of HF's (tests/test_kernel_ssd_scan.py: chunked sums in another order); the
# compiled Zamba2 gradient measured 1.16e-5 for one seed (1385606979) on an H200, with transformers 5.17.
GPU_GRAD_TOL = 3e-5


def _check(result, where, gradients, grad_tol=1e-5):
    assert result["logits_err"] < 1e-5 and result["longer_err"] < 1e-5, (where, result["logits_err"], result["longer_err"])
    if gradients:
        assert not result["no_grad"], (where, result["no_grad"])
        assert result["grad_err"] < grad_tol, (where, result["grad_err"])
    assert result["ours"] == result["hf"], where
    assert result["chunked"] == result["ours"], where
    check_finishing_rows(result["finishing"], where)
    # Each program ran compiled, and the report says what compiling took.
    assert all(count >= 1 for count in result["compilations"].values()), (where, result["compilations"])
    assert f"compiled (Plan(compile=True)): {result['compilations']['forward']} compilations" in result["report"], where


# Sharded at tp = 2 by default. At tp = 1 the compiled gradients against HF are checked by
# test_kernel_ops_compile_with_their_gradients below; the whole tp-1 run (124 s in a CI run on 2
# cores, where Inductor's cache starts empty) is in the slow set; on a GPU every family's runs
# (test_compiled_graphed_decode_on_a_gpu_equals_hf).
@pytest.mark.parametrize("world,family", [pytest.param(1, "mamba", marks=pytest.mark.slow), (2, "mamba2")])
def test_compiled_programs_equal_hf(world, family, tmp_path, fresh_seed):
    _check(_compiled(world, family, fresh_seed, tmp_path), f"{family} tp={world} (seed {fresh_seed})", world == 1)


@pytest.mark.slow
@pytest.mark.parametrize("world,family", [(1, f) for f in SIX_FAMILIES if f != "mamba"]
                         + [(2, f) for f in ("zamba2", "llama")])
def test_compiled_programs_of_every_family_equal_hf(world, family, tmp_path, fresh_seed):
    _check(_compiled(world, family, fresh_seed, tmp_path), f"{family} tp={world} (seed {fresh_seed})", world == 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels and CUDA graphs need a GPU")
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_compiled_graphed_decode_on_a_gpu_equals_hf(family, tmp_path, fresh_seed):
    """On a GPU: the SSM kernels as opaque ops in the compiled graphs, the compiled decode step
    captured as a CUDA graph (attention families over static key/value buffers)."""
    result = _compiled(1, family, fresh_seed, tmp_path, "cuda")
    _check(result, f"{family} tp=1 on a GPU (seed {fresh_seed})", gradients=True, grad_tol=GPU_GRAD_TOL)
    assert result["graphed"], family


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor-parallel CUDA graphs need 2 GPUs")
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_compiled_graphed_decode_at_tp2_on_gpus_equals_hf(family, tmp_path, fresh_seed):
    result = _compiled(2, family, fresh_seed, tmp_path, "cuda")
    _check(result, f"{family} tp=2 on GPUs (seed {fresh_seed})", gradients=False)
    assert result["graphed"], family


# Llama: transformers 5.17 exports its rotary embedding as a no-grad region, which is inlined
# before compiling (runtime/compiled.py); the compat run checks it on that version.
@pytest.mark.parametrize("family", ["mamba", "mamba2", pytest.param("llama", marks=pytest.mark.compat)])
def test_kernel_ops_compile_with_their_gradients(family, fresh_seed):
    """The path a GPU takes, on the CPU: SSM nodes retargeted to the opaque kernel ops (which run
    the reference off CUDA) and the norms to their reference functions, the program compiled;
    logits and every weight's gradient against HF eager (1e-5 relative, whole gradient), the
    backward through the ``<op>_grad`` ops."""
    from ssmshard.passes import run_pipeline
    from ssmshard.passes.swap_kernels import LEFT_TO_INDUCTOR
    from ssmshard.testing import joint_rel_err, rel_err

    from conftest import small_model

    model = small_model(family)
    program = run_pipeline(ssmshard.capture(model), [("fuse_rmsnorm", {}),
                                                     ("swap_kernels", {"kernels": "triton", "compile": True})])
    assert {str(n.target).split(".")[0] for n in program.graph.nodes if "ssmshard" in str(n.target)} <= {"ssmshard_kernels"}
    # The norms are left to Inductor: their nodes call the reference functions, traced into ATen ops.
    norms = [r for r in program.kernel_report if "norm" in r["op"]]
    assert norms and all(r["kernel"] == "inductor" for r in norms), program.kernel_report
    assert {n.target for n in program.graph.nodes if n.name in {r["node"] for r in norms}} <= set(LEFT_TO_INDUCTOR.values())
    program.compile = True
    weights = {k: v.detach().clone().requires_grad_(True) for k, v in program.weights.items()}
    program.weights = weights
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=generator)
    scale = torch.randn(2, 12, model.config.vocab_size, generator=generator)
    logits = program(ids)
    (logits * scale).sum().backward()
    expected = model(ids).logits
    (expected * scale).sum().backward()
    assert program.compilations, "the program did not run compiled"
    assert rel_err(logits, expected) < 1e-5
    hf = dict(model.named_parameters(remove_duplicate=False))
    params = [k for k in weights if k in hf]  # not the buffers (rotary inv_freq)
    assert params and all(weights[k].grad is not None for k in params)
    grad_err = joint_rel_err((weights[k].grad, hf[k].grad) for k in params)
    assert grad_err < 1e-5, (family, fresh_seed, grad_err)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_compiled_decode_writes_states_through_the_opaque_writers(family, fresh_seed):
    """The decode program a GPU compiles, on the CPU: the SSM decode-step nodes retargeted to the
    opaque kernel ops, then ``inplace_decode_states`` turns them into the ``<op>_into_state``
    ops (state declared mutated, only the output returned). Compiled, each step's logits are
    the eager program's (1e-5), every state comes back as the tensor passed in, and greedy
    tokens from left-padded prompts of different lengths are HF's."""
    from ssmshard.passes import run_pipeline
    from ssmshard.testing import rel_err

    from conftest import small_model
    from test_decode_passes import decode_step_by_step, greedy_tokens_and_hf

    model = small_model(family)
    plain = ssmshard.capture(model, mode="decode")
    passed = run_pipeline(ssmshard.capture(model, mode="decode"),
                          [("swap_kernels", {"kernels": "triton", "compile": True}), "inplace_decode_states"])
    writers = {str(n.target) for n in passed.graph.nodes if str(n.target).endswith("_into_state.default")}
    assert writers == {"ssmshard_kernels.causal_conv1d_update_into_state.default",
                       "ssmshard_kernels.selective_state_update_into_state.default"}, writers
    assert passed.states_written_by_op, "no state is written by its op"
    passed.compile = True
    results, same_objects = decode_step_by_step(model, plain, passed, fresh_seed)
    where = f"{family} (seed {fresh_seed})"
    assert passed.compilations, "the decode program did not run compiled"
    assert max(rel_err(got, expected) for got, expected in results) < 1e-5, where
    assert same_objects, where
    tokens, hf = greedy_tokens_and_hf(model, passed, fresh_seed, max_new_tokens=8)
    assert torch.equal(tokens, hf), where
