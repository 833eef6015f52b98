"""Per-layer communication and memory of ``Plan(tp=D)`` against ``Plan(tsp=D)`` at a given batch
and sequence length, and the break-even token count (``Plan.explain(..., batch=, seq=)``).

Counted from the programs themselves, per rank and per forward pass, bytes received:

* TP: every sync point of rank 0's tensor-parallel program (``communicate`` names them and gives
  their bytes per token); a ring all-reduce moves ``2 (D-1)/D`` of its message, an all-gather or
  reduce-scatter ``(D-1)/D``.
* TSP: ``(D-1)/D`` of every whole weight an op of the layer reads (each read is one gather), of
  the keys and values of each attention, plus per sequence the conv halo (``k - 1`` tokens) and
  the ``D - 1`` (state, decay) pairs each scan's all-gather brings, and the logits gathered along
  the sequence (none under ``tsp_logits="local"``). Under ``tsp_order="zigzag"`` a rank holds two chunks: two halos (one shift per
  chunk) and ``2 (D - 1)`` (state, decay) pairs; keys, values and logits move the same bytes.

The break-even is the number of tokens (batch x sequence) above which TSP moves fewer bytes: its
weight traffic is fixed, TP's traffic grows with the tokens. Activations are reported as the
residual stream a rank holds per layer (tokens x hidden), the part TSP divides by D.
"""

from __future__ import annotations

import collections

import torch

ssm = torch.ops.ssmshard
aten = torch.ops.aten


def _layer_of(node):
    return node.meta.get("ssmshard", {}).get("layer")


def _tp_traffic_per_token(program, model, plan_tp) -> dict:
    """{layer: bytes received per rank per token} of rank 0's TP program."""
    from .capture import capture
    from .runtime.pipeline import shard_program

    # A capture of its own: the sharding passes rewrite the program they are given.
    sharded = shard_program(capture(model, mode=program.mode), model, plan_tp, rank=0, group="ssmshard_explain")
    world = plan_tp.tp
    per_layer = collections.Counter()
    for point in sharded.sync_points:
        factor = 2 * (world - 1) / world if point.kind == "all_reduce" else (world - 1) / world
        per_layer[point.layer] += factor * (point.bytes_per_token or 0)
    return per_layer


def _tsp_traffic(program, placements, world: int, slots: int = 1,
                 gathered_logits: bool = True) -> tuple[dict, dict, dict]:
    """({layer: weight bytes gathered}, {layer: bytes per token}, {layer: bytes per sequence});
    ``slots``: chunks per rank (``token_layout.TokenLayout.slots``), each with its own halo and state;
    ``gathered_logits``: whether the logits are all-gathered (``Plan.tsp_logits``)."""
    from .passes.shard import bytes_per_token, token_symbols
    from .placement import Shard

    tokens = token_symbols(program)
    names = {i.name: i.target for i in program.inputs if i.kind != "user"}
    weights, per_token, per_sequence = (collections.Counter() for _ in range(3))
    share = (world - 1) / world
    for node in program.graph.nodes:
        if node.op == "placeholder" and isinstance(placements.get(names.get(node.name)), Shard):
            val = node.meta["val"]
            for user in node.users:
                weights[_layer_of(user)] += share * val.numel() * val.element_size()
        elif node.target is aten.scaled_dot_product_attention.default:
            for kv in node.args[1:3]:
                per_token[_layer_of(node)] += share * (bytes_per_token(kv.meta["val"], tokens) or 0)
        elif node.target is ssm.causal_conv1d.default:
            x, weight = node.args[0].meta["val"], node.args[1].meta["val"]
            per_sequence[_layer_of(node)] += slots * (weight.shape[-1] - 1) * x.shape[1] * x.element_size()
        elif node.target in (ssm.selective_scan.default, ssm.ssd_scan.default):
            state = node.meta["val"][1][0]  # one sequence's: (d, n) for Mamba-1, (h, p, n) for Mamba-2
            # The all-gather of every rank's (state, total decay) brings D - 1 of each; the decay is
            # as big as the state for Mamba-1 (per channel and state dim), one value per head for
            # Mamba-2 (sequence_blocks.selective_scan / ssd_scan).
            decay = state.numel() if node.target is ssm.selective_scan.default else state.shape[0]
            per_sequence[_layer_of(node)] += slots * (world - 1) * (state.numel() + decay) * state.element_size()
        elif node.op == "output" and gathered_logits:  # the logits every rank returns whole
            for value in node.all_input_nodes:
                per_token[None] += share * (bytes_per_token(value.meta["val"], tokens) or 0)
    return weights, per_token, per_sequence


def _hidden_bytes(program) -> int:
    """Bytes per token of the residual stream (the embedding's output)."""
    from .passes.shard import bytes_per_token, token_symbols

    tokens = token_symbols(program)
    for node in program.graph.nodes:
        if node.target is aten.embedding.default:
            return bytes_per_token(node.meta["val"], tokens) or 0
    return 0


def comparison(program, model, plan, batch: int, seq: int) -> str:
    """The per-layer table ``Plan.explain`` prints for a TSP plan (module docstring)."""
    from .plan import Plan
    from .token_layout import TokenLayout

    world, slots = plan.tsp, TokenLayout(0, plan.tsp, plan.tsp_order).slots
    plan_tp = Plan(tp=world, vocab_parallel=plan.vocab_parallel, rules=list(plan.rules), kernels="reference")
    placements = plan_tp.layout(program, model)
    tp = _tp_traffic_per_token(program, model, plan_tp)
    weights, per_token, per_sequence = _tsp_traffic(program, placements, world, slots,
                                                    gathered_logits=plan.tsp_logits == "gathered")
    tokens = batch * seq
    local_tokens = batch * slots * -(-seq // (world * slots))
    hidden = _hidden_bytes(program)
    layers = sorted({*tp, *weights, *per_token, *per_sequence}, key=lambda k: (k is None, k if k is not None else 0))
    logits = ", logits kept local" if plan.tsp_logits == "local" else ""
    lines = [f"TP vs TSP ({plan.tsp_order} tokens{logits}) over {world} ranks at batch {batch} x seq {seq} ({tokens} "
             "tokens), per rank per forward:",
             f"  {'layer':<8} {'TP bytes':>14} {'TSP bytes':>14} {'break-even tokens':>18} "
             f"{'TP stream/layer':>16} {'TSP stream/layer':>17}"]
    totals = collections.Counter()
    for layer in layers:
        tp_bytes = tp[layer] * tokens
        tsp_fixed = weights[layer] + per_sequence[layer] * batch
        tsp_bytes = tsp_fixed + per_token[layer] * tokens
        gain = tp[layer] - per_token[layer]
        even = f"{tsp_fixed / gain:,.0f}" if gain > 0 else "never"
        totals.update(tp=tp_bytes, tsp=tsp_bytes, fixed=tsp_fixed, gain=gain)
        name = "glue" if layer is None else str(layer)
        lines.append(f"  {name:<8} {tp_bytes:>14,.0f} {tsp_bytes:>14,.0f} {even:>18} "
                     f"{hidden * tokens:>16,} {hidden * local_tokens:>17,}")
    even = f"{totals['fixed'] / totals['gain']:,.0f}" if totals["gain"] > 0 else "never"
    lines.append(f"  {'total':<8} {totals['tp']:>14,.0f} {totals['tsp']:>14,.0f} {even:>18}")
    lines.append("  weights per rank: the same under both (TSP gathers each whole weight only for the op that "
                 "reads it)")
    if any(n.target is aten.scaled_dot_product_attention.default for n in program.graph.nodes):
        lines.append(_attention_balance(world, plan.tsp_order, seq))
    return "\n".join(lines)


def _attention_balance(world: int, order: str, seq: int) -> str:
    """How evenly causal attention's (query, real key at or before it) pairs fall on the ranks
    under this token order: each rank's count, and the busiest rank's against the mean."""
    from .token_layout import TokenLayout

    layouts = [TokenLayout(rank, world, order) for rank in range(world)]
    chunk = -(-seq // layouts[0].chunks)
    pairs = [sum(p + 1 for p in layout.positions(chunk).tolist() if p < seq) for layout in layouts]
    mean = sum(pairs) / world
    hint = "; tsp_order='zigzag' evens them out" if order == "contiguous" else ""
    return (f"  causal attention (query, key) pairs per rank and sequence: {', '.join(f'{p:,}' for p in pairs)} "
            f"(busiest {max(pairs) / mean:.2f}x the mean{hint})")
