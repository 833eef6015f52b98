"""The ``token_major_in_proj`` pass: Mamba-1's ``in_proj`` computed as ``W @ hidden^T``, so that the
conv's input, its output (the scan's u) and the gate z are token-contiguous. Checked on the CPU
with the GPU plan's passes (the kernel adapters run the reference ops on CPU tensors) at tp 2:
forward and prefill logits against Hugging Face eager within 1e-5 (float32), greedy tokens equal
to HF's, and the layouts the rewrite is for."""

import pytest
import torch

import ssmshard
from ssmshard.testing import rel_err

from conftest import pipeline_steps, simulated_gpu_plan_generation, small_model

aten = torch.ops.aten


def _kernel_targets():
    from ssmshard.passes.swap_kernels import KERNELS
    ssm = torch.ops.ssmshard
    return KERNELS[ssm.causal_conv1d.default][0], KERNELS[ssm.selective_scan.default][0]


def _check_layouts(program, layers):
    """Every in_proj a matmul of the weight and the transposed hidden states, and the conv's
    input and output and the scan's u and z with their tokens contiguous."""
    from ssmshard.ops import SIGNATURES

    conv, scan = _kernel_targets()
    assert len(program.token_major_report) == layers
    nodes = list(program.graph.nodes)
    assert not [n for n in nodes if n.target is aten.linear.default and "in_proj" in str(n.args[1])]
    convs = [n for n in nodes if n.target is conv]
    scans = [n for n in nodes if n.target is scan]
    assert len(convs) == len(scans) == layers
    for node in convs:
        assert node.args[0].meta["val"].stride(-1) == 1 and node.meta["val"].stride(-1) == 1
    for node in scans:
        a = SIGNATURES["selective_scan"].bind(node.args, node.kwargs)
        assert a["u"].meta["val"].stride(-1) == 1 and a["z"].meta["val"].stride(-1) == 1


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_token_major_in_proj_equals_hf(family, fresh_seed, monkeypatch):
    model = small_model(family)
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, training=False))
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=generator)
    with torch.no_grad():
        expected = model(ids).logits
        logits = mesh.run(lambda dm: dm(ids))
        prefill = mesh.prefill(ids)
    for rank, dm in enumerate(mesh.ranks):
        assert rel_err(logits[rank], expected) < 1e-5, f"rank {rank}, seed {fresh_seed}"
        assert rel_err(prefill[rank][0], expected[:, -1:]) < 1e-5, f"rank {rank}, seed {fresh_seed}"
        for program in (dm.program, dm.prefill_program()):
            _check_layouts(program, model.config.num_hidden_layers)


def test_token_major_in_proj_generates_hf_tokens(fresh_seed, monkeypatch):
    tokens, expected, mesh = simulated_gpu_plan_generation(small_model("mamba"), fresh_seed, monkeypatch)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    assert all(len(dm.prefill_program().token_major_report) == 2 for dm in mesh.ranks)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_left_padded_chunked_generation_gives_hf_tokens(family, fresh_seed, monkeypatch):
    """Prompts of different lengths, left-padded, prefilled in chunks: HF's greedy tokens. The
    prefill program is rewritten; the chunk program's conv reads the carried conv state joined to
    x (a ``cat``, which the pass does not look through), so it keeps HF's layout."""
    from generate_worker import left_padded_prompts

    model = small_model(family)
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2))
    ids, mask = left_padded_prompts(model.config.vocab_size, [9, 4, 7], fresh_seed)
    with torch.no_grad():
        tokens = mesh.generate(ids, attention_mask=mask, max_new_tokens=4, prefill_chunk_size=4)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    for dm in mesh.ranks:
        assert len(dm.prefill_program().token_major_report) == model.config.num_hidden_layers
        for program in (dm.prefill_program(), dm.chunk_program()):
            for entry in program.token_major_report:
                node = next(n for n in program.graph.nodes if n.name == entry["node"])
                assert node.target is aten.matmul.default and node.meta["val"].stride(-1) == 1


def test_only_inference_programs_and_it_can_be_skipped():
    """A training forward keeps HF's linear: with a weight that requires grad, ATen's matmul
    would copy the transposed operand."""
    assert "token_major_in_proj" not in pipeline_steps(ssmshard.Plan(tp=2), "forward")
    for mode in ("forward", "prefill", "chunk"):
        assert "token_major_in_proj" in pipeline_steps(ssmshard.Plan(tp=2, training=False), mode)
    assert "token_major_in_proj" not in pipeline_steps(ssmshard.Plan(tp=2, training=False), "decode")
    skipped = ssmshard.Plan(tp=2, training=False, skip_passes=["token_major_in_proj"])
    assert "token_major_in_proj" not in pipeline_steps(skipped, "forward")
