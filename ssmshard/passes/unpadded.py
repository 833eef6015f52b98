"""The unpadded copy of a prefill or chunk program: what its attention mask does when it pads
nothing, removed.

Under ``torch.export`` Hugging Face cannot prove a prompt unpadded (the test is on data), so a
captured prefill or chunk program pays for padding it may never see:

* every attention call reads an explicit (b, 1, l, l) mask, and PyTorch cannot run
  FlashAttention on a masked call (``causal_attention.rewrite_causal`` says what it costs);
* every Mamba mixer multiplies its input and its convolution's output by the mask, to zero
  padded positions (HF's ``apply_mask_to_padding_states`` and its Mamba-1 equivalent): two
  passes over (b, l, channels) activations per layer. On an H200 these put Mamba2-2.7B's
  batch-1 prefill of a 4096-token prompt 4% over its forward (benchmarks/results/decode/).

``unpadded_variant`` gives a copy of the (sharded) program with the attention calls asking for
the causal mask instead (prefill only: a chunk's queries do not line up with its keys) and the
mask multiplies dropped; ``Program.run`` runs that copy when every mask entry is 1 (one host
synchronisation per call). Both rewrites are exact there: ``x * 1 == x`` bit for bit, and an
all-ones mask with as many queries as keys is the causal mask.
"""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .causal_attention import full_causal_attention, rewrite_causal

aten = torch.ops.aten
# Ops that carry the mask's values to a multiply unchanged (up to a cast or a broadcast).
_MASK_VIEWS = {aten.slice.Tensor, aten.unsqueeze.default, aten.to.dtype, aten._to_copy.default,
               aten.expand.default, aten.view.default, aten.reshape.default, aten.alias.default,
               aten.contiguous.default, aten.clone.default}


def mask_values(graph: torch.fx.Graph, mask_input: str) -> set:
    """The attention-mask input and every node that is its values viewed, cast or broadcast."""
    found = {n for n in graph.nodes if n.op == "placeholder" and n.name == mask_input}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _MASK_VIEWS and node.args and node.args[0] in found:
            found.add(node)
    return found


def _same_layout(a, b) -> bool:
    return (a is not None and b is not None and a.dtype == b.dtype and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)))


def drop_mask_multiplies(graph: torch.fx.Graph, mask_input: str) -> int:
    """Replace every ``x * mask`` (``mask_input`` viewed or cast, the product of x's dtype and
    shape) by ``x``; returns how many went. Exact only where the mask is all ones: the caller
    answers for that."""
    mask = mask_values(graph, mask_input)
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2:
            continue
        left, right = node.args
        if right in mask and left not in mask and isinstance(left, torch.fx.Node):
            kept = left
        elif left in mask and right not in mask and isinstance(right, torch.fx.Node):
            kept = right
        else:
            continue
        if not _same_layout(kept.meta.get("val"), node.meta.get("val")):
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        dropped += 1
    if dropped:
        graph.eliminate_dead_code()
    return dropped


def unpadded_variant(program):
    """A copy of prefill or chunk ``program`` for batches whose mask is all ones (module
    docstring), or None when nothing would change. The copy shares the program's weights,
    folded values and tables; its graph is its own."""
    if program.mode not in ("prefill", "chunk") or program.packed or program.static_kv:
        return None
    graph = torch.fx.Graph()
    graph._codegen = program.graph._codegen  # how the module's code takes and returns values
    graph.output(graph.graph_copy(program.graph, {}))  # nodes copied, their values shared
    mask_input = [i.name for i in program.inputs if i.kind == "user"][1]  # (input_ids, attention_mask, ...)
    changed = drop_mask_multiplies(graph, mask_input)
    if program.mode == "prefill" and full_causal_attention(program.config):
        changed += rewrite_causal(graph)
    if not changed:
        return None
    return variant_of(program, torch.fx.GraphModule(program.graph_module, graph))


def variant_of(program, graph_module):
    """A copy of ``program`` running ``graph_module``: the same weights, folded values and tables;
    no shape siblings, compiled form or variant of its own. The program store rebuilds a stored
    program's unpadded variant with it."""
    variant = copy.copy(program)
    variant.graph_module = graph_module
    variant._compiled, variant.siblings, variant.recapture, variant.unpadded = None, [], None, None
    return variant
