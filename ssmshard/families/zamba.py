"""Zamba: ``ZambaForCausalLM``, Mamba-1 layers with a shared attention block every few layers.

Its mixer cuts d_inner into ``n_mamba_heads`` heads, each a full Mamba-1 mixer with its own
x_proj/dt_proj/A/D (parameters stacked on a leading head dim, used without calling a module),
and its in_proj rows interleave x and z per head. Every rank takes the same share of every
head's channels, so each head's scan stays local and x_proj's output is all-reduced per head
as in Mamba-1; splitting whole heads instead would need n_mamba_heads % tp == 0, which
Zamba-7B (2 heads) breaks. Attention and MLP follow the shared rules.
"""

from __future__ import annotations

from ..placement import REPLICATE, Segment, Shard
from .family import Family, TagHints
from .mamba import MIXER_RULES
from .styles import ATTENTION_RULES, MLP_RULES, is_bias, mixer_of, split

TAG_HINTS = TagHints(
    blocks={"ZambaMambaMixer": "mamba1"},
    # The hybrid layer's projection of the shared block's output back into the stream.
    roles={"linear": "hybrid_linear", "final_layernorm": "norm", "pre_ff_layernorm": "norm"},
    param_roles={"x_proj_weight": "x_proj", "dt_proj_weight": "dt_proj", "dt_proj_bias": "dt_proj"},
)


def mamba1_heads(tp, fqn, spec, model):
    """Zamba's multi-head Mamba-1 mixer, split by channel within each head."""
    if spec.role == "out_proj" and is_bias(fqn):
        return REPLICATE  # added once, after the all-reduce
    mixer = mixer_of(model, fqn)
    heads = mixer.n_mamba_heads
    head_dim = mixer.intermediate_size // heads
    channels = split(head_dim, tp, fqn, f"channels of each of the {heads} Mamba heads (mamba_head_dim)")
    if spec.role == "in_proj":
        # rows (2 * d_inner) are [x_0, z_0, x_1, z_1, ...]: a rank's channels of a head are
        # one contiguous run of 2 * head_dim / tp rows inside that head's 2 * head_dim.
        return Shard(0, (Segment(2 * head_dim, channels.pieces),) * heads)
    if spec.role == "conv":
        return Shard(0, (channels,) * heads)
    if spec.role == "out_proj":
        return Shard(1, (channels,) * heads)
    if spec.role == "x_proj":  # (heads, dt_rank + 2 * N, head_dim): row-parallel per head
        return Shard(2, (channels,))
    return Shard(1, (channels,))  # dt_proj weight/bias, A_log, D: (heads, head_dim, ...)


def small_config():
    # Zamba places hybrid (shared attention) layers at 2, then every attn_layer_period: 2 and 4 here.
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=2, attn_layer_period=2, attn_layer_offset=1,
                max_position_embeddings=512)


ZAMBA = Family(
    "zamba", "ZambaForCausalLM", "ZambaConfig", "transformers.models.zamba.modeling_zamba", small_config,
    has_attention=True, tag_hints=TAG_HINTS,
    # Mamba's mixer rules, served by this family's "mamba1" style (the per-head split).
    rules=(*MIXER_RULES, *ATTENTION_RULES, *MLP_RULES), styles={"mamba1": mamba1_heads},
    scans_need_states=True,
)
FAMILIES = (ZAMBA,)
