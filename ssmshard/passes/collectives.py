"""The ``collectives`` pass: account for every collective the ``shard`` pass inserted.

Each collective node gets ``meta["ssmshard"]["sync"]`` (all_reduce | all_gather), the bytes
of its operand per token (what each rank hands to the collective), and a stable ``sync_id``
that later passes (sync-point drop, quantised all-reduce) use to name it.
``program.collectives`` lists them for reports.

Bytes per token come from the symbolic shapes: the graph's batch and sequence lengths are
the symbols of ``input_ids``' shape (batch and sequence; decode: batch, one new token; packed:
the packed length), so an operand of shape ``(batch, seq, 2560)`` holds 2560 values per
token whatever example sizes the graph was traced with.
"""

from __future__ import annotations

import logging
import math

import sympy
import torch

from .manager import register

log = logging.getLogger(__name__)

_COLLECTIVES = {torch.ops.ssmshard.all_reduce.default: "all_reduce",
                torch.ops.ssmshard.all_gather.default: "all_gather"}


def _token_sizes(program) -> list:
    """The sizes of the token-carrying input (``input_ids``): ints and symbolic sizes."""
    first_user = next(i.name for i in program.inputs if i.kind == "user")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == first_user)
    return list(node.meta["val"].shape)


def token_symbols(program) -> set:
    """The symbols of ``input_ids``' shape: the batch and sequence lengths."""
    return {sym for size in _token_sizes(program) if isinstance(size, torch.SymInt)
            for sym in size.node.expr.free_symbols}


def _size_expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def bytes_per_token(val, tokens: set) -> int | None:
    """Bytes of ``val`` per token: its element count with the batch and sequence symbols set to
    one, times the element size; None when the count depends on another symbol (a past length)."""
    numel = sympy.Mul(*(_size_expr(s) for s in val.shape)).subs({sym: 1 for sym in tokens})
    if numel.free_symbols or not numel.is_integer:
        return None
    return int(numel) * val.dtype.itemsize


def _specialised(program) -> list[str]:
    """Token symbols a pass fixed to their example value (every later shape then holds it)."""
    fixed = []
    for size in _token_sizes(program):
        if isinstance(size, torch.SymInt):
            replacements = size.node.shape_env.replacements
            fixed += [f"{sym} = {replacements[sym]}" for sym in size.node.expr.free_symbols
                      if getattr(replacements.get(sym), "is_number", False)]
    return fixed


@register("collectives", analysis_only=True)
def collectives(program, ctx):
    tokens = token_symbols(program)
    fixed = _specialised(program)
    if fixed:
        log.warning("the %s program's batch/sequence lengths were fixed to their example values by a pass "
                    "(%s): bytes per token are not reported", program.mode, ", ".join(fixed))
    rows = []
    for node in program.graph.nodes:
        kind = _COLLECTIVES.get(node.target)
        if kind is None:
            continue
        tags = node.meta["ssmshard"]
        val = node.args[0].meta["val"]
        per_token = None if fixed else bytes_per_token(val, tokens)
        tags.update(sync=kind, sync_id=len(rows), bytes_per_token=per_token)
        rows.append({"id": len(rows), "op": kind, "node": node.name, "layer": tags["layer"],
                     "block": tags["block"], "role": tags["role"], "dtype": str(val.dtype).replace("torch.", ""),
                     "bytes_per_token": per_token})
    program.collectives = rows
    return program


def total_bytes_per_token(rows) -> int | float:
    """The sum over ``rows`` (``program.collectives``); NaN when any is unknown."""
    sizes = [r["bytes_per_token"] for r in rows]
    return math.nan if None in sizes else sum(sizes)
