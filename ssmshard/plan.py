"""``Plan``: how to split a model over a tensor-parallel group, and its validation.

A plan is a list of rules. Each rule matches weights by a glob over the parameter FQN and/or
the block kind and role the ``tag`` pass gave them, and names a style. Styles know the
layouts of each mixer (docs/parallel_layouts.md) and turn a weight into a
:class:`~ssmshard.placement.Shard` or :class:`Replicate` (the notation: docs/design.md). Later
rules (user overrides) win over the family defaults.

Everything here runs before any process group exists: ``Plan.layout(program, model)``
computes every weight's placement and raises :class:`PlanError` naming the parameter and
the numbers when a split is impossible.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from typing import Callable

import torch

from .placement import REPLICATE, Placement, Segment, Shard, even


class PlanError(ValueError):
    """The plan cannot be applied to this model; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Rule:
    style: str  # colwise | rowwise | replicate | vocab | mamba1_* | mamba2_* | attn_*
    glob: str = "*"  # over the parameter FQN
    block: str | None = None  # tag block kind, or None for any
    role: str | None = None  # tag role, or None for any

    def matches(self, fqn: str, block: str | None, role: str) -> bool:
        return (fnmatch.fnmatchcase(fqn, self.glob) and (self.block is None or self.block == block)
                and (self.role is None or self.role == role))


def _defaults(vocab_parallel: bool) -> list[Rule]:
    head = "vocab" if vocab_parallel else "replicate"
    return [
        Rule("replicate"),  # anything not named below: norms, embeddings, small adapters
        Rule(head, role="lm_head"),
        # Mamba-1 / Falcon-Mamba / Zamba mixers: channels split (within each of Zamba's Mamba
        # heads), x_proj and out_proj row-parallel.
        *[Rule("mamba1", block="mamba1", role=r) for r in ("in_proj", "conv", "x_proj", "dt_proj", "A_log", "D",
                                                            "out_proj")],
        # Mamba-2 / Zamba2 mixers: packed [z, x, B, C, dt]; heads split, groups split or replicated.
        Rule("mamba2_in_proj", block="mamba2", role="in_proj"),
        Rule("mamba2_conv", block="mamba2", role="conv"),
        *[Rule("channels", block="mamba2", role=r) for r in ("A_log", "D", "dt_bias", "gate_norm")],
        Rule("rowwise", block="mamba2", role="out_proj"),
        # Attention: q by heads, k/v by kv heads (replicated to the ranks that need them), o rowwise.
        Rule("attn_q", block="attention", role="q_proj"),
        Rule("attn_kv", block="attention", role="k_proj"),
        Rule("attn_kv", block="attention", role="v_proj"),
        Rule("rowwise", block="attention", role="o_proj"),
        # MLP: gate/up colwise, down rowwise; a fused gate_up (Zamba2) is two packed segments.
        *[Rule("colwise", block="mlp", role=r) for r in ("gate_proj", "up_proj")],
        Rule("packed_halves", block="mlp", role="gate_up_proj"),
        Rule("rowwise", block="mlp", role="down_proj"),
        # Zamba2's per-call-site LoRA adapters: the down-projection (first linear) stays replicated,
        # the up-projection (second) is split like the base projection it is added to.
        Rule("attn_q", glob="*linear_q_adapter_list.*.1.weight"),
        Rule("attn_kv", glob="*linear_k_adapter_list.*.1.weight"),
        Rule("attn_kv", glob="*linear_v_adapter_list.*.1.weight"),
        Rule("packed_halves", glob="*gate_up_proj_adapter_list.*.1.weight"),
    ]


@dataclasses.dataclass
class Plan:
    """Tensor-parallel plan. ``tp``: ranks in the group; ``vocab_parallel``: split lm_head by vocab
    (logits are all-gathered) instead of replicating it; ``rules``: user overrides, applied after
    the family defaults (e.g. ``Rule("replicate", glob="*.layers.0.*")``).

    ``sequence_parallel``: Megatron's sequence parallelism in forward (scoring and training)
    programs: the residual stream between blocks holds 1/tp of the tokens per rank
    (``passes.shard.SequenceParallelPolicy``); generation programs stay plain TP (one decode
    token cannot be split, and their states are per channel anyway). ``policy``: a
    ``passes.shard.ReducePolicy`` (class or instance) deciding where partial sums are reduced
    and with which collectives, for every program (instead of the default or the SP policy).

    ``quantize_syncs``: run all-reduce sync points as block-scaled quantized all-reduces:
    ``"int8"`` or ``"fp8"`` for all of them, or ``{glob over sync point names: format or None}``
    (the ``quantize_sync`` pass; docs/quantized_sync.md). ``quantize_min_bytes``: a call whose
    message is smaller stays exact (decided per call; decode's small messages stay exact by
    default). ``quantize_block``: values per scale (32, 64 or 128).
    """

    tp: int = 1
    vocab_parallel: bool = True
    rules: list[Rule] = dataclasses.field(default_factory=list)
    training: bool = True  # insert the backward all-reduces (identity in forward)
    # SSM kernels: "auto" (Triton on CUDA weights, the torch reference otherwise), "triton", "reference"
    kernels: str = "auto"
    sequence_parallel: bool = False
    policy: object = None
    quantize_syncs: object = None
    quantize_min_bytes: int = 1 << 20
    quantize_block: int = 64

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise PlanError(f"tp must be a positive integer, got {self.tp!r}")
        if self.kernels not in ("auto", "triton", "reference"):
            raise PlanError(f"kernels must be 'auto', 'triton' or 'reference', got {self.kernels!r}")
        if self.quantize_syncs is not None:
            from .passes.quantize_sync import normalize_choice

            normalize_choice(self.quantize_syncs, self.quantize_block, self.quantize_min_bytes)

    def policy_for(self, mode: str):
        """A fresh reduce policy for a program of ``mode`` (policies keep per-program state)."""
        from .passes.shard import MegatronPolicy, SequenceParallelPolicy

        if self.policy is not None:
            return self.policy() if isinstance(self.policy, type) else copy.copy(self.policy)
        if self.sequence_parallel and mode == "forward":
            return SequenceParallelPolicy()
        return MegatronPolicy()

    def kernel_choice(self, device: torch.device) -> str:
        """"triton" or "reference" for weights on ``device``; Triton needs CUDA tensors."""
        if self.kernels == "triton" and device.type != "cuda":
            raise PlanError(f"Plan(kernels='triton') needs the weights on a CUDA device, not {device}; "
                            "use kernels='auto' or 'reference' on the CPU")
        if self.kernels == "auto":
            return "triton" if device.type == "cuda" else "reference"
        return self.kernels

    def all_rules(self) -> list[Rule]:
        return _defaults(self.vocab_parallel) + list(self.rules)

    def rule_for(self, fqn: str, block: str | None, role: str) -> Rule:
        chosen = None
        for rule in self.all_rules():
            if rule.matches(fqn, block, role):
                chosen = rule
        return chosen

    def layout(self, program, model) -> dict[str, Placement]:
        """Placement of every weight of ``program``; raises PlanError before any distributed work."""
        blocks = weight_blocks(program)
        placements = {}
        if self.tp == 1:
            return {fqn: REPLICATE for fqn in program.param_specs}
        for fqn, spec in program.param_specs.items():
            rule = self.rule_for(fqn, blocks.get(fqn), spec.role)
            placements[fqn] = STYLES[rule.style](self.tp, fqn, spec, model)
        return placements

    def explain(self, program, model=None) -> str:
        """Which rule hit which weight, and the placement it gives (when ``model`` is given)."""
        blocks = weight_blocks(program)
        lines = [f"Plan(tp={self.tp}, vocab_parallel={self.vocab_parallel}) on {program.family}:"]
        for fqn, spec in program.param_specs.items():
            rule = self.rule_for(fqn, blocks.get(fqn), spec.role)
            where = f"block={blocks.get(fqn)} role={spec.role}"
            placement = ""
            if model is not None:
                placement = " -> " + str(STYLES[rule.style](self.tp, fqn, spec, model))
            lines.append(f"  {fqn:<60} {where:<32} {rule.style}{placement}")
        return "\n".join(lines)


def weight_blocks(program) -> dict[str, str]:
    """Block kind of each weight: the block of the first node that reads it."""
    by_name = {i.name: i.target for i in program.inputs if i.kind != "user"}
    blocks = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in by_name:
            for user in node.users:
                tags = user.meta.get("ssmshard")
                if tags:
                    blocks[by_name[node.name]] = tags["block"]
                    break
    return blocks


# ----------------------------------------------------------------------------- styles
def _split(size: int, tp: int, fqn: str, what: str) -> Segment:
    if size % tp:
        raise PlanError(f"{fqn}: {size} {what} cannot be split over tp={tp}; choose tp dividing {size}")
    return even(size, tp)


def _grouped(count: int, unit: int, tp: int, fqn: str, what: str) -> Segment:
    """``count`` groups of ``unit`` rows: split when count % tp == 0, else each rank holds the one it needs."""
    if count % tp == 0:
        return Segment(count * unit, tp, 1)
    if tp % count == 0:
        return Segment(count * unit, count, tp // count)
    raise PlanError(f"{fqn}: {count} {what} can be neither split over tp={tp} ({count} % {tp} != 0) nor "
                    f"replicated to whole ranks ({tp} % {count} != 0); choose tp dividing {count} or a multiple of it")


def _mixer(model, fqn):
    path = fqn.rpartition(".")[0]
    while path:
        module = model.get_submodule(path)
        if hasattr(module, "intermediate_size") and hasattr(module, "conv1d"):
            return module
        path = path.rpartition(".")[0]
    raise PlanError(f"{fqn}: no SSM mixer module above this weight")


def _is_bias(fqn):
    return fqn.endswith(".bias")


def _replicate(tp, fqn, spec, model):
    return REPLICATE


def _colwise(tp, fqn, spec, model):
    return Shard(0, (_split(spec.shape[0], tp, fqn, "output features"),))


def _rowwise(tp, fqn, spec, model):
    if _is_bias(fqn):
        return REPLICATE  # added once, after the all-reduce
    return Shard(1, (_split(spec.shape[1], tp, fqn, "input features"),))


def _channels(tp, fqn, spec, model):
    mixer = _mixer(model, fqn)
    if spec.role in ("A_log", "D", "dt_bias") and hasattr(mixer, "num_heads") and spec.shape[0] == mixer.num_heads:
        return Shard(0, (_split(spec.shape[0], tp, fqn, "SSM heads"),))
    return Shard(0, (_split(spec.shape[0], tp, fqn, "channels"),))


def _mamba1(tp, fqn, spec, model):
    """Mamba-1 mixers, and Zamba's multi-head variant, split by channel.

    Zamba cuts d_inner into ``n_mamba_heads`` heads, each a full Mamba-1 mixer with its own
    x_proj/dt_proj/A/D (stacked on a leading head dim), and its in_proj rows interleave x and z
    per channel. Every rank takes the same share of every head's channels, so each head's
    scan stays local and x_proj's output is all-reduced per head as in Mamba-1; splitting
    whole heads instead would need n_mamba_heads % tp == 0, which Zamba-7B (2 heads) breaks.
    """
    if spec.role == "out_proj" and _is_bias(fqn):
        return REPLICATE  # added once, after the all-reduce
    mixer = _mixer(model, fqn)
    heads = getattr(mixer, "n_mamba_heads", None)
    d = mixer.intermediate_size
    if heads is None:  # plain Mamba-1 / Falcon-Mamba
        channels = _split(d, tp, fqn, "SSM channels (intermediate_size)")
        return {"in_proj": Shard(0, (channels, channels)),  # rows are [x | z]
                "x_proj": Shard(1, (channels,)),
                "out_proj": Shard(1, (channels,))}.get(spec.role, Shard(0, (channels,)))
    head_dim = d // heads
    channels = _split(head_dim, tp, fqn, f"channels of each of the {heads} Mamba heads (mamba_head_dim)")
    if spec.role == "in_proj":
        # rows (2 * d_inner) are [x_0, z_0, x_1, z_1, ...]: a rank's channels of a head are
        # one contiguous run of 2 * head_dim / tp rows inside that head's 2 * head_dim.
        return Shard(0, (Segment(2 * head_dim, channels.pieces),) * heads)
    if spec.role == "conv":
        return Shard(0, (channels,) * heads)
    if spec.role == "out_proj":
        return Shard(1, (channels,) * heads)
    if spec.role == "x_proj":  # (heads, dt_rank + 2 * N, head_dim): row-parallel per head
        return Shard(2, (channels,))
    return Shard(1, (channels,))  # dt_proj weight/bias, A_log, D: (heads, head_dim, ...)


def _mamba2_segments(tp, fqn, model, with_gate_and_dt: bool):
    m = _mixer(model, fqn)
    heads = _split(m.num_heads, tp, fqn, "SSM heads")
    channels = Segment(m.intermediate_size, heads.pieces, 1)
    groups = _grouped(m.n_groups, m.ssm_state_size, tp, fqn, "SSM groups (n_groups)")
    conv = (channels, groups, groups)  # [x, B, C]
    return (channels, *conv, Segment(m.num_heads, tp, 1)) if with_gate_and_dt else conv


def _mamba2_in_proj(tp, fqn, spec, model):
    return Shard(0, _mamba2_segments(tp, fqn, model, True))


def _mamba2_conv(tp, fqn, spec, model):
    return Shard(0, _mamba2_segments(tp, fqn, model, False))


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


def _attn_q(tp, fqn, spec, model):
    _, head_dim, heads, _ = _attention_heads(model, fqn)
    seg = _split(heads, tp, fqn, "attention heads")
    return Shard(0, (Segment(heads * head_dim, seg.pieces, 1),))


def _attn_kv(tp, fqn, spec, model):
    _, head_dim, heads, kv_heads = _attention_heads(model, fqn)
    _split(heads, tp, fqn, "attention heads")
    seg = _grouped(kv_heads, head_dim, tp, fqn, "key/value heads")
    return Shard(0, (seg,))


def _packed_halves(tp, fqn, spec, model):
    half = _split(spec.shape[0] // 2, tp, fqn, "rows of each half of a fused projection")
    return Shard(0, (half, half))  # rows are [gate | up]: each rank takes its rows of both


def _vocab(tp, fqn, spec, model):
    return Shard(0, (_split(spec.shape[0], tp, fqn, "vocabulary entries (pad the vocabulary or use "
                                                     "Plan(vocab_parallel=False))"),))


STYLES: dict[str, Callable] = {
    "replicate": _replicate, "colwise": _colwise, "rowwise": _rowwise, "channels": _channels,
    "vocab": _vocab, "mamba1": _mamba1, "mamba2_in_proj": _mamba2_in_proj,
    "mamba2_conv": _mamba2_conv, "attn_q": _attn_q, "attn_kv": _attn_kv, "packed_halves": _packed_halves,
}
