"""The ``inplace_decode_states`` pass: a decode program writes its new states into its state inputs.

As captured, a decode program clones every state input, writes the new state into the clone
(HF's cache update, ``copy_`` or ``index_copy_`` after export) and returns the clone; a CUDA
graph runner then copies each returned state back into its static buffer: three copies of
every state per token. This pass drops the clone, so the cache update writes into the state
input itself and the program returns that same tensor object: one write per state. A caller
that still needs the states it passed in must clone them first (no caller in ssmshard does:
the generation loop, the static key/value step and the CUDA graph runner all replace their
states by the returned ones).

Where the new state comes from a decode-step op (``causal_conv1d_update``,
``selective_state_update``, on the reference or the Triton kernel) and is only copied into the
input, the op node is retargeted to a variant that writes the new state into its state argument
(the Triton kernels take ``out_state=state``; the reference computes it and copies it in) and
the ``copy_`` goes: no copy of the state is left.

A state is rewritten only when its returned value is the clone of its own input mutated in
place, and nothing else reads the input's data (so no reader can see the new value where it expected
the old one). Growing key/value states (``cat``) are new tensors each step and stay as they
are. Decode programs only (``Plan(skip_passes=["inplace_decode_states"])`` switches it off).
"""

from __future__ import annotations

import operator

import torch

from ..ops import SIGNATURES
from .manager import register
from .kernel_ops import opaque_state_writer
from .shard.context import clone_under_writes, data_readers  # readers: shape queries do not see a state change
from .swap_kernels import KERNEL_OPS, KERNELS, _on_gpu

_COPY = torch.ops.aten.copy_.default
ssm = torch.ops.ssmshard


def _state_writer(name: str, state_argument: str, triton: bool):
    """A graph target with the signature of ``ssmshard.<name>`` that writes the new state into its
    ``state_argument`` and returns ``(out, that state tensor)``. ``triton``: on CUDA tensors outside
    grad mode the Triton kernel writes it there (``out_state=``), as ``swap_kernels`` would have run
    the kernel; elsewhere the reference op computes it and it is copied in."""
    signature, op = SIGNATURES[name], getattr(ssm, name).default
    module = KERNELS[op][1]

    def write(*args, **kwargs):
        bound = signature.bind(args, kwargs)
        state = bound[state_argument]
        if triton and _on_gpu(state) and not torch.is_grad_enabled():
            import importlib

            out, _ = getattr(importlib.import_module(module), name)(**bound, out_state=state)
            return out, state
        out, new_state = op(*args, **kwargs)
        state.copy_(new_state)
        return out, state

    # FX code generation imports graph call targets by qualified name: bind it at module level.
    write.__name__ = write.__qualname__ = f"{name}_into_state{'_kernel' if triton else ''}"
    write.__doc__ = f"``ssmshard.{name}`` writing its new state into ``{state_argument}``."
    globals()[write.__name__] = write
    return write


# Decode-step op, its Triton adapter or the adapter's opaque op (compiled programs) -> its
# state-writing variant and the state argument's index. The opaque variant mutates the state and
# returns only the output (``kernel_ops``).
_WRITERS = {}
_OPAQUE_WRITERS = set()
for _name, _argument in (("causal_conv1d_update", "conv_state"), ("selective_state_update", "state")):
    _op = getattr(ssm, _name).default
    _index = SIGNATURES[_name].names.index(_argument)
    _WRITERS[_op] = (_state_writer(_name, _argument, triton=False), _index)
    _kernel_writer = _state_writer(_name, _argument, triton=True)
    _WRITERS[KERNELS[_op][0]] = (_kernel_writer, _index)
    _opaque = opaque_state_writer(_name, _argument, _kernel_writer)
    _WRITERS[KERNEL_OPS[_op]] = (_opaque, _index)
    _OPAQUE_WRITERS.add(_opaque)


def _write_in_op(copy: torch.fx.Node, placeholder: torch.fx.Node) -> bool:
    """Drop ``copy_(placeholder, getitem(op, 1))`` by retargeting ``op`` to write its new state
    into ``placeholder`` (its state argument); whether it could."""
    if copy.target is not _COPY or copy.args[0] is not placeholder or len(copy.args) != 2:
        return False
    new_state = copy.args[1]
    if not (isinstance(new_state, torch.fx.Node) and new_state.target is operator.getitem
            and new_state.args[1] == 1 and len(new_state.users) == 1):
        return False
    op = new_state.args[0]
    writer = _WRITERS.get(op.target)
    if writer is None or op.kwargs:
        return False
    target, index = writer
    if len(op.args) <= index or op.args[index] is not placeholder:
        return False
    # The op reads the state and writes the new one; any other reader of the input after it
    # would see the new state (before the rewrite it saw the old until the copy_).
    order = {n: i for i, n in enumerate(op.graph.nodes)}
    if any(order[u] > order[op] and u is not copy for u in data_readers(placeholder)):
        return False
    op.target = target
    copy.replace_all_uses_with(new_state)
    op.graph.erase_node(copy)
    if target in _OPAQUE_WRITERS:  # returns the output alone; the new state is the input itself
        new_state.replace_all_uses_with(placeholder)
        op.graph.erase_node(new_state)
        for out in [u for u in op.users if u.target is operator.getitem and u.args[1] == 0]:
            out.replace_all_uses_with(op)
            op.graph.erase_node(out)
        op.meta["val"] = op.meta["val"][0]
    return True


def _mutated_clone(value) -> torch.fx.Node | None:
    """The ``clone`` node that ``value`` (a returned state) is, after in-place updates; else None."""
    found = clone_under_writes(value)
    return found[0] if found else None


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
    rewritten, written_by_op = [], []
    for index, (placeholder, value) in enumerate(zip(state_placeholders(program), returned)):
        clone = _mutated_clone(value)
        if clone is None or clone.args[0] is not placeholder or data_readers(placeholder) != [clone]:
            continue
        clone.replace_all_uses_with(placeholder)
        program.graph.erase_node(clone)
        rewritten.append(index)
        if _write_in_op(value, placeholder):
            written_by_op.append(index)
    program.states_in_place = rewritten
    program.states_written_by_op = written_by_op
    return program
