"""The ``shard`` pass: rewrite a captured program into one tensor-parallel rank's program.

Inputs (``ctx.options``): ``placements`` (weight FQN -> placement, from ``Plan.layout``),
``rank``, ``tp``, ``group`` (the collective group's name) and ``training`` (insert the
backward all-reduces).

Walking the graph in order, every value gets a placement (``placement.py``) from the rule of
the op that produces it. The rules also rewrite what the local graph needs: size constants in
view/reshape/expand/split become local sizes, a rank-dependent lookup replaces a
vocab-parallel embedding, and collectives are inserted where placements demand them:

* a ``Partial`` value read by anything but a linear op  -> ``all_reduce`` (then Replicate);
* a ``Replicate`` activation entering a sharded op       -> ``tp_copy`` (all-reduce in backward);
* a sharded program output                              -> ``all_gather``.

A sharded value reaching an op without a rule is an error naming the op and the source line:
never a silent fallback to replication.
"""

from __future__ import annotations

import math
import operator

import torch
from torch._guards import detect_fake_mode

from ..placement import (PARTIAL, REPLICATE, Partial, Replicate, Segment, Shard, local_shape, normalize,
                         same_data)
from ..ops import cu_seqlens_arg
from ..program import source_line
from .manager import register

aten = torch.ops.aten
ssm = torch.ops.ssmshard


class ShardingError(RuntimeError):
    """No rule can shard this op with these placements; names the op and the source line."""


def _shape(node):
    return tuple(node.meta["val"].shape)


def _hint(size) -> int:
    """A concrete number for a (possibly symbolic) size: its example value."""
    return size if isinstance(size, int) else size.node.hint


# Ops that act element by element: the output has the placement of its (broadcast) inputs.
UNARY = {aten.neg.default, aten.exp.default, aten.rsqrt.default, aten.silu.default, aten.gelu.default,
         aten.pow.Tensor_Scalar, aten.softplus.default, aten.clone.default, aten.contiguous.default,
         aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default, aten.sigmoid.default,
         aten.tanh.default, aten.relu.default, aten.sqrt.default, aten.reciprocal.default,
         aten.type_as.default,  # type_as(x, other): x's values, other's dtype
         aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default}
# Fresh tensors from a size list (index of the size argument): the same on every rank, so one
# can take any placement by allocating the local size (HF's state caches allocate these).
FACTORIES = {aten.zeros.default: 0, aten.empty.memory_format: 0, aten.ones.default: 0, aten.full.default: 0,
             aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.new_ones.default: 1,
             aten.new_full.default: 1}
BINARY = {aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor}
class _Sharder:
    def __init__(self, program, options):
        self.program = program
        self.graph = program.graph
        self.rank = options["rank"]
        self.tp = options["tp"]
        self.group = options.get("group", "tp")
        self.training = options.get("training", True)
        self.weights = options["placements"]
        # Placements of user inputs by position (decode's state inputs arrive sharded).
        self.input_placements = options.get("input_placements", {})
        self.output_placements: list = []
        self.place: dict = {}
        self.reduced: dict = {}  # Partial producer -> its all_reduce node
        self.copied: dict = {}  # Replicate activation -> its tp_copy node
        self.weight_nodes: set = set()

    # ------------------------------------------------------------------ helpers
    def fail(self, node, why: str):
        shown = ", ".join(f"{a.name}={self.place.get(a)}" for a in node.all_input_nodes)
        raise ShardingError(f"no sharding rule for {node.target} at {node.name} ({why}); inputs: {shown}; "
                            f"source: {source_line(node)}")

    def _new(self, target, args, like, tags_from=None, val=None):
        node = self.graph.call_function(target, args)
        node.meta["ssmshard"] = dict((tags_from or like).meta.get("ssmshard", {}))
        if val is not None:
            node.meta["val"] = val
        elif "val" in like.meta:
            node.meta["val"] = like.meta["val"]
        return node

    def all_reduce(self, node):
        """Replicate a Partial value (once per producer)."""
        if node not in self.reduced:
            with self.graph.inserting_after(node):
                reduced = self._new(ssm.all_reduce.default, (node, self.group), node)
            reduced.meta["ssmshard"]["sync"] = "all_reduce"
            self.reduced[node] = reduced
            self.place[reduced] = REPLICATE
        return self.reduced[node]

    def tp_copy(self, node):
        if node not in self.copied:
            with self.graph.inserting_after(node):
                copied = self._new(ssm.tp_copy.default, (node, self.group), node)
            self.copied[node] = copied
            self.place[copied] = REPLICATE
        return self.copied[node]

    # ------------------------------------------------------------------ driver
    def run(self):
        inputs = {i.name: i for i in self.program.inputs}
        user_index = 0
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                spec = inputs[node.name]
                if spec.kind == "user":
                    placement = self.input_placements.get(user_index, REPLICATE)
                    self._localize_range(user_index, placement)
                    user_index += 1
                else:
                    placement = self.weights.get(spec.target, REPLICATE)
                    self.weight_nodes.add(node)
                    self.program.param_specs[spec.target].placement = placement
                self.place[node] = placement
                if isinstance(placement, Shard):
                    _make_local(node, placement)
                continue
            if node.op == "output":
                self.finish_outputs(node)
                continue
            if node.op != "call_function":
                continue
            self.visit(node)

    def _localize_range(self, user_index, placement):
        """A sharded user input (decode's state inputs) arrives with its local size: the range
        the program admits must say so, or every call would miss the shape-bucket cache and
        capture a new sibling (each decode step, at tp > 1)."""
        key = (user_index, getattr(placement, "dim", None))
        if isinstance(placement, Shard) and self.program.ranges.get(key) == (placement.global_size,) * 2:
            self.program.ranges[key] = (placement.local_size,) * 2

    def visit(self, node):
        if node.target is aten._assert_tensor_metadata.default:
            self.graph.erase_node(node)  # asserts global sizes; the local graph has local ones
            return
        if node.target is operator.getitem:
            source = self.place.get(node.args[0])
            self.place[node] = source[node.args[1]] if isinstance(source, tuple) else source
            return
        tensor_inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        placements = [self.place.get(a, REPLICATE) for a in tensor_inputs]
        if all(isinstance(p, Replicate) for p in placements):
            flavour = Replicate(partial_grad=any(p.partial_grad for p in placements))
            self.place[node] = self._replicated_output(node, flavour)
            self._copy_replicated_activations(node, flavour)
            return
        # Partial inputs are summed first unless the op is linear in them.
        if any(isinstance(p, Partial) for p in placements) and not self._partial_ok(node):
            for a, p in zip(tensor_inputs, placements):
                if isinstance(p, Partial):
                    node.replace_input_with(a, self.all_reduce(a))
            if all(not isinstance(self.place.get(a, REPLICATE), (Shard, Partial)) for a in node.all_input_nodes):
                self.place[node] = self._replicated_output(node)
                return
        rule = RULES.get(node.target)
        if node.target in UNARY:
            rule = _rule_unary
        elif node.target in BINARY:
            rule = _rule_binary
        if rule is None:
            self.fail(node, "op has no rule")
        out = rule(self, node)
        self.place[node] = out
        self._copy_replicated_activations(node, out)

    def _replicated_output(self, node, flavour=REPLICATE):
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return tuple(flavour for _ in val)
        return flavour

    def _partial_ok(self, node):
        # Partial sums are reduced at their first consumer, once per producer (Megatron's
        # placement). Only an add of two partial sums stays partial. Letting them flow further
        # (through casts, scalings) would make every later consumer that needs the full value
        # reduce its own copy.
        return node.target is aten.add.Tensor and all(isinstance(self.place.get(a), Partial)
                                                      for a in node.all_input_nodes)

    def _copy_replicated_activations(self, node, out):
        """Megatron's "f": a replicated activation feeding a sharded op gets a backward all-reduce."""
        if not self.training:
            return
        outs = out if isinstance(out, tuple) else (out,)
        if all(o == REPLICATE for o in outs):
            return
        for arg in list(node.all_input_nodes):
            val = arg.meta.get("val")
            if (arg in self.weight_nodes or self.place.get(arg) != REPLICATE
                    or not isinstance(val, torch.Tensor) or not val.is_floating_point()
                    or arg.target is ssm.tp_copy.default):
                continue
            node.replace_input_with(arg, self.tp_copy(arg))

    def finish_outputs(self, output):
        values = output.args[0]
        flat = list(values) if isinstance(values, (tuple, list)) else [values]
        new = []
        for value in flat:
            placement = self.place.get(value, REPLICATE) if isinstance(value, torch.fx.Node) else REPLICATE
            if isinstance(placement, Partial):
                value = self.all_reduce(value)
            elif isinstance(placement, Shard):
                if self.program.mode == "forward" or value is flat[0]:  # logits
                    value = self.gather(value, placement)
                else:
                    pass  # states stay sharded: each rank keeps its own channels/heads
            new.append(value)
            self.output_placements.append(self.place.get(value, REPLICATE) if isinstance(value, torch.fx.Node)
                                          else REPLICATE)
        output.args = (type(values)(new) if isinstance(values, (tuple, list)) else new[0],)

    def gather(self, node, placement):
        if len(placement.segments) != 1 or placement.segments[0].stride != 1 or placement.segments[0].pieces != self.tp:
            self.fail(node, f"cannot all-gather a packed/replicated shard {placement}")
        with self.graph.inserting_after(node):
            gathered = self._new(ssm.all_gather.default, (node, placement.dim, self.group), node)
        gathered.meta["ssmshard"]["sync"] = "all_gather"
        self.place[gathered] = REPLICATE
        return gathered


def _make_local(node, placement):
    """Give a sharded placeholder its local shape (the graph's fake value)."""
    val = node.meta["val"]
    with detect_fake_mode([val]):
        local = torch.empty(local_shape(val.shape, placement), dtype=val.dtype, device=val.device)
    # Keep requires_grad: at::matmul folds a 3-D input into one mm only for weights that need
    # grad like the parameter did, and its other path cannot run on symbolic sizes (CUDA).
    node.meta["val"] = local.requires_grad_(val.requires_grad) if val.is_floating_point() else local


# ---------------------------------------------------------------------- rules
def _rule_unary(s: _Sharder, node):
    return s.place[node.args[0]]


def _rule_binary(s: _Sharder, node):
    """Broadcast rule: sharded operands agree; replicated ones must broadcast (size 1) there."""
    out_ndim = len(_shape(node))
    sharded, partial = None, False
    operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    for a in operands:
        p = s.place.get(a, REPLICATE)
        if isinstance(p, Partial):
            partial = True
        elif isinstance(p, Shard):
            candidate = Shard(p.dim + out_ndim - len(_shape(a)), p.segments)
            if sharded is not None and sharded != candidate:
                s.fail(node, f"operands sharded differently: {sharded} vs {candidate}")
            sharded = candidate
    if partial:
        if sharded is not None:
            s.fail(node, "mixes Partial and Shard")
        return PARTIAL
    for a in operands:
        p = s.place.get(a, REPLICATE)
        if isinstance(p, Replicate):
            shape = _shape(a)
            k = sharded.dim - (out_ndim - len(shape))
            if 0 <= k < len(shape) and _hint(shape[k]) != 1:
                s.fail(node, f"replicated operand {a.name} is not broadcast along sharded dim {sharded.dim}")
    return sharded


def _rule_linear(s: _Sharder, node):
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    px, pw = s.place.get(x, REPLICATE), s.place.get(w, REPLICATE)
    out_ndim = len(_shape(node))
    if isinstance(pw, Shard) and pw.dim == 0 and isinstance(px, Replicate):  # column-parallel
        if bias is not None and not same_data(s.place.get(bias), Shard(0, pw.segments)):
            s.fail(node, "column-parallel bias must be split like the weight rows")
        return normalize(Shard(out_ndim - 1, pw.segments))
    if isinstance(pw, Shard) and pw.dim == 1 and isinstance(px, Shard) and px.dim == out_ndim - 1 \
            and px.segments == pw.segments:  # row-parallel: partial sums
        if bias is not None:
            # The bias is added once, after the sum: y = all_reduce(x W^T) + b.
            node.args = (x, w)
            users = list(node.users)
            reduced = s.all_reduce(node)
            with s.graph.inserting_after(reduced):
                added = s._new(aten.add.Tensor, (reduced, bias), node)
            s.place[added] = REPLICATE
            for user in users:
                user.replace_input_with(node, added)
        return PARTIAL
    if isinstance(pw, Replicate) and isinstance(px, Shard) and px.dim != out_ndim - 1:
        return px  # a replicated weight acting on an unsharded feature dim
    s.fail(node, f"linear with input {px} and weight {pw}")


def _rule_matmul(s: _Sharder, node):
    a, b = node.args
    pa, pb = s.place.get(a, REPLICATE), s.place.get(b, REPLICATE)
    na, nb, out_ndim = len(_shape(a)), len(_shape(b)), len(_shape(node))
    if isinstance(pa, Shard) and pa.dim == na - 2 and isinstance(pb, Replicate):
        return Shard(out_ndim - 2, pa.segments)  # rows of the left factor: dt_proj.weight @ x
    if isinstance(pb, Shard) and pb.dim == nb - 1 and isinstance(pa, Replicate):
        return Shard(out_ndim - 1, pb.segments)
    if isinstance(pa, Shard) and isinstance(pb, Shard) and pa.dim == na - 1 and pb.dim == nb - 2 \
            and pa.segments == pb.segments:
        return PARTIAL
    s.fail(node, f"matmul of {pa} and {pb}")


def _rule_embedding(s: _Sharder, node):
    weight, ids = node.args[0], node.args[1]
    pw = s.place[weight]
    if not (isinstance(pw, Shard) and pw.dim == 0 and len(pw.segments) == 1 and pw.segments[0].stride == 1):
        s.fail(node, f"embedding with weight {pw}")
    seg = pw.segments[0]
    start, rows = seg.offset(s.rank), seg.local
    # Vocab-parallel lookup: ids outside this rank's rows read row 0 and are zeroed; the
    # all-reduce of the partial results restores every row.
    g = s.graph
    with g.inserting_before(node):
        local = s._new(aten.sub.Tensor, (ids, start), node, val=ids.meta["val"])
        below = s._new(aten.lt.Scalar, (local, 0), node, val=ids.meta["val"].bool())
        above = s._new(aten.ge.Scalar, (local, rows), node, val=ids.meta["val"].bool())
        outside = s._new(aten.logical_or.default, (below, above), node, val=ids.meta["val"].bool())
        safe = s._new(aten.masked_fill.Scalar, (local, outside, 0), node, val=ids.meta["val"])
    # padding_idx names a global row: it is this rank's local row (index - start) or none (-1).
    # Left global, rank r would drop the gradient of global row start_r + padding_idx.
    rest = list(node.args[2:])
    padding_idx = rest[0] if rest else -1
    if padding_idx >= 0:
        rest[0] = padding_idx - start if 0 <= padding_idx - start < rows else -1
    node.args = (weight, safe, *rest)
    users = list(node.users)
    with g.inserting_after(node):
        keep = s._new(aten.unsqueeze.default, (outside, -1), node)
    with g.inserting_after(keep):
        zeroed = s._new(aten.masked_fill.Scalar, (node, keep, 0.0), node)
    for user in users:
        user.replace_input_with(node, zeroed)
    for n in (local, below, above, outside, safe, keep):
        s.place[n] = REPLICATE
    s.place[zeroed] = PARTIAL
    return PARTIAL


def _rule_transpose(s: _Sharder, node):
    p = s.place[node.args[0]]
    if isinstance(p, Partial):
        return p
    nd = len(_shape(node))
    d0, d1 = node.args[1] % nd, node.args[2] % nd
    return p.with_dim({d0: d1, d1: d0}.get(p.dim, p.dim))


def _rule_unsqueeze(s: _Sharder, node):
    p = s.place[node.args[0]]
    if isinstance(p, Partial):
        return p
    d = node.args[1] % len(_shape(node))
    return p.with_dim(p.dim + 1 if d <= p.dim else p.dim)


def _rule_squeeze(s: _Sharder, node):
    p = s.place[node.args[0]]
    if isinstance(p, Partial):
        return p
    in_shape = _shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [i for i, n in enumerate(in_shape) if _hint(n) == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [d % len(in_shape) for d in dims if _hint(in_shape[d % len(in_shape)]) == 1]
    if p.dim in dims:
        s.fail(node, "squeezes the sharded dim")
    return p.with_dim(p.dim - sum(1 for d in dims if d < p.dim))


def _rule_slice_select(s: _Sharder, node):
    p = s.place[node.args[0]]
    d = node.args[1] % len(_shape(node.args[0]))
    if d == p.dim:
        full = node.target is aten.slice.Tensor and node.args[2:4] in ((0, None), (None, None)) \
            or (node.target is aten.slice.Tensor and len(node.args) >= 4 and node.args[2] == 0
                and _hint(node.args[3]) >= p.global_size)
        if full:
            if len(node.args) >= 4:
                node.args = (*node.args[:3], p.local_size, *node.args[4:])
            return p
        s.fail(node, "slices the sharded dim")
    if node.target is aten.select.int:
        return p.with_dim(p.dim - 1 if d < p.dim else p.dim)
    return p


def _split_segments(s, node, p, sizes):
    """Give each split piece the segments it covers; split sizes become local sizes."""
    pieces, local_sizes, i = [], [], 0
    segs = list(p.segments)
    for size in sizes:
        taken, total = [], 0
        while total < size and i < len(segs):
            taken.append(segs[i])
            total += segs[i].size
            i += 1
        if total != size:
            s.fail(node, f"split size {size} cuts through a packed segment of {p}")
        # A piece every rank holds whole (Mamba-2's B and C with one group) becomes R~.
        pieces.append(normalize(Shard(p.dim, tuple(taken))))
        local_sizes.append(sum(t.local for t in taken))
    return tuple(pieces), local_sizes


def _rule_split(s: _Sharder, node):
    x = node.args[0]
    p = s.place[x]
    nd = len(_shape(x))
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    if node.target is aten.chunk.default:
        count = node.args[1]
        if dim != p.dim:
            return tuple(p for _ in range(count))
        size = p.global_size // count
        pieces, local = _split_segments(s, node, p, [size] * count)
        if len(set(local)) != 1:
            s.fail(node, "chunks of unequal local size")
        return pieces
    sizes = list(node.args[1])
    if dim != p.dim:
        return tuple(p for _ in sizes)
    pieces, local = _split_segments(s, node, p, sizes)
    node.args = (x, local, *node.args[2:])
    return pieces


def _view_groups(in_shape, out_shape):
    """Pairs (input dims, output dims) whose sizes multiply to the same (on example sizes)."""
    ins, outs = [_hint(x) for x in in_shape], [_hint(x) for x in out_shape]
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj = [], []
        pi = pj = 1
        if i < len(ins):
            gi.append(i); pi *= ins[i]; i += 1
        if j < len(outs):
            gj.append(j); pj *= outs[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(ins):
                gi.append(i); pi *= ins[i]; i += 1
            elif j < len(outs):
                gj.append(j); pj *= outs[j]; j += 1
            else:
                break
        # trailing size-1 dims join the current group
        while i < len(ins) and ins[i] == 1 and (j >= len(outs) or outs[j] != 1):
            gi.append(i); i += 1
        while j < len(outs) and outs[j] == 1 and (i >= len(ins) or ins[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


def _rule_view(s: _Sharder, node):
    x = node.args[0]
    p = s.place[x]
    in_shape, out_shape = _shape(x), _shape(node)
    if isinstance(p, Partial):
        return p
    for gi, gj in _view_groups(in_shape, out_shape):
        if p.dim not in gi:
            continue
        if len(gi) == 1 and len(gj) == 1:
            return p.with_dim(gj[0])
        placement = _reshape_cut(s, node, p, [_hint(in_shape[d]) for d in gi], gi.index(p.dim),
                                 [_hint(out_shape[d]) for d in gj])
        target = gj[placement.dim]
        _rewrite_size(s, node, target, placement.local_size)
        return placement.with_dim(target)
    return p


def _reshape_cut(s, node, p, in_sizes, position, out_sizes) -> Shard:
    """Where the cut of ``p`` lands when dims ``in_sizes`` (the sharded one at ``position``) are
    reshaped into ``out_sizes``; the result's ``dim`` indexes ``out_sizes``.

    The flattened group is ``outer`` repeats of the sharded dim's segments, each scaled by the
    dims inside it. An output dim can carry that cut when the dims before it count whole
    repeats of a segment pattern and the dims after it divide every segment and every rank's
    chunk: a split of Zamba's interleaved in_proj rows (d_inner * 2 -> d_inner, 2) keeps the
    cut on d_inner, and (heads * head_dim -> heads, head_dim) with one segment per head moves
    it to head_dim. Anything else would interleave ranks' data and fails.
    """
    outer = math.prod(in_sizes[:position])
    inner = math.prod(in_sizes[position + 1:])
    if outer > 1 and len(p.segments) * outer > 4096:
        s.fail(node, f"view merges {outer} unsharded outer elements into the sharded dim of {p}")
    flat = [seg.scaled(inner) for seg in p.segments] * outer
    before = 1
    for t, size in enumerate(out_sizes):
        after = math.prod(out_sizes[t + 1:])
        if len(flat) % before == 0:
            pattern = flat[:len(flat) // before]
            repeats = pattern * before == flat
            fits = all(seg.size % after == 0 and seg.local % after == 0 for seg in pattern)
            if repeats and fits and sum(seg.size for seg in pattern) == size * after:
                return Shard(t, tuple(Segment(seg.size // after, seg.pieces, seg.stride) for seg in pattern))
        before *= size
    s.fail(node, f"view cannot keep the cut of {p} when reshaping {in_sizes} into {out_sizes}")


def _rewrite_size(s, node, dim, local):
    sizes = list(node.args[1])
    if isinstance(sizes[dim], int) and sizes[dim] != -1:
        sizes[dim] = local
        node.args = (node.args[0], sizes, *node.args[2:])
    elif isinstance(sizes[dim], torch.fx.Node):
        s.fail(node, "symbolic size on the sharded dim")


def _rule_expand(s: _Sharder, node):
    p = s.place[node.args[0]]
    if isinstance(p, Partial):
        s.fail(node, "expand of a Partial value")
    offset = len(_shape(node)) - len(_shape(node.args[0]))
    out = p.with_dim(p.dim + offset)
    _rewrite_size(s, node, out.dim, p.local_size)
    return out


def _rule_cat(s: _Sharder, node):
    # torch.cat skips 1-D empty tensors (an HF cache's "no keys yet" placeholder): so do we.
    tensors = [t for t in node.args[0] if _shape(t) != (0,)]
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))
    p = _common_placement(s, node, tensors)
    if isinstance(p, Shard) and p.dim == dim:
        # Zamba's per-head scan outputs, concatenated by head: each input's segments in order.
        return Shard(dim, p.segments * len(tensors))
    return p


def _common_placement(s, node, tensors):
    """The one placement every input of a cat/stack has (anything else would mix ranks' data)."""
    placements = {s.place.get(t, REPLICATE) for t in tensors}
    if len(placements) != 1:
        s.fail(node, f"joins differently placed tensors {placements}")
    return next(iter(placements))


def _rule_stack(s: _Sharder, node):
    """Stacking equally placed tensors (Zamba's per-head states) adds an unsharded dim."""
    p = _common_placement(s, node, node.args[0])
    if not isinstance(p, Shard):
        return p
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))
    return p.with_dim(p.dim + 1 if dim <= p.dim else p.dim)


def _rule_reduce(s: _Sharder, node):
    """mean/sum over dims: over the sharded dim the local result is a partial sum."""
    x = node.args[0]
    p = s.place[x]
    nd = len(_shape(x))
    dims = node.args[1] if len(node.args) > 1 else list(range(nd))
    dims = [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if p.dim in dims:
        s.fail(node, "reduces over the sharded dim")  # gated norms are one op; nothing else does this
    return p if keepdim else p.with_dim(p.dim - sum(1 for d in dims if d < p.dim))


def _rule_sdpa(s: _Sharder, node):
    q, k, v = node.args[:3]
    pq, pk, pv = (s.place.get(t, REPLICATE) for t in (q, k, v))
    if not (isinstance(pq, Shard) and pq.dim == 1):
        s.fail(node, "queries must be split by heads")
    heads = pq.segments[0]
    if pk != pv:
        s.fail(node, "keys and values placed differently")
    kv = pk.segments[0] if isinstance(pk, Shard) else Segment(_hint(_shape(k)[1]), 1, s.tp)
    # Query head i reads key/value head i // (heads / kv_heads): this rank's query heads must
    # read exactly the key/value heads it holds.
    group = heads.size // kv.size
    first_kv = heads.offset(s.rank) // group
    if kv.offset(s.rank) != first_kv or heads.local // group not in (kv.local, 0) and kv.local != 1:
        s.fail(node, f"key/value heads {pk} do not serve query heads {pq} on rank {s.rank}")
    if not node.kwargs.get("enable_gqa") and heads.local != kv.local:
        node.kwargs = {**node.kwargs, "enable_gqa": True}
    return pq


def _same(s, node, expected, *args):
    """Every arg holds the same data per rank as ``expected`` (whole-on-every-rank counts as replicated)."""
    for a in args:
        if a is not None and not same_data(s.place.get(a, REPLICATE), expected):
            s.fail(node, f"{a.name} is {s.place.get(a, REPLICATE)}, expected {expected}")


def _rule_conv(s: _Sharder, node):
    x, weight, bias = node.args[:3]
    p = s.place[x]
    if not (isinstance(p, Shard) and p.dim == 1):
        s.fail(node, "conv channels must be dim 1")
    _same(s, node, Shard(0, p.segments), weight, bias)
    _same(s, node, REPLICATE, cu_seqlens_arg(node))  # every rank sees every token: same boundaries
    return p


def _rule_conv_update(s: _Sharder, node):
    x, state, weight, bias = node.args[:4]
    p = s.place[x]
    _same(s, node, p, state)
    _same(s, node, Shard(0, p.segments), weight, bias)
    return (p, p)


def _rule_selective_scan(s: _Sharder, node):
    u, delta, A, B, C, D, z, delta_bias = node.args[:8]
    initial = node.args[9] if len(node.args) > 9 else None
    p = s.place[u]
    if not (isinstance(p, Shard) and p.dim == 1):
        s.fail(node, "scan channels must be dim 1 of u")
    _same(s, node, p, delta, z)
    _same(s, node, Shard(0, p.segments), A, D, delta_bias)
    _same(s, node, REPLICATE, B, C)  # dt, B, C are replicated after x_proj's all-reduce
    _same(s, node, p, initial)
    _same(s, node, REPLICATE, cu_seqlens_arg(node))
    return (p, p)


def _group_placement(heads: Segment, groups: int, dim: int, tp: int):
    if groups % tp == 0:
        return Shard(dim, (Segment(groups, tp, 1),))
    return Shard(dim, (Segment(groups, groups, tp // groups),))


def _rule_ssd_scan(s: _Sharder, node):
    x, dt, A, B, C, chunk, D, dt_bias = node.args[:8]
    initial = node.args[8] if len(node.args) > 8 else None
    p = s.place[x]
    if not (isinstance(p, Shard) and p.dim == 2 and len(p.segments) == 1):
        s.fail(node, "SSD heads must be dim 2 of x")
    heads = p.segments[0]
    _same(s, node, p, dt)
    _same(s, node, Shard(0, p.segments), A, D if D is not None and len(_shape(D)) == 1 else None, dt_bias)
    groups = _hint(_shape(B)[2])
    _same(s, node, _group_placement(heads, groups, 2, s.tp), B, C)
    _same(s, node, Shard(1, p.segments), initial)
    _same(s, node, REPLICATE, cu_seqlens_arg(node))
    return (p, Shard(1, p.segments))


def _rule_state_update(s: _Sharder, node):
    state, x, dt, A, B, C, D, z, dt_bias = node.args[:9]
    p = s.place[x]
    if not (isinstance(p, Shard) and p.dim == 1):
        s.fail(node, "state update channels/heads must be dim 1")
    _same(s, node, p, dt, z, state)
    _same(s, node, Shard(0, p.segments), A, D, dt_bias)
    if len(_shape(x)) == 2:
        _same(s, node, REPLICATE, B, C)
    else:
        _same(s, node, _group_placement(p.segments[0], _hint(_shape(B)[1]), 1, s.tp), B, C)
    return (p, p)


def _rule_gated_norm(s: _Sharder, node):
    x, gate, weight, eps, group_size = node.args
    p = s.place[x]
    last = len(_shape(x)) - 1
    if not (isinstance(p, Shard) and p.dim == last and len(p.segments) == 1):
        s.fail(node, "gated norm input must be split along its channels")
    _same(s, node, p, gate)
    _same(s, node, Shard(0, p.segments), weight)
    if p.segments[0].local % group_size == 0:
        return p  # whole groups on this rank: nothing to communicate
    return _gated_norm_across_ranks(s, node, p)


def _gated_norm_across_ranks(s, node, p):
    """Groups wider than a rank's channels: all-reduce each token's per-group sum of squares.

    The local partial sum goes into its group's slot of a (..., n_groups) tensor of zeros, the
    all-reduce adds the ranks that share a group, and each rank reads its group back: one
    scalar per token and group crosses the wire.
    """
    x, gate, weight, eps, group_size = node.args
    seg = p.segments[0]
    n_groups = seg.size // group_size
    my_group = seg.offset(s.rank) // group_size
    g = s.graph
    f32 = torch.float32
    with g.inserting_before(node):
        y = s._new(aten._to_copy.default, (x,), node)
        y.kwargs = {"dtype": f32}
        gate32 = s._new(aten._to_copy.default, (gate,), node)
        gate32.kwargs = {"dtype": f32}
        act = s._new(aten.silu.default, (gate32,), node)
        gated = s._new(aten.mul.Tensor, (y, act), node)
        square = s._new(aten.mul.Tensor, (gated, gated), node)
        partial = s._new(aten.sum.dim_IntList, (square, [-1], True), node)
        # Zeros in the other groups' slots by concatenation: constant_pad_nd would do the same,
        # but its fake kernel fixes the symbolic batch and sequence lengths to the example's,
        # and every shape after it (bytes-per-token accounting included) would keep them.
        slots = partial
        if n_groups > 1:
            zero = s._new(aten.zeros_like.default, (partial,), node)
            s.place[zero] = PARTIAL
            pieces = [zero] * my_group + [partial] + [zero] * (n_groups - my_group - 1)
            slots = s._new(aten.cat.default, (pieces, -1), node)
        total = s._new(ssm.all_reduce.default, (slots, s.group), node)
        total.meta["ssmshard"]["sync"] = "all_reduce"
    s.place[total] = REPLICATE
    if s.training:
        # Each rank's statistic scales only its own channels: sum its gradient over ranks, slot
        # by slot, so ranks of one group add up and other groups' zeros mix in nothing.
        total = s.tp_copy(total)
    with g.inserting_before(node):
        mine = s._new(aten.slice.Tensor, (total, -1, my_group, my_group + 1), node)
        var = s._new(aten.div.Tensor, (mine, float(group_size)), node)
        var_eps = s._new(aten.add.Tensor, (var, float(eps)), node)
        inv = s._new(aten.rsqrt.default, (var_eps,), node)
        normed = s._new(aten.mul.Tensor, (gated, inv), node)
        back = s._new(aten._to_copy.default, (normed,), node)
        back.kwargs = {"dtype": x.meta["val"].dtype}
        out = s._new(aten.mul.Tensor, (weight, back), node)
    for n, pl in ((y, p), (gate32, p), (act, p), (gated, p), (square, p), (partial, PARTIAL),
                  (slots, PARTIAL), (mine, REPLICATE), (var, REPLICATE), (var_eps, REPLICATE),
                  (inv, REPLICATE), (normed, p), (back, p), (out, p)):
        s.place[n] = pl
    node.replace_all_uses_with(out)
    s.graph.erase_node(node)
    return p


def _rule_copy(s: _Sharder, node):
    """``dst.copy_(src)``: HF writes new states into freshly allocated cache buffers."""
    dst, src = node.args[:2]
    pd, ps = s.place.get(dst, REPLICATE), s.place.get(src, REPLICATE)
    if same_data(pd, ps):
        return ps
    if isinstance(pd, Replicate) and isinstance(ps, Shard) and dst.target in FACTORIES:
        _localize_factory(s, dst, ps)
        return ps
    s.fail(node, f"copies a {ps} value into a {pd} buffer")


def _localize_factory(s, node, placement):
    """Allocate a factory's local part: its size on the sharded dim becomes the local size."""
    index = FACTORIES[node.target]
    sizes = list(node.args[index])
    if _hint(sizes[placement.dim]) != placement.global_size:
        s.fail(node, f"allocates {sizes[placement.dim]} where {placement} needs {placement.global_size}")
    sizes[placement.dim] = placement.local_size
    node.args = (*node.args[:index], sizes, *node.args[index + 1:])
    _make_local(node, placement)
    s.place[node] = placement


def _rule_sym_size(s: _Sharder, node):
    p = s.place.get(node.args[0])
    if isinstance(p, Shard) and node.args[1] % len(_shape(node.args[0])) == p.dim:
        s.fail(node, "reads the size of a sharded dim")
    return None


RULES = {
    aten.linear.default: _rule_linear,
    aten.matmul.default: _rule_matmul,
    aten.embedding.default: _rule_embedding,
    aten.transpose.int: _rule_transpose,
    aten.unsqueeze.default: _rule_unsqueeze,
    aten.squeeze.dim: _rule_squeeze,
    aten.squeeze.dims: _rule_squeeze,
    aten.squeeze.default: _rule_squeeze,
    aten.slice.Tensor: _rule_slice_select,
    aten.select.int: _rule_slice_select,
    aten.split_with_sizes.default: _rule_split,
    aten.split.Tensor: _rule_split,
    aten.chunk.default: _rule_split,
    aten.view.default: _rule_view,
    aten.reshape.default: _rule_view,
    aten._unsafe_view.default: _rule_view,
    aten.expand.default: _rule_expand,
    aten.cat.default: _rule_cat,
    aten.concatenate.default: _rule_cat,
    aten.mean.dim: _rule_reduce,
    aten.sum.dim_IntList: _rule_reduce,
    aten.scaled_dot_product_attention.default: _rule_sdpa,
    aten.sym_size.int: _rule_sym_size,
    aten.copy_.default: _rule_copy,
    aten.stack.default: _rule_stack,
    ssm.causal_conv1d.default: _rule_conv,
    ssm.causal_conv1d_update.default: _rule_conv_update,
    ssm.selective_scan.default: _rule_selective_scan,
    ssm.ssd_scan.default: _rule_ssd_scan,
    ssm.selective_state_update.default: _rule_state_update,
    ssm.gated_rms_norm.default: _rule_gated_norm,
}


@register("shard")
def shard(program, ctx):
    """Rewrite ``program`` into rank ``ctx.options['rank']``'s local program (see module docstring)."""
    from ..collectives import declare_group_size

    options = ctx.options
    declare_group_size(options.get("group", "tp"), options["tp"])
    sharder = _Sharder(program, options)
    sharder.run()
    program.graph.eliminate_dead_code()
    program.shard = {"rank": options["rank"], "tp": options["tp"], "group": options.get("group", "tp"),
                     "outputs": sharder.output_placements}
    return program
