"""The ``tag`` pass: give every node its place in the model.

Reads ``nn_module_stack`` (which torch.export records per node, by call path) and writes
``node.meta["ssmshard"] = {module, call_site, layer, block, role}`` (see ``program.py`` for
the glossary). Later passes select nodes by these tags instead of by op patterns, so a
sharding rule reads "the in_proj of every mamba2 block", not "the third linear".
"""

from __future__ import annotations

import re

import torch

from ..families.family import TagHints
from ..program import op_name
from .manager import register

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# Hugging Face's shared naming; a family adds or overrides names in its ``TagHints``
# (``families/<name>.py``). Attribute name of a module on the call path -> role of the nodes inside it.
_ROLE_BY_ATTR = {
    "in_proj": "in_proj", "conv1d": "conv", "out_proj": "out_proj", "q_proj": "q_proj", "k_proj": "k_proj",
    "v_proj": "v_proj", "o_proj": "o_proj", "gate_proj": "gate_proj", "up_proj": "up_proj",
    "down_proj": "down_proj", "embeddings": "embed", "embed_tokens": "embed", "lm_head": "lm_head",
    "rotary_emb": "rope", "norm": "norm", "input_layernorm": "norm", "post_attention_layernorm": "norm",
}
# Parameters that sit directly on a mixer, by their own name.
_ROLE_BY_PARAM = {"A_log": "A_log", "D": "D"}
_ROLE_BY_OP = {"ssmshard.selective_scan": "scan", "ssmshard.ssd_scan": "scan",
               "ssmshard.selective_state_update": "scan", "ssmshard.causal_conv1d": "conv",
               "ssmshard.causal_conv1d_update": "conv"}
_SUBBLOCKS = ("mamba1", "mamba2", "attention", "mlp")


def block_of_class(class_name: str, hints: TagHints = TagHints()) -> str | None:
    """Block kind of a module class, or None for containers (layers, models).

    The family's hints name its SSM mixers (and any class the rules below would get wrong);
    the rules cover Hugging Face's shared naming of the other blocks.
    """
    if class_name in hints.blocks:
        return hints.blocks[class_name]
    if "Attention" in class_name and not class_name.endswith(("Layer", "Block")):
        return "attention"
    if "RotaryEmbedding" in class_name:
        return "attention"
    if class_name.endswith("MLP"):
        return "mlp"
    if class_name == "Embedding":
        return "embed"
    if "Norm" in class_name:
        return "norm"
    return None


def _is_layer_container(class_name: str) -> bool:
    return class_name.endswith(("Block", "DecoderLayer", "HybridLayer", "Layer"))


# torch.export's marker for a node traced outside every module (the batch/sequence sizes it
# reads off the inputs): such a node belongs to the model itself, not to a module of that name.
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


def _stack(node, prefix: str):
    """[(call path relative to the model, class name)], outermost first."""
    out = []
    for key, (path, type_name) in (node.meta.get("nn_module_stack") or {}).items():
        if key == _NO_MODULE:
            continue
        if path == prefix.rstrip("."):
            path = ""
        elif prefix and path.startswith(prefix):
            path = path[len(prefix):]
        out.append((path, str(type_name).rsplit(".", 1)[-1]))
    return out


def _role_from_path(path: str, block: str | None, hints: TagHints) -> str | None:
    parts = path.split(".") if path else []
    for part in reversed(parts):
        role = hints.block_roles.get((block, part)) or hints.roles.get(part) or _ROLE_BY_ATTR.get(part)
        if role:
            return role
    return None


def tag_node(node, program, prefix: str = "model.", hints: TagHints | None = None) -> dict:
    hints = _hints(program) if hints is None else hints
    stack = _stack(node, prefix)
    call_site = stack[-1][0] if stack else ""
    block = None
    for _, class_name in stack:  # the outermost sub-block wins: a gated norm belongs to its mixer
        kind = block_of_class(class_name, hints)
        if kind in _SUBBLOCKS:
            block = kind
            break
    if block is None:
        for path, class_name in reversed(stack):
            kind = block_of_class(class_name, hints)
            if kind is not None:
                block = kind
                break
            if path.split(".")[-1] == "lm_head":
                block = "head"
                break
    role = _ROLE_BY_OP.get(op_name(node)) or _role_from_path(call_site, block, hints)
    innermost_class = stack[-1][1] if stack else ""
    if role is None:
        if node.target in (torch.ops.aten.add.Tensor,) and _is_layer_container(innermost_class):
            role = "residual_add"
            producers = [a.meta.get("ssmshard", {}).get("block") for a in node.args if isinstance(a, torch.fx.Node)]
            block = next((b for b in producers if b in _SUBBLOCKS), block)
        else:
            role = "body"
    if block is None:
        block = "head" if innermost_class.endswith("ForCausalLM") else "glue"
    layer = _LAYER.search(call_site)
    return {
        "module": program.module_names.get(call_site, call_site),
        "call_site": call_site,
        "layer": int(layer.group(1)) if layer else None,
        "block": block,
        "role": role,
    }


def _param_role(fqn: str, hints: TagHints) -> str:
    module_path, _, leaf = fqn.rpartition(".")
    role = hints.param_roles.get(leaf) or _ROLE_BY_PARAM.get(leaf)
    return role or _role_from_path(module_path, None, hints) or leaf


def _hints(program) -> TagHints:
    """The tag hints of the program's family (none for a program of no family)."""
    from ..families import family_named

    return TagHints() if program.family is None else family_named(program.family).tag_hints


@register("tag", analysis_only=True)
def tag(program, ctx):
    """Tag every call_function node (in graph order, so residual adds see their producers)."""
    hints = _hints(program)
    for spec in program.param_specs.values():
        spec.role = _param_role(spec.fqn, hints)
    weight_role = {i.name: program.param_specs[i.target].role for i in program.inputs if i.kind != "user"}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        tags = tag_node(node, program, hints=hints)
        if tags["role"] == "body":
            # Weights used without calling their module (``self.dt_proj.weight @ x``, ``A_log``,
            # Zamba's ``x_proj_weight[:, None] @ x``) still name the computation.
            roles = [weight_role[a.name] for a in node.all_input_nodes if a.name in weight_role]
            if roles:
                tags["role"] = roles[0]
        if node.all_input_nodes and all(a.name in weight_role for a in node.all_input_nodes):
            weight_role[node.name] = tags["role"]  # a view or cast of a weight names its users too
        node.meta["ssmshard"] = tags
    for node in program.graph.nodes:  # a mixer's gated norm weight is named like any norm's
        if node.op == "placeholder" and node.name in weight_role:
            if any(u.meta.get("ssmshard", {}).get("role") == "gate_norm" for u in node.users):
                spec = program.param_specs[next(i.target for i in program.inputs if i.name == node.name)]
                spec.role = "gate_norm"
    program.tagged = True
    return program
