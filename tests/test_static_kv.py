"""Decode over static key/value buffers (runtime/static_kv.py): attention models (Zamba, Zamba2,
Llama) generate Hugging Face's greedy tokens with their keys and values in preallocated buffers,
at tp = 1, 2 (and 4 for Llama), over gloo."""

import json

import pytest
import torch

import ssmshard
from ssmshard.runtime.cuda_graph import why_not_graphable
from ssmshard.runtime.static_kv import StaticKVDecode

from conftest import small_model
import static_kv_worker

ATTENTION_FAMILIES = ["zamba", "zamba2", "llama"]


# tp = 2 runs Zamba2 and Llama by default (Zamba's hybrid layers are Zamba2's in older form; its
# static-K/V decode is graphed in the GPU tests); at tp = 1 Llama; all three in the slow set.
@pytest.mark.parametrize("tp, families", [(1, ["llama"]),
                                         pytest.param(2, ["zamba2", "llama"], marks=pytest.mark.compat),
                                         pytest.param(4, ["llama"], marks=pytest.mark.slow),
                                         pytest.param(1, ATTENTION_FAMILIES, marks=pytest.mark.slow),
                                         pytest.param(2, ATTENTION_FAMILIES, marks=pytest.mark.slow)],
                         ids=["1", "2", "4", "1-all", "2-all"])
def test_static_kv_decode_generates_hf_tokens(tp, families, tmp_path, fresh_seed):
    """dm.generate(static_kv=True | N) gives exactly HF's greedy tokens (as the growing cache's decode
    does in tests/test_generate.py) for two left-padded batches of prompts of different lengths,
    with buffers sized exactly and with unfilled slots to hide; a generation longer than the
    buffers is refused before any program is built, with the sizes in the message; a static-K/V
    generate builds only the programs it runs."""
    out = tmp_path / "static_kv.json"
    ssmshard.launch(static_kv_worker.static_kv_results, tp, families, fresh_seed, str(out), backend="gloo")
    results = json.loads(out.read_text())
    assert [r["family"] for r in results] == families
    for r in results:
        where = f"{r['family']} tp={tp} (seed {fresh_seed})"
        assert len(r["batches"]) == len(static_kv_worker.PROMPT_LENGTHS)
        for lengths, batch in zip(static_kv_worker.PROMPT_LENGTHS, r["batches"]):
            assert len(batch["hf"][0]) == max(lengths) + static_kv_worker.NEW_TOKENS, where  # no early stop
            assert batch["sized"] == batch["hf"], f"{where}: ours {batch['sized']} vs HF {batch['hf']}"
            assert batch.get("roomy", batch["hf"]) == batch["hf"], f"{where}: ours {batch['roomy']} vs HF {batch['hf']}"
            assert batch["same_on_all_ranks"], where
        assert "roomy" in r["batches"][0], where
        error = r["too_long_error"]
        assert error.startswith("ValueError") and "static key/value buffers of 16 positions" in error, (where, error)
        assert f"max_length={12 + static_kv_worker.NEW_TOKENS}" in error, (where, error)
        assert not r["built_after_error"], where
        assert r["built_for_static"] == ["prefill", "static_decode"], where
        assert r["kv_placements_equal_prefill"], where
        assert {"key", "value"} <= set(r["kv_heads"]), where


@pytest.mark.compat
def test_static_kv_programs_are_graphable_and_refuse_what_they_cannot_do():
    """A static-K/V decode program has only fixed-shape inputs (so a CUDA graph may replay it); a
    model without attention, a non-decode mode, missing step inputs and a step past the buffers
    are clear errors."""
    model = small_model("llama")
    static = ssmshard.capture(model, mode="decode", static_kv=True)
    assert static.static_kv and why_not_graphable(static) is None
    with pytest.raises(ValueError, match="no attention"):
        ssmshard.capture(small_model("mamba"), mode="decode", static_kv=True)
    with pytest.raises(ValueError, match="decode programs"):
        ssmshard.capture(model, mode="prefill", static_kv=True)
    ids = torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(TypeError, match="cache_position"):
        static(ids, [], attention_mask=torch.ones(1, 4, dtype=torch.long), position_ids=ids)
    prefill = ssmshard.capture(model, mode="prefill")
    _, states = prefill(torch.ones(1, 3, dtype=torch.long))
    step = StaticKVDecode(static, 4)
    step(ids, states, attention_mask=torch.ones(1, 4, dtype=torch.long), position_ids=ids * 3)  # the last slot
    with pytest.raises(ValueError, match="runs past static key/value buffers of 4 positions"):
        step(ids, states, attention_mask=torch.ones(1, 5, dtype=torch.long), position_ids=ids * 4)
    with pytest.raises(ValueError, match="does not fit static key/value buffers of 2"):
        StaticKVDecode(static, 2)(ids, states, attention_mask=torch.ones(1, 2, dtype=torch.long), position_ids=ids)
