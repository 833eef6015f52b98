"""The program cache (runtime/program_cache.py, program_store.py): generation programs stored by
one process and loaded by the next give Hugging Face's tokens, are the programs building them
again gives (node for node), and are found only under a key that covers what decides them."""

import json
import pytest
import torch

import ssmshard
from ssmshard.runtime.program_cache import ProgramCache, Uncacheable

from conftest import small_model
from finishing_rows import check_finishing_rows
import generate_worker
import program_cache_worker


def test_a_second_launch_loads_every_generation_program_and_generates_hf_tokens(tmp_path, fresh_seed):
    """tp=2 over gloo, Zamba2 (a meta model read from a checkpoint; static-K/V, growing-cache and
    chunked decode) and Mamba-2: the first launch stores prefill, chunk and decode programs (and the
    static-K/V decode's), the second, in new processes, loads all of them and stores nothing; both
    give HF's greedy tokens for a left-padded batch of prompts of different lengths, the same on
    every rank; the loaded programs equal the programs the second launch builds again without the
    cache, node for node."""
    cache = tmp_path / "programs"
    small_model("zamba2").save_pretrained(tmp_path / "zamba2")  # its module: a meta model read from it
    runs = []
    for launch, compare in enumerate((False, True)):
        out = tmp_path / f"launch{launch}.json"
        ssmshard.launch(program_cache_worker.cached_generation, 2, ["zamba2", "mamba2"], fresh_seed, str(cache),
                        str(out), compare, {"zamba2": str(tmp_path / "zamba2")}, backend="gloo")
        runs.append(json.loads(out.read_text()))
    for first, second in zip(*runs):
        where = f"{first['family']} (seed {fresh_seed})"
        kinds = ["chunk", "decode", "prefill"] + (["static_decode"] if first["family"] == "zamba2" else [])
        assert first["stored"] == [f"{k} rank 0" for k in kinds] and first["loaded"] == [], where
        assert second["loaded"] == [f"{k} rank 0" for k in kinds] and second["stored"] == [], where
        assert not any(first["from_store"].values()) and all(second["from_store"].values()), where
        for result in (first, second):
            assert len(result["hf"][0]) == max(program_cache_worker.PROMPT_LENGTHS) + program_cache_worker.NEW_TOKENS
            for name, tokens in result["runs"].items():
                assert tokens == result["hf"], f"{where}, {name}: {tokens} vs HF {result['hf']}"
            assert result["same_on_all_ranks"], where
        assert second["differing_programs"] == [], where
        assert min(second["nodes"].values()) > 50, where


def test_compiled_programs_loaded_in_a_new_process_generate_hf_tokens(tmp_path, fresh_seed):
    """``Plan(compile=True)``, Mamba-2, one rank: the process that loads the programs compiles them
    and gives HF's tokens, as the one that stored them did. (A state writer's first call, made
    inside the compiled graph in a loading process, once reached a lock Dynamo cannot enter.)"""
    cache = str(tmp_path / "programs")
    for launch in ("stores", "loads"):
        out = tmp_path / f"{launch}.json"
        ssmshard.launch(program_cache_worker.compiled_generation, 1, "mamba2", fresh_seed, cache, str(out),
                        backend="gloo")
        result = json.loads(out.read_text())
        assert result["ours"] == result["hf"], (launch, fresh_seed)
        assert result["compilations"] >= 1, launch
        assert result["loaded" if launch == "loads" else "stored"] == ["decode rank 0", "prefill rank 0"], result
        assert result["stored" if launch == "loads" else "loaded"] == [], result


def a_user_pass(program, ctx):
    return program


@pytest.mark.compat
def test_key_covers_plan_model_code_and_environment_not_weights(monkeypatch):
    """A key changes with the plan, the capture and shard options, the config, a weight's dtype, an
    SSMSHARD_* variable and the passes registered; not with the weights' values. A plan holding
    a lambda has no key. The folder is the argument's, else the environment's."""
    model = small_model("mamba2")
    options = {"mode": "decode", "rank": 0, "kernels": "reference"}
    key = ProgramCache.key("decode", model, ssmshard.Plan(tp=1), options)[0]
    assert ProgramCache.key("decode", model, ssmshard.Plan(tp=1), dict(options))[0] == key  # stable
    changed = {
        "plan": ProgramCache.key("decode", model, ssmshard.Plan(tp=2), options),
        "skip_passes": ProgramCache.key("decode", model, ssmshard.Plan(tp=1, skip_passes=["fuse_rmsnorm"]), options),
        "state dtype": ProgramCache.key("decode", model, ssmshard.Plan(tp=1, ssm_state_dtype=torch.bfloat16), options),
        "rank": ProgramCache.key("decode", model, ssmshard.Plan(tp=1), {**options, "rank": 1}),
        "kernels": ProgramCache.key("decode", model, ssmshard.Plan(tp=1), {**options, "kernels": "triton"}),
        "kind": ProgramCache.key("chunk", model, ssmshard.Plan(tp=1), options),
        "config": ProgramCache.key("decode", small_model("mamba2", rms_norm_eps=1e-3), ssmshard.Plan(tp=1), options),
    }
    with torch.no_grad():
        weight = next(model.parameters())
        saved = weight.clone()
        weight.add_(1.0)
        assert ProgramCache.key("decode", model, ssmshard.Plan(tp=1), options)[0] == key  # values are not in it
        weight.copy_(saved)
    other = ssmshard.build_small_model("mamba2")  # not the shared test model: one weight changes dtype
    first = next(other.parameters())
    first.data = first.data.double()
    changed["dtype"] = ProgramCache.key("decode", other, ssmshard.Plan(tp=1), options)
    monkeypatch.setenv("SSMSHARD_FULL_PROPAGATION", "1")
    changed["environment"] = ProgramCache.key("decode", model, ssmshard.Plan(tp=1), options)
    monkeypatch.delenv("SSMSHARD_FULL_PROPAGATION")
    ssmshard.passes.register("count_nodes_for_key_test", a_user_pass)
    try:
        changed["registered pass"] = ProgramCache.key("decode", model, ssmshard.Plan(tp=1), options)
    finally:
        ssmshard.passes.unregister("count_nodes_for_key_test")
    assert ProgramCache.key("decode", model, ssmshard.Plan(tp=1), options)[0] == key
    assert [what for what, (other_key, _) in changed.items() if other_key == key] == []
    with pytest.raises(Uncacheable, match="lambda"):
        ProgramCache.key("decode", model, ssmshard.Plan(tp=1, policy=lambda *a: None), options)
    # Which folder: the argument, else $SSMSHARD_PROGRAM_CACHE; empty or unset is no cache.
    monkeypatch.setenv("SSMSHARD_PROGRAM_CACHE", "")
    assert ProgramCache.of(None) is None and ProgramCache.of("") is None
    monkeypatch.setenv("SSMSHARD_PROGRAM_CACHE", "/tmp/programs")
    assert str(ProgramCache.of(None).directory) == "/tmp/programs"
    assert str(ProgramCache.of("elsewhere").directory) == "elsewhere"


@pytest.mark.compat
def test_a_loaded_program_refuses_passes_and_an_unreadable_entry_is_built_again(tmp_path):
    """A stored program keeps no fake values: running passes on it, or asking every op's shape, is a
    clear error. An entry that cannot be read is named in a warning, and the program is built (and
    stored) again, with HF's tokens."""
    out = tmp_path / "result.json"
    ssmshard.launch(program_cache_worker.refusals_and_unreadable_entries, 1, str(tmp_path / "programs"), str(out),
                    backend="gloo")
    result = json.loads(out.read_text())
    assert result["first_stored"] == ["prefill rank 0"]
    assert result["loaded"] == ["prefill rank 0"] and result["from_store"]
    for what in ("passes", "report"):
        assert result[what] is not None and "program cache" in result[what], (what, result[what])
    assert result["loaded_tokens_equal_hf"]
    assert any("could not be loaded" in message for message in result["warnings"]), result["warnings"]
    assert result["rebuilt_stored"] == ["prefill rank 0"] and not result["rebuilt_from_store"]
    assert result["rebuilt_tokens_equal_hf"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("world", [pytest.param(1, id="tp1"), pytest.param(2, id="tp2", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="tensor-parallel CUDA graphs need 2 GPUs"))])
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2", "llama"])
def test_loaded_programs_graph_their_decode_on_a_gpu(family, world, tmp_path, fresh_seed):
    """The GPU plan (Triton kernels, decode rewrites, CUDA-graph decode, attention models over static
    key/value buffers), at tp 1 and (on two GPUs, NCCL's all-reduces inside the graph) tp 2: a
    second launch loads the programs the first stored, and both give eager's and HF's tokens
    graphed, finishing rows included."""
    cache = str(tmp_path / "programs")
    for launch in ("stores", "loads"):
        out = tmp_path / f"tokens_{launch}.json"
        ssmshard.launch(generate_worker.graphed_vs_eager, world, family, fresh_seed, str(out), False, None, (),
                        True, cache, backend="nccl")
        tokens = json.loads(out.read_text())
        where = f"{family} at tp {world}, the launch that {launch} (seed {fresh_seed})"
        assert tokens["graphed"] == tokens["eager"] == tokens["again"] == tokens["hf"], where
        check_finishing_rows(tokens["finishing"], where)
        assert tokens["cache"]["loaded" if launch == "loads" else "stored"], (where, tokens["cache"])
        assert not tokens["cache"]["stored" if launch == "loads" else "loaded"], (where, tokens["cache"])


@pytest.mark.compat
def test_a_miss_names_what_differs_and_the_cli_lists_and_prunes_what_cannot_load(tmp_path, caplog, capsys):
    """A lookup that misses logs the parts in which the closest stored entry of its kind differs
    (the plan's tp, the rank); ``ssmshard programs DIR`` lists every entry with whether this
    installation can load it, and ``--prune`` deletes exactly the entries stored by other code
    (another torch here), nothing else."""
    import logging

    from ssmshard import cli

    model, folder = small_model("mamba2"), tmp_path / "programs"
    cache = ProgramCache(folder)
    with caplog.at_level(logging.INFO, logger="ssmshard"):
        assert cache.load("decode", model, ssmshard.Plan(tp=1), {"rank": 0}, "group") is None
    assert "no decode program stored" in caplog.text
    for kind in ("decode", "prefill"):
        cache.store(kind, model, ssmshard.Plan(tp=1), {"rank": 0}, ssmshard.capture(model, mode=kind), "group")
    assert cache.stored == ["decode rank 0", "prefill rank 0"]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ssmshard"):
        assert cache.load("decode", model, ssmshard.Plan(tp=2), {"rank": 1}, "group") is None
    decode_key = ProgramCache.key("decode", model, ssmshard.Plan(tp=1), {"rank": 0})[0]
    assert f"closest stored one ({decode_key}) differs in options.rank: 0 -> 1; plan.tp: 1 -> 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ssmshard"):
        half = ssmshard.build_small_model("mamba2").to(torch.bfloat16)  # not the shared test model
        assert cache.load("decode", half, ssmshard.Plan(tp=1), {"rank": 0}, "group") is None
    assert "model.tensors.backbone.embeddings.weight.dtype: torch.float32 -> torch.bfloat16" in caplog.text

    prefill_key = ProgramCache.key("prefill", model, ssmshard.Plan(tp=1), {"rank": 0})[0]
    sidecar = folder / f"{prefill_key}.json"
    parts = json.loads(sidecar.read_text())
    parts["code"]["versions"]["torch"] = "0.0.1"  # as another installation would have stored it
    sidecar.write_text(json.dumps(parts))
    assert cli.main(["programs", str(folder)]) == 0
    listing = capsys.readouterr().out
    assert "2 programs" in listing and "1 stored by other code" in listing
    decode_row, prefill_row = (next(line for line in listing.splitlines() if line.startswith(kind))
                               for kind in ("decode", "prefill"))
    assert "Mamba2ForCausalLM" in decode_row and decode_row.endswith("yes")
    assert prefill_row.endswith(f"no: code.versions.torch: 0.0.1 -> {torch.__version__}")

    (folder / "notes.json").write_text("{}")  # not the cache's: listed nowhere, never pruned
    assert cli.main(["programs", str(folder), "--prune"]) == 0
    assert "pruned 1 programs" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{decode_key}.json", f"{decode_key}.pt", "notes.json"])
    assert cli.main(["programs", str(tmp_path / "absent")]) == 2
