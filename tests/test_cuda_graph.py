"""The decode step as a CUDA graph: which programs qualify (CPU), and on a GPU, graphed
generation gives exactly the tokens of eager generation and of Hugging Face generate."""

import pytest
import torch

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.runtime.cuda_graph import GraphedDecode, why_not_graphable
from ssmshard.runtime.generate import generate
from ssmshard.runtime.static_kv import StaticKVDecode

from conftest import SIX_FAMILIES, small_model
from finishing_rows import check_finishing_rows
import generate_worker
from generate_worker import PAD, left_padded_prompts


@pytest.mark.parametrize("family,graphable", [("mamba", True), ("mamba2", True), ("zamba2", False), ("llama", False)])
def test_decode_programs_with_fixed_size_states_are_graphable(family, graphable):
    decode = ssmshard.capture(small_model(family), mode="decode")
    reason = why_not_graphable(decode)
    if graphable:
        assert reason is None
    else:
        assert "key" in reason and "grow" in reason, reason
        with pytest.raises(ValueError, match="cannot be replayed as a CUDA graph"):
            GraphedDecode(decode)


def _prompts(model, seed):
    """Three left-padded prompts of different lengths on the GPU, and the generation options."""
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
    return ids.cuda(), mask.cuda(), dict(max_new_tokens=20, pad_token_id=PAD)


def _graphed_and_hf(model, prefill, graphed_step, ids, mask, options):
    """Tokens of a graphed generation, of a second one (a replay of the captured graph), and HF's."""
    graphed = generate(prefill, graphed_step, ids, mask, **options)
    again = generate(prefill, graphed_step, ids, mask, **options)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    return graphed, again, hf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
def test_graphed_decode_generates_the_eager_and_hf_tokens(family, fresh_seed):
    model = small_model(family).cuda()
    try:
        prefill, decode = (run_pipeline(ssmshard.capture(model, mode=mode), [("swap_kernels", {"kernels": "triton"})])
                           for mode in ("prefill", "decode"))
        ids, mask, options = _prompts(model, fresh_seed)
        eager = generate(prefill, decode, ids, mask, **options)
        graphed, again, hf = _graphed_and_hf(model, prefill, GraphedDecode(decode), ids, mask, options)
    finally:
        model.cpu()
    where = f"{family} (seed {fresh_seed})"
    assert torch.equal(graphed, eager), where
    assert torch.equal(again, eager), where
    assert torch.equal(eager, hf), where


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["zamba", "zamba2", "llama"])
def test_graphed_static_kv_decode_generates_the_eager_and_hf_tokens(family, fresh_seed):
    """Attention models graph their decode over static key/value buffers: the graph's tokens are
    the eager static step's, the dynamic cache's and HF's; a second generation replays the same
    graph (prefill's states copied into its buffers)."""
    model = small_model(family).cuda()
    try:
        kernels = [("swap_kernels", {"kernels": "triton"})]
        prefill, decode = (run_pipeline(ssmshard.capture(model, mode=mode), kernels) for mode in ("prefill", "decode"))
        static = run_pipeline(ssmshard.capture(model, mode="decode", static_kv=True), kernels)
        ids, mask, options = _prompts(model, fresh_seed)
        length = ids.shape[1] + 24  # unfilled slots too
        dynamic = generate(prefill, decode, ids, mask, **options)
        eager = generate(prefill, StaticKVDecode(static, length), ids, mask, **options)
        graphed, again, hf = _graphed_and_hf(model, prefill, GraphedDecode(static, length), ids, mask, options)
    finally:
        model.cpu()
    where = f"{family} (seed {fresh_seed})"
    assert torch.equal(eager, hf), where
    assert torch.equal(dynamic, hf), where
    assert torch.equal(graphed, eager), where
    assert torch.equal(again, eager), where


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_dm_generate_graphs_decode_at_tp1(family, tmp_path, fresh_seed):
    """dm.generate(cuda_graph=True) at tp = 1 graphs the decode step as the plan makes it (the
    decode passes and kernels: fused norms, decode GEMVs), an attention model's over static
    key/value buffers (static_kv="auto"): the eager tokens (growing cache), capture and replay.
    Mamba-2 and Zamba2 are built with ``lazy_forward=True`` (weights laid out from prefill)."""
    import json

    out = tmp_path / "tokens.json"
    ssmshard.launch(generate_worker.graphed_vs_eager, 1, family, fresh_seed, str(out), False, None, (),
                    family in ("mamba2", "zamba2"), backend="nccl")
    tokens = json.loads(out.read_text())
    assert tokens["static_graph"] == (family in ("zamba", "zamba2", "llama")), family
    assert tokens["graphed"] == tokens["eager"] and tokens["again"] == tokens["eager"], (family, fresh_seed)
    assert tokens["eager"] == tokens["hf"], (family, fresh_seed)
    check_finishing_rows(tokens["finishing"], f"{family} tp=1 graphed (seed {fresh_seed})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family,tp", [(family, 2) for family in SIX_FAMILIES] + [("mamba2", 4), ("zamba2", 4)])
def test_one_graph_replays_every_rank_of_a_gpu_mesh(family, tp, fresh_seed):
    """On one GPU the ranks of a SimulatedMesh replay their sharded decode steps (the plan's decode
    passes and kernels at tp > 1) from one CUDA graph (runtime/joint_graph.py): the tokens of the
    eager steps and HF's for left-padded prompts of different lengths, capture and replay; and
    across a batch whose rows finish at different steps, finished rows stay padded and each
    row's tokens are its prompt's alone. The NCCL kernels of a real run are the test above's."""
    from finishing_rows import finishing_rows
    from ssmshard.runtime.joint_graph import RankOfJointGraph

    model = small_model(family).cuda()
    try:
        mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
        ids, mask, options = _prompts(model, fresh_seed)
        with torch.no_grad():
            eager = mesh.generate(ids, mask, cuda_graph=False, **options)
            graphed = mesh.generate(ids, mask, cuda_graph=True, **options)
            graphs = [dm.decode_graph(ids.shape[0]) for dm in mesh.ranks]
            again = mesh.generate(ids, mask, cuda_graph=True, **options)
            hf = model.generate(ids, attention_mask=mask, do_sample=False, **options)
            finishing = finishing_rows(lambda i, m, **o: mesh.generate(i, m, cuda_graph=True, **o), model, ids, mask,
                                       PAD)
        mesh.release_cuda_graphs()
    finally:
        model.cpu()
    where = f"{family} tp={tp} (seed {fresh_seed})"
    assert all(isinstance(g, RankOfJointGraph) and g.graph is graphs[0].graph for g in graphs), (where, graphs)
    assert all((g.static is not None) == (family in ("zamba", "zamba2", "llama")) for g in graphs), where
    assert torch.equal(graphed, eager) and torch.equal(again, eager), where
    assert torch.equal(eager, hf), where
    check_finishing_rows(finishing, f"{where} graphed")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_rank_failing_while_the_mesh_graph_is_captured(monkeypatch, fresh_seed):
    """A rank that raises while the ranks record their steps: every rank raises at once (the
    failing rank's error first), the capture is ended, and the next generate captures the graph
    anew and gives HF's tokens."""
    from ssmshard.runtime.joint_graph import RankOfJointGraph

    model = small_model("mamba2").cuda()
    real = RankOfJointGraph._run_and_keep

    def fail_on_rank_1(self, run):
        if self.rank == 1:
            raise RuntimeError("rank 1 fails under capture")
        return real(self, run)

    try:
        mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2), timeout=60)
        ids, mask, options = _prompts(model, fresh_seed)
        with torch.no_grad():
            with monkeypatch.context() as patch:
                patch.setattr(RankOfJointGraph, "_run_and_keep", fail_on_rank_1)
                with pytest.raises(RuntimeError, match="rank 1 fails under capture") as failure:
                    mesh.generate(ids, mask, cuda_graph=True, **options)
            assert not torch.cuda.is_current_stream_capturing()
            tokens = mesh.generate(ids, mask, cuda_graph=True, **options)
            graph = mesh.ranks[0].decode_graph(ids.shape[0])
            hf = model.generate(ids, attention_mask=mask, do_sample=False, **options)
        mesh.release_cuda_graphs()
    finally:
        model.cpu()
    notes = " ".join(getattr(failure.value, "__notes__", []))
    assert "simulated rank 0: SimulatedGroupError" in notes, notes
    assert isinstance(graph, RankOfJointGraph), graph
    assert torch.equal(tokens, hf), fresh_seed


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor-parallel CUDA graphs need 2 GPUs")
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_graphed_decode_with_nccl_all_reduces_matches_eager(family, tmp_path, fresh_seed):
    """At tp = 2 the graph holds the NCCL all-reduces: replays give the eager tokens (attention
    families: the graph over static key/value buffers, eager over the growing cache) and HF's,
    for left-padded prompts of different lengths; replayed across a batch whose rows finish at
    different steps, finished rows stay padded and each row's tokens are its prompt's alone."""
    import json

    out = tmp_path / "tokens.json"
    ssmshard.launch(generate_worker.graphed_vs_eager, 2, family, fresh_seed, str(out), backend="nccl")
    tokens = json.loads(out.read_text())
    assert tokens["graphed"] == tokens["eager"] and tokens["again"] == tokens["eager"], (family, fresh_seed)
    assert tokens["eager"] == tokens["hf"], (family, fresh_seed)
    check_finishing_rows(tokens["finishing"], f"{family} tp=2 graphed (seed {fresh_seed})")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor-parallel CUDA graphs need 2 GPUs")
def test_launch_ends_with_a_graphed_module_still_alive(tmp_path, fresh_seed):
    """A rank function that returns with its module (and the module's NCCL-holding CUDA graph)
    still alive: ``launch`` releases the graph before destroying the process group, which would
    otherwise wait forever (pytorch/pytorch#115388)."""
    import json
    import threading

    out = tmp_path / "tokens.json"
    errors = []

    def run():
        try:
            ssmshard.launch(generate_worker.graphed_vs_eager, 2, "mamba2", fresh_seed, str(out), True,
                            backend="nccl")
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(240)
    assert not thread.is_alive(), "the ranks did not end: the process-group teardown is waiting"
    assert not errors, errors
    tokens = json.loads(out.read_text())
    assert tokens["graphed"] == tokens["eager"] == tokens["hf"], fresh_seed
