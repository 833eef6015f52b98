"""Bytes per token in the sharding report, against a hand computation from real configs.

The models are built on the meta device from full-size Hugging Face configs (two or three
layers): each collective's operand per token is a count of the config's dimensions times 4
bytes (float32), whatever example batch and sequence lengths the graph was traced with.
"""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, Zamba2Config,
                          Zamba2ForCausalLM)

import ssmshard
from ssmshard.runtime.pipeline import shard_program

from conftest import gated_norm_has_groups

FP32 = 4  # bytes per value


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config).eval()


def _mamba2(n_groups):  # Mamba2-2.7B's dimensions, two layers
    return Mamba2Config(hidden_size=2560, num_heads=80, head_dim=64, expand=2, n_groups=n_groups, state_size=128,
                        num_hidden_layers=2, vocab_size=50288, tie_word_embeddings=False)


def _zamba2():  # Zamba2-1.2B's dimensions: a mamba layer, then a hybrid one (shared attention + MLP + mamba)
    return Zamba2Config(hidden_size=2048, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                        mamba_d_state=64, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=64,
                        num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192, vocab_size=32000,
                        num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=128,
                        tie_word_embeddings=True)


def _llama():  # Llama-3-8B's dimensions, two layers
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       num_hidden_layers=2, vocab_size=128256, tie_word_embeddings=False)


def _norm_groups(model, n_groups):
    """Groups of the mixers' gated RMSNorm: n_groups, or one (all of d_inner) where the installed
    transformers normalises Mamba-2 without groups (5.17 does)."""
    return n_groups if gated_norm_has_groups(model) else 1


def _mamba2_expected(c, tp, model):
    rows = []
    groups = _norm_groups(model, c.n_groups)
    for layer in range(c.num_hidden_layers):
        if groups % tp:  # groups span ranks: the gated norm sums one square per token and group
            rows.append(("all_reduce", layer, "gate_norm", groups * FP32))
        rows.append(("all_reduce", layer, "out_proj", c.hidden_size * FP32))
    return rows + [("all_gather", None, None, c.vocab_size // tp * FP32)]  # vocab-parallel logits


def _zamba2_expected(c, tp, model):
    # The tied embedding is a vocab-parallel lookup: each rank's partial hidden state is summed.
    rows = [("all_reduce", None, "embed", c.hidden_size * FP32)]
    groups = _norm_groups(model, c.mamba_ngroups)
    for layer, kind in enumerate(c.layers_block_type):
        if kind == "hybrid":  # the shared transformer block before the layer's mixer
            rows += [("all_reduce", layer, "o_proj", c.hidden_size * FP32),
                     ("all_reduce", layer, "down_proj", c.hidden_size * FP32)]
        if groups % tp:
            rows.append(("all_reduce", layer, "gate_norm", groups * FP32))
        rows.append(("all_reduce", layer, "out_proj", c.hidden_size * FP32))
    return rows + [("all_gather", None, None, c.vocab_size // tp * FP32)]


def _llama_expected(c, tp, model):
    rows = []
    for layer in range(c.num_hidden_layers):
        rows += [("all_reduce", layer, "o_proj", c.hidden_size * FP32),
                 ("all_reduce", layer, "down_proj", c.hidden_size * FP32)]
    return rows + [("all_gather", None, None, c.vocab_size // tp * FP32)]


CASES = {
    "mamba2_1_group": (Mamba2ForCausalLM, lambda: _mamba2(1), _mamba2_expected),
    "mamba2_2_groups": (Mamba2ForCausalLM, lambda: _mamba2(2), _mamba2_expected),
    "zamba2": (Zamba2ForCausalLM, _zamba2, _zamba2_expected),
    "llama": (LlamaForCausalLM, _llama, _llama_expected),
}


def _reported(program):
    return [(r["op"], r["layer"], None if r["op"] == "all_gather" else r["role"], r["bytes_per_token"])
            for r in program.collectives]


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_per_token_equal_a_hand_computation(case):
    cls, make_config, expected = CASES[case]
    config = make_config()
    model = _meta(cls, config)
    for tp in (2, 4):
        program = shard_program(ssmshard.capture(model), model, ssmshard.Plan(tp=tp), rank=tp - 1, group="report")
        assert _reported(program) == expected(config, tp, model), f"tp={tp}"
        total = sum(row[-1] for row in expected(config, tp, model))
        assert f"{len(program.sync_points)} sync points, {total:,} bytes per token in all" in program.report()


def test_decode_bytes_per_token_count_the_one_new_token():
    config = _mamba2(1)
    model = _meta(Mamba2ForCausalLM, config)
    plan = ssmshard.Plan(tp=4)
    prefill = shard_program(ssmshard.capture(model, mode="prefill"), model, plan, rank=0, group="report")
    decode = shard_program(ssmshard.capture(model, mode="decode"), model, plan, rank=0, group="report",
                           prefill=prefill)
    assert _reported(decode) == _mamba2_expected(config, 4, model)
