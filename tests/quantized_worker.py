"""Workers for tests/test_quantized_sync.py: the quantized all-reduce on every rank of a group.

Rank k's input of case i is drawn from (seed, i, k), so the test rebuilds every rank's input
for its oracle. Inputs are heavy-tailed (magnitudes spanning about four decades inside a
block) with an all-zero stretch, so block scales differ and some blocks are empty.
"""

import os

import torch
import torch.distributed as dist

from ssmshard import comm

# (format, block, local shape): sizes that are not multiples of the block nor of N * block.
CASES = [("int8", 64, (3, 7, 13)), ("fp8", 64, (3, 7, 13)), ("int8", 32, (1001,)), ("fp8", 128, (1001,)),
         ("int8", 128, (1,)), ("fp8", 32, (2, 5, 64))]


def rank_input(seed, index, rank, shape):
    gen = torch.Generator().manual_seed(seed * 1000 + index * 10 + rank)
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
    flat = x.view(-1)
    flat[flat.numel() // 3: flat.numel() // 3 + 70] = 0.0  # at least one whole empty block
    return x


def upstream_gradient(seed, index, shape):
    """The same on every rank: the output is replicated (one loss)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1000 + index * 10 + 9))


def exercise(rank, world, group, seed):
    """Every case on this rank: the value, the gradient of the quantized all-reduce and that of
    the exact all-reduce for the same upstream gradient, and the bytes it recorded as sent."""
    results = {}
    with comm.record_quantized_syncs() as recorder:
        for index, (fmt, block, shape) in enumerate(CASES):
            x = rank_input(seed, index, rank, shape).requires_grad_(True)
            w = upstream_gradient(seed, index, shape)
            y = comm.quantized_all_reduce(x, group, fmt, block, 0, f"case{index}")
            (grad,) = torch.autograd.grad((y * w).sum(), x)
            (exact_grad,) = torch.autograd.grad((comm.all_reduce(x, group) * w).sum(), x)
            results[f"{index}.value"], results[f"{index}.grad"] = y.detach(), grad
            results[f"{index}.exact_grad"] = exact_grad
    mine = [c for c in recorder.calls if c.rank == rank]
    results["bytes_sent"] = torch.tensor([c.bytes_sent for c in mine])
    return results


def gloo_ranks(global_rank, launched, seed, out_dir, worlds):
    """For each N in ``worlds``, on a group of the last N processes: every case, saved per rank."""
    groups = {world: dist.new_group(list(range(launched - world, launched))) for world in worlds}  # all ranks
    for world, pg in groups.items():
        rank = global_rank - (launched - world)
        if rank < 0:
            continue
        name = f"quantized_gloo_{world}"
        comm.register_group(name, pg)
        torch.save(exercise(rank, world, name, seed), os.path.join(out_dir, f"world{world}_rank{rank}.pt"))
