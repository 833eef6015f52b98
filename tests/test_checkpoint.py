"""Tensor-parallel weights read slice by slice from safetensors checkpoints; device_mesh=; torchrun.

The multi-process tests run 2 ranks over gloo (tests/checkpoint_worker.py). Loading from a
checkpoint must give bit-identical local weights and logits to slicing the same model in
memory (same program, same values), and each rank must read from the files exactly the
elements of its own shards: counted by a wrapper around ``safe_open`` in the real processes.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import ssmshard
from ssmshard import CheckpointError
from ssmshard.families import build_meta_model
from ssmshard.program import ParamSpec
from ssmshard.runtime.checkpoint import SafetensorsCheckpoint, match_checkpoint, recompute_buffer

import checkpoint_worker
from conftest import small_model

TP = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL_VS_HF = {None: 1e-5, "bfloat16": 2e-2}  # relative, logits against HF eager in the same dtype

# family, config overrides, saved as, loaded by, dtype, through device_mesh=
CASES = [
    ("mamba", {}, "single", "meta", None, False),  # tied lm_head: only the embedding is stored
    ("mamba2", {}, "sharded", "from_pretrained", None, False),  # 2 groups: split
    ("mamba2", {"n_groups": 1}, "sharded", "from_pretrained", None, True),  # B/C rows held whole by both ranks
    ("llama", {"tie_word_embeddings": True}, "single", "from_pretrained", None, False),  # inv_freq recomputed
    ("mamba", {}, "sharded", "from_pretrained", "bfloat16", False),  # float32 checkpoint read as bfloat16
    ("falcon_mamba", {}, "sharded", "meta", None, False),  # the B/C/dt norms have no weights to read
    ("zamba", {}, "single", "from_pretrained", None, False),  # the shared block stored under its first layer's name
]


def save(model, directory, how):
    if how == "base_model":
        model.base_model.save_pretrained(directory, safe_serialization=True)
    elif how == "sharded":
        model.save_pretrained(directory, safe_serialization=True, max_shard_size="20KB")
    else:
        model.save_pretrained(directory, safe_serialization=True)
    files = os.listdir(directory)
    assert ("model.safetensors.index.json" in files) == (how == "sharded"), files
    return str(directory)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One 2-process launch for all the multi-process checks (process start-up dominates)."""
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs; printed in failures
    root = tmp_path_factory.mktemp("checkpoints")
    cases = []
    for index, (family, overrides, saved, how, dtype, mesh) in enumerate(CASES):
        directory = save(small_model(family, **overrides), root / f"{index}_{family}_{saved}", saved)
        cases.append({"family": family, "overrides": overrides, "dir": directory, "saved": saved, "how": how,
                      "dtype": dtype, "mesh": mesh})
    out = root / "results.json"
    ssmshard.launch(checkpoint_worker.run_all, TP, cases, seed, str(out), backend="gloo")
    results = json.loads(out.read_text())
    assert len(results) == TP * len(CASES)
    return results, seed


def _label(r, seed):
    case = r["case"]
    return f"{case['family']} {case['overrides']} {case['saved']} {case['how']} {case['dtype']} rank {r['rank']} (seed {seed})"


def test_checkpoint_gives_the_in_memory_weights_and_logits_bit_for_bit(tp2):
    results, seed = tp2
    for r in results:
        assert r["mismatched_weights"] == [] and r["same_logits"], _label(r, seed)
        assert r["err_vs_hf"] < TOL_VS_HF[r["case"]["dtype"]], (r["err_vs_hf"], _label(r, seed))


def test_greedy_generation_from_a_checkpoint_equals_hf(tp2):
    """dm.generate on modules loaded from checkpoints (models on meta) gives HF's greedy tokens."""
    results, seed = tp2
    checked = [r for r in results if "generate_equal_hf" in r]
    assert len(checked) == TP * sum(1 for case in CASES if case[4] is None)
    for r in checked:
        assert r["generate_equal_hf"], (_label(r, seed), r["generated"], r["hf_generated"])


def test_dtype_conversion_as_hf_from_pretrained(tp2):
    results, seed = tp2
    for r in results:
        dtypes = {w["dtype"] for w in r["weights"].values()}
        assert dtypes == {f"torch.{r['case']['dtype'] or 'float32'}"}, (dtypes, _label(r, seed))


def test_device_mesh(tp2):
    results, seed = tp2
    for r in results:
        if r["case"]["mesh"]:
            assert r["group_size"] == TP and r["collectives"] > 0, _label(r, seed)


def _share_of_largest(r):
    """Most elements a rank may hold of the largest parameter: it split tp ways, or for
    Mamba-2's in_proj with fewer groups than ranks, with the B/C rows every rank holds whole."""
    name, numel = r["largest_param"]
    config = small_model(r["case"]["family"], **r["case"]["overrides"]).config
    if name.endswith("mixer.in_proj.weight") and r["case"]["family"] == "mamba2" and config.n_groups < TP:
        d_inner = config.expand * config.hidden_size
        rows = 2 * d_inner // TP + 2 * config.n_groups * config.state_size + config.num_heads // TP
        return rows * config.hidden_size
    return numel // TP


def test_each_rank_reads_only_its_own_slices(tp2):
    results, _ = tp2
    for r in results:
        label = _label(r, "-")
        weights, reads = r["weights"], r["reads"]
        # Every local element came from the files exactly once: nothing read twice, nothing extra.
        assert sum(n for _, n in reads) == sum(w["local"] for w in weights.values() if w["from_file"]), label
        # No sharded weight is held whole; the largest is held (and read) only in its share.
        assert all(w["local"] < w["full"] for w in weights.values() if w["sharded"]), label
        largest, share = r["largest_param"][0], _share_of_largest(r)
        assert weights[largest]["local"] <= share, label
        # Replicated weights are held whole by design (norms; an untied embedding): the bound on
        # any read or local tensor is the share of the largest parameter or the largest of those.
        replicated = max((w["full"] for w in weights.values() if not w["sharded"]), default=0)
        bound = max(share, replicated)
        assert max(n for _, n in reads) <= bound and max(w["local"] for w in weights.values()) <= bound, label
        if small_model(r["case"]["family"], **r["case"]["overrides"]).config.tie_word_embeddings:
            assert bound == r["largest_param"][1] // TP, label  # tied: the embedding is vocab-parallel too
    # A packed in_proj is read as one row range per segment: [x | z] and [z, x, B, C, dt].
    for family, pieces in (("mamba", 2), ("mamba2", 5)):
        r = next(r for r in results if r["case"]["family"] == family)
        in_proj = [n for key, n in r["reads"] if key.endswith("layers.0.mixer.in_proj.weight")]
        assert len(in_proj) == pieces, (family, in_proj)


def test_torchrun_example_with_a_checkpoint(tmp_path):
    """A real ``torchrun --standalone --nproc_per_node 2`` launch of examples/torchrun_forward.py."""
    directory = save(small_model("mamba"), tmp_path / "mamba", "sharded")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(TP),
               os.path.join(ROOT, "examples", "torchrun_forward.py"), "--checkpoint", directory]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Ranks print concurrently, so two reports can share a line: count them, not lines.
    assert done.stdout.count("MambaForCausalLM: logits relative error") == TP, done.stdout


# ------------------------------------------------------------------ in one process, no capture
def test_keys_found_through_tied_shared_and_prefixless_names(tmp_path):
    """Every name the model has for a tensor resolves to a stored key that holds its values:
    tied lm_head (stored as the embedding), a base-model save (no ``backbone.``), Zamba2's
    shared transformer (stored under one layer's names)."""
    for family, saved in (("mamba", "single"), ("mamba", "base_model"), ("zamba2", "sharded")):
        model = small_model(family)
        checkpoint = SafetensorsCheckpoint(save(model, tmp_path / f"{family}_{saved}", saved))
        with torch.device("meta"):
            meta = type(model)(model.config)
        named = dict(model.named_parameters(remove_duplicate=False))
        every_name = SimpleNamespace(param_specs={
            name: ParamSpec(name, "parameter", tuple(t.shape), t.dtype) for name, t in named.items()})
        keys = match_checkpoint(every_name, meta, checkpoint)
        assert any(name != key for name, key in keys.items()), (family, saved)
        for name, key in keys.items():
            stored = checkpoint.read_into(torch.empty_like(named[name]), key)
            assert torch.equal(stored, named[name]), (family, saved, name, key)


def test_meta_model_dtype_and_recomputed_buffers(tmp_path):
    model = small_model("llama")
    meta = build_meta_model(save(model, tmp_path / "llama", "single"), dtype=torch.bfloat16)
    weight = meta.model.layers[0].mlp.up_proj.weight
    assert weight.device.type == "meta" and weight.dtype == torch.bfloat16
    inv_freq = recompute_buffer(meta, "model.rotary_emb.inv_freq")
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, model.model.rotary_emb.inv_freq)
    # A buffer _init_weights does not compute is refused, not left uninitialised.
    meta.model.register_buffer("unknown", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(CheckpointError, match="'model.unknown' is not saved in checkpoints"):
        recompute_buffer(meta, "model.unknown")


# ------------------------------------------------------------------ errors, before any process group
def _checkpoint_without(tmp_path, family, missing):
    model = small_model(family)
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != missing}
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path)


def test_missing_key_is_named_before_any_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    directory = _checkpoint_without(tmp_path, "mamba2", "backbone.layers.1.mixer.out_proj.weight")
    with pytest.raises(CheckpointError, match=r"missing: model weight 'backbone\.layers\.1\.mixer\.out_proj\.weight'"):
        ssmshard.parallelize_from_pretrained(directory, ssmshard.Plan(tp=TP))


def test_mismatched_shape_names_key_and_both_shapes(tmp_path):
    directory = _checkpoint_without(tmp_path, "mamba2", None)  # state_size 16
    other = ssmshard.build_small_model("mamba2", device="meta", state_size=8)
    with pytest.raises(CheckpointError) as info:
        ssmshard.parallelize(other, ssmshard.Plan(tp=TP), checkpoint=directory)
    message = str(info.value)
    # in_proj rows: 2 * 128 (z, x) + 2 * 2 groups * N (B, C) + 8 (dt)
    assert "'backbone.layers.0.mixer.in_proj.weight' is [328, 64]" in message and "is [296, 64]" in message
    assert "6 problems" in message  # in_proj, conv1d weight and bias in both layers, all listed at once


def test_non_safetensors_directory_and_meta_model_without_checkpoint(tmp_path):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        SafetensorsCheckpoint(tmp_path)
    meta = ssmshard.build_small_model("mamba", device="meta")
    with pytest.raises(ValueError, match="meta device.*checkpoint=DIR"):
        ssmshard.parallelize(meta, ssmshard.Plan(tp=TP))


def test_keys_the_model_has_no_weight_for_are_errors_unless_allowed(tmp_path):
    """A checkpoint of a deeper model than its config.json says: HF reports the extra layers as
    unexpected keys; loading the first layers silently would give another model."""
    from ssmshard.runtime.checkpoint import match_checkpoint

    deeper = ssmshard.build_small_model("mamba2", num_hidden_layers=3)
    deeper.save_pretrained(tmp_path, safe_serialization=True)
    shallow = ssmshard.build_small_model("mamba2", device="meta")  # 2 layers
    with pytest.raises(CheckpointError, match=r"(?s)unexpected: checkpoint key 'backbone\.layers\.2\..*"
                                              r"allow_unexpected_keys=True"):
        ssmshard.parallelize(shallow, ssmshard.Plan(tp=TP), checkpoint=str(tmp_path))
    keys = match_checkpoint(ssmshard.capture(shallow), shallow, SafetensorsCheckpoint(tmp_path),
                            allow_unexpected_keys=True)
    assert keys["backbone.layers.1.mixer.in_proj.weight"] == "backbone.layers.1.mixer.in_proj.weight"
