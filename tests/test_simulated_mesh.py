"""``SimulatedMesh`` against real processes: the same plan (TP with a dropped and quantized sync
points) launched over gloo gives the same logits as the simulated mesh in one process. Its ranks
share one capture per program, and generate HF's tokens from prompts shorter than the conv
kernel (on the CPU, and on a GPU with the Triton kernels)."""


import pytest
import torch

import ssmshard
from ssmshard.testing import rel_err

import mesh_worker
from conftest import small_model


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_simulated_mesh_equals_a_gloo_run(world, tmp_path, fresh_seed):
    model = small_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(fresh_seed))
    out = tmp_path / "logits.pt"
    ssmshard.launch(mesh_worker.logits, world, ids, str(out), backend="gloo")
    mesh = ssmshard.SimulatedMesh(model, mesh_worker.plan_for(world))
    with torch.no_grad():
        simulated = mesh(ids)
        exact = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=world))(ids)
    assert {p.action for p in mesh.program.sync_points} == {"kept", "dropped", "quantized"}
    assert rel_err(simulated, torch.load(out)) < 1e-6, f"world {world} (seed {fresh_seed})"
    assert rel_err(simulated, exact) > 1e-4  # the plan did change the values


# Prompts shorter than the conv kernel: HF pads them, Mamba-2 (and Mamba) by a pad of symbolic
# width (a cat of a pad sized after the split tensor), Falcon-Mamba (and Zamba) by a constant pad
# once the length is fixed. The slow set runs every family.
@pytest.mark.parametrize("family", ["mamba2", "falcon_mamba", *(pytest.param(f, marks=pytest.mark.slow)
                                                                for f in ("mamba", "zamba", "zamba2", "llama"))])
def test_the_ranks_share_one_capture_of_each_program_and_shard_their_own_siblings(family, monkeypatch, fresh_seed):
    """A mesh exports each generation program once for all its ranks (each rank shards a copy);
    prompts outside the captured prefill's range (1 to 3 tokens, shorter than the conv kernel)
    take sibling programs, which each rank captures from its own copy, so a sibling runs that
    rank's passes: HF's greedy tokens at tp = 2 for every prompt length."""
    from ssmshard.runtime import simulated

    captured = []
    real = simulated.capture
    monkeypatch.setattr(simulated, "capture", lambda model, **options: captured.append(options["mode"])
                        or real(model, **options))
    model = small_model(family)
    generator = torch.Generator().manual_seed(fresh_seed)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2))
    for length in (7, 1, 2, 3):
        ids = torch.randint(1, model.config.vocab_size, (2, length), generator=generator)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            tokens = mesh.generate(ids, attention_mask=mask, max_new_tokens=3)
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(tokens, expected), f"{family}: prompt of {length} (seed {fresh_seed})"
    assert sorted(captured) == ["decode", "forward", "prefill"], captured
    prefills = [rank.prefill_program() for rank in mesh.ranks]
    if family != "llama":  # no conv: one prefill program serves every length
        assert all(p.siblings for p in prefills), [p.describe_ranges() for p in prefills]
    for program in prefills:
        passes = [h["pass"] for h in program.history]
        assert [h["pass"] for h in program.siblings[0].history][-len(passes):] == passes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU plan's kernels and CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2", "llama"])
def test_short_prompts_on_a_gpu_mesh(family, fresh_seed):
    """On a GPU (the Triton kernels): prompts of 1 to 7 tokens give HF's greedy tokens at tp = 1
    and tp = 2 (the decode steps of both ranks one CUDA graph, runtime/joint_graph.py)."""
    model = small_model(family).cuda()
    generator = torch.Generator().manual_seed(fresh_seed)
    try:
        for tp in (1, 2):
            mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
            for length in (1, 2, 3, 7):
                ids = torch.randint(1, model.config.vocab_size, (2, length), generator=generator).cuda()
                mask = torch.ones_like(ids)
                with torch.no_grad():
                    tokens = mesh.generate(ids, attention_mask=mask, max_new_tokens=4, cuda_graph=True)
                    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
                assert torch.equal(tokens, expected), f"{family} tp={tp}: prompt of {length} (seed {fresh_seed})"
            mesh.release_cuda_graphs()
    finally:
        model.cpu()  # the model object is shared by the tests of this process
