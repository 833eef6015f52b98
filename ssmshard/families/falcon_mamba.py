"""Falcon-Mamba: ``FalconMambaForCausalLM``, a Mamba-1 model with RMSNorms on dt, B and C.

Its layout is Mamba's (``mamba.py``): x_proj's output is all-reduced before the norms, so
they act on replicated values and need no communication.
"""

from __future__ import annotations

from . import mamba
from .family import Family, TagHints


def small_config():
    return {**mamba.small_config(), "mixer_rms_eps": 1e-6}


FALCON_MAMBA = Family(
    "falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig",
    "transformers.models.falcon_mamba.modeling_falcon_mamba", small_config,
    tag_hints=mamba.MIXER_HINTS | TagHints(
        blocks={"FalconMambaMixer": "mamba1"},
        roles={"dt_layernorm": "dt_norm", "b_layernorm": "b_norm", "c_layernorm": "c_norm"}),
    rules=mamba.MIXER_RULES, styles={"mamba1": mamba.mamba1},
    scans_need_states=True,
)
FAMILIES = (FALCON_MAMBA,)
