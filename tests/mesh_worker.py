"""Worker for tests/test_simulated_mesh.py: one rank of a real gloo run of a sync plan."""

import torch

import ssmshard

from conftest import small_model


def plan_for(world):
    """TP with a dropped sync point and int8-quantized ones (every call quantized)."""
    return ssmshard.Plan(tp=world, drop_syncs=["layers.0.o_proj"], quantize_syncs={"layers.1.*": "int8"},
                         quantize_min_bytes=0)


def logits(rank, world, ids, out_path):
    dm = ssmshard.parallelize(small_model("llama"), plan_for(world))
    with torch.no_grad():
        result = dm(ids)
    if rank == 0:
        torch.save(result, out_path)
