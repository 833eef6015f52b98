"""The ``spd`` pass: sync-point drop (SPD, Kim et al., ICML 2025) on a rank's sharded program.

Runs after ``communicate`` (it reads ``program.sync_points``) and before ``quantize_sync``.
For each dropped all-reduce sync point with partial sum ``P`` (rank i holds ``P_i``) whose
reduced value enters the residual stream (it reaches an add tagged ``residual_add`` through
dtype casts and adds, e.g. a bias), the all-reduce is removed and the stream is carried as
two values: its exact part ``base`` (replicated: the stream before the block, plus the
block's bias, added once) and this rank's pending partials ``pending``:

* ops that read the stream as a sub-block's input (norms, concatenations) read
  ``base + pending`` (``X + P_i``): the approximation;
* adds and dtype casts on the stream act on both parts;
* the next kept all-reduce whose sum is added to the stream (``X + all_reduce(Q)``) reduces
  ``Q + pending`` instead, and the add reads ``base``: the stream is exact after it;
* where the stream ends in ops only (the final norm) while some of its pending partials were
  absorbed by no kept all-reduce, one new all-reduce (sync point ``spd_flush``) reduces them
  there: a sync always precedes the head.

A dropped sync point whose value does not enter the residual stream is *unrepaired*: its
consumers read this rank's partial and nothing restores the sum later (Zamba/Zamba2's shared
transformer has no residual around its attention and MLP; Mamba-1's ``x_proj`` feeds dt/B/C).
``x_proj`` is dropped only with ``allow_approximate=True`` (``Plan(allow_approximate=True)``).

Values that differ per rank although their placement says replicated (what reads
``X + P_i``, until the next sharded or partial value) carry ``meta["ssmshard"]["spd"] =
"rank_local"``. Training: autograd of the per-rank programs is the gradient of the SPD model
(the function of all ranks' weights) when (1) a ``tp_copy`` inside the rank-local region
(whose backward would sum the ranks' gradients of different values) becomes an identity and
(2) every exact replicated value read by the rank-local region (``base``, norm weights, the
embedding a Zamba2 block concatenates) passes through a ``tp_copy``, whose backward sums
the ranks' contributions. Both are done here.

Options (``Plan(drop_syncs=..., allow_approximate=...)`` builds them): ``drop`` (names or
globs over sync point names), ``allow_approximate``, ``training``, ``group``.

Errors (``PlanError``, before any collective): a name or glob that matches no sync point (the
valid names are listed), an all-gather or reduce-scatter, a statistic sync (``gate_norm``), and
``x_proj`` without ``allow_approximate``.
"""

from __future__ import annotations

import fnmatch

import torch

from ..placement import REPLICATE, Partial, Replicate
from ..plan import PlanError
from .manager import register
from .quantize_sync import STATISTIC_ROLES, _listed
from .shard.communicate import SyncPoint, bytes_per_token, token_symbols
from .shard.context import is_tensor, new_node, placement_of

aten = torch.ops.aten
ssm = torch.ops.ssmshard
PARTIAL = Partial()
APPROXIMATE_ROLES = ("x_proj",)  # their value feeds no residual stream: dropping them is never repaired
CASTS = (aten.to.dtype, aten._to_copy.default, aten.clone.default)  # act on base and pending alike
RANK_LOCAL = "rank_local"


def select(sync_points, drop, allow_approximate: bool = False, where: str = "program") -> list:
    """The sync points ``drop`` (names or globs) selects; PlanError for what cannot be dropped."""
    if isinstance(drop, str) or not all(isinstance(g, str) for g in drop):
        raise PlanError(f"drop_syncs must be a list of sync point names or globs, not {drop!r}")
    chosen = {}
    for glob in drop:
        matched = [p for p in sync_points if fnmatch.fnmatchcase(p.name, glob)]
        if not matched:
            raise PlanError(f"drop_syncs entry {glob!r} matches no sync point of this {where}; its sync points are "
                            f"{_listed([p.name for p in sync_points], limit=40)}")
        for point in matched:
            if point.kind != "all_reduce":
                raise PlanError(f"drop_syncs entry {glob!r} selects {point.name!r}, a {point.kind}: only all-reduce "
                                "sync points (partial sums) can be dropped; leave it out"
                                + (" or use Plan(sequence_parallel=False)" if point.kind == "reduce_scatter" else ""))
            if point.role in STATISTIC_ROLES:
                raise PlanError(f"drop_syncs entry {glob!r} selects {point.name!r}, a statistic (a sum of squares "
                                "feeding a normalisation): a rank's partial of it is meaningless; leave it out")
            if point.role in APPROXIMATE_ROLES and not allow_approximate:
                raise PlanError(f"drop_syncs entry {glob!r} selects {point.name!r}: dropping an {point.role} sync is "
                                "never repaired (its value feeds dt/B/C, not the residual stream), so every later "
                                "token reads this rank's partial; pass Plan(allow_approximate=True) to drop it anyway")
            chosen[point.name] = point
    return list(chosen.values())


def _is_add(node) -> bool:
    return (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2
            and all(is_tensor(a) for a in node.args) and not node.kwargs)


def _stream_op(node) -> bool:
    """An op that acts on the stream linearly: base and pending go through it separately."""
    return _is_add(node) or (node.op == "call_function" and node.target in CASTS and is_tensor(node.args[0]))


def _rewire(user, old, new):
    """``user`` reads ``new`` where it read ``old``, wanting it in the placement it wanted ``old`` in."""
    user.replace_input_with(old, new)
    wanted = user.meta.get("input_placements", {})
    if old.name in wanted:
        wanted[new.name] = wanted.pop(old.name)


def _replace_uses(old, new):
    for user in list(old.users):
        _rewire(user, old, new)


class _Rewriter:
    def __init__(self, program, kept_reduces: set, training: bool, group: str):
        self.program = program
        self.graph = program.graph
        self.training = training
        self.group = group
        self.kept = kept_reduces  # names of kept all_reduce nodes
        self.state = {}  # node -> (base node or None, pending node, frozenset of dropped names)
        self.local = {}  # node -> its base + pending (rank-local)
        self.flushed = {}  # node -> base + all_reduce(pending)
        self.dead = []  # nodes whose value the state replaced
        self.flushes: list[SyncPoint] = []
        self.unrepaired: list[str] = []
        self.absorbed_anywhere: set[str] = set()  # dropped names some path hands to a kept all-reduce

    # ------------------------------------------------------------- analysis
    def _absorber(self, node, arg):
        """For ``node = arg + K`` where K is a kept all-reduce (optionally + a bias) used only here:
        (the all-reduce, K). Else None."""
        if not _is_add(node):
            return None
        other = node.args[1] if node.args[0] is arg else node.args[0]
        if other is arg or len(other.users) != 1:
            return None
        reduce = other
        if _is_add(other):  # all_reduce(Q) + bias
            reduce = next((a for a in other.args if a.op == "call_function" and a.name in self.kept), None)
            if reduce is None or len(reduce.users) != 1:
                return None
        if reduce.op == "call_function" and reduce.name in self.kept:
            return reduce, other
        return None

    def _reaches_residual(self, node, seen=None) -> bool:
        seen = set() if seen is None else seen
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _stream_op(user) and (user.meta.get("ssmshard", {}).get("role") == "residual_add"
                                     or self._reaches_residual(user, seen)):
                return True
        return False

    def _absorbed_from(self, node, seen=None) -> bool:
        """Whether a stream value at ``node`` reaches, through stream ops, an add of a kept all-reduce."""
        seen = set() if seen is None else seen
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if self._absorber(user, node) is not None:
                return True
            if _stream_op(user) and self._absorbed_from(user, seen):
                return True
        return False

    # ------------------------------------------------------------- building nodes
    def _node(self, target, args, like, placement, before, kwargs=None):
        with self.graph.inserting_before(before):
            node = new_node(self.graph, target, args, like, kwargs=kwargs)
        node.meta["placement"] = placement
        node.meta["input_placements"] = {a.name: placement_of(a) for a in args if isinstance(a, torch.fx.Node)}
        return node

    def _add(self, a, b, like, placement, before):
        if a is None:
            return b
        if b is None:
            return a
        return self._node(aten.add.Tensor, (a, b), like, placement, before)

    def _exact_into_local(self, value, before):
        """``value`` (exact, replicated) as read by rank-local ops: its gradient sums the ranks'."""
        if not self.training or not value.meta["val"].is_floating_point():
            return value
        return self._node(ssm.tp_copy.default, (value, self.group), value if "ssmshard" in value.meta else before,
                          REPLICATE, before)

    def _local(self, node, before):
        if node not in self.local:
            base, pending, _ = self.state[node]
            if base is None:
                local = self._node(aten.alias.default, (pending,), node, REPLICATE, before)
            else:
                local = self._node(aten.add.Tensor, (self._exact_into_local(base, before), pending), node, REPLICATE,
                                   before)
            local.meta["ssmshard"]["spd"] = RANK_LOCAL
            self.local[node] = local
        return self.local[node]

    def _flush(self, node, before):
        if node not in self.flushed:
            base, pending, names = self.state[node]
            with self.graph.inserting_before(before):
                reduce = new_node(self.graph, ssm.all_reduce.default, (pending, self.group), node,
                                  val=pending.meta["val"])
            reduce.meta["placement"] = REPLICATE
            reduce.meta["input_placements"] = {pending.name: PARTIAL}
            tags = node.meta["ssmshard"]
            count = sum(p.name.startswith("spd_flush") for p in self.flushes)
            point = SyncPoint(name="spd_flush" if count == 0 else f"spd_flush#{count + 1}", kind="all_reduce",
                              node=reduce.name, layer=tags.get("layer"), block=tags.get("block", "glue"),
                              role="spd_flush", dtype=str(pending.meta["val"].dtype).replace("torch.", ""),
                              bytes_per_token=bytes_per_token(pending.meta["val"], token_symbols(self.program)))
            reduce.meta["sync"] = point
            reduce.meta["ssmshard"].update(sync="all_reduce", sync_point=point.name,
                                           bytes_per_token=point.bytes_per_token, spd_flushes=sorted(names))
            self.flushes.append(point)
            self.flushed[node] = self._add(base, reduce, node, REPLICATE, before)
        return self.flushed[node]

    # ------------------------------------------------------------- the rewrite
    def drop(self, point: SyncPoint, node):
        partial = node.args[0]
        if self._reaches_residual(node):
            self.state[node] = (None, partial, frozenset([point.name]))
            self.dead.append(node)
        else:  # unrepaired: every consumer reads this rank's partial
            local = self._node(aten.alias.default, (partial,), node, REPLICATE, node)
            local.meta["ssmshard"]["spd"] = RANK_LOCAL
            _replace_uses(node, local)
            self.graph.erase_node(node)
            self.unrepaired.append(point.name)

    def run(self):
        for node in list(self.graph.nodes):
            carried = [a for a in node.all_input_nodes if a in self.state]
            if not carried:
                continue
            if node.op == "call_function" and _stream_op(node) and len(carried) == 1 \
                    and self._absorber(node, carried[0]) is not None:
                self._absorb(node, carried[0])
            elif node.op == "call_function" and _stream_op(node):
                self._carry(node, carried)
            else:
                for arg in carried:
                    _rewire(node, arg, self._read(arg, node))
        for node in reversed(self.dead):
            if not node.users:
                self.graph.erase_node(node)

    def _read(self, arg, user):
        """What a non-stream op reads for ``arg``: base + pending while some pending partial is
        still to be absorbed downstream or was absorbed on another path, else flushed here."""
        _, _, names = self.state[arg]
        continues = any(_stream_op(u) for u in arg.users)
        if continues or names <= self.absorbed_anywhere:
            return self._local(arg, user)
        return self._flush(arg, user)

    def _absorb(self, node, arg):
        reduce, term = self._absorber(node, arg)
        base, pending, names = self.state[arg]
        operand = reduce.args[0]
        summed = self._add(operand, pending, operand, PARTIAL, reduce)
        _rewire(reduce, operand, summed)
        exact = base
        if exact is None:  # the stream before the dropped block was zero (a dropped embedding)
            _replace_uses(node, term)
            self.dead.append(node)
            return
        _rewire(node, arg, exact)

    def _carry(self, node, carried):
        """``node`` (an add or a cast of the stream) on base and pending separately."""
        if node.target is aten.add.Tensor:
            parts = []
            for arg in node.args:
                parts.append(self.state[arg][:2] if arg in self.state else (arg, None))
            base = self._add(parts[0][0], parts[1][0], node, REPLICATE, node)
            pending = self._add(parts[0][1], parts[1][1], node, PARTIAL, node)
        else:
            arg = node.args[0]
            base, pending, _ = self.state[arg]
            rest, kwargs = node.args[1:], dict(node.kwargs)
            base = None if base is None else self._node(node.target, (base, *rest), node, REPLICATE, node, kwargs)
            pending = self._node(node.target, (pending, *rest), node, PARTIAL, node, kwargs)
        names = frozenset().union(*(self.state[a][2] for a in carried))
        self.state[node] = (base, pending, names)
        self.dead.append(node)


def _mark_rank_local(program, training: bool, rewriter: _Rewriter) -> None:
    """Tag what reads a rank-local value (until a sharded or partial value), and for training make
    the gradients those of the SPD model (module docstring)."""
    def replicated(placement):
        placements = placement if isinstance(placement, tuple) else (placement,)
        return all(isinstance(p, Replicate) for p in placements)

    region = set()
    for node in program.graph.nodes:
        tags = node.meta.get("ssmshard", {})
        if node.op != "call_function":
            continue
        if tags.get("spd") == RANK_LOCAL or (
                any(a in region for a in node.all_input_nodes) and node.target not in COLLECTIVES
                and "placement" in node.meta and replicated(node.meta["placement"])):
            region.add(node)
            tags["spd"] = RANK_LOCAL
    for node in [n for n in program.graph.nodes if n in region]:
        if node.target is ssm.tp_copy.default:  # its input differs per rank: no sum in backward
            node.target, node.args = aten.alias.default, (node.args[0],)
            continue
        if not training or node.target is aten.alias.default:
            continue
        for arg in node.all_input_nodes:
            if arg in region or not is_tensor(arg) or not isinstance(placement_of(arg), Replicate):
                continue
            if placement_of(arg).partial_grad or arg.target is ssm.tp_copy.default:
                continue
            if not arg.meta["val"].is_floating_point() or arg in rewriter.local.values():
                continue
            copied = rewriter._exact_into_local(arg, node)
            _rewire(node, arg, copied)


COLLECTIVES = (ssm.all_reduce.default, ssm.all_gather.default, ssm.reduce_scatter.default,
               ssm.all_gather_partial_grad.default)


@register("spd")
def spd(program, ctx):
    """Drop the chosen all-reduce sync points (see the module docstring)."""
    options = ctx.options
    dropped = select(program.sync_points, options.get("drop", []), options.get("allow_approximate", False),
                     where=f"{program.mode} program")
    if not dropped:
        return program
    names = {p.name for p in dropped}
    kept = {p.node for p in program.sync_points if p.kind == "all_reduce" and p.name not in names}
    nodes = {node.name: node for node in program.graph.nodes}
    rewriter = _Rewriter(program, kept, options.get("training", True), options["group"])
    for point in dropped:
        node = nodes[point.node]
        if node.target is not ssm.all_reduce.default:
            raise PlanError(f"sync point {point.name!r} is no longer an all_reduce node ({node.target}); run spd right "
                            "after communicate")
        rewriter.drop(point, node)
    rewriter.absorbed_anywhere = {p.name for p in dropped
                                  if nodes[p.node] in rewriter.state and rewriter._absorbed_from(nodes[p.node])}
    rewriter.run()
    _mark_rank_local(program, options.get("training", True), rewriter)
    for point in program.sync_points:
        if point.name in names:
            point.action = "dropped"
    # A flush reduces where the stream ends (before the final norm): after the layers' sync points.
    head = [p for p in program.sync_points if p.name == "lm_head"]
    program.sync_points = [p for p in program.sync_points if p.name != "lm_head"] + rewriter.flushes + head
    for row in getattr(program, "collectives", []):
        if row.get("name") in names:
            row.update(action="dropped")
    program.dropped_syncs = sorted(names)
    program.unrepaired_syncs = rewriter.unrepaired
    return program
