"""What the three sharding passes share: the options of one rank, and the placement records.

Records on the graph (they stay there after the pipeline, for later passes and reports):

* ``node.meta["placement"]``: the placement of the value a node produces (a tuple for ops
  with several outputs, ``None`` for non-tensors such as sizes).
* ``node.meta["input_placements"]``: ``{input node name: placement}`` for every tensor input,
  as the op needs it. Where it differs from the producer's placement, ``communicate`` inserts
  the collective that converts one into the other.
* ``node.meta["localize"]``: a function ``(LocalizeContext, node) -> None`` a rule left for
  ``localize`` (local sizes, rank-dependent constants).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from ...placement import Partial, Placement, Replicate, Shard, SeqShard
from ...program import source_line
from ..fake_values import ALIKE_VALUES, alike_key, fake_execution, free_symbols, leaves


class ShardingError(RuntimeError):
    """No rule can shard this op with these placements; names the op and the source line."""


@dataclasses.dataclass
class ShardOptions:
    """One rank's sharding options (``ctx.options`` of the passes; see ``Plan.pipeline``)."""
    placements: dict[str, Placement]  # weight FQN -> placement (``Plan.layout``)
    rank: int
    tp: int
    group: str = "tp"  # name of the collective group (``collectives.register_group``)
    training: bool = True  # insert the backward all-reduces
    # Placements of user inputs by flat position (decode's state inputs arrive sharded).
    input_placements: dict[int, Placement] = dataclasses.field(default_factory=dict)
    policy: Any = None  # a ReducePolicy; None: Megatron's (policy.MegatronPolicy)

    @classmethod
    def of(cls, options: dict) -> "ShardOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - known - {"kernels"}
        if unknown:
            raise TypeError(f"unknown sharding options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: v for k, v in options.items() if k in known})


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def hint(size) -> int:
    """A concrete number for a (possibly symbolic) size: its example value."""
    return size if isinstance(size, int) else size.node.hint


def value_of(node):
    """``node``'s fake value (``meta["val"]``); None for a non-node argument or a node without one."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def calls(node, target) -> bool:
    """Whether ``node`` is a graph node calling ``target``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def node_order(graph) -> dict:
    """Each node's position in ``graph``, for "does this come before that" questions."""
    return {node: i for i, node in enumerate(graph.nodes)}


# Reading a tensor's shape does not read its data.
_SHAPE_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                  torch.ops.aten.sym_storage_offset.default}


def data_readers(node) -> list:
    """The nodes reading ``node``'s data (its users but those asking only for its shape)."""
    return [u for u in node.users if u.target not in _SHAPE_QUERIES]


def writes_first_argument(node) -> bool:
    """Whether ``node`` is an in-place op mutating (and returning) its first argument."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments or not schema.returns:
        return False
    first, result = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and result is not None and result.is_write


def clone_under_writes(value):
    """``(clone, writes)`` if ``value`` is a ``clone`` node after the in-place ``writes`` (newest
    first), else None."""
    writes = []
    while isinstance(value, torch.fx.Node) and writes_first_argument(value):
        writes.append(value)
        value = value.args[0]
    if isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is torch.ops.aten.clone.default:
        return value, writes
    return None


def returns_view(node) -> bool:
    """Whether ``node``'s output may share its first argument's memory without writing it (a view,
    or a cast that may return its input): what its op's schema declares."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return (returned is not None and first is not None and not returned.is_write
            and bool(set(returned.before_set) & set(first.before_set)))


def aliases(node, follows=returns_view) -> list:
    """``node`` and the nodes that share its memory, transitively: users taking it as their first
    argument for which ``follows(user)`` holds (by default every view the schemas declare)."""
    found, frontier = [node], [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user not in found and user.args and user.args[0] is current and follows(user):
                found.append(user)
                frontier.append(user)
    return found


# scaled_dot_product_attention's positional parameters (scale and enable_gqa are keyword-only).
SDPA_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_arguments(node) -> dict:
    """A ``scaled_dot_product_attention`` node's arguments by name, however they were passed
    (those left at their defaults are absent)."""
    return {**dict(zip(SDPA_POSITIONAL, node.args)), **node.kwargs}


# Ops whose output is always a view of their first argument (no cast or reshape that may copy),
# and the splits whose getitems are views of theirs.
VIEW_OPS = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.view.default,
            torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
            torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.alias.default}
SPLIT_OPS = {torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor, torch.ops.aten.chunk.default}


def view_source(node):
    """The node whose memory ``node`` views (through a split's getitem too), or None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        split = node.args[0]
        return split.args[0] if isinstance(split, torch.fx.Node) and split.target in SPLIT_OPS else None
    return node.args[0] if node.target in VIEW_OPS and isinstance(node.args[0], torch.fx.Node) else None


def single_user(node):
    """The one node reading ``node``; None when it is not a node or has no or several readers."""
    return next(iter(node.users)) if isinstance(node, torch.fx.Node) and len(node.users) == 1 else None


def is_tensor(node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def tensor_inputs(node) -> list:
    return [a for a in node.all_input_nodes if is_tensor(a)]


def placement_of(node):
    """The placement recorded on ``node`` (a Node); Replicate where none was recorded."""
    return node.meta.get("placement", Replicate()) if isinstance(node, torch.fx.Node) else Replicate()


def fail(node, why: str):
    shown = ", ".join(f"{a.name}={placement_of(a)}" for a in node.all_input_nodes)
    raise ShardingError(f"no sharding rule for {node.target} at {node.name} ({why}); inputs: {shown}; "
                        f"source: {source_line(node)}")


def new_node(graph, target, args, like, *, kwargs=None, val=None):
    """A call to ``target`` carrying ``like``'s tags, its fake value computed from its inputs'
    (or ``val``; ``like``'s when the op cannot run on fake inputs, e.g. a collective whose
    group is not registered yet)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    node.meta["ssmshard"] = dict(like.meta.get("ssmshard", {}))
    if val is None:
        val = _fake_value(node)
    if val is not None:
        node.meta["val"] = val
    elif "val" in like.meta:
        node.meta["val"] = like.meta["val"]
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def _fake_value(node):
    def value(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a
    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    # A pass rewrites every layer alike: nodes with the op and arguments of an earlier one (tensors
    # by metadata, fake_values.alike_key) take its value instead of running the op on fake inputs
    # again (0.84 s for 897 nodes of a 64-layer Llama's programs on a CPU).
    flat = leaves((args, kwargs), {})
    key = alike_key((node.target, flat))
    cache = node.graph.__dict__.setdefault(ALIKE_VALUES, {})
    if key is not None and key in cache:
        return cache[key]
    try:
        with fake_execution():
            val = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the verifier re-propagates every value after the pass
        return None
    if key is not None and free_symbols(val) <= free_symbols(flat):
        cache[key] = val
    return val


def is_sharded(placement) -> bool:
    return isinstance(placement, (Shard, SeqShard))


def is_partial(placement) -> bool:
    return isinstance(placement, Partial)


# ------------------------------------------------------------------ local rewrites (localize)
def leave_for_localize(node, edit) -> None:
    """Record ``edit(lcx, node)`` for the ``localize`` pass (several edits run in order)."""
    node.meta.setdefault("localize", []).append(edit)


def local_size_edit(arg_index: int, dim: int, local: int):
    """An edit setting entry ``dim`` of the size list at ``node.args[arg_index]`` to ``local``."""
    def edit(lcx, node):
        sizes = list(node.args[arg_index])
        if isinstance(sizes[dim], int) and sizes[dim] != -1:
            sizes[dim] = local
            node.args = (*node.args[:arg_index], sizes, *node.args[arg_index + 1:])
    return edit


def bound_args(node) -> dict:
    """``{argument name: value}`` of a call to an op overload, defaults filled in (by schema)."""
    values = {}
    for index, arg in enumerate(node.target._schema.arguments):
        if index < len(node.args):
            values[arg.name] = node.args[index]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        else:
            values[arg.name] = arg.default_value if arg.has_default_value() else None
    return values
