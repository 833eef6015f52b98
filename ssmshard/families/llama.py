"""Llama and the Llama-style decoders whose graphs are the same ops under other names
(Mistral, Qwen2): attention and MLP only, with the shared rules (``styles.py``)."""

from __future__ import annotations

from .family import Family
from .styles import ATTENTION_RULES, MLP_RULES

RULES = (*ATTENTION_RULES, *MLP_RULES)


def small_config():
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False)


def _llama_style(name, prefix, small_config=small_config):
    return Family(name, f"{prefix}ForCausalLM", f"{prefix}Config", f"transformers.models.{name}.modeling_{name}",
                  small_config, has_attention=True, has_ssm=False, rules=RULES)


FAMILIES = (
    _llama_style("llama", "Llama"),
    _llama_style("mistral", "Mistral", lambda: {**small_config(), "sliding_window": None}),
    _llama_style("qwen2", "Qwen2"),
)
