"""The fuse_rmsnorm pass: every RMSNorm of a captured program (and the residual add before it)
becomes one node, and the program still computes Hugging Face's logits and tokens."""

import copy

import pytest
import torch

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.passes.fuse_gemv_conv import gemv_conv_kernel
from ssmshard.passes.swap_kernels import KERNELS
from ssmshard.runtime.simulated import SimulatedMesh
from ssmshard.testing import rel_err

from conftest import pipeline_steps, small_model

aten, ssm = torch.ops.aten, torch.ops.ssmshard
NORM_OPS = (ssm.rms_norm.default, ssm.add_rms_norm.default)
FAMILIES = ["mamba", "mamba2", "zamba2", "llama"]


def rmsnorm_call_sites(model) -> list[str]:
    """Names of the model's (ungated) RMSNorm modules: one call site each."""
    return sorted(name for name, module in model.named_modules()
                  if type(module).__name__.endswith("RMSNorm"))


def assert_every_norm_fused(program, model, norm_targets=NORM_OPS):
    """One fused node (calling one of ``norm_targets``) per norm call site, tagged, and none of
    the norms' small ops left."""
    report = program.norm_fusion_report
    assert sorted(r["call_site"] for r in report) == rmsnorm_call_sites(model)
    fused = [n for n in program.graph.nodes if n.op == "call_function" and n.target in norm_targets]
    assert len(fused) == len(report) and all(n.meta.get("ssmshard") for n in fused)
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert not {aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.mean.dim} & targets


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_program_gives_hf_logits(family, fresh_seed):
    model = small_model(family)
    unfused = ssmshard.capture(model)
    fused = run_pipeline(copy.deepcopy(unfused), ["fuse_rmsnorm"])
    assert_every_norm_fused(fused, model)
    assert any(r["residual_add"] for r in fused.norm_fusion_report)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        logits = fused(ids)
        assert rel_err(logits, model(ids).logits) <= 1e-5
        assert torch.equal(logits, unfused(ids))  # the reference op is the chain's arithmetic


def test_fused_bf16_program_is_the_unfused_one(fresh_seed):
    """Mamba's residual_in_fp32 in bfloat16: float32 residual, bfloat16 norm input (a cast
    between the add and the norm); the fused program matches bit for bit."""
    model = small_model("mamba").to(torch.bfloat16)
    try:
        unfused = ssmshard.capture(model)
        program = run_pipeline(copy.deepcopy(unfused), ["fuse_rmsnorm"])
        assert all(r["residual_add"] for r in program.norm_fusion_report[1:])
        fused = [n for n in program.graph.nodes if n.target is ssm.add_rms_norm.default]
        assert fused and all(n.args[4] is torch.bfloat16 and n.args[1].meta["val"].dtype == torch.float32
                             for n in fused[:-1])
        ids = torch.randint(0, model.config.vocab_size, (2, 9))
        with torch.no_grad():
            assert torch.equal(program(ids), unfused(ids))
    finally:
        model.float()


def test_pipeline_fuses_inference_programs_only_under_triton():
    plan = ssmshard.Plan()
    decode = pipeline_steps(plan, "decode", "triton")
    # then the decode GEMVs and the kernels, then the inference passes
    between = decode[decode.index("fuse_rmsnorm") + 1:decode.index("swap_kernels") + 1]
    assert between == ["decode_gemv", "fuse_dt_proj", "group_decode_linears", "fuse_gated_activation", "fuse_rotary",
                       "fold_cache_positions", "hoist_attention_mask", "swap_kernels"]
    assert "fuse_rmsnorm" in pipeline_steps(plan, "prefill", "triton")
    # Training forward programs keep torch's norms (the fused kernel has no backward).
    assert "fuse_rmsnorm" not in pipeline_steps(plan, "forward", "triton") + pipeline_steps(plan, "decode", "reference")
    assert "fuse_rmsnorm" in pipeline_steps(ssmshard.Plan(training=False), "forward", "triton")
    skipping = ssmshard.Plan(skip_passes=["fuse_rmsnorm"])
    assert "fuse_rmsnorm" not in pipeline_steps(skipping, "decode", "triton")
    assert "swap_kernels" in pipeline_steps(skipping, "decode", "triton")
    for bad in (["propagate"], "fuse_rmsnorm", ["no_such_pass"]):
        with pytest.raises(ssmshard.PlanError, match="skip_passes must list optimisation passes"):
            ssmshard.Plan(skip_passes=bad)


def test_tensor_parallel_generation_with_fused_norms_gives_hf_tokens(monkeypatch, fresh_seed):
    """The rank pipeline as on CUDA (kernels="triton": fuse_rmsnorm then swap_kernels, whose
    adapters run the reference ops on CPU tensors) at tp=2: the fused norms sit on replicated
    values between the all-reduces."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    model = small_model("mamba")
    mesh = SimulatedMesh(model, ssmshard.Plan(tp=2))
    # Ids from 1 and the same minimum length on both sides: this model's EOS and pad id is 0, so a
    # 0 in the prompt would be padding and an early 0 would end only our generation.
    ids = torch.randint(1, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        tokens = mesh.generate(ids, max_new_tokens=4, min_new_tokens=4)
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(tokens, expected)
    decode = mesh.ranks[0]._generation["decode"]  # swap_kernels put the fused nodes on their kernel adapters
    assert_every_norm_fused(decode, model, norm_targets={KERNELS[op][0] for op in NORM_OPS})
    # The decode GEMVs too (decode_gemv): x_proj, out_proj per layer and the head; in_proj with the
    # conv update (fuse_gemv_conv); the sharded dt_proj (``weight @ x``, rewritten) folded into the
    # state update (fuse_dt_proj).
    gemvs = [n for n in decode.graph.nodes if n.target is KERNELS[ssm.decode_linear.default][0]]
    layers = model.config.num_hidden_layers
    assert len(gemvs) == 2 * layers + 1 and all("placement" in n.meta for n in gemvs)
    assert len([n for n in decode.graph.nodes if n.target is gemv_conv_kernel]) == layers


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_inference_forward_with_fused_norms_gives_hf_logits(monkeypatch, sequence_parallel, fresh_seed):
    """A forward program of a plan that does not train, as on CUDA (kernels="triton"), at tp=2:
    its norms are fused, on replicated values or on sequence shards (sequence parallelism)."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    model = small_model("mamba")
    mesh = SimulatedMesh(model, ssmshard.Plan(tp=2, training=False, sequence_parallel=sequence_parallel))
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert rel_err(mesh(ids), model(ids).logits) <= 1e-5
    assert_every_norm_fused(mesh.program, model, norm_targets={KERNELS[op][0] for op in NORM_OPS})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_graphed_decode_on_fused_norm_kernels_generates_hf_tokens(family, fresh_seed):
    """On a GPU: prefill and decode with fused norms on the Triton kernels (the gated norm too),
    the decode replayed as a CUDA graph: the tokens of eager generation and of HF generate."""
    from test_cuda_graph import _graphed_and_hf, _prompts

    from ssmshard.runtime.cuda_graph import GraphedDecode
    from ssmshard.runtime.generate import generate

    model = small_model(family).cuda()
    try:
        steps = ["fuse_rmsnorm", ("swap_kernels", {"kernels": "triton"})]
        prefill, decode = (run_pipeline(ssmshard.capture(model, mode=mode), steps) for mode in ("prefill", "decode"))
        norms = {r["op"] for r in decode.kernel_report if r["kernel"] == "triton"}
        assert {"rms_norm", "add_rms_norm"} <= norms and (family != "mamba2" or "gated_rms_norm" in norms)
        ids, mask, options = _prompts(model, fresh_seed)
        eager = generate(prefill, decode, ids, mask, **options)
        graphed, again, hf = _graphed_and_hf(model, prefill, GraphedDecode(decode), ids, mask, options)
    finally:
        model.cpu()
    assert torch.equal(graphed, eager) and torch.equal(again, eager) and torch.equal(eager, hf), fresh_seed
