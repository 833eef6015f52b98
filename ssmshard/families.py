"""The model families ssmshard understands, and a small default config for each.

A family ties a Hugging Face ``*ForCausalLM`` class to what capture needs to know about it:
the modeling module whose kernel functions get swapped, the keyword the model takes its
cache under, and a tiny config for demos and tests (``ssmshard inspect mamba``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # short name used on the command line: "mamba", "zamba2", ...
    class_name: str  # Hugging Face class, e.g. "MambaForCausalLM"
    config_class: str
    modeling_module: str  # transformers.models.<x>.modeling_<x>
    small_config: Callable[[], dict[str, Any]]  # kwargs of a tiny random config
    # Has attention layers: a packed forward must hand them per-sequence positions and a
    # block-diagonal mask (pure SSM families take neither argument).
    has_attention: bool = False

    def model_class(self):
        return getattr(importlib.import_module("transformers"), self.class_name)

    def make_config(self, **overrides):
        config_cls = getattr(importlib.import_module("transformers"), self.config_class)
        return config_cls(**{**self.small_config(), **overrides})


def _mamba():
    return dict(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                conv_kernel=4, time_step_rank=8, use_cache=True)


def _mamba2():
    # num_heads * head_dim == expand * hidden_size; chunk_size deliberately small so short test
    # sequences cross chunk edges.
    return dict(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                num_heads=8, head_dim=16, n_groups=2, chunk_size=16, conv_kernel=4,
                tie_word_embeddings=False)


def _zamba():
    # Zamba places hybrid (shared attention) layers at 2, then every attn_layer_period: 2 and 4 here.
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=2, attn_layer_period=2, attn_layer_offset=1,
                max_position_embeddings=512)


def _zamba2():
    return dict(vocab_size=256, hidden_size=64, num_hidden_layers=5,
                layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid",
                                   "linear_attention"],
                mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8,
                chunk_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8,
                use_mem_rope=True, max_position_embeddings=512)


def _llama():
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False)


def _falcon_mamba():
    return {**_mamba(), "mixer_rms_eps": 1e-6}


FAMILIES: dict[str, Family] = {
    f.class_name: f
    for f in [
        Family("mamba", "MambaForCausalLM", "MambaConfig", "transformers.models.mamba.modeling_mamba", _mamba),
        Family("falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig",
               "transformers.models.falcon_mamba.modeling_falcon_mamba", _falcon_mamba),
        Family("mamba2", "Mamba2ForCausalLM", "Mamba2Config", "transformers.models.mamba2.modeling_mamba2", _mamba2),
        Family("zamba", "ZambaForCausalLM", "ZambaConfig", "transformers.models.zamba.modeling_zamba", _zamba,
               has_attention=True),
        Family("zamba2", "Zamba2ForCausalLM", "Zamba2Config", "transformers.models.zamba2.modeling_zamba2", _zamba2,
               has_attention=True),
        Family("llama", "LlamaForCausalLM", "LlamaConfig", "transformers.models.llama.modeling_llama", _llama,
               has_attention=True),
        # Llama-style decoders whose graphs are the same ops under other names.
        Family("mistral", "MistralForCausalLM", "MistralConfig", "transformers.models.mistral.modeling_mistral",
               lambda: {**_llama(), "sliding_window": None}, has_attention=True),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "transformers.models.qwen2.modeling_qwen2", _llama,
               has_attention=True),
    ]
}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES.values()}


def family_of(model) -> Family:
    """The family of a Hugging Face model instance; a clear error for anything else."""
    name = type(model).__name__
    if name not in FAMILIES:
        supported = ", ".join(FAMILIES)
        raise ValueError(
            f"ssmshard does not support {name}. Supported model classes: {supported}. "
            "Load the checkpoint with one of these classes (e.g. AutoModelForCausalLM on a "
            "supported config), or open an issue for the family you need."
        )
    return FAMILIES[name]


def build_small_model(name: str, *, device="cpu", dtype=None, seed=0, **overrides):
    """A tiny randomly initialised model of the family ``name`` (demos and tests)."""
    import torch

    if name not in BY_NAME:
        raise ValueError(f"unknown family {name!r}; choose one of {', '.join(BY_NAME)}")
    family = BY_NAME[name]
    config = family.make_config(**overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = family.model_class()(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def model_class_for(config):
    """The supported HF class for ``config``: by ``architectures[0]``, else by ``model_type``."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        if architectures[0] in FAMILIES:
            return FAMILIES[architectures[0]].model_class()
        unsupported = architectures[0]
    else:
        for family in FAMILIES.values():
            config_cls = getattr(transformers, family.config_class)
            if config_cls.model_type == config.model_type:
                return family.model_class()
        unsupported = f"model_type {config.model_type!r}"
    raise ValueError(f"ssmshard does not support {unsupported}. Supported model classes: "
                     f"{', '.join(FAMILIES)}.")


def build_meta_model(config, *, dtype=None):
    """The HF model of ``config`` (a config object or a checkpoint directory) on the meta device.

    Built the way ``from_pretrained(dtype=...)`` builds it (``_from_config``), so parameter
    dtypes match what Hugging Face would load, including buffers it keeps in float32 (rotary
    ``inv_freq``). ``dtype``: a ``torch.dtype``, ``None`` (torch's default dtype) or ``"auto"``
    (the ``dtype`` recorded in the config).
    """
    import copy

    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config) if isinstance(config, str) else copy.deepcopy(config)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    cls = model_class_for(config)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = cls._from_config(config, dtype=dtype) if dtype is not None else cls._from_config(config)
    return model.eval()
