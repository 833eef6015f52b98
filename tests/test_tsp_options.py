"""Generation and runtime options of a ``Plan(tsp=D)`` module (docs/tsp.md, "Generation"):
chunked prefill and static key/value decode against HF, and the options that cannot apply
raising before any rank runs. Ranks run in one process on ``ssmshard.SimulatedMesh`` (the same
``DistributedModule`` code as a real process; tests/test_simulated_mesh.py checks it against
gloo processes); tests/test_tsp.py runs TSP in real processes."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ssmshard
from ssmshard.capture import capture
from ssmshard.comm import CollectiveBackend
from ssmshard.testing import rel_err

from conftest import interpreted_kernels, small_model
from generate_worker import left_padded_prompts


def _hf(model, call):
    with torch.no_grad():
        return call(model)


# Each case captures and shards four programs per rank (forward, TP and TSP prefill, decode, chunk):
# 70 s for mamba2 and 300 s for zamba2 on the shared 2-core machine, hence the slow set.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba2", "zamba2"])
def test_tsp_chunked_prefill_equals_hf(family, fresh_seed):
    """``prefill_chunk_size`` under TSP: the first chunk is prefilled sequence-sharded, the later
    chunks by the tensor-parallel chunk program over the same shards. A left-padded batch (lengths
    11, 6, 9) in chunks of 4: greedy tokens equal HF's, the last-token logits HF eager's (1e-5)."""
    model = small_model(family)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=2))
    ids, mask = left_padded_prompts(model.config.vocab_size, (11, 6, 9), fresh_seed)
    ours = mesh.generate(ids, mask, max_new_tokens=4, prefill_chunk_size=4)
    want = _hf(model, lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
    assert torch.equal(ours, want), (family, fresh_seed, ours, want)
    expected = _hf(model, lambda m: m(ids, attention_mask=mask).logits[:, -1:])
    for rank, (logits, _) in enumerate(mesh.prefill(ids, mask, chunk_size=4)):
        assert rel_err(logits, expected) < 1e-5, (family, rank, fresh_seed)


@pytest.mark.slow
def test_tsp_static_kv_decode_equals_hf(fresh_seed):
    """``static_kv=True`` and a fixed number of positions: the TSP prefill's keys and values,
    re-laid by heads, fill the static buffers of the tensor-parallel decode step (eager on CPU)."""
    model = small_model("llama")
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=2))
    ids, mask = left_padded_prompts(model.config.vocab_size, (7, 4), fresh_seed)
    want = _hf(model, lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    for static_kv in (True, 16):
        ours = mesh.generate(ids, mask, max_new_tokens=5, static_kv=static_kv, cuda_graph=False)
        assert torch.equal(ours, want), (static_kv, fresh_seed, ours, want)


def test_tsp_options_that_cannot_apply_raise_before_work():
    """Each rank raises before building its generation programs or entering a collective: rank 0
    is called alone here, so a collective would never return."""
    model = small_model("llama")
    rank0 = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=2), timeout=20).ranks[0]
    ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="cuda_graph=True.*not on a CUDA device"):
        rank0.generate(ids, max_new_tokens=2, cuda_graph=True)
    with pytest.raises(ValueError, match="static_kv"):
        rank0.generate(ids, max_new_tokens=8, static_kv=6)  # too few positions for 5 + 8 tokens
    assert rank0._generation is None  # nothing was captured


# Interpreted, Mamba-1's 128-channel scans took 956 s on the shared 2-core machine (Mamba-2: 19 s).
@interpreted_kernels
@pytest.mark.parametrize("family", [pytest.param("mamba", marks=pytest.mark.slow), "mamba2"])
def test_tsp_on_triton_scan_kernels_equals_hf_eager(family, monkeypatch, fresh_seed):
    """``Plan(tsp=2, kernels="triton")``: the rank pipeline as on CUDA (the ``tsp`` pass hands
    "triton" to the sequence blocks, ``swap_kernels`` follows), the scans run by Triton's CPU
    interpreter. Logits against HF eager (1e-5) and each rank's gradients against the slices of
    HF's (1e-5 over the rank's gradient vector, 1e-4 per tensor, as tests/test_tsp.py), at a
    length that leaves the last chunk padded."""
    from tsp_worker import gradient_errors

    from ssmshard.sequence_blocks import selective_scan, ssd_scan

    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    model = small_model(family)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=2, kernels="triton"))
    scans = [n for n in mesh.program.graph.nodes if n.target in (selective_scan, ssd_scan)]
    assert scans and all(n.kwargs["kernels"] == "triton" for n in scans)
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    probe = torch.randn(1, 5, model.config.vocab_size, generator=gen)
    model.zero_grad()
    want = model(ids).logits
    (want * probe).sum().backward()

    def rank_main(dm):
        logits = dm(ids)
        (logits * probe).sum().backward()
        dm.sync_replicated_grads()
        return logits.detach(), gradient_errors(dm, model, dm.rank)

    try:
        results = mesh.run(rank_main)
    finally:
        model.zero_grad()
    for rank, (logits, errors) in enumerate(results):
        where = (family, rank, fresh_seed)
        assert rel_err(logits, want.detach()) < 1e-5, where
        assert errors["grad_err"] < 1e-5 and errors["worst_tensor_grad_err"] < 1e-4, (where, errors)


class _ReceivedBytes(TorchDispatchMode):
    """Bytes a rank receives through the TSP program's collectives, counted as they run: an
    all-gather brings the D - 1 other ranks' inputs, a shift or broadcast one input."""

    def __init__(self, world):
        super().__init__()
        self.world = world
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__ if func.namespace == "ssmshard" else None
        sent = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if sent is not None and name in ("all_gather", "all_gather_partial_grad", "shift", "broadcast"):
            copies = self.world - 1 if name.startswith("all_gather") else 1
            self.total += copies * sent.numel() * sent.element_size()
        return out


@pytest.mark.parametrize("family,order,weights,logits", [
    ("mamba2", "contiguous", "gather", "gathered"), ("llama", "contiguous", "gather", "gathered"),
    ("mamba2", "zigzag", "gather", "gathered"), ("mamba2", "contiguous", "ring", "gathered"),
    ("mamba2", "zigzag", "gather", "local"),
    pytest.param("llama", "contiguous", "ring", "gathered", marks=pytest.mark.slow)])
def test_explain_tsp_bytes_equal_the_collectives_measured(family, order, weights, logits, monkeypatch):
    """``plan.explain``'s TSP total (weights, halos, scan states, keys and values, logits) equals
    the bytes each rank's collectives receive in one forward pass, counted at run time (batch 2,
    16 tokens: chunks of 8, or of 4 under zigzag, so every halo comes by one shift). Under
    ``tsp_weights="ring"`` the linear layers' shards arrive through the ring's point-to-point
    shifts inside ``ring_matmul`` (below the ops the dispatch mode sees): counted where the
    backend starts them; the total is the all-gather's. Under ``tsp_logits="local"`` no logits
    move."""
    model = small_model(family)
    world, batch, seq = 2, 2, 16
    plan = ssmshard.Plan(tsp=world, tsp_order=order, tsp_weights=weights, tsp_logits=logits)
    mesh = ssmshard.SimulatedMesh(model, plan)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    ring_bytes = [0] * world
    start_shifts = CollectiveBackend.start_shifts

    def counted_start_shifts(backend, sends):
        ring_bytes[backend.rank()] += sum(x.numel() * x.element_size() for x, _ in sends)
        return start_shifts(backend, sends)

    monkeypatch.setattr(CollectiveBackend, "start_shifts", counted_start_shifts)

    def received(dm):
        counter = _ReceivedBytes(world)
        with torch.no_grad(), counter:
            dm(ids)
        return counter.total + ring_bytes[dm.rank]

    measured = mesh.run(received)
    assert all((sent > 0) == (weights == "ring") for sent in ring_bytes), ring_bytes
    text = plan.explain(capture(model, mode="forward"), model, batch=batch, seq=seq)
    total = next(line for line in text[text.index("TP vs TSP"):].splitlines() if line.split()[:1] == ["total"])
    assert measured == [int(total.split()[2].replace(",", ""))] * world, (family, measured, total)


@pytest.mark.parametrize("family,world,order,length", [
    ("mamba2", 2, "contiguous", 7), ("llama", 2, "zigzag", 9),
    pytest.param("zamba2", 3, "zigzag", 8, marks=pytest.mark.slow)])
def test_tsp_local_logits_are_each_ranks_rows_of_hf(family, world, order, length, fresh_seed):
    """``Plan(tsp=D, tsp_logits="local")``: each rank returns the logits of its own tokens (a
    padded last chunk cut back), at the positions ``token_positions`` names; together the ranks
    name every position once. Values against HF eager's rows (1e-5); a loss summed per rank over
    its own rows gives each rank's gradients as the slices of HF's gradient of the whole loss
    (1e-5 over the rank's gradient vector, 1e-4 per tensor, or no further from HF's fp64 gradient
    than 3x HF's fp32 one where that cancels: Zamba2's ``A_log`` at D = 3, as tests/test_tsp.py, or
    than twice the farthest of HF's fp32 gradients of rounding-perturbed weights:
    ``tsp_worker._within_fp32``)."""
    from test_sequence_parallel import TP3
    from tsp_worker import gradient_errors

    model = small_model(family, **(TP3[family] if world == 3 else {}))
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=world, tsp_order=order, tsp_logits="local"))
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=gen)
    probe = torch.randn(2, length, model.config.vocab_size, generator=gen)
    loss = lambda m: (m(ids).logits * probe.to(m.dtype)).sum()  # noqa: E731
    model.zero_grad()
    want = model(ids).logits
    (want * probe).sum().backward()
    exact = copy.deepcopy(model).double()
    loss(exact).backward()

    def rank_main(dm):
        positions = dm.token_positions(length)
        logits = dm(ids)
        (logits * probe[:, positions]).sum().backward()
        dm.sync_replicated_grads()
        return positions, logits.detach(), gradient_errors(dm, model, dm.rank, exact, loss)

    try:
        results = mesh.run(rank_main)
    finally:
        model.zero_grad()
    assert sorted(p for positions, _, _ in results for p in positions.tolist()) == list(range(length))
    for rank, (positions, logits, errors) in enumerate(results):
        where = (family, order, rank, fresh_seed)
        assert logits.shape[:2] == (2, len(positions)), where
        assert rel_err(logits, want.detach()[:, positions]) < 1e-5, where
        assert errors["grad_within_fp32"] and not errors["tensors_beyond_fp32"], (where, errors)
    with pytest.raises(ValueError, match="tsp_logits='local'"):
        ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=world)).ranks[0].token_positions(length)
    with pytest.raises(ssmshard.PlanError, match="tsp_logits"):
        ssmshard.Plan(tp=2, tsp_logits="local")


def test_tsp_prefill_traced_shorter_than_the_conv_per_rank_is_refused():
    """A prefill traced at 8 tokens gives chunks of 3 at D = 3, fewer than the conv kernel (4):
    its chunk would take HF's short-prefill branch, which real chunks never take. The pass says
    which example length to capture at; traced at that length, the program builds."""
    from ssmshard.passes.shard import ShardingError
    from ssmshard.runtime.pipeline import shard_program
    from test_sequence_parallel import TP3

    model = small_model("mamba", **TP3["mamba"])
    plan = ssmshard.Plan(tsp=3)
    with pytest.raises(ShardingError, match=r"3 per chunk in 3 chunks.*example_seq >= 12"):
        shard_program(capture(model, mode="prefill"), model, plan, rank=0, group="tsp", sequence_sharded=True)
    program = shard_program(capture(model, mode="prefill", example_seq=12), model, plan, rank=0, group="tsp",
                            sequence_sharded=True)
    assert program.shard["tsp"] == 3 and program.shard["min_chunk"] == 4
