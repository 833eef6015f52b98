"""The ``inplace_decode_states`` pass: a decode program writes its new states into its state inputs.

As captured, a decode program clones every state input, writes the new state into the clone
(HF's cache update, ``copy_`` or ``index_copy_`` after export) and returns the clone; a CUDA
graph runner then copies each returned state back into its static buffer: three copies of
every state per token. This pass drops the clone, so the cache update writes into the state
input itself and the program returns that same tensor object: one write per state. A caller
that still needs the states it passed in must clone them first (no caller in ssmshard does:
the generation loop, the static key/value step and the CUDA graph runner all replace their
states by the returned ones).

A state is rewritten only when its returned value is the clone of its own input mutated in
place, and nothing else reads the input (so no reader can see the new value where it expected
the old one). Growing key/value states (``cat``) are new tensors each step and stay as they
are. Decode programs only (``Plan(decode_states_in_place=False)`` switches it off).
"""

from __future__ import annotations

import torch

from .manager import register

_CLONE = torch.ops.aten.clone.default


def _writes_first_argument(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an in-place op mutating (and returning) its first argument."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments or not schema.returns:
        return False
    first, result = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and result is not None and result.is_write


def _mutated_clone(value) -> torch.fx.Node | None:
    """The ``clone`` node that ``value`` (a returned state) is, after in-place updates; else None."""
    if not isinstance(value, torch.fx.Node):
        return None
    while _writes_first_argument(value):
        value = value.args[0]
    return value if value.op == "call_function" and value.target is _CLONE else None


def state_placeholders(program) -> list[torch.fx.Node]:
    """The decode program's state input placeholders, in state order."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders, program.inputs) if spec.kind == "user"]
    return user[3:3 + len(program.state_specs)]  # after input_ids, attention_mask, position_ids


@register("inplace_decode_states", repropagate=False)
def inplace_decode_states(program, ctx):
    """Write each new state into its state input (see the module docstring)."""
    if program.mode != "decode":
        raise ValueError(f"inplace_decode_states rewrites decode programs, not {program.mode} programs")
    output = next(n for n in program.graph.nodes if n.op == "output")
    returned = list(output.args[0][1:])
    rewritten = []
    for index, (placeholder, value) in enumerate(zip(state_placeholders(program), returned)):
        clone = _mutated_clone(value)
        if clone is None or clone.args[0] is not placeholder or len(placeholder.users) != 1:
            continue
        clone.replace_all_uses_with(placeholder)
        program.graph.erase_node(clone)
        rewritten.append(index)
    program.graph_module.recompile()
    program.states_in_place = rewritten
    return program
