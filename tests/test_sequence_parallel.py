"""Megatron sequence parallelism (``Plan(sequence_parallel=True)``) against HF eager and plain TP,
in real processes over gloo: logits, every rank's gradients, and the residual stream's bytes."""

import json

import pytest

import ssmshard

import sp_worker
from conftest import SIX_FAMILIES

# The small default configs split evenly over 2 and 4 ranks; these split over 3 (hidden 48:
# 6 attention or SSM heads, vocabulary 264).
TP3 = {
    "mamba": {"hidden_size": 48, "vocab_size": 264},
    "falcon_mamba": {"hidden_size": 48, "vocab_size": 264},
    "mamba2": {"hidden_size": 48, "num_heads": 6, "head_dim": 16, "n_groups": 3, "vocab_size": 264},
    "zamba": {"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6,
              "vocab_size": 264},
    "zamba2": {"hidden_size": 48, "n_mamba_heads": 6, "mamba_ngroups": 3, "num_attention_heads": 6,
               "num_key_value_heads": 6, "intermediate_size": 96, "vocab_size": 264},
    "llama": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96,
              "vocab_size": 264},
}


@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_equals_eager_and_tp(tp, tmp_path, fresh_seed):
    """Lengths 1 (shorter than tp and than the conv kernel) and 2 tp + 1 (not divisible): the
    padding inside the program never shows. Gradients equal plain TP's (1e-5 over the whole gradient
    vector); the residual adds hold 1/tp of the tokens' bytes per rank."""
    cases = [(family, TP3[family] if tp == 3 else {}) for family in SIX_FAMILIES]
    out = tmp_path / "sp.json"
    ssmshard.launch(sp_worker.sequence_parallel_results, tp, cases, [1, 2 * tp + 1], fresh_seed,
                    str(out), backend="gloo")
    for rank, results in enumerate(json.loads(out.read_text())):
        assert [r["family"] for r in results] == SIX_FAMILIES
        for r in results:
            where = f"{r['family']} tp={tp} rank {rank} (seed {fresh_seed})"
            assert r["logits_err"] < 1e-5, (where, r)
            assert r["grad_err"] < 1e-5, (where, r)
            assert r["sharded_adds"] > 0 and r["sp_residual_bytes"] * tp == r["tp_residual_bytes"], (where, r)
            assert "reduce_scatter" in r["sync_kinds"] and "all_gather" in r["sync_kinds"], (where, r)
