"""Worker for tests/test_simulated_mesh.py: one rank of a real gloo run of a sync plan."""

import torch

import ssmshard

from conftest import small_model


def plan_for(world):
    """TP with a dropped sync point and an int8-quantized one (every call quantized), the model's
    first: the quantized all-reduce sums its dequantized parts in rank order on both backends,
    while gloo's exact all-reduce of more than two parts sums in an order of its own; a sum one
    bit off, quantized later, could round to the next code step (seed 15 at tp 4: 5.4e-4 apart
    when layer 1's syncs were the quantized ones)."""
    return ssmshard.Plan(tp=world, drop_syncs=["layers.0.o_proj"], quantize_syncs={"layers.0.down_proj": "int8"},
                         quantize_min_bytes=0)


def logits(rank, world, ids, out_path):
    dm = ssmshard.parallelize(small_model("llama"), plan_for(world))
    with torch.no_grad():
        result = dm(ids)
    if rank == 0:
        torch.save(result, out_path)
