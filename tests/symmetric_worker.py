"""Worker for tests/test_symmetric_allreduce.py (NCCL, one GPU per rank): the one-shot
symmetric-memory all-reduce against NCCL's, eagerly and replayed in a CUDA graph, and a
tensor-parallel model generating with it."""

import json

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.comm import backend_of
from ssmshard.comm.groups import ProcessGroupBackend
from ssmshard.comm.symmetric import SymmetricMemoryBackend

from conftest import small_model


def _operand(shape, dtype, seed, rank):
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    # Integers below 2**8: every partial sum is exact in bf16 (8 mantissa bits) and fp32, so the
    # two summation orders must give the same bits.
    return torch.randint(-8, 8, shape, generator=gen, device="cuda").to(dtype)


def collective_results(rank, world, seed, out_path):
    group = dist.group.WORLD
    symm = SymmetricMemoryBackend(group, max_bytes=1 << 20)
    nccl = ProcessGroupBackend(group)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 1000, 2560, 65536, 300000):  # the last one is above max_bytes: NCCL
            x = _operand((numel,), dtype, seed, rank)
            before = dict(symm.calls)
            got, want = symm.all_reduce(x), nccl.all_reduce(x)
            path = "symm_mem" if symm.calls["symm_mem"] > before["symm_mem"] else "nccl"
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            rows.append({"dtype": str(dtype), "numel": numel, "path": path,
                         "equal_to_nccl": bool(torch.equal(got, want)),
                         "same_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered)})
    # Random (non-integer) bf16 values: the orders differ, the results stay within bf16 rounding.
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    x = torch.randn(4096, generator=gen, device="cuda").to(torch.bfloat16)
    exact = nccl.all_reduce(x.float())
    # Relative to the sum of the magnitudes (the scale of a floating-point sum's error bound):
    # four random terms can cancel, and a result near zero has no relative accuracy to keep.
    magnitude = nccl.all_reduce(x.float().abs())
    bf16_err = ((symm.all_reduce(x).float() - exact).abs() / magnitude).max().item()
    # Inside a CUDA graph: capture once, replay with new operands written into the static input.
    static = torch.zeros(2560, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        symm.all_reduce(static)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = symm.all_reduce(static)
    graph_equal = []
    for step in range(3):
        static.copy_(_operand((2560,), torch.bfloat16, seed + step + 1, rank))
        graph.replay()
        graph_equal.append(bool(torch.equal(static_out, nccl.all_reduce(static))))
    torch.cuda.synchronize()
    result = {"rows": rows, "bf16_random_max_rel_err": bf16_err, "graph_replays_equal_nccl": graph_equal}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def generation_results(rank, world, family, seed, out_path):
    torch.cuda.set_device(rank)
    # fp32: the one-shot kernel and NCCL sum in different orders, and in bf16 that flips near ties
    # of greedy decoding after a few steps at tp 4; fp32 keeps the logits within 1e-5 (asserted).
    model = small_model(family).to("cuda")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen).cuda()
    outs = {}
    for allreduce in ("nccl", "symm_mem"):
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, allreduce=allreduce))
        with torch.no_grad():
            logits = dm(ids).float()
        # String keys: JSON turns a bool key into "false" / "true".
        tokens = {("graphed" if graphed else "eager"):
                  dm.generate(ids, max_new_tokens=12, do_sample=False, cuda_graph=graphed).tolist()
                  for graphed in (False, True)}
        backend = backend_of(dm.program.shard["group"])
        outs[allreduce] = {"logits": logits, "tokens": tokens, "symm_calls": getattr(backend, "calls", {}).get("symm_mem")}
    rel = ((outs["symm_mem"]["logits"] - outs["nccl"]["logits"]).abs().max()
           / outs["nccl"]["logits"].abs().max()).item()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"logits_rel_diff": rel, "tokens": {k: v["tokens"] for k, v in outs.items()},
                       "symm_calls": outs["symm_mem"]["symm_calls"]}, f)
