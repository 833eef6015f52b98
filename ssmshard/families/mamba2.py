"""Mamba-2: ``Mamba2ForCausalLM``.

Tensor-parallel layout: in_proj rows are packed ``[z, x, B, C, dt]`` and the conv runs over
``[x, B, C]``; each segment is split on its own: z, x and dt by heads, B and C by groups
(split when ``n_groups % tp == 0``, else each rank holds the group its heads read, computed
redundantly). A_log, D, dt_bias and the gated norm by heads/channels; out_proj row-parallel.
The gated norm spans ``d_inner / n_groups`` channels; where a group spans ranks the sharding
pass all-reduces one scalar per token and group. Zamba2 builds on this module.
"""

from __future__ import annotations

from ..placement import Segment, Shard
from ..plan import Rule
from .family import Family, TagHints
from .styles import grouped, mixer_of, split

# The Mamba-2 mixer's per-head bias, and its ``norm``: the gated norm (the final norm is norm_f).
MIXER_HINTS = TagHints(param_roles={"dt_bias": "dt_bias"}, roles={"norm_f": "norm"},
                       block_roles={("mamba2", "norm"): "gate_norm"})


def _segments(tp, fqn, model, with_gate_and_dt: bool):
    m = mixer_of(model, fqn)
    heads = split(m.num_heads, tp, fqn, "SSM heads")
    channels = Segment(m.intermediate_size, heads.pieces, 1)
    groups = grouped(m.n_groups, m.ssm_state_size, tp, fqn, "SSM groups (n_groups)")
    conv = (channels, groups, groups)  # [x, B, C]
    return (channels, *conv, Segment(m.num_heads, tp, 1)) if with_gate_and_dt else conv


def in_proj(tp, fqn, spec, model):
    return Shard(0, _segments(tp, fqn, model, True))


def conv(tp, fqn, spec, model):
    return Shard(0, _segments(tp, fqn, model, False))


def channels(tp, fqn, spec, model):
    """Per-head weights (A_log, D, dt_bias) by heads; per-channel ones (gated norm) by channels."""
    mixer = mixer_of(model, fqn)
    if spec.role in ("A_log", "D", "dt_bias") and hasattr(mixer, "num_heads") and spec.shape[0] == mixer.num_heads:
        return Shard(0, (split(spec.shape[0], tp, fqn, "SSM heads"),))
    return Shard(0, (split(spec.shape[0], tp, fqn, "channels"),))


STYLES = {"mamba2_in_proj": in_proj, "mamba2_conv": conv, "channels": channels}
MIXER_RULES = (
    Rule("mamba2_in_proj", block="mamba2", role="in_proj"),
    Rule("mamba2_conv", block="mamba2", role="conv"),
    *[Rule("channels", block="mamba2", role=r) for r in ("A_log", "D", "dt_bias", "gate_norm")],
    Rule("rowwise", block="mamba2", role="out_proj"),
)


def small_config():
    # num_heads * head_dim == expand * hidden_size; chunk_size deliberately small so short test
    # sequences cross chunk edges.
    return dict(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                num_heads=8, head_dim=16, n_groups=2, chunk_size=16, conv_kernel=4,
                tie_word_embeddings=False)


MAMBA2 = Family(
    "mamba2", "Mamba2ForCausalLM", "Mamba2Config", "transformers.models.mamba2.modeling_mamba2", small_config,
    tag_hints=TagHints(blocks={"Mamba2Mixer": "mamba2"}) | MIXER_HINTS,
    rules=MIXER_RULES, styles=STYLES,
)
FAMILIES = (MAMBA2,)
