"""What capture needs for packed programs: the traced wrapper, the checks before and after.

A packed forward program maps ``(input_ids (1, T), cu_seqlens (S+1,))`` to logits (1, T, V)
equal to running each of the S sequences on its own. Everything that depends on the
boundaries is computed inside the graph from ``cu_seqlens``, its one source of truth:

* scans and causal convs: the shims hand ``cu_seqlens`` to every ``ssmshard`` scan/conv op
  (``hf_shims.packed_sequences``), whose kernels reset state and mask taps at each start;
* attention: a (1, 1, T, T) block-diagonal causal boolean mask, which HF's mask builders
  pass through unchanged (a 4-D mask is "already prepared" in transformers 5.x) and the sdpa
  path hands to ``scaled_dot_product_attention``;
* rotary positions: ``position_ids`` restarting at 0 per sequence.

transformers 5.x would also detect packing from restarting ``position_ids`` alone (its
``find_packed_sequence_indices``); the mask is built here instead so that attention and the
scans read the same boundaries whatever the HF version does, and so the graph can be checked.

After tracing, ``verify_packed_graph`` refuses a graph in which any sequence-mixing op could
ignore the boundaries (an unswapped HF conv or scan fallback, eager softmax attention, an
sdpa without the mask): a silent cross-sequence leak is the failure this guards against.
"""

from __future__ import annotations

import torch

from .hf_shims import packed_sequences
from .packing import block_causal_mask, positions_in_sequence
from .ops import cu_seqlens_arg
from .program import source_line

ssm = torch.ops.ssmshard
aten = torch.ops.aten

# Ops that mix tokens and must carry cu_seqlens in a packed graph.
_PACKED_OPS = (ssm.selective_scan.default, ssm.ssd_scan.default, ssm.causal_conv1d.default)
# Ops that would mix tokens without knowing the boundaries.
_FORBIDDEN = {
    ssm.causal_conv1d_update.default: "a decode-step conv",
    ssm.selective_state_update.default: "a decode-step scan",
    aten.convolution.default: "an HF causal conv that was not swapped for ssmshard.causal_conv1d",
    aten.conv1d.default: "an HF causal conv that was not swapped for ssmshard.causal_conv1d",
    aten.cumsum.default: "a cumulative sum over tokens (an HF scan fallback that was not swapped)",
    aten._softmax.default: "eager softmax attention",
    aten.softmax.int: "eager softmax attention",
}


class PackedForward(torch.nn.Module):
    """The traced function of a packed forward program: (input_ids, cu_seqlens) -> logits."""

    def __init__(self, model, has_attention: bool):
        super().__init__()
        self.model = model
        self.has_attention = has_attention

    def forward(self, input_ids, cu_seqlens):
        length = input_ids.shape[1]
        extra = {}
        if self.has_attention:
            extra["position_ids"] = positions_in_sequence(cu_seqlens, length)[None]  # (T,) -> (1, T)
            extra["attention_mask"] = block_causal_mask(cu_seqlens, length)  # (1, 1, T, T)
        with packed_sequences(cu_seqlens):
            return self.model(input_ids=input_ids, use_cache=False, return_dict=True, **extra).logits


def example_cu_seqlens(length: int, device) -> torch.Tensor:
    """Offsets of up to three near-equal sequences covering ``length`` tokens (trace inputs)."""
    count = max(1, min(3, length))
    bounds = [round(i * length / count) for i in range(count + 1)]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def check_packable(model, family) -> None:
    """Refuse, before tracing, a model whose attention the packed mask could not serve exactly."""
    if not family.has_attention:
        return
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise NotImplementedError(
            f"packed capture of {family.class_name} needs attn_implementation='sdpa' (it passes a "
            f"block-diagonal boolean mask); the model uses {implementation!r}. Load it with "
            "attn_implementation='sdpa' or call model.set_attn_implementation('sdpa')."
        )
    from .passes.causal_attention import full_causal_attention  # late import: passes import the capture

    if not full_causal_attention(config):
        raise NotImplementedError(
            f"packed capture does not support sliding-window attention ({family.class_name}, "
            f"sliding_window={getattr(config, 'sliding_window', None)}): the packed mask would replace "
            "the window. Set sliding_window=None for full attention, or run sequences unpacked."
        )


def verify_packed_graph(program) -> None:
    """Raise if some token-mixing op of the packed graph could read across sequence boundaries."""
    mixers = 0
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        where = source_line(node)
        if node.target in _FORBIDDEN:
            raise NotImplementedError(
                f"packed capture of {program.family}: the graph contains {_FORBIDDEN[node.target]} "
                f"({node.target} at {where}), which would ignore sequence boundaries. This model/"
                "transformers version is not supported with packing; run sequences unpacked."
            )
        if node.target in _PACKED_OPS:
            if not isinstance(cu_seqlens_arg(node), torch.fx.Node):
                raise RuntimeError(f"packed capture bug: {node.target} at {where} did not receive cu_seqlens")
            mixers += 1
        if node.target is aten.scaled_dot_product_attention.default:
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
            if not isinstance(mask, torch.fx.Node) or is_causal:
                raise NotImplementedError(
                    f"packed capture of {program.family}: attention at {where} does not use the packed "
                    "block-diagonal mask; this model/transformers version is not supported with packing"
                )
            mixers += 1
    if mixers == 0:
        raise RuntimeError(f"packed capture of {program.family} found no scan, conv or attention node; "
                           "cannot confirm that sequence boundaries are respected")
