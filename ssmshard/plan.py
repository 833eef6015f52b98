"""``Plan``: how to split a model over a tensor-parallel group, and its validation.

A plan is a list of rules. Each rule matches weights by a glob over the parameter FQN and/or
the block kind and role the ``tag`` pass gave them, and names a style: a layout function that
turns a weight into a :class:`~ssmshard.placement.Shard` or :class:`Replicate` (the notation:
docs/design.md). The default rules and the styles come from the program's family
(``ssmshard/families/<name>.py``, shared ones in ``families/styles.py``); later rules (user
overrides) win over the family defaults.

Everything here runs before any process group exists: ``Plan.layout(program, model)``
computes every weight's placement and raises :class:`PlanError` naming the parameter and
the numbers when a split is impossible.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch

import torch

from .placement import REPLICATE, Placement
from .token_layout import ORDERS as TSP_ORDERS


# The dtypes a plan may hold SSM states in (``Plan.ssm_state_dtype``), by name too.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _state_dtype(value):
    """``Plan.ssm_state_dtype`` as a torch dtype (or None); PlanError for anything else."""
    if value is None or value in STATE_DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in STATE_DTYPES:
        return STATE_DTYPES[value.removeprefix("torch.")]
    raise PlanError(f"ssm_state_dtype must be None (HF's float32) or one of {', '.join(STATE_DTYPES)} (a torch "
                    f"dtype or its name), got {value!r}")


# Passes a plan runs only to make its programs faster; ``Plan(skip_passes=[...])`` leaves them out.
OPTIONAL_PASSES = ("fuse_rmsnorm", "scan_outputs", "token_major_in_proj", "decode_gemv", "fuse_dt_proj",
                   "group_decode_linears", "fuse_gated_activation", "fuse_rotary", "fold_cache_positions",
                   "hoist_attention_mask", "inplace_decode_states", "fuse_cache_write", "fuse_gemv_conv",
                   "fold_weights", "decode_attention")
# What a plan runs only when asked (``Plan(add_passes=[...])``): measured, not faster everywhere.
# ``decode_attention`` runs by default on head dims PyTorch's backends pad; asked for, on every head dim.
OPT_IN_PASSES = ("decode_attention",)
# How a linear layer under Plan(tsp=D) reads a sharded weight (docs/tsp.md).
TSP_WEIGHT_SCHEDULES = ("gather", "ring")
TSP_LOGITS = ("gathered", "local")


class PlanError(ValueError):
    """The plan cannot be applied to this model; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Rule:
    style: str  # a style of the model's family or a shared one (families/styles.py): colwise, rowwise, ...
    glob: str = "*"  # over the parameter FQN
    block: str | None = None  # tag block kind, or None for any
    role: str | None = None  # tag role, or None for any

    def matches(self, fqn: str, block: str | None, role: str) -> bool:
        return (fnmatch.fnmatchcase(fqn, self.glob) and (self.block is None or self.block == block)
                and (self.role is None or self.role == role))


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

    ``allreduce``: ``"nccl"`` (default), or ``"symm_mem"``: all-reduces of at most
    ``allreduce_max_bytes`` run torch symmetric memory's one-shot kernel over peer memory (low
    latency, CUDA-graph capturable; NCCL groups on one host; ``comm/symmetric.py``).

    ``drop_syncs``: sync point names or globs (``"layers.*.o_proj"``) whose all-reduce is dropped
    (SPD: the ``spd`` pass, docs/spd.md); empty: plain TP. ``allow_approximate``: also allow
    dropping sync points that nothing repairs later (Mamba-1's ``x_proj``). At tp=1 there are
    no sync points and the drop set is not applied.

    ``head_permutations``: head grouping carried by the plan (docs/spd.md): ``{sync point name:
    head permutation}`` (new head j of the block that sync point reduces is original head
    ``permutation[j]``), or what ``head_grouping.group_heads`` returns (a ``HeadGrouping``, its
    ``as_dict()``, a list of them). The re-ordering is applied on the way to the ranks (each
    rank's slices, from the model in memory or the unpermuted checkpoint); the model is not
    changed. Without a drop at that sync point it changes no value (only which heads each rank
    holds). Stored as the JSON-serialisable ``{name: [head, ...]}``.

    ``tsp``: tensor and sequence parallelism on one axis of ``tsp`` ranks (docs/tsp.md): each rank
    holds ``1/tsp`` of every sharded weight (the layout ``tp=tsp`` gives) and ``1/tsp`` of the
    tokens of every forward program (scoring, training); weights are gathered where they are
    read, states and halos pass between ranks along the sequence. ``tp`` is set to ``tsp``.
    Generation prefills with a TSP program and decodes with the tensor-parallel program over the
    same shards (the prefill's states re-laid into TP's channel-sharded layout).
    ``tsp_order``: which tokens a rank holds in forward programs: ``"contiguous"`` (rank ``r`` holds
    chunk ``r`` of ``tsp``) or ``"zigzag"`` (chunks ``r`` and ``2 tsp - 1 - r`` of ``2 tsp``, so
    causal attention gives every rank the same work; unpacked forward programs and the
    sequence-sharded prefill: docs/tsp.md).
    ``tsp_weights``: how a linear layer reads a sharded weight under ``tsp``: ``"gather"`` (the
    whole weight all-gathered for that op) or ``"ring"`` (the shards passed around the ranks, two
    in flight at once, point-to-point transfers overlapping the matmuls: ``comm.ring``). Other ops
    reading a sharded weight gather it under either (docs/tsp.md).
    ``tsp_logits``: what a forward program returns under ``tsp``: ``"gathered"`` (the logits of
    every token on every rank, like ``Plan(tp=...)``) or ``"local"`` (the logits of the rank's own
    tokens, padding dropped; ``DistributedModule.token_positions(L)`` says which): no gather, and
    ``1/tsp`` of the logits' memory, for a loss computed per rank (docs/tsp.md, "Local logits").

    ``skip_passes``: optimisation passes (``OPTIONAL_PASSES``) to leave out of every program, to
    measure what they bring or to rule one out; the results do not change, only the speed. They
    are ``fuse_rmsnorm`` (each RMSNorm, and the residual add before it, as one Triton kernel;
    generation programs under the Triton kernels), ``decode_gemv`` (the decode program's linear layers
    on a kernel that streams each weight for a batch of one; under the Triton kernels),
    ``fuse_dt_proj`` (Mamba-1's ``dt_proj`` computed inside the decode step's state update kernel
    instead of as a kernel of its own; under the Triton kernels), ``group_decode_linears`` (a decode
    step's linear layers that read the same input, such as q/k/v and gate/up, as one kernel launch
    at batch 1; under the Triton kernels), ``fuse_gated_activation`` (a gated MLP's activation and
    product, ``act(gate) * up``, as one kernel launch in decode steps; under the Triton kernels, not
    compiled), ``fuse_rotary`` (a decode step's rotary embedding of q and k, ten small ops a layer,
    as one kernel launch; under the Triton kernels), ``fold_cache_positions``
    (a static-K/V decode step's per-layer slot arithmetic, four small kernels a layer, read from its
    cache-position input; under the Triton kernels), ``hoist_attention_mask`` (a decode step's boolean
    attention mask made additive once instead of by every attention layer; under the Triton
    kernels), ``inplace_decode_states`` (the decode program
    writes each new state into the state tensor it was given and returns that tensor: the states
    passed in are overwritten), ``fuse_cache_write`` (a static-K/V decode step's rotary embedding and
    its two key/value cache writes as one kernel launch, or the two writes alone where there is no
    rotary embedding; under the Triton kernels), ``fuse_gemv_conv`` (a Mamba or Mamba-2 layer's
    ``in_proj`` and conv update as one kernel launch in batch-1 decode steps; under the Triton
    kernels, not compiled), ``fold_weights`` (weight-only subgraphs such as
    ``-exp(A_log.float())`` and casts of weights computed once per binding of the weights instead
    of every call: decode always, prefill and chunk when
    ``training=False``, forward programs never, since gradients must reach the weights) and
    ``decode_attention`` (a decode step's one-position attention on ssmshard's Triton kernel instead
    of PyTorch's SDPA backend where the head dim is not a power of two, which cuDNN pads, such as
    Zamba2's 160; under the Triton kernels). docs/decode.md.
    ``add_passes``: what a plan runs only when asked (``OPT_IN_PASSES``): ``decode_attention`` on
    every head dim (measured slower in Llama's graphed step, head dim 128: docs/decode.md).

    ``ssm_state_dtype``: the dtype generation programs hold the SSM (recurrent) states in, for
    the models that have them: ``None`` (default) keeps Hugging Face's, float32; ``torch.bfloat16``
    (or ``"bfloat16"``, ``torch.float16``) halves the state cache's memory and the bytes a decode
    step reads and writes, the way vLLM's ``mamba_ssm_cache_dtype`` does. The step's arithmetic
    stays float32 (each kernel reads the state, updates it in float32 and stores it rounded), so
    tokens follow HF's with its states rounded alike, not HF's float32 cache (docs/decode.md,
    "State dtype"). Conv states and key/value caches keep the model's dtype.

    ``compile``: run every program of the plan through ``torch.compile`` (Inductor), the SSM kernels,
    norms and collectives kept as opaque ops and the glue between them fused; each program compiles
    on its first call (and again for new shapes), CUDA-graph decode included. docs/compile.md.
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
    allreduce: str = "nccl"
    allreduce_max_bytes: int = 256 * 1024
    drop_syncs: list = dataclasses.field(default_factory=list)
    allow_approximate: bool = False
    head_permutations: object = None
    tsp: int = 1
    tsp_order: str = "contiguous"
    tsp_weights: str = "gather"
    tsp_logits: str = "gathered"
    # Optimisation passes to leave out (``OPTIONAL_PASSES``): to compare against, or to rule one out
    # when a program misbehaves. The sharding and sync-point passes are the plan itself.
    skip_passes: list = dataclasses.field(default_factory=list)
    # Passes run only when asked (``OPT_IN_PASSES``).
    add_passes: list = dataclasses.field(default_factory=list)
    # SSM states of generation programs: None keeps HF's (float32).
    ssm_state_dtype: object = None
    compile: bool = False

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise PlanError(f"tp must be a positive integer, got {self.tp!r}")
        if not isinstance(self.tsp, int) or self.tsp < 1:
            raise PlanError(f"tsp must be a positive integer, got {self.tsp!r}")
        from .head_grouping import normalize_head_permutations

        self.head_permutations = normalize_head_permutations(self.head_permutations, self.tsp if self.tsp > 1
                                                             else self.tp)
        if self.tsp_order not in TSP_ORDERS:
            raise PlanError(f"tsp_order must be one of {', '.join(map(repr, TSP_ORDERS))}, got {self.tsp_order!r}")
        if self.tsp_order != "contiguous" and self.tsp == 1:
            raise PlanError(f"tsp_order={self.tsp_order!r} orders the tokens of Plan(tsp=D) with D > 1; set tsp "
                            "or leave tsp_order out")
        if self.tsp_weights not in TSP_WEIGHT_SCHEDULES:
            raise PlanError(f"tsp_weights must be one of {', '.join(map(repr, TSP_WEIGHT_SCHEDULES))}, got "
                            f"{self.tsp_weights!r}")
        if self.tsp_weights != "gather" and self.tsp == 1:
            raise PlanError(f"tsp_weights={self.tsp_weights!r} schedules the weight shards of Plan(tsp=D) with D > 1; "
                            "set tsp or leave tsp_weights out")
        if self.tsp_logits not in TSP_LOGITS:
            raise PlanError(f"tsp_logits must be one of {', '.join(map(repr, TSP_LOGITS))}, got {self.tsp_logits!r}")
        if self.tsp_logits != "gathered" and self.tsp == 1:
            raise PlanError(f"tsp_logits={self.tsp_logits!r} keeps each rank's logits of Plan(tsp=D) with D > 1; set "
                            "tsp or leave tsp_logits out")
        self.ssm_state_dtype = _state_dtype(self.ssm_state_dtype)
        if self.tsp > 1:
            self._check_tsp()
        if self.kernels not in ("auto", "triton", "reference"):
            raise PlanError(f"kernels must be 'auto', 'triton' or 'reference', got {self.kernels!r}")
        if not isinstance(self.compile, bool):
            raise PlanError(f"compile must be True or False, got {self.compile!r}")
        if self.allreduce not in ("nccl", "symm_mem"):
            raise PlanError(f"allreduce must be 'nccl' or 'symm_mem', got {self.allreduce!r}")
        if not isinstance(self.allreduce_max_bytes, int) or self.allreduce_max_bytes <= 0:
            raise PlanError(f"allreduce_max_bytes must be a positive integer, got {self.allreduce_max_bytes!r}")
        if self.quantize_syncs is not None:
            from .passes.quantize_sync import normalize_choice

            normalize_choice(self.quantize_syncs, self.quantize_block, self.quantize_min_bytes)
        if self.drop_syncs is None:
            self.drop_syncs = []
        if isinstance(self.drop_syncs, str) or not isinstance(self.drop_syncs, (list, tuple)) \
                or not all(isinstance(g, str) for g in self.drop_syncs):
            raise PlanError(f"drop_syncs must be a list of sync point names or globs, not {self.drop_syncs!r}")
        self.drop_syncs = list(self.drop_syncs)
        if isinstance(self.skip_passes, str) or not all(name in OPTIONAL_PASSES for name in self.skip_passes):
            raise PlanError(f"skip_passes must list optimisation passes ({', '.join(OPTIONAL_PASSES)}), "
                            f"got {self.skip_passes!r}")
        self.skip_passes = list(self.skip_passes)
        if isinstance(self.add_passes, str) or not all(name in OPT_IN_PASSES for name in self.add_passes):
            raise PlanError(f"add_passes must list opt-in passes ({', '.join(OPT_IN_PASSES)}), got {self.add_passes!r}")
        self.add_passes = list(self.add_passes)
        if set(self.add_passes) & set(self.skip_passes):
            raise PlanError(f"{sorted(set(self.add_passes) & set(self.skip_passes))} in both add_passes and "
                            f"skip_passes: list each pass in one of them")
        if self.drop_syncs and self.sequence_parallel:
            raise PlanError("drop_syncs with sequence_parallel=True: sequence parallelism reduce-scatters the "
                            "residual stream, and only all-reduce sync points can be dropped; use one or the other")

    def _check_tsp(self):
        """TSP is one mesh axis with its own schedule: what it cannot combine with, up front."""
        if self.tp not in (1, self.tsp):
            raise PlanError(f"Plan(tsp={self.tsp}) folds tensor parallelism into the same {self.tsp} ranks; "
                            f"tp={self.tp} cannot be added (leave tp out or set tp={self.tsp})")
        if self.compile:
            raise PlanError("Plan(tsp=..., compile=True) is not supported: a TSP rank's graph differs by rank, and "
                            "Inductor, scheduling each rank's graph on its own, can order their collectives "
                            "differently (a mismatch or a hang); leave compile out under tsp (docs/compile.md)")
        conflicts = [name for name, on in (("sequence_parallel", self.sequence_parallel),
                                           ("policy", self.policy is not None),
                                           ("quantize_syncs", self.quantize_syncs is not None),
                                           ("drop_syncs", bool(self.drop_syncs)),
                                           ("head_permutations", bool(self.head_permutations)),
                                           ("ssm_state_dtype", self.ssm_state_dtype is not None)) if on]
        if conflicts:
            raise PlanError(f"Plan(tsp=...) does not take {', '.join(conflicts)} (all-reduce sync points, a reduce "
                            f"policy, or SSM states in another dtype, which its sequence-sharded prefill combines "
                            f"across ranks in float32): remove them, or use Plan(tp=...)")
        self.tp = self.tsp

    def policy_for(self, mode: str):
        """A fresh reduce policy for a program of ``mode`` (policies keep per-program state)."""
        from .passes.shard import MegatronPolicy, SequenceParallelPolicy

        if self.policy is not None:
            return self.policy() if isinstance(self.policy, type) else copy.copy(self.policy)
        if self.sequence_parallel and mode == "forward":
            return SequenceParallelPolicy()
        return MegatronPolicy()

    def pipeline(self, mode: str, *, placements, rank: int, group: str, kernels: str = "reference",
                 input_placements=None, sequence_sharded: bool = False) -> list:
        """The pass steps that make rank ``rank``'s program of ``mode`` under this plan, in order:
        the sharding passes (``propagate``, ``localize``, ``communicate``) with the plan's reduce
        policy, the sync-point passes (``spd``, then ``quantize_sync``), then, when
        ``kernels == "triton"``, ``fuse_rmsnorm`` (generation programs, and forward programs of a plan
        that does not train: each RMSNorm and the residual add before it as one node),
        ``scan_outputs`` (the same programs but decode: Mamba-1's scan writing the dtype its output
        is cast to, without a final state nothing reads), ``token_major_in_proj`` (the same
        programs: Mamba-1's ``in_proj`` written token-contiguous for the conv and the scan),
        ``decode_gemv`` (decode programs: linear layers on the skinny-matmul op), ``fuse_dt_proj``
        (decode programs: Mamba-1's dt projection inside the state update), ``group_decode_linears`` (decode programs:
        linear layers reading one input as one op), ``fuse_gated_activation`` (decode programs: a gated
        MLP's ``act(gate) * up`` as one op), ``fuse_rotary`` (decode programs: q and k's rotary
        embedding as one op), ``fold_cache_positions`` (decode programs: the static-K/V slot arithmetic
        folded into views of the cache position), ``hoist_attention_mask`` (decode programs: the
        boolean attention mask made additive once a step) and ``swap_kernels`` (it only retargets SSM ops);
        then the inference passes (``inference_steps``) and, for decode programs under the Triton
        kernels, ``fuse_cache_write`` (the rotary kernel writing keys and values into the static
        cache, or one kernel writing both where there is no rotary embedding), ``fuse_gemv_conv`` (a
        Mamba layer's ``in_proj`` and conv update as one launch at batch 1) and
        ``decode_attention`` (the one-position attention on its own kernel: head dims that are not
        a power of two, every head dim when ``add_passes`` asks for it).
        ``runtime.pipeline.shard_program`` runs them; ``ssmshard inspect`` and the runtime both go
        through it. Under ``tsp``, forward programs are the ``tsp`` pass's;
        ``sequence_sharded=True`` asks for it on a prefill program too (the TSP prefill, whose
        states feed the tensor-parallel decode program: docs/tsp.md)."""
        from .passes.shard import sharding_steps

        if sequence_sharded and (self.tsp == 1 or mode != "prefill"):
            raise PlanError(f"a sequence-sharded {mode} program needs Plan(tsp=...) and a prefill program")
        if self.tsp > 1 and (mode == "forward" or sequence_sharded):
            order = self.tsp_order
            return self._tsp_pipeline(placements=placements, rank=rank, group=group, order=order, kernels=kernels)
        options = {"placements": placements, "rank": rank, "tp": self.tp, "group": group,
                   "training": self.training, "policy": self.policy_for(mode),
                   "input_placements": input_placements or {}}
        steps = sharding_steps(options)
        if self.drop_syncs and self.tp > 1:  # after communicate, whose sync points it drops
            steps.append(("spd", {"drop": self.drop_syncs, "allow_approximate": self.allow_approximate,
                                  "training": self.training, "group": group}))
        if self.quantize_syncs and self.tp > 1:  # after communicate, whose sync points it rewrites
            steps.append(("quantize_sync", {"syncs": self.quantize_syncs, "min_bytes": self.quantize_min_bytes,
                                            "block": self.quantize_block}))
        if kernels == "triton":
            if mode != "forward" or not self.training:  # the fused kernel has no backward
                steps.append(("fuse_rmsnorm", {}))
                if mode != "decode":  # a decode step has no scan over tokens, nor their conv
                    steps.append(("scan_outputs", {}))
                    steps.append(("token_major_in_proj", {}))
            if mode == "decode":
                steps.append(("decode_gemv", {}))
                steps.append(("fuse_dt_proj", {}))
                steps.append(("group_decode_linears", {}))
                steps.append(("fuse_gated_activation", {"compile": self.compile}))
                steps.append(("fuse_rotary", {}))
                steps.append(("fold_cache_positions", {}))
                steps.append(("hoist_attention_mask", {}))
            steps.append(("swap_kernels", {"kernels": "triton", "compile": self.compile}))
        steps += self.inference_steps(mode)
        if kernels == "triton" and mode == "decode":  # after inplace_decode_states, on the rotary kernel
            steps.append(("fuse_cache_write", {"compile": self.compile}))
            steps.append(("fuse_gemv_conv", {"compile": self.compile}))
            # After fuse_cache_write, which matches SDPA nodes.
            steps.append(("decode_attention", {"compile": self.compile,
                                               "every_head_dim": "decode_attention" in self.add_passes}))
        return [step for step in steps if (step if isinstance(step, str) else step[0]) not in self.skip_passes]

    def inference_steps(self, mode: str) -> list:
        """The passes after sharding and kernels that only inference programs get: states written
        in place (decode), weight-only subgraphs folded (decode; prefill and chunk when the plan
        does not train)."""
        steps = []
        if mode == "decode":
            steps.append("inplace_decode_states")
        if mode == "decode" or (mode in ("prefill", "chunk") and not self.training):
            steps.append("fold_weights")
        return steps

    def _tsp_pipeline(self, *, placements, rank: int, group: str, order: str, kernels: str) -> list:
        """A forward (or sequence-sharded prefill) program under TSP. Decode and chunk programs of
        a TSP plan are the plain tensor-parallel ones over the same weight shards (the layouts are
        the same by construction): docs/tsp.md. With ``kernels == "triton"`` the sequence blocks'
        scans run on the Triton kernels (the ``tsp`` pass hands them the choice) and
        ``swap_kernels`` retargets the SSM ops left in the program (the norms)."""
        steps = [("tsp", {"placements": placements, "rank": rank, "tsp": self.tsp, "group": group,
                          "training": self.training, "order": order,
                          "weights": self.tsp_weights, "kernels": kernels, "logits": self.tsp_logits})]
        if kernels == "triton":
            steps.append(("swap_kernels", {"kernels": "triton", "compile": self.compile}))
        return steps

    def kernel_choice(self, device: torch.device) -> str:
        """"triton" or "reference" for weights on ``device``; Triton needs CUDA tensors."""
        if self.kernels == "triton" and device.type != "cuda":
            raise PlanError(f"Plan(kernels='triton') needs the weights on a CUDA device, not {device}; "
                            "use kernels='auto' or 'reference' on the CPU")
        if self.kernels == "auto":
            return "triton" if device.type == "cuda" else "reference"
        return self.kernels

    def all_rules(self, family) -> list[Rule]:
        """The rules for a model of ``family`` (a ``Family`` or its name): its defaults, then the user's."""
        from .families import family_named

        family = family_named(family) if isinstance(family, str) else family
        return family.default_rules(self.vocab_parallel) + list(self.rules)

    def _rules_by_weight(self, program):
        """(fqn, spec, block, the last rule matching it, the family) for every weight of ``program``."""
        from .families import family_named

        family = family_named(program.family)
        rules = self.all_rules(family)
        blocks = weight_blocks(program)
        for fqn, spec in program.param_specs.items():
            matching = [r for r in rules if r.matches(fqn, blocks.get(fqn), spec.role)]
            yield fqn, spec, blocks.get(fqn), matching[-1], family

    def capture_options(self, mode: str) -> dict:
        """What ``capture`` takes from the plan for a program of ``mode``: the SSM state dtype of a
        generation program (a forward program holds no states)."""
        if mode == "forward" or self.ssm_state_dtype is None:
            return {}
        return {"ssm_state_dtype": self.ssm_state_dtype}

    def check_model(self, model) -> None:
        """What the plan asks of the model that it may not have; PlanError before any distributed work."""
        from .families import family_of

        family = family_of(model)
        if self.ssm_state_dtype is not None and not family.has_ssm:
            raise PlanError(f"Plan(ssm_state_dtype={self.ssm_state_dtype}) sets the dtype of SSM states, and "
                            f"{family.class_name} has none (its key/value caches keep the model's dtype): leave "
                            "ssm_state_dtype out")

    def layout(self, program, model) -> dict[str, Placement]:
        """Placement of every weight of ``program``; raises PlanError before any distributed work."""
        if self.tp == 1:
            return {fqn: REPLICATE for fqn in program.param_specs}
        return {fqn: family.style(rule.style)(self.tp, fqn, spec, model)
                for fqn, spec, _, rule, family in self._rules_by_weight(program)}

    def weight_permutations(self, program, model) -> dict:
        """The weights ``head_permutations`` re-order: FQN -> ``permutation.WeightPermutation``.
        Raises PlanError before any distributed work (an unknown sync point, a block without heads
        or shared by several layers, a list that is not a permutation of the block's heads or
        that splits a unit, a weight the program does not read)."""
        if not self.head_permutations:
            return {}
        from .head_grouping import plan_weight_permutations

        permutations = plan_weight_permutations(model, self.head_permutations)
        unread = sorted(set(permutations) - set(program.param_specs))
        if unread:
            raise PlanError(f"head_permutations re-order {unread[:3]}, which the captured program does not read "
                            "under those names (tied or shared weights are not supported)")
        return permutations

    def explain(self, program, model=None, *, syncs: bool = True, batch: int | None = None,
                seq: int | None = None) -> str:
        """Which rule hit which weight, and the placement it gives (when ``model`` is given); with
        ``model`` and ``syncs``, also rank 0's sync points of a forward ``program`` under this plan:
        each kept, dropped or quantized, its bytes per token and the totals. For a TSP plan with
        ``model``, ``batch`` and ``seq``: per layer, TP's and TSP's bytes moved per rank, the
        break-even token count and the residual stream per rank (``tsp_cost``)."""
        lines = [f"Plan(tp={self.tp}, vocab_parallel={self.vocab_parallel}"
                 + (f", drop_syncs={self.drop_syncs}" if self.drop_syncs else "")
                 + (f", head_permutations at {list(self.head_permutations)}" if self.head_permutations else "")
                 + (f", quantize_syncs={self.quantize_syncs!r}" if self.quantize_syncs else "")
                 + f") on {program.family}:"]
        if model is not None:
            self.weight_permutations(program, model)  # a wrong head permutation is an error here too
        if self.tsp > 1:
            lines[0] = (f"Plan(tsp={self.tsp}, tsp_order={self.tsp_order!r}, tsp_weights={self.tsp_weights!r}, "
                        f"tsp_logits={self.tsp_logits!r}, vocab_parallel={self.vocab_parallel}) on {program.family}:")
        for fqn, spec, block, rule, family in self._rules_by_weight(program):
            where = f"block={block} role={spec.role}"
            placement = ""
            if model is not None:
                placement = " -> " + str(family.style(rule.style)(self.tp, fqn, spec, model))
            lines.append(f"  {fqn:<60} {where:<32} {rule.style}{placement}")
        if model is not None and syncs and self.tp > 1 and self.tsp == 1 and program.mode == "forward":
            from .inspect import sharding_report
            from .runtime.pipeline import shard_program

            from .passes.shard import ShardingError

            try:
                sharded = shard_program(copy.deepcopy(program), model, self, rank=0, group="ssmshard_explain")
            except ShardingError as exc:  # the rules above are still worth reading: say why no sync points follow
                lines.append(f"  sync points: none listed, this layout does not shard the program: {exc}")
            else:
                lines += sharding_report(sharded, weights=False).splitlines()[1:]
        if self.tsp > 1 and model is not None and batch and seq:
            from .tsp_cost import comparison

            lines.append(comparison(program, model, self, batch, seq))
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
