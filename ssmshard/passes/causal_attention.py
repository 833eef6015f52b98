"""``causal_attention``: attention whose mask can only be the causal one runs as
``scaled_dot_product_attention(q, k, v, is_causal=True)``, without the mask tensor.

Why: under ``torch.export`` Hugging Face cannot prove a prompt unpadded (the test is on data),
so every captured attention reads an explicit (b, 1, l, l) mask, and PyTorch cannot run
FlashAttention on a masked call: on an H200 in bf16 the masked call took 6.6x (Zamba2-2.7B's
attention, l = 4096) to 8.0x (l = 32768) the causal call's time, which made batch-1 time to
first token of a 32K prompt 2.0-2.1x Hugging Face's for Zamba2 and Llama
(benchmarks/results/decode/README.md).

Where the rewrite is exact:

* a forward program (its only input is ``input_ids``: nothing is padded and nothing is in the
  past) - rewritten in place at capture;
* a prefill program called with an attention mask of all ones - ``unpadded.unpadded_variant``
  gives a copy of the (sharded) program with its attention rewritten (and the Mamba mixers'
  mask multiplies dropped), and ``Program.run`` runs that copy when every mask entry is 1.

Each rewritten call must have as many queries as keys (``is_causal`` aligns the mask to the
top left) and the model no sliding window (the captured mask then also cuts old keys). Packed
programs keep their block-diagonal masks.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .manager import register
from .shard.context import sdpa_arguments

aten = torch.ops.aten


def full_causal_attention(config) -> bool:
    """Whether ``config``'s attention layers see every earlier token (no sliding window)."""
    layer_types = getattr(config, "layer_types", None) or []
    return getattr(config, "sliding_window", None) is None and not any("sliding" in t for t in layer_types)


def _rewritable(node) -> bool:
    if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
        return False
    arguments = sdpa_arguments(node)
    if arguments.get("attn_mask") is None or arguments.get("is_causal", False):
        return False
    query, key = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    return query is not None and key is not None and statically_known_true(query.shape[-2] == key.shape[-2])


def rewrite_causal(graph: torch.fx.Graph) -> int:
    """Drop the mask of every attention call in ``graph`` with as many queries as keys, asking
    for the causal mask instead; the nodes that only built the mask are removed. Returns how
    many calls changed. The caller answers for the masks being causal (module docstring)."""
    changed = 0
    for node in graph.nodes:
        if not _rewritable(node):
            continue
        q, k, v, *rest = node.args
        kwargs = dict(node.kwargs)
        kwargs.pop("attn_mask", None)
        kwargs.pop("is_causal", None)
        if len(node.args) > 4:  # dropout_p; scale and enable_gqa are keyword-only
            kwargs["dropout_p"] = node.args[4]
        node.args = (q, k, v)
        node.kwargs = {**kwargs, "is_causal": True}
        changed += 1
    if changed:
        graph.eliminate_dead_code()
    return changed


def _eligible(program) -> bool:
    return not program.packed and full_causal_attention(program.config)


@register("causal_attention", repropagate=False)
def causal_attention(program, ctx):
    """Forward programs: every attention call over the causal mask, unmasked (module docstring)."""
    if program.mode == "forward" and _eligible(program):
        rewrite_causal(program.graph)
    return program
