"""``SimulatedMesh`` against real processes: the same plan (TP with a dropped and quantized sync
points) launched over gloo gives the same logits as the simulated mesh in one process."""

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
    ssmshard.launch(mesh_worker.logits, world, ids, str(out))
    mesh = ssmshard.SimulatedMesh(model, mesh_worker.plan_for(world))
    with torch.no_grad():
        simulated = mesh(ids)
        exact = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=world))(ids)
    assert {p.action for p in mesh.program.sync_points} == {"kept", "dropped", "quantized"}
    assert rel_err(simulated, torch.load(out)) < 1e-6, f"world {world} (seed {fresh_seed})"
    assert rel_err(simulated, exact) > 1e-4  # the plan did change the values
