"""Canonical forms: rewrites capture runs before tagging, so later passes see one form per idea.

* ``pad_as_cat``: HF pads a prefill shorter than the conv kernel with ``F.pad(x, (K - L, 0))``.
  The pad kernels insist on concrete widths, so fake-tensor propagation of such a graph fails
  on symbolic lengths; a zero block concatenated in front is the same computation.
* ``drop_tensor_asserts``: export records ``aten._assert_tensor_metadata`` checks of the dtypes
  and sizes it traced with. They fail under autocast and on a rank's local (sharded) sizes;
  the casts the graph records stay.
* ``gqa_attention``: grouped-query attention as ``sdpa(q, k, v, enable_gqa=True)`` instead of
  HF's ``repeat_kv`` (``reshape(expand(unsqueeze(k, 2)))``). Same values (query head i reads
  key/value head i // n_rep either way), but key/value heads stay a plain tensor dim, so
  sharding them never has to look through the expand/reshape.

* ``whole_tensor_splits``: from transformers 5.25 the scan wrappers split off the last tokens
  whose states a recording cache keeps, ``tensor_split(x, [L - k], dim)``, and capture has
  ``k = 0``: the first piece is ``x`` and the empty second one is unused. ``x`` itself takes its
  place, so no sharding rule has to split a sharded dim (the sequence dim, under TSP).

* ``clones_copied_back``: from transformers 5.25 the decode step clones a recurrent state,
  updates the clone in place and copies it back into the cache's tensor (``x' = clone(x); op
  writes x'; copy_(x, x')``). Where nothing else touches ``x`` in between, the update writes
  ``x`` itself, the form earlier releases trace and ``inplace_decode_states`` expects.

All are semantics-preserving local rewrites, registered without fake re-propagation (the
capture of a 64-layer model would pay for it twice); the sharding passes re-propagate later.
"""

from __future__ import annotations

import operator
import sys

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .manager import register
from .shard.context import clone_under_writes, data_readers

aten = torch.ops.aten


@register("drop_tensor_asserts", repropagate=False)
def drop_tensor_asserts(program, ctx):
    for module in program.graph_module.modules():  # nested graphs too (autocast/no_grad regions)
        if isinstance(module, torch.fx.GraphModule):
            for node in list(module.graph.nodes):
                if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
                    module.graph.erase_node(node)
    return program


@register("pad_as_cat", repropagate=False)
def pad_as_cat(program, ctx):
    graph = program.graph
    for node in list(graph.nodes):
        if node.target not in (aten.pad.default, aten.constant_pad_nd.default):
            continue
        args = list(node.args)
        if node.target is aten.pad.default:
            mode = args[2] if len(args) > 2 else node.kwargs.get("mode", "constant")
            value = args[3] if len(args) > 3 else node.kwargs.get("value", None)
            if mode != "constant":
                continue
        else:
            value = args[2] if len(args) > 2 else node.kwargs.get("value", 0.0)
        x, widths = args[0], args[1]
        if len(widths) != 2 or not any(isinstance(w, torch.fx.Node) for w in widths):
            continue
        x_val = x.meta["val"]
        with graph.inserting_before(node):
            pieces = []
            for width in widths:
                if isinstance(width, int) and width == 0:
                    pieces.append(None)
                    continue
                sizes = []
                for d in range(x_val.dim() - 1):
                    sizes.append(graph.call_function(aten.sym_size.int, (x, d)))
                    sizes[-1].meta["val"] = x_val.size(d)
                # Fake values for the new nodes (the sharding rules read their shapes): the ops
                # run on x's fake tensor, in its fake mode.
                piece = graph.call_function(aten.new_full.default, (x, [*sizes, width], value or 0.0))
                piece.meta["val"] = x_val.new_full([*x_val.shape[:-1], _value(width)], value or 0.0)
                pieces.append(piece)
            parts = [part for part in (pieces[0], x, pieces[1]) if part is not None]
            cat = graph.call_function(aten.cat.default, (parts, -1))
        cat.meta.update(node.meta)  # the padded value: same shape, dtype and source
        node.replace_all_uses_with(cat)
        graph.erase_node(node)
    return program


def _value(arg):
    """A size argument's value: an int, or the SymInt its node computes."""
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg


def _through_noop_slices(node):
    while node.target is aten.slice.Tensor and node.args[2:4] in ((0, sys.maxsize), (0, None)):
        node = node.args[0]
    return node


def _repeated_kv_source(node):
    """``k`` if ``node`` is HF's repeat_kv(k): reshape(expand(unsqueeze(k, 2))) with no-op slices."""
    if node.target is not aten.reshape.default or node.args[0].target is not aten.expand.default:
        return None
    x = _through_noop_slices(node.args[0].args[0])
    if x.target is not aten.unsqueeze.default or x.args[1] != 2:
        return None
    return _through_noop_slices(x.args[0])


@register("gqa_attention", repropagate=False)
def gqa_attention(program, ctx):
    graph = program.graph
    for node in list(graph.nodes):
        if node.target is not aten.scaled_dot_product_attention.default or node.kwargs.get("enable_gqa"):
            continue
        key, value = (_repeated_kv_source(a) for a in node.args[1:3])
        if key is None or value is None:
            continue
        node.args = (node.args[0], key, value, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
    graph.eliminate_dead_code()
    return program


@register("whole_tensor_splits", repropagate=False)
def whole_tensor_splits(program, ctx):
    graph = program.graph
    for node in list(graph.nodes):
        if node.target is not aten.tensor_split.indices or len(node.args[1]) != 1:
            continue
        x, (index,) = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if not statically_known_true(_value(index) == x.meta["val"].size(dim)):
            continue
        pieces = list(node.users)
        if any(piece.target is not operator.getitem or (piece.args[1] != 0 and piece.users) for piece in pieces):
            continue  # the empty piece is read, or the pieces are used as a list
        for piece in pieces:
            piece.replace_all_uses_with(x)
            graph.erase_node(piece)
        graph.erase_node(node)
    return program


@register("clones_copied_back", repropagate=False)
def clones_copied_back(program, ctx):
    graph = program.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    for copy in list(graph.nodes):
        if copy.target is not aten.copy_.default or len(copy.args) != 2 or copy.kwargs:
            continue
        x, value = copy.args
        found = clone_under_writes(value)
        if found is None or found[0].args[0] is not x:
            continue
        clone, writes = found
        between = range(order[clone] + 1, order[copy])
        if any(order[reader] in between for reader in data_readers(x) if reader is not copy):
            continue  # x is read or written while the clone is updated
        if any(order[user] > order[copy] for node in (clone, *writes) for user in node.users):
            continue  # the clone is read after the copy, where it would now see x's later writes
        clone.replace_all_uses_with(x)
        graph.erase_node(clone)
        copy.replace_all_uses_with(value)
        graph.erase_node(copy)
    return program
