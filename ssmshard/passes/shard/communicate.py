"""The ``communicate`` pass: insert the collectives that placement changes demand, and name them.

Wherever an op needs an input in another placement than its producer gives
(``node.meta["input_placements"]``, from ``propagate``), the reduce policy lowers the change
to collectives (``policy.lower``; ``Collectives.standard`` is the table below). One
conversion is built per (producer, placement) and shared by every consumer that needs it.

=====================  ==========================================  ======================
from -> to             collective                                  backward
=====================  ==========================================  ======================
Partial -> Replicate   ``all_reduce``                              identity
Replicate -> R~        ``tp_copy`` (training only)                 all_reduce
Partial -> SeqShard    ``reduce_scatter`` along the sequence       all_gather
SeqShard -> Replicate  ``all_gather`` along the sequence           slice, or reduce_scatter for R~
Replicate -> SeqShard  ``split`` (this rank's chunk, no traffic)    all_gather
Shard -> Replicate     ``all_gather`` (program outputs: logits)    slice
=====================  ==========================================  ======================

Every forward collective is a **sync point**: a :class:`SyncPoint` on the node
(``node.meta["sync"]``) and in ``program.sync_points``, named stably after the op whose
output it reduces (``layers.<i>.<role>``: ``out_proj``, ``x_proj``, ``o_proj``,
``down_proj``, ``gate_norm``; ``embed``; ``lm_head`` for the logits), so later passes and
plans address them by name or glob.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch

from ...placement import REPLICATE, Partial, Replicate, SeqShard, Shard
from ...comm import declare_group_size
from ..manager import register
from .context import ShardOptions, fail, new_node, placement_of, tensor_inputs
from .policy import MegatronPolicy

ssm = torch.ops.ssmshard
PARTIAL_GRAD_REPLICATE = Replicate(partial_grad=True)


@dataclasses.dataclass
class SyncPoint:
    """One forward collective of a rank's program."""
    name: str  # stable: layers.<i>.<role>, embed, lm_head
    kind: str  # all_reduce | reduce_scatter | all_gather
    node: str  # the collective's node name
    layer: int | None
    block: str
    role: str
    dtype: str
    bytes_per_token: int | None  # payload per token of this rank's input (None: depends on a past length)
    action: str = "kept"  # kept | dropped | quantized (sync-point passes change it)


def token_symbols(program) -> set:
    """The symbols of the first user input's shape (``input_ids``: batch and sequence; decode:
    batch; packed: the packed length)."""
    first_user = next(i.name for i in program.inputs if i.kind == "user")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == first_user)
    return {sym for size in node.meta["val"].shape if isinstance(size, torch.SymInt)
            for sym in size.node.expr.free_symbols}


def bytes_per_token(val, tokens: set) -> int | None:
    """Bytes of ``val`` per token: its element count with the batch and sequence symbols set to
    one, times the element size; None when the count depends on another symbol (a past length).
    Not "the product of the static dims": a pass that fixes batch or sequence to the example
    sizes would make those look per-token."""
    def expr(size):
        return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)

    numel = sympy.Mul(*(expr(s) for s in val.shape)).subs({sym: 1 for sym in tokens})
    if numel.free_symbols or not numel.is_integer:
        return None
    return int(numel) * val.dtype.itemsize


class Collectives:
    """Builds collective nodes in one rank's graph (the ``comm`` argument of ``policy.lower``)."""

    def __init__(self, program, options: ShardOptions):
        self.program = program
        self.graph = program.graph
        self.group = options.group
        self.tp = options.tp
        self.training = options.training
        self.sync_points: list[SyncPoint] = []
        self._names: dict[str, int] = {}
        self._kinds = {i.name: i.kind for i in program.inputs}
        self._length = None
        self._tokens = token_symbols(program)

    # ------------------------------------------------------------- primitives
    def call(self, op, value, *extra, placement, consumer=None):
        """``op(value, *extra, group)`` inserted right after ``value``, placed ``placement``; tagged
        like ``value``, or like ``consumer`` where ``value`` is a placeholder (no tags)."""
        like = value if "ssmshard" in value.meta or consumer is None else consumer
        with self.graph.inserting_after(value):
            node = new_node(self.graph, op, (value, *extra, self.group), like)
        node.meta["placement"] = placement
        node.meta["input_placements"] = {value.name: placement_of(value)}
        return node

    def all_reduce(self, value):
        return self._sync(self.call(ssm.all_reduce.default, value, placement=REPLICATE), "all_reduce", value)

    def tp_copy(self, value, consumer=None):
        return self.call(ssm.tp_copy.default, value, placement=PARTIAL_GRAD_REPLICATE, consumer=consumer)

    def all_gather(self, value, dim, *, name_like=None):
        node = self.call(ssm.all_gather.default, value, dim, placement=REPLICATE)
        return self._sync(node, "all_gather", name_like or value)

    def reduce_scatter(self, value, dim):
        return self._sync(self.call(ssm.reduce_scatter.default, value, dim, placement=SeqShard(dim)),
                          "reduce_scatter", value)

    def gather(self, value, dim, consumer, *, partial_grad: bool, length=None):
        """All-gather a value cut by ``reduce_scatter``/``split`` back to ``length`` rows along
        ``dim`` (the padding dropped; default: the sequence length). ``partial_grad``: the result
        feeds sharded computation (backward reduce-scatters)."""
        op = ssm.all_gather_partial_grad.default if partial_grad else ssm.all_gather.default
        length = self.sequence_length() if length is None else length
        with self.graph.inserting_after(value):
            node = new_node(self.graph, op, (value, dim, self.group, length),
                            value if "ssmshard" in value.meta else consumer)
        node.meta["placement"] = PARTIAL_GRAD_REPLICATE if partial_grad else REPLICATE
        node.meta["input_placements"] = {value.name: placement_of(value)}
        return self._sync(node, "all_gather", consumer)

    def split(self, value, dim, consumer=None):
        """This rank's tokens of a replicated value (no traffic)."""
        return self.call(ssm.split.default, value, dim, placement=SeqShard(dim), consumer=consumer)

    def sequence_length(self):
        """A node holding the unsharded sequence length (dim 1 of the first user input)."""
        if self._length is None:
            placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
            ids = next(n for n in placeholders if self._kinds[n.name] == "user")
            with self.graph.inserting_after(placeholders[-1]):
                self._length = self.graph.call_function(torch.ops.aten.sym_size.int, (ids, 1))
            self._length.meta.update(val=ids.meta["val"].shape[1], placement=None,
                                     ssmshard={"module": "", "call_site": "", "layer": None, "block": "glue",
                                               "role": "body"})
        return self._length

    # ------------------------------------------------------------- the table
    def standard(self, value, have, want, consumer):
        if isinstance(have, Partial) and isinstance(want, Replicate):
            reduced = self.all_reduce(value)
            return self.tp_copy(reduced) if want.partial_grad else reduced
        if isinstance(have, Replicate) and want == PARTIAL_GRAD_REPLICATE:
            return self.tp_copy(value, consumer)
        if isinstance(have, Partial) and isinstance(want, SeqShard):
            return self.reduce_scatter(value, want.dim)
        if isinstance(have, SeqShard) and isinstance(want, Replicate):
            return self.gather(value, have.dim, consumer, partial_grad=want.partial_grad)
        if isinstance(have, Replicate) and isinstance(want, SeqShard):
            return self.split(value, want.dim, consumer)
        if isinstance(have, Shard) and isinstance(want, Replicate) and not want.partial_grad:
            seg = have.segments
            if len(seg) != 1 or seg[0].stride != 1 or seg[0].pieces != self.tp:
                fail(consumer, f"cannot all-gather a packed or partly replicated shard {have}")
            return self.all_gather(value, have.dim, name_like=consumer if consumer.op != "output" else None)
        fail(consumer, f"no collective turns {have} into {want} for input {value.name}")

    # ------------------------------------------------------------- sync points
    def _sync(self, node, kind, named_after):
        tags = named_after.meta.get("ssmshard", {})
        layer, role = tags.get("layer"), tags.get("role", "body")
        if named_after.op == "output" or tags.get("block") == "head":
            base = "lm_head"
        elif layer is None:
            base = role
        else:
            base = f"layers.{layer}.{role}"
        count = self._names.get(base, 0)
        self._names[base] = count + 1
        name = base if count == 0 else f"{base}#{count + 1}"
        val = node.args[0].meta["val"]
        point = SyncPoint(name=name, kind=kind, node=node.name, layer=layer, block=tags.get("block", "glue"),
                          role=role, dtype=str(val.dtype).replace("torch.", ""),
                          bytes_per_token=bytes_per_token(val, self._tokens))
        node.meta["sync"] = point
        # In the tags too, where views and reports read a node's facts generically.
        node.meta["ssmshard"].update(sync=kind, sync_point=name, bytes_per_token=point.bytes_per_token)
        self.sync_points.append(point)
        return node


def _same_placement(have, want) -> bool:
    return have == want or (isinstance(have, Replicate) and isinstance(want, Replicate)
                            and (have.partial_grad or not want.partial_grad))


@register("communicate")
def communicate(program, ctx):
    """Insert the collectives ``propagate`` recorded as needed (see the module docstring)."""
    options = ShardOptions.of(ctx.options)
    declare_group_size(options.group, options.tp)  # fake shapes of collectives before the group exists
    policy = options.policy or MegatronPolicy()
    comm = Collectives(program, options)
    converted: dict = {}  # (producer, placement) -> node holding the producer in that placement
    for node in list(program.graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        wanted = node.meta.get("input_placements", {})
        for arg in tensor_inputs(node):
            want = wanted.get(arg.name)
            have = placement_of(arg)
            if want is None or _same_placement(have, want):
                continue
            key = (arg, want)
            if key not in converted:
                converted[key] = policy.lower(comm, arg, have, want, node)
            node.replace_input_with(arg, converted[key])
            wanted[converted[key].name] = wanted.pop(arg.name)
    program.sync_points = comm.sync_points
    program.collectives = [dataclasses.asdict(p) | {"id": i, "op": p.kind} for i, p in enumerate(comm.sync_points)]
    for node in program.graph.nodes:  # what the stateful programs' states are handed back as
        if node.op == "output":
            values = node.args[0]
            flat = list(values) if isinstance(values, (tuple, list)) else [values]
            program.shard["outputs"] = [placement_of(v) if isinstance(v, torch.fx.Node) else REPLICATE
                                        for v in flat]
    return program

