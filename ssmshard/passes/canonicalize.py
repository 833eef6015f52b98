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

Both are semantics-preserving local rewrites, registered without fake re-propagation (the
capture of a 64-layer model would pay for it twice); the sharding passes re-propagate later.
"""

from __future__ import annotations

import sys

import torch

from .manager import register

aten = torch.ops.aten
CANONICAL_PASSES = ("drop_tensor_asserts", "pad_as_cat", "gqa_attention")


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
