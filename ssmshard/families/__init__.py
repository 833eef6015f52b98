"""The model families ssmshard understands: one module per family, collected here.

A family module (``mamba.py``, ``zamba2.py``, ...) declares ``FAMILIES``, a tuple of
:class:`Family`: the Hugging Face classes, a small default config, the hints the ``tag``
pass needs, the default plan rules and the styles only that family uses, and what capture
needs to know. Capture, tagging and ``Plan`` read those declarations and have no
family-specific code, so adding a family means adding one module (docs/adding_a_family.md).
Shared pieces: ``family.py`` (the declarations' types), ``styles.py`` (styles and rules
several families use).
"""

from __future__ import annotations

import importlib
import pkgutil

from .family import Family, TagHints

# Modules of this package that declare no family.
SHARED_MODULES = ("family", "styles")


def _declared_families() -> list[Family]:
    declared = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in SHARED_MODULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        families = getattr(module, "FAMILIES", None)
        if not families or not all(isinstance(f, Family) for f in families):
            raise TypeError(f"{module.__name__} must declare FAMILIES, a tuple of ssmshard.families.Family")
        declared.extend(families)
    return declared


FAMILIES: dict[str, Family] = {f.class_name: f for f in _declared_families()}  # by Hugging Face class
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


def family_named(name: str) -> Family:
    """The family called ``name`` (``program.family``); a clear error for an unknown one."""
    if name not in BY_NAME:
        raise ValueError(f"unknown family {name!r}; choose one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def build_small_model(name: str, *, device="cpu", dtype=None, seed=0, **overrides):
    """A tiny randomly initialised model of the family ``name`` (demos and tests)."""
    import torch

    family = family_named(name)
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
