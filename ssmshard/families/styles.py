"""Styles (layout functions) and rules shared by several families, and their helpers.

A style turns one weight into a :class:`~ssmshard.placement.Shard` or ``Replicate`` for a
tensor-parallel group of ``tp`` ranks: ``style(tp, fqn, spec, model) -> Placement`` (``spec``:
the weight's ``ParamSpec``, with its shape and tagged role). It raises ``PlanError`` naming
the weight and the numbers when the split is impossible. Layouts: docs/parallel_layouts.md;
the notation: docs/design.md. Styles only one family uses live in that family's module.
"""

from __future__ import annotations

from typing import Callable

from ..placement import REPLICATE, Segment, Shard, even
from ..plan import PlanError, Rule


def split(size: int, tp: int, fqn: str, what: str) -> Segment:
    if size % tp:
        raise PlanError(f"{fqn}: {size} {what} cannot be split over tp={tp}; choose tp dividing {size}")
    return even(size, tp)


def grouped(count: int, unit: int, tp: int, fqn: str, what: str) -> Segment:
    """``count`` groups of ``unit`` rows: split when count % tp == 0, else each rank holds the one it needs."""
    if count % tp == 0:
        return Segment(count * unit, tp, 1)
    if tp % count == 0:
        return Segment(count * unit, count, tp // count)
    raise PlanError(f"{fqn}: {count} {what} can be neither split over tp={tp} ({count} % {tp} != 0) nor "
                    f"replicated to whole ranks ({tp} % {count} != 0); choose tp dividing {count} or a multiple of it")


def mixer_of(model, fqn):
    """The SSM mixer module holding the weight ``fqn``."""
    path = fqn.rpartition(".")[0]
    while path:
        module = model.get_submodule(path)
        if hasattr(module, "intermediate_size") and hasattr(module, "conv1d"):
            return module
        path = path.rpartition(".")[0]
    raise PlanError(f"{fqn}: no SSM mixer module above this weight")


def is_bias(fqn):
    return fqn.endswith(".bias")


def replicate(tp, fqn, spec, model):
    return REPLICATE


def colwise(tp, fqn, spec, model):
    return Shard(0, (split(spec.shape[0], tp, fqn, "output features"),))


def rowwise(tp, fqn, spec, model):
    if is_bias(fqn):
        return REPLICATE  # added once, after the all-reduce
    return Shard(1, (split(spec.shape[1], tp, fqn, "input features"),))


def vocab(tp, fqn, spec, model):
    return Shard(0, (split(spec.shape[0], tp, fqn, "vocabulary entries (pad the vocabulary or use "
                                                   "Plan(vocab_parallel=False))"),))


def _attention_heads(model, fqn):
    path = fqn
    while True:  # the attention module owning this projection (or adapter)
        path = path.rpartition(".")[0]
        attn = model.get_submodule(path)
        if hasattr(attn, "q_proj") and hasattr(attn, "head_dim"):
            break
        if not path:
            raise PlanError(f"{fqn}: no attention module above this weight")
    head_dim = attn.head_dim
    return attn, head_dim, attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim


def attn_q(tp, fqn, spec, model):
    _, head_dim, heads, _ = _attention_heads(model, fqn)
    seg = split(heads, tp, fqn, "attention heads")
    return Shard(0, (Segment(heads * head_dim, seg.pieces, 1),))


def attn_kv(tp, fqn, spec, model):
    _, head_dim, heads, kv_heads = _attention_heads(model, fqn)
    split(heads, tp, fqn, "attention heads")
    seg = grouped(kv_heads, head_dim, tp, fqn, "key/value heads")
    return Shard(0, (seg,))


STYLES: dict[str, Callable] = {
    "replicate": replicate, "colwise": colwise, "rowwise": rowwise, "vocab": vocab,
    "attn_q": attn_q, "attn_kv": attn_kv,
}


def generic_rules(vocab_parallel: bool) -> list[Rule]:
    """The rules every family starts from: replicate whatever no rule names (norms, embeddings,
    small adapters); lm_head split by vocabulary or replicated."""
    return [Rule("replicate"), Rule("vocab" if vocab_parallel else "replicate", role="lm_head")]


# Attention: q by heads, k/v by kv heads (replicated to the ranks that need them), o rowwise.
ATTENTION_RULES = (
    Rule("attn_q", block="attention", role="q_proj"),
    Rule("attn_kv", block="attention", role="k_proj"),
    Rule("attn_kv", block="attention", role="v_proj"),
    Rule("rowwise", block="attention", role="o_proj"),
)
# Gated MLP: gate/up colwise, down rowwise.
MLP_RULES = (
    *[Rule("colwise", block="mlp", role=r) for r in ("gate_proj", "up_proj")],
    Rule("rowwise", block="mlp", role="down_proj"),
)
