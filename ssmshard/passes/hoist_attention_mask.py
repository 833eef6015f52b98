"""The ``hoist_attention_mask`` pass: a boolean attention mask turned into an additive one once a
step, not once per attention layer.

Hugging Face builds one boolean mask per step (``True``: attend) and hands it to every layer's
``scaled_dot_product_attention``. PyTorch converts a boolean mask to the additive form each call
(a zero tensor of the query's dtype, ``-inf`` filled where the mask is ``False``): a fill and a
masked fill per layer, about 4 us of a decode step's layer on an H200 where the step is launches,
not bytes (benchmarks/results/attention_decode/). The pass does that conversion once per distinct
(mask, query dtype) and hands the additive mask to every attention reading the boolean one. The
values are the ones PyTorch computes inside each call (only 0 and ``-inf`` occur), so the
attention results are unchanged.

Runs on decode programs. ``program.attention_mask_report`` counts the attention calls that now
read a hoisted mask and the masks converted. ``Plan(skip_passes=["hoist_attention_mask"])``
turns it off.
"""

from __future__ import annotations

import torch

from .manager import register
from .shard.context import SDPA_POSITIONAL, calls, new_node, sdpa_arguments, value_of

aten = torch.ops.aten
_MASK = SDPA_POSITIONAL.index("attn_mask")


def _boolean_mask(attention):
    """The boolean mask node ``attention`` reads, with its query dtype; None where there is none."""
    mask = sdpa_arguments(attention).get("attn_mask")
    mask_value, query_value = value_of(mask), value_of(attention.args[0])
    if not isinstance(mask_value, torch.Tensor) or mask_value.dtype != torch.bool:
        return None
    if not isinstance(query_value, torch.Tensor) or not query_value.dtype.is_floating_point:
        return None
    return mask, query_value.dtype


def _additive(graph, mask, dtype):
    """Nodes computing ``zeros(mask.shape, dtype).masked_fill(~mask, -inf)`` right after ``mask``
    (after the last input where the mask is one)."""
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1] if mask.op == "placeholder" else mask
    with graph.inserting_after(anchor):
        zeros = new_node(graph, aten.zeros_like.default, (mask,), mask, kwargs={"dtype": dtype})
    with graph.inserting_after(zeros):
        masked_out = new_node(graph, aten.logical_not.default, (mask,), mask)
    with graph.inserting_after(masked_out):
        additive = new_node(graph, aten.masked_fill.Scalar, (zeros, masked_out, float("-inf")), mask)
    for node in (zeros, masked_out, additive):
        if "placement" in mask.meta:
            node.meta["placement"] = mask.meta["placement"]
    return additive


def _read_mask(attention, additive) -> None:
    if len(attention.args) > _MASK:
        attention.update_arg(_MASK, additive)
    else:
        attention.update_kwarg("attn_mask", additive)


@register("hoist_attention_mask")
def hoist_attention_mask(program, ctx):
    """Convert each boolean attention mask to the additive form once (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    hoisted, rewritten = {}, 0
    for attention in list(graph.nodes):
        if not calls(attention, aten.scaled_dot_product_attention.default):
            continue
        found = _boolean_mask(attention)
        if found is None:
            continue
        if found not in hoisted:
            hoisted[found] = _additive(graph, *found)
        _read_mask(attention, hoisted[found])
        rewritten += 1
    program.attention_mask_report = {"attention_calls": rewritten, "masks": len(hoisted)}
    return program
