"""``Plan(tsp=D)`` on a GPU: the sequence-sharded scans run on the Triton kernels, every op on
CUDA tensors (on the CPU the scans run the reference ops, or the same kernels under Triton's
interpreter: tests/test_tsp_options.py). The D ranks are threads of one process on one
GPU (``ssmshard.SimulatedMesh``: the same ``DistributedModule`` code as a real process, its
collectives exchanged in memory), so a single GPU checks every rank's kernels. Skipped without
CUDA."""

import pytest
import torch

import ssmshard
from ssmshard.testing import rel_err

from conftest import SIX_FAMILIES, small_model
from generate_worker import left_padded_prompts
from test_sequence_parallel import TP3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on CUDA need a GPU")


@pytest.fixture
def exact_fp32(monkeypatch):
    """HF's fp32 oracle without TF32: its matmuls and its convolution (cuDNN's default allows TF32)
    at full fp32, like ours."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def on_gpu():
    """Moves a shared small model to the GPU for one test and back (other tests of the process use it)."""
    moved = []

    def move(model):
        moved.append(model)
        return model.cuda()

    yield move
    for model in moved:
        model.cpu()


CASES = [(family, 2, "contiguous") for family in SIX_FAMILIES] + [
    ("mamba2", 2, "zigzag"), ("zamba2", 2, "zigzag"), ("llama", 2, "zigzag"),
    ("mamba", 3, "contiguous"), ("zamba2", 3, "zigzag"), ("mamba2", 4, "contiguous"), ("zamba2", 4, "contiguous")]


@pytest.mark.parametrize("family,world,order", CASES)
def test_tsp_on_the_gpu_equals_hf_eager(family, world, order, exact_fp32, on_gpu, fresh_seed):
    """Every rank's logits within 1e-5 of HF eager's at batch 2 x 13 (the last chunk padded; under
    zigzag, chunks of 3-4 tokens, about the conv's 3-token halo), the scans the Triton ones.
    Values only: a backward of CUDA tensors runs on autograd's one thread for the device, which
    the D rank threads would share, so their collectives would wait on each other
    (``SimulatedGroupError`` says so); gradients are checked in real processes on the CPU
    (tests/test_tsp.py) and under Triton's interpreter (tests/test_tsp_options.py)."""
    from ssmshard.sequence_blocks import selective_scan, ssd_scan

    model = on_gpu(small_model(family, **(TP3[family] if world == 3 else {})))
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=world, tsp_order=order))
    scans = [n for n in mesh.program.graph.nodes if n.target in (selective_scan, ssd_scan)]
    assert bool(scans) == (family != "llama") and all(n.kwargs["kernels"] == "triton" for n in scans), scans
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(fresh_seed))
    ids = ids.cuda()
    with torch.no_grad():
        want = model(ids).logits
        results = mesh.run(lambda dm: dm(ids))
    for rank, logits in enumerate(results):
        where = (family, world, order, rank, fresh_seed)
        assert logits.is_cuda, where
        assert rel_err(logits, want) < 1e-5, (where, rel_err(logits, want))


@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_tsp_generate_on_the_gpu_equals_hf(family, exact_fp32, on_gpu, fresh_seed):
    """``mesh.generate`` at ``Plan(tsp=2)``: a left-padded batch (lengths 11, 6, 9) prefilled
    sequence-sharded on the Triton kernels, its states handed to tensor-parallel decode over the
    same shards, both ranks' steps replayed from one CUDA graph (runtime/joint_graph.py; attention
    families over static key/value buffers). Greedy tokens equal HF's; the prefill's last-token
    logits HF eager's (1e-5)."""
    from ssmshard.runtime.joint_graph import RankOfJointGraph

    model = on_gpu(small_model(family))
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tsp=2))
    ids, mask = (t.cuda() for t in left_padded_prompts(model.config.vocab_size, (11, 6, 9), fresh_seed))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        expected = model(ids, attention_mask=mask).logits[:, -1:]
        ours = mesh.generate(ids, mask, max_new_tokens=6)
        prefills = mesh.prefill(ids, mask)
    assert torch.equal(ours, want), (family, fresh_seed, ours, want)
    graphs = [dm.decode_graph(ids.shape[0]) for dm in mesh.ranks]
    assert all(isinstance(g, RankOfJointGraph) and g.graph is graphs[0].graph for g in graphs), graphs
    assert all((g.static is not None) == (family in ("zamba", "zamba2", "llama")) for g in graphs), family
    mesh.release_cuda_graphs()
    for rank, (logits, _) in enumerate(prefills):
        assert rel_err(logits, expected) < 1e-5, (family, rank, fresh_seed, rel_err(logits, expected))
