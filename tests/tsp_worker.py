"""Worker for tests/test_tsp.py: each rank runs ``Plan(tsp=N)`` on the six families and records
logits errors against HF eager, gradient errors against the unsharded model's gradient slices,
weight counts and activation bytes."""

import json

import torch

import ssmshard
from ssmshard.placement import Shard, local_slice
from ssmshard.testing import rel_err

from conftest import small_model


def tsp_results(rank, world, cases, lengths, seed, out_path):
    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tsp=world))
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        errors = []
        for length in lengths:
            ids = torch.randint(0, vocab, (2, length), generator=gen)
            with torch.no_grad():
                errors.append(rel_err(dm(ids), model(ids).logits))
        # Gradients: one loss through the sharded and the unsharded model.
        ids = torch.randint(0, vocab, (2, lengths[-1]), generator=gen)
        probe = torch.randn(2, lengths[-1], vocab, generator=gen)
        (dm(ids) * probe).sum().backward()
        dm.sync_replicated_grads()
        model.zero_grad()
        (model(ids).logits * probe).sum().backward()
        named = dict(model.named_parameters(remove_duplicate=False))
        got, want, worst = [], [], 0.0
        for fqn, spec in dm.program.param_specs.items():
            if spec.kind != "parameter" or named[fqn].grad is None:
                continue
            expected = local_slice(named[fqn].grad, spec.placement, rank)
            local = dm.local_weight(fqn).grad
            got.append(local.flatten())
            want.append(expected.flatten())
            worst = max(worst, rel_err(local, expected))
        model.zero_grad()
        results.append({"family": family, "logits_err": max(errors),
                        "grad_err": rel_err(torch.cat(got), torch.cat(want)), "worst_tensor_grad_err": worst})
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
