"""Zamba2: ``Zamba2ForCausalLM``, Mamba-2 layers with shared transformer blocks.

Mixers follow Mamba-2's layout (``mamba2.py``); attention and MLP the shared rules. Two
things are its own: the MLP's fused ``gate_up_proj`` (rows ``[gate | up]``: each rank takes its
rows of both halves), and the per-call-site LoRA adapters of the shared block, whose
down-projection (first linear) stays replicated while the up-projection (second) is split
like the base projection it is added to.
"""

from __future__ import annotations

import re

from ..placement import Shard
from ..plan import Rule
from . import mamba2
from .family import Family, TagHints
from .styles import ATTENTION_RULES, MLP_RULES, split

TAG_HINTS = mamba2.MIXER_HINTS | TagHints(
    blocks={"Zamba2MambaMixer": "mamba2"},
    roles={"linear": "hybrid_linear", "final_layernorm": "norm", "pre_ff_layernorm": "norm",
           "gate_up_proj": "gate_up_proj", "linear_q_adapter_list": "q_adapter",
           "linear_k_adapter_list": "k_adapter", "linear_v_adapter_list": "v_adapter",
           "gate_up_proj_adapter_list": "gate_up_adapter"},
)


def packed_halves(tp, fqn, spec, model):
    half = split(spec.shape[0] // 2, tp, fqn, "rows of each half of a fused projection")
    return Shard(0, (half, half))  # rows are [gate | up]: each rank takes its rows of both


RULES = (
    *mamba2.MIXER_RULES, *ATTENTION_RULES, *MLP_RULES,
    Rule("packed_halves", block="mlp", role="gate_up_proj"),
    Rule("attn_q", glob="*linear_q_adapter_list.*.1.weight"),
    Rule("attn_kv", glob="*linear_k_adapter_list.*.1.weight"),
    Rule("attn_kv", glob="*linear_v_adapter_list.*.1.weight"),
    Rule("packed_halves", glob="*gate_up_proj_adapter_list.*.1.weight"),
)


def repeat_path(path, source, target, model):
    """A shared block's adapters are one per call site: ``*_adapter_list.<k>`` with ``k`` the
    layer's place among the hybrid layers (``config.hybrid_layer_ids``)."""
    if "_adapter_list." not in path:
        return path
    sites = list(model.config.hybrid_layer_ids)
    return re.sub(rf"(_adapter_list\.){sites.index(source)}(?=\.|$)", rf"\g<1>{sites.index(target)}", path)


def small_config():
    return dict(vocab_size=256, hidden_size=64, num_hidden_layers=5,
                layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid",
                                   "linear_attention"],
                mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8,
                chunk_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8,
                use_mem_rope=True, max_position_embeddings=512)


ZAMBA2 = Family(
    "zamba2", "Zamba2ForCausalLM", "Zamba2Config", "transformers.models.zamba2.modeling_zamba2", small_config,
    has_attention=True, tag_hints=TAG_HINTS, rules=RULES,
    styles={**mamba2.STYLES, "packed_halves": packed_halves}, repeat_path=repeat_path,
)
FAMILIES = (ZAMBA2,)
