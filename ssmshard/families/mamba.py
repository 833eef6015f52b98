"""Mamba (Mamba-1): ``MambaForCausalLM``.

Tensor-parallel layout (exact, 2 all-reduces per layer): in_proj rows are packed ``[x | z]``,
so each rank takes its channels of both; conv1d, dt_proj rows, A_log and D are split by
channel; x_proj is row-parallel and its output (dt_rank + 2N values per token) is
all-reduced, so dt, B and C are replicated; out_proj is row-parallel. Falcon-Mamba builds on
this module.
"""

from __future__ import annotations

from ..placement import REPLICATE, Shard
from ..plan import Rule
from .family import Family, TagHints
from .styles import is_bias, mixer_of, split

# The Mamba-1 mixer's own projections, and the final norm's name.
MIXER_HINTS = TagHints(roles={"x_proj": "x_proj", "dt_proj": "dt_proj", "norm_f": "norm"})
MIXER_ROLES = ("in_proj", "conv", "x_proj", "dt_proj", "A_log", "D", "out_proj")


def mamba1(tp, fqn, spec, model):
    """A Mamba-1 mixer's weights split by channel (d_inner)."""
    if spec.role == "out_proj" and is_bias(fqn):
        return REPLICATE  # added once, after the all-reduce
    channels = split(mixer_of(model, fqn).intermediate_size, tp, fqn, "SSM channels (intermediate_size)")
    return {"in_proj": Shard(0, (channels, channels)),  # rows are [x | z]
            "x_proj": Shard(1, (channels,)),
            "out_proj": Shard(1, (channels,))}.get(spec.role, Shard(0, (channels,)))


MIXER_RULES = tuple(Rule("mamba1", block="mamba1", role=r) for r in MIXER_ROLES)


def small_config():
    return dict(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                conv_kernel=4, time_step_rank=8, use_cache=True)


MAMBA = Family(
    "mamba", "MambaForCausalLM", "MambaConfig", "transformers.models.mamba.modeling_mamba", small_config,
    tag_hints=TagHints(blocks={"MambaMixer": "mamba1"}) | MIXER_HINTS,
    rules=MIXER_RULES, styles={"mamba1": mamba1},
    scans_need_states=True,
)
FAMILIES = (MAMBA,)
