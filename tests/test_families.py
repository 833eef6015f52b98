"""One home per family: each ``ssmshard/families/<name>.py`` declares everything ssmshard needs,
and capture, tagging and ``Plan`` take family knowledge from those declarations only."""

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import ssmshard
from ssmshard import families
from ssmshard.families import Family
from ssmshard.families.styles import split
from ssmshard.ops import SIGNATURES
from ssmshard.placement import REPLICATE, Replicate, Shard, even

from conftest import small_model

BLOCK_KINDS = {"mamba1", "mamba2", "attention", "mlp", "embed", "norm", "head", "glue"}
SOURCE = Path(ssmshard.__file__).parent
# Modules that must hold no family-specific knowledge.
FAMILY_FREE = ["plan.py", "passes/tag.py", "capture.py", "hf_shims.py", "packed_capture.py",
               "passes/swap_kernels.py"]


def _family_modules():
    return [importlib.import_module(f"ssmshard.families.{m.name}") for m in pkgutil.iter_modules(families.__path__)
            if m.name not in families.SHARED_MODULES]


def _hf_module_classes(family):
    module = importlib.import_module(family.modeling_module)
    return {name for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, torch.nn.Module) and value.__module__ == module.__name__}


def test_every_family_module_declares_complete_families():
    modules = _family_modules()
    declared = [f for m in modules for f in m.FAMILIES]
    assert all(isinstance(f, Family) for f in declared)
    # The registry is exactly what the modules declare: adding a module adds its families.
    assert {f.class_name: f for f in declared} == ssmshard.FAMILIES
    assert {f.name for f in declared} == set(families.BY_NAME)
    for family in declared:
        classes = _hf_module_classes(family)
        assert family.class_name in classes, family.name
        model = families.build_meta_model(family.make_config())
        assert type(model).__name__ == family.class_name
        # Every SSM mixer of the model is named by the family's tag hints; every class the hints
        # name exists in the HF modeling file (a rename upstream fails here, not silently later).
        mixers = {type(m).__name__ for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "intermediate_size")}
        assert mixers <= set(family.tag_hints.blocks), (family.name, mixers)
        assert set(family.tag_hints.blocks) <= classes, family.name
        assert set(family.tag_hints.blocks.values()) <= BLOCK_KINDS
        assert {block for block, _ in family.tag_hints.block_roles} <= BLOCK_KINDS
        # Every style the family's rules name exists (its own, or a shared one).
        for rule in family.default_rules(vocab_parallel=True):
            assert callable(family.style(rule.style)), (family.name, rule)
        # What capture needs: the modeling module whose kernel functions get swapped.
        assert importlib.import_module(family.modeling_module)
        if family.scans_need_states:
            assert any(kind == "mamba1" for kind in family.tag_hints.blocks.values()), family.name


def test_unknown_style_is_a_plan_error_naming_the_choices():
    program = ssmshard.capture(small_model("mamba"))
    plan = ssmshard.Plan(tp=2, rules=[ssmshard.Rule("diagonal", role="in_proj")])
    with pytest.raises(ssmshard.PlanError, match=r"no style 'diagonal'.*mamba1.*rowwise"):
        plan.layout(program, small_model("mamba"))


def _code_strings(tree):
    """String constants that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.mark.parametrize("path", FAMILY_FREE)
def test_no_family_special_cases_outside_the_family_modules(path):
    """Capture, tagging, the plan and the kernel shims name no family and no HF class.

    Flagged: a string naming a family (other than as a block kind: "mamba2" is both), a string
    holding a HF model class stem as a word ("Zamba2", not the architecture "Mamba-2") or any
    module class of a family's modeling file, and a comparison of anything family-valued.
    """
    source = (SOURCE / path).read_text()
    tree = ast.parse(source)
    names = set(families.BY_NAME) - BLOCK_KINDS
    stems = {f.class_name.removesuffix("ForCausalLM") for f in ssmshard.FAMILIES.values()}
    classes = set().union(*(_hf_module_classes(f) for f in ssmshard.FAMILIES.values()))
    word = re.compile(r"(?<![\w])(%s)(?![\w-])" % "|".join(sorted(stems, key=len, reverse=True)))
    found = []
    for text in _code_strings(tree):
        if text in names or word.search(text) or any(c in text for c in classes):
            found.append(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            compared = [node.left, *node.comparators]
            mentions_family = any("family" in ast.unparse(c) for c in compared)
            only_none = all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
            if mentions_family and not only_none:
                found.append(ast.unparse(node))
    assert not found, f"{path}: family-specific code belongs in ssmshard/families/: {found}"


def _with_declaration(monkeypatch, family):
    """Registers ``family`` in place of the declared one of the same name (for this test)."""
    monkeypatch.setitem(ssmshard.FAMILIES, family.class_name, family)
    monkeypatch.setitem(families.BY_NAME, family.name, family)


def test_plan_defaults_come_from_the_family_declaration_only(monkeypatch):
    model = small_model("zamba2")
    program = ssmshard.capture(model)
    declared = ssmshard.Plan(tp=2).layout(program, model)
    assert sum(not isinstance(p, Replicate) for p in declared.values()) > 10
    # Without its rules the family gets the generic plan alone: only lm_head is split.
    _with_declaration(monkeypatch, dataclasses.replace(families.BY_NAME["zamba2"], rules=()))
    bare = ssmshard.Plan(tp=2).layout(program, model)
    assert {fqn for fqn, p in bare.items() if p != REPLICATE} == {"lm_head.weight"}


def _scans(program):
    return [n for n in program.graph.nodes if n.target is torch.ops.ssmshard.selective_scan.default]


def test_tag_hints_and_capture_needs_come_from_the_family_declaration(monkeypatch):
    model = small_model("mamba")
    chunk = ssmshard.capture(model, mode="chunk")
    assert _scans(chunk) and all(n.meta["ssmshard"]["block"] == "mamba1" for n in _scans(chunk))
    # The declaration says Mamba's scans get their recurrent state in a continued prefill.
    initial_states = [SIGNATURES["selective_scan"].bind(n.args, n.kwargs)["initial_state"] for n in _scans(chunk)]
    assert all(state is not None for state in initial_states)
    mamba = families.BY_NAME["mamba"]
    _with_declaration(monkeypatch, dataclasses.replace(mamba, tag_hints=families.TagHints()))
    forward = ssmshard.capture(model)
    assert _scans(forward) and all(n.meta["ssmshard"]["block"] != "mamba1" for n in _scans(forward))
    # x_proj is Mamba-1 vocabulary, not HF's shared naming: unnamed, the weight keeps its leaf name.
    assert forward.param_specs["backbone.layers.0.mixer.x_proj.weight"].role == "weight"
    # A declaration that withholds the states is caught while capturing, not left to run wrong.
    _with_declaration(monkeypatch, dataclasses.replace(mamba, scans_need_states=False))
    with pytest.raises(RuntimeError, match="more Mamba-1 scans than the 0 recurrent states.*scans_need_states"):
        ssmshard.capture(model, mode="chunk")


def test_a_new_family_is_one_declaration(monkeypatch):
    """A family ssmshard has never seen, declared in one place, is captured, tagged and planned
    by that declaration: its own mixer class, its own style for its own role."""
    from transformers import MambaForCausalLM
    from transformers.models.mamba.modeling_mamba import MambaMixer

    class TinyMixer(MambaMixer):
        pass

    class TinyMambaForCausalLM(MambaForCausalLM):
        pass

    mamba = families.BY_NAME["mamba"]

    def rows_evenly(tp, fqn, spec, model):
        return Shard(0, (split(spec.shape[0], tp, fqn, "rows"),))

    tiny = Family("tiny_mamba", "TinyMambaForCausalLM", mamba.config_class, mamba.modeling_module, mamba.small_config,
                  tag_hints=families.TagHints(blocks={"TinyMixer": "mamba1"}, roles={"x_proj": "tiny_x_proj"}),
                  rules=(ssmshard.Rule("tiny_in_proj", block="mamba1", role="in_proj"),),
                  styles={"tiny_in_proj": rows_evenly})
    _with_declaration(monkeypatch, tiny)
    torch.manual_seed(0)
    model = TinyMambaForCausalLM(mamba.make_config()).eval()
    for layer in model.backbone.layers:
        layer.mixer.__class__ = TinyMixer
    program = ssmshard.capture(model)
    assert program.family == "tiny_mamba"
    assert program.param_specs["backbone.layers.0.mixer.x_proj.weight"].role == "tiny_x_proj"
    layout = ssmshard.Plan(tp=2).layout(program, model)
    sharded = {fqn for fqn, p in layout.items() if p != REPLICATE}
    assert sharded == {"lm_head.weight", "backbone.layers.0.mixer.in_proj.weight",
                     "backbone.layers.1.mixer.in_proj.weight"}
    assert layout["backbone.layers.0.mixer.in_proj.weight"] == Shard(0, (even(256, 2),))  # rows [x | z] as one
    assert "tiny_in_proj" in ssmshard.Plan(tp=2).explain(program, model)
