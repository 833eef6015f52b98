"""The ``tsp`` pass: one rank's forward program under tensor and sequence parallelism folded onto
one axis of ``D`` ranks (``Plan(tsp=D)``, docs/tsp.md).

Each rank keeps ``1/D`` of every sharded weight (the tensor-parallel layout ``Plan.layout``
gives at ``tp=D``) and ``1/D`` of the tokens (a contiguous chunk, padded inside as
``comm.split`` pads; under ``order="zigzag"`` two chunks, ``token_layout``). The pass rewrites
the unsharded captured graph:

* the ids are split along the sequence right after the placeholder, and every use of the
  ids (and of their length) reads the local chunk: the whole program then runs on ``c`` local
  tokens, every view and allocation included;
* every read of a sharded weight is preceded by ``comm.weights.gather_shards`` (the whole
  weight, in flight only for that op), or, under ``weights="ring"``, a linear layer becomes
  ``comm.ring.ring_linear`` over the local shard (the shards go around the ranks); a replicated
  parameter gets a ``tp_copy`` (its gradient sums over the ranks' tokens);
* positions (``arange`` over the sequence length) become the local tokens' global positions, so
  rotary embeddings see them;
* the ops that mix tokens become their ``sequence_blocks`` counterparts: the causal conv takes
  its halo from the previous rank, the scans pass states over ranks (on the Triton kernels
  when the ``kernels`` option is "triton"), attention gathers keys and values (causal by
  global position);
* a packed program's ``cu_seqlens`` stays whole (global offsets) and reaches every conv, scan
  and attention, which keep sequences apart across the chunks;
* the logits are all-gathered along the sequence (put in sequence order, the padding dropped)
  before the output; under ``logits="local"`` (``Plan.tsp_logits``) each rank returns its own
  tokens' logits, the padding dropped (``SeqShard(1)``).

Placements stay on the nodes: ``SeqShard(d)`` where a value carries the local tokens along
dim ``d``, ``R~`` for a gathered weight, the weights' shards on their placeholders.
"""

from __future__ import annotations

import torch

from .. import sequence_blocks
from ..comm import ops as _register_collectives  # noqa: F401  (torch.ops.ssmshard collectives)
from ..comm.groups import declare_group_size
from ..comm.ring import ring_layout, ring_linear
from ..comm.weights import gather_shards, gathered_ranges
from ..ops.signatures import SIGNATURES
from ..placement import REPLICATE, Replicate, SeqShard, Shard
from ..token_layout import TokenLayout, local_positions, real_local_tokens, sequence_ordered, split_sequence
from .fake_values import propagate_fake_values
from .manager import register
from .shard.context import ShardingError, new_node
from .shard.localize import _make_local

aten = torch.ops.aten
ssm = torch.ops.ssmshard
GLUE = {"module": "", "call_site": "", "layer": None, "block": "glue", "role": "body"}
PARTIAL_GRAD_REPLICATE = Replicate(partial_grad=True)


class _Rewriter:
    def __init__(self, program, options):
        self.program = program
        self.graph = program.graph
        self.placements = options["placements"]
        self.rank = options["rank"]
        self.world = options["tsp"]
        self.group = options["group"]
        self.training = options.get("training", True)
        self.order = options.get("order", "contiguous")
        self.weight_schedule = options.get("weights", "gather")
        self.local_logits = options.get("logits", "gathered") == "local"
        self.layout = TokenLayout(self.rank, self.world, self.order)
        # The sequence blocks' scans: "reference" ops or "triton" kernels (Plan.kernel_choice).
        self.kernels = options.get("kernels", "reference")
        self.inputs = {i.name: i for i in program.inputs}

    def call(self, target, args, like, kwargs=None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        tags = like.meta.get("ssmshard") if like is not None else None
        node.meta["ssmshard"] = dict(tags or GLUE)
        if like is not None and "stack_trace" in like.meta:
            node.meta["stack_trace"] = like.meta["stack_trace"]
        return node

    # ------------------------------------------------------------- tokens
    def split_tokens(self):
        """Every user input (the ids; a prefill's attention mask and positions too) is split along
        the sequence right after the placeholders, and every use reads the local chunk."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        users = [n for n in placeholders if self.inputs[n.name].kind == "user"]
        mode, packed = self.program.mode, self.program.packed
        # A packed forward program reads (input_ids, cu_seqlens): the offsets stay whole (global),
        # every conv and scan cuts its own chunk's part of them (sequence_blocks).
        expected_users = 2 if packed else 1
        if mode not in ("forward", "prefill") or (packed and mode != "forward") \
                or (mode == "forward" and len(users) != expected_users):
            raise ShardingError(f"the tsp pass shards forward programs over input_ids (packed ones over input_ids "
                                f"and cu_seqlens) and prefill programs, not a {'packed ' if packed else ''}{mode} "
                                "program")
        if self.layout.slots > 1 and packed:
            raise ShardingError(f"the tsp pass's {self.order!r} order shards unpacked programs; a packed program "
                                "takes order='contiguous'")
        ids = users[0]
        self.cu_seqlens = users[1] if packed else None
        if packed:
            users = users[:1]
        with self.graph.inserting_after(placeholders[-1]):
            self.length = self.call(aten.sym_size.int, (ids, 1), None)
        anchor, self.local_inputs = self.length, {}
        for user in users:
            split = ((ssm.split.default, (user, 1, self.group)) if self.layout.slots == 1
                     else (split_sequence, (user, 1, self.rank, self.world, self.order)))
            with self.graph.inserting_after(anchor):
                local = anchor = self.call(*split, None)
            local.meta["placement"] = SeqShard(1)
            self.local_inputs[user.name] = local
            keep = {local, self.length}
            user.replace_all_uses_with(local, delete_user_cb=lambda use, keep=keep: use not in keep)
        self.local_ids = self.local_inputs[ids.name]
        self.local_length_nodes = {n for local in self.local_inputs.values() for n in local.users
                                   if n.target is aten.sym_size.int and n.args[1] in (1, -1)}

    def offset_positions(self):
        """``arange(L)`` counts the local tokens' global positions: ``arange(c) + rank * c`` for a
        contiguous chunk, each chunk's own offset under zigzag."""
        for node in list(self.graph.nodes):
            if node.target is aten.arange.default and node.args[0] in self.local_length_nodes:
                with self.graph.inserting_after(node):
                    shifted = self.call(local_positions, (node, self.rank, self.world, self.order), node)
                node.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)

    # ------------------------------------------------------------- weights
    def gather_weights(self):
        for node in [n for n in self.graph.nodes if n.op == "placeholder"]:
            spec_input = self.inputs[node.name]
            if spec_input.kind == "user":
                continue
            spec = self.program.param_specs[spec_input.target]
            placement = self.placements.get(spec_input.target, REPLICATE)
            spec.placement = placement
            node.meta["placement"] = placement
            if isinstance(placement, Shard):
                _make_local(node, placement)
                ranges = gathered_ranges(placement, self.world)
                for user in list(node.users):
                    if self.weight_schedule == "ring" and _ring_reads(user, node, placement):
                        self.ring_linear(user, node, placement)
                        continue
                    with self.graph.inserting_before(user):
                        whole = self.call(gather_shards, (node, placement.dim, ranges, self.group), user)
                    whole.meta["placement"] = PARTIAL_GRAD_REPLICATE
                    user.replace_input_with(node, whole)
            elif spec.kind == "parameter" and self.training and node.users:
                first = next(iter(node.users))
                with self.graph.inserting_after(node):
                    copy = self.call(ssm.tp_copy.default, (node, self.group), first)
                copy.meta["placement"] = PARTIAL_GRAD_REPLICATE
                node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)

    def ring_linear(self, linear, shard, placement):
        """``linear(x, W, b)`` as ``comm.ring.ring_linear`` over the local shard (the shards go
        around the ranks instead of being gathered; a sharded bias is gathered like any weight)."""
        x, _, *bias = linear.args
        args = (x, shard, bias[0] if bias else None, placement.dim, placement.global_size,
                ring_layout(placement, self.world), self.group)
        with self.graph.inserting_before(linear):
            ring = self.call(ring_linear, args, linear)
        linear.replace_all_uses_with(ring)
        self.graph.erase_node(linear)

    # ------------------------------------------------------------- ops that mix tokens
    def sequence_ops(self):
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                continue
            replacement = None
            if node.target is ssm.causal_conv1d.default:
                a = self._bound(node, "causal_conv1d")
                replacement = (sequence_blocks.causal_conv1d,
                               (a["x"], a["weight"], a["bias"], a["activation"], self.rank, self.group,
                                a.get("cu_seqlens")), {"order": self.order})
            elif node.target is ssm.selective_scan.default:
                a = self._bound(node, "selective_scan", "initial_state")
                replacement = (sequence_blocks.selective_scan,
                               (a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                                a["delta_softplus"], self.rank, self.group, a.get("cu_seqlens")), {"order": self.order, "kernels": self.kernels})
            elif node.target is ssm.ssd_scan.default:
                a = self._bound(node, "ssd_scan", "initial_states")
                self._check_kernel_limits(node)
                replacement = (sequence_blocks.ssd_scan,
                               (a["x"], a["dt"], a["A"], a["B"], a["C"], a["chunk_size"], a["D"], a["dt_bias"],
                                a["dt_softplus"], a["dt_min"], a["dt_max"], self.rank, self.group,
                                a.get("cu_seqlens")), {"order": self.order, "kernels": self.kernels})
            elif node.target is aten.scaled_dot_product_attention.default:
                replacement = self._attention(node)
            elif node.target in _TOKEN_MIXING_UNSUPPORTED:
                raise ShardingError(f"Plan(tsp=...) cannot run {node.target} at {node.name} on a chunk of the "
                                    "sequence (it carries state across tokens); run this model with Plan(tp=...)")
            if replacement is None:
                continue
            fn, args, *kwargs = replacement
            with self.graph.inserting_before(node):
                new = self.call(fn, args, node, kwargs=kwargs[0] if kwargs else None)
            node.replace_all_uses_with(new)
            self.graph.erase_node(node)

    def _check_kernel_limits(self, node):
        """A scan the Triton kernel cannot run (``swap_kernels``' static checks) is an error here,
        before any rank runs, where ``kernels="triton"`` was asked for: the sequence blocks never
        fall back to the reference op on their own."""
        from .swap_kernels import KERNELS

        check = KERNELS[node.target][2]
        why = check(node) if self.kernels == "triton" and check is not None else None
        if why is not None:
            raise ShardingError(f"Plan(tsp=..., kernels='triton'): {node.name} cannot run on its Triton kernel "
                                f"({why}); use kernels='reference'")

    def _bound(self, node, name, *must_be_none):
        """The op's arguments by name. ``cu_seqlens`` may only be the packed program's global
        offsets (handed on to the sequence block); an initial state is refused."""
        a = SIGNATURES[name].bind(node.args, node.kwargs)
        for arg in must_be_none:
            if a.get(arg) is not None:
                raise ShardingError(f"Plan(tsp=...) runs {name} from the sequence start: {arg} at {node.name} "
                                    "is not supported (stateful programs)")
        if a.get("cu_seqlens") is not None and a["cu_seqlens"] is not self.cu_seqlens:
            raise ShardingError(f"Plan(tsp=...) passes the packed row's global cu_seqlens input to {name}; at "
                                f"{node.name} it reads {a['cu_seqlens']} instead, which the pass cannot split")
        return a

    def _attention(self, node):
        schema = [a.name for a in node.target._schema.arguments]
        a = dict(zip(schema, node.args)) | dict(node.kwargs)
        if a.get("dropout_p", 0.0) not in (0, 0.0):
            raise ShardingError(f"Plan(tsp=...) supports attention without dropout; {node.name} has dropout")
        # The captured mask is the causal one, over padding in prefill (left-padded prompts), or a
        # packed row's block-diagonal one: sequence_blocks.causal_attention rebuilds it from global
        # positions and, in prefill, from the attention mask's local chunk (all-gathered there), in
        # a packed program from the row's global cu_seqlens.
        kwargs = {"scale": a.get("scale"), "enable_gqa": a.get("enable_gqa", False),
                  "key_mask": self.local_inputs.get("attention_mask"), "cu_seqlens": self.cu_seqlens,
                  "order": self.order}
        return (sequence_blocks.causal_attention, (a["query"], a["key"], a["value"], self.rank, self.group), kwargs)

    # ------------------------------------------------------------- output
    def gather_outputs(self):
        if self.program.mode == "prefill":
            self.prefill_outputs()
        else:
            self.gather_logits()

    def prefill_outputs(self):
        """The prompt's last token is the last local token of the rank holding the last chunk (the
        runtime left-pads the prompt to fill every chunk, ``runtime.tsp_prefill``): the last rank,
        or rank 0 under zigzag (its second chunk). So are the SSM and conv states after it: they are
        broadcast from that rank. Keys and values are all-gathered along their positions (and put
        in sequence order under zigzag). Every output is then whole on every rank (``R``)."""
        from ..runtime.static_kv import KV_KINDS, KV_POSITIONS  # (runtime imports the passes)

        output = next(n for n in self.graph.nodes if n.op == "output")
        logits, *states = output.args[0]
        last, _ = self.layout.owner(self.layout.chunks - 1)
        outs = []
        for value, spec in zip([logits, *states], [None, *self.program.state_specs]):
            with self.graph.inserting_before(output):
                if spec is not None and spec.kind in KV_KINDS:
                    node = self.call(ssm.all_gather.default, (value, KV_POSITIONS, self.group), value)
                    if self.layout.slots > 1:
                        node.meta["placement"] = REPLICATE
                        node = self.call(sequence_ordered, (node, KV_POSITIONS, self.world, self.order, None), value)
                else:
                    node = self.call(ssm.broadcast.default, (value, last, self.group), value)
            node.meta["placement"] = REPLICATE
            outs.append(node)
        output.args = (tuple(outs),)

    def gather_logits(self):
        output = next(n for n in self.graph.nodes if n.op == "output")
        values = output.args[0]
        flat = list(values) if isinstance(values, (tuple, list)) else [values]
        gathered = []
        for value in flat:
            with self.graph.inserting_before(output):
                if self.local_logits:  # the rank's own tokens, no traffic (Plan.tsp_logits)
                    node = self.call(real_local_tokens, (value, 1, self.rank, self.world, self.order, self.length),
                                     value)
                    node.meta["placement"] = SeqShard(1)
                    gathered.append(node)
                    continue
                if self.layout.slots == 1:
                    node = self.call(ssm.all_gather.default, (value, 1, self.group, self.length), value)
                else:  # rank order is not sequence order: reorder the chunks, then drop the padding
                    in_rank_order = self.call(ssm.all_gather.default, (value, 1, self.group), value)
                    in_rank_order.meta["placement"] = REPLICATE
                    node = self.call(sequence_ordered, (in_rank_order, 1, self.world, self.order, self.length),
                                     value)
            node.meta["placement"] = REPLICATE
            gathered.append(node)
        output.args = (tuple(gathered) if isinstance(values, (tuple, list)) else gathered[0],)

    # ------------------------------------------------------------- placements
    def record_placements(self):
        """Fresh fake values, then ``SeqShard(d)`` on every value carrying the local tokens."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        vals = [n.meta["val"] for n in placeholders]
        propagate_fake_values(self.program.graph_module, vals)
        local = self.local_ids.meta["val"].shape[1]
        for node in self.graph.nodes:
            val = node.meta.get("val")
            if node.op != "call_function" or "placement" in node.meta or not isinstance(val, torch.Tensor):
                continue
            dims = [d for d, size in enumerate(val.shape) if _same_size(size, local)]
            node.meta["placement"] = SeqShard(dims[0]) if dims else PARTIAL_GRAD_REPLICATE


def _ring_reads(user, weight, placement) -> bool:
    """Whether ``user`` is a linear layer reading ``weight`` as its matrix (only there), split
    along one of its two dims. The logits head is left to the gather (docs/tsp.md)."""
    if user.target is not aten.linear.default or user.meta.get("ssmshard", {}).get("role") == "lm_head":
        return False
    x, matrix, *rest = user.args
    return matrix is weight and weight is not x and weight not in rest and placement.dim in (0, 1)


def _same_size(a, b) -> bool:
    """Whether two symbolic sizes are the same expression (a concrete size matches nothing)."""
    if isinstance(a, int) or isinstance(b, int):
        return False
    return a.node.expr == b.node.expr


def _conv_width(graph) -> int:
    """The widest causal conv's kernel (1 without convs): a prefill's conv state is the last that
    many tokens, so the rank holding the prompt's end must hold at least as many."""
    widths = [n.args[1].meta["val"].shape[-1] for n in graph.nodes if n.target is ssm.causal_conv1d.default]
    return max(widths, default=1)


def _check_traced_chunk(program, chunks, min_chunk):
    """Shapes are propagated at the traced length's chunk: a chunk shorter than the conv kernel
    would take HF's short-prefill branch (the conv state padded), which real chunks never take
    (the runtime pads prompts to fill every chunk, of ``c >= min_chunk`` tokens)."""
    users = {i.name for i in program.inputs if i.kind == "user"}
    ids = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name in users)
    length = ids.meta["val"].shape[1]
    traced = length.node.hint if isinstance(length, torch.SymInt) else length
    if -(-traced // chunks) < min_chunk:
        raise ShardingError(f"the prefill program was traced at {traced} tokens, {-(-traced // chunks)} per chunk "
                            f"in {chunks} chunks, fewer than the conv kernel ({min_chunk}): capture it with "
                            f"example_seq >= {chunks * min_chunk}")


# Ops whose forward programs would carry state across tokens in a way this pass does not rewrite.
_TOKEN_MIXING_UNSUPPORTED = (ssm.causal_conv1d_update.default, ssm.selective_state_update.default)


@register("tsp")
def tsp(program, ctx):
    """Rank ``ctx.options['rank']``'s TSP forward program (see the module docstring)."""
    options = ctx.options
    declare_group_size(options["group"], options["tsp"])  # fake shapes of collectives before the group exists
    rewriter = _Rewriter(program, options)
    min_chunk = _conv_width(program.graph)
    if program.mode == "prefill":
        _check_traced_chunk(program, rewriter.layout.chunks, min_chunk)
    rewriter.split_tokens()
    rewriter.offset_positions()
    rewriter.gather_weights()
    rewriter.sequence_ops()
    rewriter.gather_outputs()
    program.graph.eliminate_dead_code()
    rewriter.record_placements()
    outputs = ([SeqShard(1)] if rewriter.local_logits and program.mode == "forward"
               else [REPLICATE] * (1 + len(program.state_specs) if program.mode == "prefill" else 1))
    program.shard = {"rank": options["rank"], "tp": options["tsp"], "tsp": options["tsp"], "group": options["group"],
                     "training": rewriter.training, "policy": "tsp", "outputs": outputs,
                     "min_chunk": min_chunk, "order": rewriter.order}
    return program
