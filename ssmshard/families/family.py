"""What ssmshard knows about one model family, as data (``Family``, ``TagHints``).

A family module (``families/<name>.py``) fills these in; capture, the ``tag`` pass and
``Plan`` read them and hold no family-specific knowledge of their own.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from ..plan import PlanError, Rule
from . import styles as shared_styles


@dataclasses.dataclass(frozen=True)
class TagHints:
    """What the ``tag`` pass needs to know beyond HF's shared naming (``passes/tag.py``).

    ``blocks``: module class -> block kind (mamba1 / mamba2 / attention / mlp / ...): the
    family's SSM mixers at least, which no class-name rule can recognise reliably.
    ``roles``: attribute name on a call path -> role (``{"x_proj": "x_proj"}``).
    ``param_roles``: name of a parameter held directly by a module -> role (``{"dt_bias": "dt_bias"}``).
    ``block_roles``: (block kind, attribute) -> role where an attribute means something else
    inside one kind of block (a Mamba-2 mixer's ``norm`` is its gated norm).
    """

    blocks: Mapping[str, str] = dataclasses.field(default_factory=dict)
    roles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    param_roles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    block_roles: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def __or__(self, other: "TagHints") -> "TagHints":
        """Both hints, ``other`` winning where they disagree (a family extending another's)."""
        return TagHints(**{f.name: {**getattr(self, f.name), **getattr(other, f.name)}
                           for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face ``*ForCausalLM`` class and everything ssmshard needs to know about it."""

    name: str  # short name used on the command line: "mamba", "zamba2", ...
    class_name: str  # Hugging Face class, e.g. "MambaForCausalLM"
    config_class: str
    modeling_module: str  # transformers.models.<x>.modeling_<x>: its kernel functions get swapped
    small_config: Callable[[], dict[str, Any]]  # kwargs of a tiny random config (demos and tests)
    # Has attention layers: a packed forward must hand them per-sequence positions and a
    # block-diagonal mask (pure SSM families take neither argument).
    has_attention: bool = False
    # Has SSM layers, whose recurrent states ``Plan(ssm_state_dtype=...)`` can hold in another dtype.
    has_ssm: bool = True
    tag_hints: TagHints = dataclasses.field(default_factory=TagHints)
    # Default plan rules, applied after the generic ones (``styles.generic_rules``) and before
    # the user's.
    rules: tuple[Rule, ...] = ()
    # Styles (layout functions) the rules may name besides the shared ``styles.STYLES``.
    styles: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    # HF's mixers run their full-sequence Mamba-1 scans without the layer's recurrent state, so
    # a continued (chunked) prefill hands each scan its state (``hf_shims.continued_scans``).
    scans_need_states: bool = False
    # Capture copies traced layers for later ones (layer_repeat.py), mapping each weight by its
    # path inside the layer; a family whose layers index modules per call site maps the path
    # here: (path inside the source layer, source layer, target layer, model) -> path in the target.
    repeat_path: Callable[[str, int, int, Any], str] | None = None

    def model_class(self):
        return getattr(importlib.import_module("transformers"), self.class_name)

    def make_config(self, **overrides):
        config_cls = getattr(importlib.import_module("transformers"), self.config_class)
        return config_cls(**{**self.small_config(), **overrides})

    def default_rules(self, vocab_parallel: bool) -> list[Rule]:
        return shared_styles.generic_rules(vocab_parallel) + list(self.rules)

    def style(self, name: str) -> Callable:
        """The layout function a rule names: this family's own, else a shared one."""
        style = self.styles.get(name) or shared_styles.STYLES.get(name)
        if style is None:
            known = sorted({*self.styles, *shared_styles.STYLES})
            raise PlanError(f"no style {name!r} for {self.class_name}; choose one of {', '.join(known)}")
        return style
