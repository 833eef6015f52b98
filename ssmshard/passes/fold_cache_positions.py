"""The ``fold_cache_positions`` pass: the static-K/V decode step's per-layer position arithmetic,
read from the cache-position input instead of computed again by four kernels a layer.

Hugging Face's static cache layers each keep a position counter and, per call, compute the
slot of the new key/value and advance the counter in place::

    slot = arange(1) + counter        # where index_copy_ writes the new key/value
    counter.add_(1)                   # for the next call, which a decode step never makes

The static decode program gives each layer its counter as a clone of the ``cache_position``
input (``capture._StaticDecode``), so a step runs a clone, an arange, an add and an in-place
add per layer: four dependent launches of a few bytes, 4-5 us a layer on an H200 (100-160 us of
a 32-layer Llama step; benchmarks/results/decode_profile/). Within one step every layer's slot
is the same, the ``cache_position`` input itself.

The pass drops each counter advance whose result nothing reads (the in-place add is the last
use of its clone and of that clone's same-dtype aliases), then each clone of an input that
nothing writes any more (its readers read the input), then rewrites ``arange(1) + position``
(a 0-d int64 position) as ``position.unsqueeze(0)``: a view, no kernel. The values are the
same integers; nothing else changes.

Runs on decode programs before ``swap_kernels``. ``program.cache_position_report`` counts what
it folded. ``Plan(skip_passes=["fold_cache_positions"])`` turns it off.
"""

from __future__ import annotations

import numbers

import torch

from .manager import register
from .shard.context import aliases, calls, new_node, node_order, value_of

aten = torch.ops.aten
# Casts that return their input itself when the dtype is already right (aliases, not copies).
_ALIAS_CASTS = (aten.to.dtype_layout, aten.to.dtype, aten.to.device)


def _same_memory_cast(user) -> bool:
    """A cast that keeps its input's dtype and device, so returns its input itself."""
    value, source = value_of(user), value_of(user.args[0])
    return (user.op == "call_function" and user.target in _ALIAS_CASTS and isinstance(value, torch.Tensor)
            and value.dtype == source.dtype and value.device == source.device)


def _aliases(node) -> list:
    """``node`` and the casts reading it that keep its dtype (so return it itself), transitively."""
    return aliases(node, _same_memory_cast)


def _is_counter_bump(node, aliases) -> bool:
    return (calls(node, aten.add_.Tensor) and node.args[0] in aliases and len(node.args) == 2
            and isinstance(node.args[1], numbers.Number) and not node.kwargs and not node.users)


def _writes_in_place(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_counter(node) -> bool:
    """A clone of an input that holds one integer (a position), read by no program output."""
    value = value_of(node)
    return (calls(node, aten.clone.default) and node.args[0].op == "placeholder" and isinstance(value, torch.Tensor)
            and value.dim() == 0 and not value.dtype.is_floating_point and not value.dtype.is_complex
            and all(u.op != "output" for u in node.users))


def _drop_counter_bumps(graph, order) -> tuple[int, int]:
    """Erase unread counter advances, then clones of inputs nothing writes; (bumps, clones) erased."""
    bumps_dropped = clones_dropped = 0
    for clone in [n for n in graph.nodes if _is_counter(n)]:
        aliases = _aliases(clone)
        readers = [u for a in aliases for u in a.users if u not in aliases]
        bumps = [u for u in readers if _is_counter_bump(u, aliases)]
        others = [u for u in readers if u not in bumps]
        if bumps and all(order[u] < min(order[b] for b in bumps) and not _writes_in_place(u) for u in others):
            for bump in bumps:
                graph.erase_node(bump)
            bumps_dropped += len(bumps)
        source = clone.args[0]
        written = [u for a in [*_aliases(source), *aliases] for u in a.users if _writes_in_place(u)]
        if not written and all(u.op != "output" for a in aliases for u in a.users):
            clone.replace_all_uses_with(source)
            graph.erase_node(clone)
            clones_dropped += 1
    return bumps_dropped, clones_dropped


def _is_unit_arange(node) -> bool:
    return (calls(node, aten.arange.default) and tuple(node.args) == (1,)
            and node.kwargs.get("dtype") in (None, torch.int64))


def _never_written(node) -> bool:
    """Whether no in-place op writes ``node``'s memory: the node its alias casts start from, and
    every alias cast of that, have no in-place readers. A view of a value written later would
    change with it, where the sum it replaces would not."""
    while node.op == "call_function" and node.target in _ALIAS_CASTS and node in _aliases(node.args[0]):
        node = node.args[0]
    return not any(_writes_in_place(u) for a in _aliases(node) for u in a.users)


def _slots_as_views(graph) -> int:
    """``arange(1) + position`` (position a 0-d int64 value nothing writes) -> ``position.unsqueeze(0)``."""
    rewritten = 0
    for add in [n for n in graph.nodes if calls(n, aten.add.Tensor) and len(n.args) == 2 and not n.kwargs]:
        a, b = add.args
        position = b if _is_unit_arange(a) else a if _is_unit_arange(b) else None
        value = value_of(position)
        if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.int64
                and _never_written(position)):
            continue
        arange = a if position is b else b
        with graph.inserting_before(add):
            view = new_node(graph, aten.unsqueeze.default, (position, 0), add)
        if "placement" in add.meta:
            view.meta["placement"] = add.meta["placement"]
        add.replace_all_uses_with(view)
        graph.erase_node(add)
        if not arange.users:
            graph.erase_node(arange)
        rewritten += 1
    return rewritten


@register("fold_cache_positions")
def fold_cache_positions(program, ctx):
    """Fold the static decode step's per-layer position arithmetic (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    order = node_order(graph)
    bumps, clones = _drop_counter_bumps(graph, order)
    program.cache_position_report = {"counter_bumps": bumps, "clones": clones, "slots": _slots_as_views(graph)}
    return program
