"""The greedy loop without per-step host syncs (ssmshard/runtime/device_loop.py) against Hugging
Face's eager generate: the same ids at tp 1 (in process) and tp 2 (two gloo processes), with
rows stopped by EOS at different steps; the settings it cannot run keep the host loop, which
says why."""

import json

import pytest
import torch
from transformers.generation import BaseStreamer

import ssmshard
from ssmshard.families import family_of
from ssmshard.runtime.device_loop import STOP_CHECK_INTERVAL, why_not_device_loop
from ssmshard.runtime.generation_config import prepare_generation

import device_loop_worker
from device_loop_worker import LATE_STOPS, eos_stops, stopping_eos
from conftest import small_model
from finishing_rows import NEW_TOKENS, eos_in_generation_config
from generate_worker import PAD, left_padded_prompts

# More new tokens than one stop-check interval, so EOS stops fall both before a check and between two.
assert NEW_TOKENS > STOP_CHECK_INTERVAL


def _tp1(model):
    """One rank of ``model`` (tp 1), run in this process: its generate and its module."""
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1))
    return mesh.generate, mesh.ranks[0]


def _hf(model, ids, mask, **options):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **{"do_sample": False, **options})


# Mamba: an SSM decode step that ignores the mask; Llama: attention over the growing mask.
@pytest.mark.parametrize("family", ["mamba", "llama"])
def test_length_only_greedy_equals_hf_on_the_device_loop(family, fresh_seed):
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 9), fresh_seed)
    generate, dm = _tp1(model)
    with eos_in_generation_config(model, None):
        ours = generate(ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        assert dm.last_generation_loop == "device"
        hf = _hf(model, ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        as_dict = generate(ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, return_dict_in_generate=True)
        assert dm.last_generation_loop == "device"
    assert torch.equal(ours, hf), (fresh_seed, ours, hf)
    assert torch.equal(as_dict.sequences, hf), (fresh_seed, as_dict.sequences, hf)


# Two families whose tiny random models emit varied tokens (Mamba's repeat one token per row).
@pytest.mark.parametrize("layout", LATE_STOPS)
@pytest.mark.parametrize("family", ["mamba2", "llama"])
def test_rows_stopped_by_eos_equal_hf_on_the_device_loop(family, layout, fresh_seed):
    """EOS ids that stop one row before the first stop check and the other later (before that
    check or after it, never at the last step): the finished row padded, the output cut where HF
    stops (the steps the loop ran after it discarded)."""
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (6, 10), fresh_seed)
    generate, dm = _tp1(model)
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    with eos_in_generation_config(model, None):
        full_new = _hf(model, ids, mask, **options)[:, ids.shape[1]:].tolist()
    with eos_in_generation_config(model, stopping_eos(full_new, LATE_STOPS[layout])) as eos:
        ours = generate(ids, mask, **options)
        assert dm.last_generation_loop == "device"
        hf = _hf(model, ids, mask, **options)
        # Attention: also over static key/value buffers (the step a CUDA graph replays, here eager),
        # which read the mask view of each step.
        static = generate(ids, mask, static_kv=True, **options) if family_of(model).has_attention else ours
    low, high = sorted(eos_stops(full_new, eos))
    assert low < high and low < STOP_CHECK_INTERVAL and high in LATE_STOPS[layout], \
        f"seed {fresh_seed}: EOS {eos} stops the rows at {low} and {high}, not as {layout} asks"
    assert hf.shape[1] == ids.shape[1] + high + 1, (low, high, hf)
    assert torch.equal(ours, hf), (fresh_seed, eos, ours, hf)
    assert torch.equal(static, hf), (fresh_seed, eos, static, hf)


SAMPLING = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)


def _seeded(seed, call):
    """``call()`` from a seeded global generator, and the next draws from it after the call."""
    torch.manual_seed(seed)
    result = call()
    return result, torch.rand(4)


@pytest.mark.parametrize("stops", ["length_only", *LATE_STOPS])
def test_sampling_equals_hf_on_the_device_loop(stops, fresh_seed):
    """Sampling (temperature, top-k, top-p; a repetition penalty too when EOS stops the rows) with
    a seeded global generator: HF's ids, by length only or with EOS ids stopping the rows at
    different steps (the loop runs on past HF's end and cuts back), and the generator left where
    HF's loop leaves it (the next draws equal)."""
    model = small_model("llama")
    ids, mask = left_padded_prompts(model.config.vocab_size, (6, 10), fresh_seed)
    generate, dm = _tp1(model)
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **SAMPLING)
    if stops != "length_only":
        options["repetition_penalty"] = 1.2
    with eos_in_generation_config(model, None):
        full, _ = _seeded(fresh_seed, lambda: _hf(model, ids, mask, **options))
    eos = None if stops == "length_only" else stopping_eos(full[:, ids.shape[1]:].tolist(), LATE_STOPS[stops])
    with eos_in_generation_config(model, eos):
        ours, ours_next = _seeded(fresh_seed, lambda: generate(ids, mask, **options))
        assert dm.last_generation_loop == "device"
        hf, hf_next = _seeded(fresh_seed, lambda: _hf(model, ids, mask, **options))
    where = f"seed {fresh_seed}, EOS {eos}"
    if eos is not None:
        low, high = sorted(eos_stops(full[:, ids.shape[1]:].tolist(), eos))
        assert low < high and high in LATE_STOPS[stops], f"{where} stops the rows at {low} and {high}"
        assert hf.shape[1] == ids.shape[1] + high + 1, (where, hf)
    assert torch.equal(ours, hf), (where, ours, hf)
    assert torch.equal(ours_next, hf_next), where


def test_greedy_with_a_repetition_penalty_equals_hf_on_the_device_loop(fresh_seed):
    model = small_model("mamba2")
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 9), fresh_seed)
    generate, dm = _tp1(model)
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, repetition_penalty=1.3, min_new_tokens=3)
    ours = generate(ids, mask, **options)
    assert dm.last_generation_loop == "device"
    assert torch.equal(ours, _hf(model, ids, mask, **options)), fresh_seed


def test_tp2_device_loop_equals_hf(tmp_path, fresh_seed):
    out = tmp_path / "device_loop.json"
    ssmshard.launch(device_loop_worker.device_loop_results, 2, "mamba2", fresh_seed, str(out), backend="gloo")
    results = json.loads(out.read_text())
    assert list(results) == ["length_only", *LATE_STOPS, "sampled"]
    for case, r in results.items():
        where = f"{case} (seed {fresh_seed}, EOS {r.get('eos')} stopping the rows at {r.get('stops')})"
        assert r["loop"] == "device", where
        assert r["ours"] == r["hf"], f"{where}: ours {r['ours']} vs HF {r['hf']}"
        assert r["same_on_all_ranks"], where


class _Collecting(BaseStreamer):
    """A streamer that keeps the token ids it is given."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        pass


INELIGIBLE = [
    (dict(do_sample=True, no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(streamer="streamer"), "streamer"),
]


@pytest.mark.parametrize("settings, named", INELIGIBLE, ids=["ngram_processor", "scores", "streamer"])
def test_settings_it_cannot_run_keep_the_host_loop_and_say_why(settings, named, fresh_seed):
    model = small_model("mamba")
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 9), fresh_seed)
    settings = {k: _Collecting() if v == "streamer" else v for k, v in settings.items()}
    options = dict(max_new_tokens=5, pad_token_id=PAD, **settings)
    assert why_not_device_loop(prepare_generation(model, ids, mask, max_new_tokens=5)) is None
    reason = why_not_device_loop(prepare_generation(model, ids, mask, **options))
    assert reason is not None and named in reason, reason
    generate, dm = _tp1(model)
    with pytest.raises(ValueError, match=f"device_loop=True.*{named}"):
        generate(ids, mask, device_loop=True, **options)
    torch.manual_seed(fresh_seed)
    ours = generate(ids, mask, **options)
    assert dm.last_generation_loop == "host"
    torch.manual_seed(fresh_seed)
    hf = _hf(model, ids, mask, **options)
    sequences = lambda out: getattr(out, "sequences", out)  # noqa: E731 (a dict with output_scores)
    assert torch.equal(sequences(ours), sequences(hf)), fresh_seed


def test_device_loop_false_and_invalid_values():
    model = small_model("mamba")
    ids = torch.randint(1, model.config.vocab_size, (1, 4))
    generate, dm = _tp1(model)
    generate(ids, max_new_tokens=2, device_loop=False)
    assert dm.last_generation_loop == "host"
    with pytest.raises(ValueError, match="device_loop must be True, False or 'auto'"):
        generate(ids, max_new_tokens=2, device_loop="yes")
