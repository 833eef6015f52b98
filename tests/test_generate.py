"""generate() on the distributed module against Hugging Face generate, over gloo."""

import json

import pytest
import torch
from transformers import GenerationConfig

import ssmshard
from ssmshard.families import BY_NAME

import generate_worker
from conftest import SIX_FAMILIES, small_model


# At tp = 4 the families whose split differs from tp = 2's: Mamba-2's two B/C groups held by two
# ranks each (also in Zamba2, a hybrid with a shared attention block) and Llama's key/value heads.
# The Mamba-1 mixers split channel by channel alike at 2 and 4; four processes on the 2-core CI
# machine made the six-family run the suite's longest test (184 s).
TP4_FAMILIES = ["mamba2", "zamba2", "llama"]

# HF's generate arguments act on the logits and on rank 0's stop decisions, not on the split: one
# family per tp covers them, a different kind of model at each (attention only, SSM, hybrid).
ARGUMENT_FAMILY = {1: "llama", 2: "mamba2", 4: "zamba2"}
PROMPT = 12  # the widest of generate_worker's left-padded prompts


# At tp = 1 nothing is split, and tp = 2 runs all six families: one family of each kind by default
# (Mamba-1 SSM, hybrid, attention only), all six in the slow set. tp = 2 runs as two tests of three
# families, so that the test processes can take one each.
TP1_FAMILIES = ["mamba", "zamba2", "llama"]
SSM_FAMILIES = [f for f in SIX_FAMILIES if not BY_NAME[f].has_attention]
WITH_ATTENTION = [f for f in SIX_FAMILIES if BY_NAME[f].has_attention]


@pytest.mark.parametrize("tp, families", [(1, TP1_FAMILIES),
                                         pytest.param(2, SSM_FAMILIES, marks=pytest.mark.compat),
                                         pytest.param(2, WITH_ATTENTION + ["qwen2"], marks=pytest.mark.compat),
                                         pytest.param(4, TP4_FAMILIES, marks=pytest.mark.slow),
                                         pytest.param(1, SIX_FAMILIES, marks=pytest.mark.slow)],
                         ids=["1", "2-ssm", "2-attention", "4", "1-all"])
def test_generate_matches_hf_generate_and_states_are_sharded(tp, families, tmp_path, fresh_seed):
    """Built with ``lazy_forward=True`` (the forward program is never captured; Mamba-2's and Llama's
    then built on a first forward call, HF's logits): greedy with the model's own generation
    config gives exactly HF's tokens for 3 left-padded prompts of different lengths, 20 new
    tokens, ``families`` (all six over the tp = 2 tests, and Qwen2: a Llama-style decoder with
    biased q/k/v projections);
    again with EOS ids the model emits early set in that config, so rows stop, are padded, and
    generation ends early. Sampling with a fixed seed (Mamba-2 and Zamba2, to keep the test
    short): the same tokens on every rank and as HF's sampling from the same seed (so tp = 2, 4
    equal tp = 1 too). HF's arguments on ``ARGUMENT_FAMILY`` (see
    ``check_hf_arguments``). Each rank's SSM/KV state tensors hold 1/tp of the
    channels or heads. Chunked prefill (Mamba, Zamba, Zamba2) gives each rank the local states
    and logits of one shot."""
    out = tmp_path / "generate.json"
    ssmshard.launch(generate_worker.generate_results, tp, families, fresh_seed, str(out), (ARGUMENT_FAMILY[tp],),
                    backend="gloo")
    results = json.loads(out.read_text())
    assert [r["family"] for r in results] == families
    # The families whose EOS is not the pad id (all but Mamba and Falcon-Mamba) also run unmasked.
    assert sum("unmasked_equal_hf" in r for r in results) == len(set(families) - {"mamba", "falcon_mamba"})
    assert sum("lazy_forward_err" in r for r in results) == len(set(families) & {"mamba2", "llama"})
    for r in results:
        where = f"{r['family']} tp={tp} (seed {fresh_seed})"
        # Built with lazy_forward=True: generating never captured the forward program.
        assert "forward" not in r["captured_generating"], (where, r["captured_generating"])
        if "lazy_forward_err" in r:  # built on the first forward call, over the same local weights
            assert r["lazy_forward_err"] < 1e-5, (where, r["lazy_forward_err"])
            assert r["captured_with_forward"].count("forward") == 1, (where, r["captured_with_forward"])
        assert r["greedy_equal_hf"], f"{where}: ours {r['ours']} vs HF {r['hf']}"
        assert r["greedy_same_on_all_ranks"], where
        assert r["early_equal_hf"], f"{where}: EOS {r['early_eos']}: ours {r['early']} vs HF {r['hf_early']}"
        assert r["early_same_on_all_ranks"], where
        assert len(r["early"][0]) <= PROMPT + 4, (where, r["early_eos"], r["early"])  # stopped by EOS, not length
        if "arguments" in r:
            check_hf_arguments(r["arguments"], r["hf_error_unknown"], where)
        if tp == 1 and r["family"] == ARGUMENT_FAMILY[tp]:  # runtime.generate.generate with no model
            assert r["programs_only_equal_hf"], where
        if "unmasked_equal_hf" in r:  # no attention_mask: the pad ids are padding, as in HF
            assert r["unmasked_equal_hf"], f"{where}: ours {r['unmasked']} vs HF {r['hf_unmasked']}"
        if "chunked_logits_err" in r:  # prefill in chunks of 4 on this rank's shards
            assert r["chunked_logits_err"] < 1e-5, (where, r["chunked_logits_err"])
            assert max(r["chunked_state_errs"]) < 1e-5, (where, r["chunked_state_errs"])
            assert r["chunked_generate_equal"], where
        if "sampled_equal_hf" in r:
            assert r["sampled_same_on_all_ranks"], where
            assert r["sampled_equal_hf"], f"{where}: ours {r['sampled']} vs HF {r['hf_sampled']}"
        for kind, share in zip(r["state_kinds"], r["states"]):
            if tp == 1:
                assert share["local"] == share["global"], (where, kind, share)
            elif kind in ("conv", "ssm") or not BY_NAME[r["family"]].has_ssm:
                # The small configs split every mixer channel/head and every kv head evenly
                # (Mamba-2's 2 groups at tp = 4 sit two ranks per group: B/C rows shared).
                assert share["sharded"], (where, kind, share)
                if share["even"]:
                    assert share["local"] * tp == share["global"], (where, kind, share)
                else:
                    assert share["local"] < share["global"], (where, kind, share)


def check_hf_arguments(per_rank, hf_error_unknown, where):
    """``generate_hf_arguments.argument_results`` of every rank: HF's sequences (and scores within
    1e-5), rank 0 alone streaming HF's puts, and every rank raising alike for what is refused."""
    for rank, results in enumerate(per_rank):
        at = f"{where} rank {rank}"
        for case, outcome in results.items():
            if case.startswith("error_") or case == "streamer":
                continue
            assert outcome["equal"], f"{at} {case}: ours {outcome['ours']} vs HF {outcome['hf']}"
            for err in ("scores_err", "logits_err"):
                if err in outcome:
                    assert outcome[err] < 1e-5, (at, case, err, outcome[err])
        assert results["min_new_tokens"]["ours"] and len(results["min_new_tokens"]["ours"][0]) >= PROMPT + 6, at
        assert "num_beams=2" in results["error_num_beams"] and "beam search" in results["error_num_beams"], at
        assert results["error_unknown"] == hf_error_unknown, at  # HF's own error for an unknown argument
        assert "not_an_argument" in results["error_unknown"], at
        assert "assistant_model" in results["error_assistant"], at
        assert "output_attentions" in results["error_attentions"], at
        failing = results["error_failing_criterion"]
        if rank == 0:
            assert failing.startswith("KeyError") and "this stopping criterion fails" in failing, (at, failing)
        else:  # told by rank 0's broadcast instead of waiting for tokens
            assert failing.startswith("RuntimeError") and "rank 0 failed" in failing, (at, failing)
        ours, hf = results["streamer"]["ours"], results["streamer"]["hf"]
        assert ours == (hf if rank == 0 else [[], 0]), (at, ours, hf)
        assert len(hf[0]) == 6 and hf[1] == 1, (at, hf)  # the prompt, 5 tokens, one end


def test_refused_arguments_raise_before_generating():
    """What HF does and ssmshard does not is a ValueError naming it, raised before any program
    runs (here there are none), so every rank raises alike."""
    from ssmshard.runtime.generate import generate

    model = small_model("mamba")
    ids = torch.ones(2, 3, dtype=torch.long)
    for arguments, name in [(dict(num_beams=3), "num_beams=3"), (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
                            (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
                            (dict(guidance_scale=1.5), "guidance_scale"),
                            (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
                            (dict(negative_prompt_ids=ids), "negative_prompt_ids"),
                            (dict(position_ids=ids), "position_ids"),
                            (dict(generation_config=GenerationConfig(num_beams=2)), "num_beams=2")]:
        with pytest.raises(ValueError, match=name):
            generate(None, None, ids, model=model, **arguments)
    # HF's own validation: invalid values, and a prompt as long as max_length.
    with pytest.raises(ValueError, match="temperature"):
        generate(None, None, ids, model=model, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_length"):
        generate(None, None, ids, model=model, max_length=3)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(None, None, ids, torch.ones(2, 4), model=model)
    with pytest.raises(ValueError, match="2-D"):
        generate(None, None, ids[0], model=model)


def test_a_lazy_forward_module_from_a_checkpoint_generates_hf_tokens(tmp_path, fresh_seed):
    """Zamba2 on the meta device, its weights read from a checkpoint, ``lazy_forward=True`` at tp=2:
    its prefill program lifts tensors the model does not hold (left to each program) and reads
    rotary buffers a meta model must recompute. HF's tokens; the forward program captured on the
    first forward call only, HF's logits."""
    small_model("zamba2").save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "lazy.json"
    ssmshard.launch(generate_worker.lazy_forward_from_a_checkpoint, 2, "zamba2", str(tmp_path / "ckpt"),
                    fresh_seed, str(out), backend="gloo")
    r = json.loads(out.read_text())
    where = f"seed {fresh_seed}"
    assert r["equal_hf"], (where, r["ours"], r["hf"])
    assert "forward" not in r["captured_generating"], (where, r["captured_generating"])
    assert r["captured"].count("forward") == 1, (where, r["captured"])
    assert r["forward_err"] < 1e-5, (where, r["forward_err"])


def test_lazy_forward_and_packed_are_refused_together():
    """``packed=True`` builds the packed forward beside the forward program, which
    ``lazy_forward=True`` defers: a ValueError before anything is captured."""
    with pytest.raises(ValueError, match="lazy_forward=True defers the forward: pass one of them"):
        ssmshard.parallelize(small_model("mamba"), ssmshard.Plan(tp=2), packed=True, lazy_forward=True)


def test_checkpoint_generation_config_gives_generate_its_defaults(tmp_path):
    """parallelize_from_pretrained builds the model from config.json on meta; generate's defaults
    then come from the checkpoint's generation_config.json, as after HF's from_pretrained."""
    import copy

    from transformers import AutoModelForCausalLM

    from ssmshard.families import build_meta_model
    from ssmshard.runtime.generation_config import load_generation_defaults

    model = small_model("llama")
    model.save_pretrained(tmp_path)
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[5, 7], do_sample=True, temperature=0.6, top_p=0.9)
    config.save_pretrained(tmp_path)
    meta = build_meta_model(str(tmp_path))
    load_generation_defaults(meta, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert meta.generation_config.to_dict() == hf.generation_config.to_dict()
    assert meta.generation_config.eos_token_id == [5, 7]
