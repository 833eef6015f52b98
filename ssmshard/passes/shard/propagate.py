"""The ``propagate`` pass: give every value of one rank's program a placement.

Weights take theirs from the plan (``options["placements"]``, from ``Plan.layout``), user
inputs from ``options["input_placements"]`` (decode's states arrive sharded) or replicated.
Then, in graph order, each op's output placement follows from its inputs':

1. the reduce policy may ask for other input placements first (sequence parallelism keeps the
   residual stream cut along the sequence);
2. a ``Partial`` input is reduced unless the policy keeps it partial through this op (by
   default only through an add of partial sums: Megatron's placement); the policy names the
   placement it is reduced to (``Replicate`` by default);
3. an op whose inputs are all replicated is replicated; any other op needs a rule
   (``rules/``). A sharded value reaching an op without a rule is a ``ShardingError`` naming
   the op, the node and the model source line.

Nothing is communicated or resized here: ``node.meta["input_placements"]`` records what each
op needs, ``communicate`` inserts the collectives, ``localize`` the local sizes. The graph only
changes where a rule decomposes an op (the gated norm across ranks).
"""

from __future__ import annotations

import operator

import torch

from ...placement import REPLICATE, Partial, Replicate, SeqShard

PARTIAL_GRAD_REPLICATE = Replicate(partial_grad=True)
from ..manager import register
from .context import ShardOptions, fail, is_partial, is_tensor, placement_of, tensor_inputs
from .policy import MegatronPolicy
from .rules import RULES

aten = torch.ops.aten


class PropagateContext:
    """State of one propagation: options, the policy, and the wants of the node being visited."""

    def __init__(self, program, options: ShardOptions):
        self.program = program
        self.graph = program.graph
        self.options = options
        self.tp, self.rank = options.tp, options.rank
        self.policy = options.policy or MegatronPolicy()
        self.policy.prepare(program, options)
        self._wants: dict = {}  # input node -> the placement the current node needs it in
        self._weight_names = {i.name for i in program.inputs if i.kind != "user"}

    def placement(self, arg):
        """``arg``'s placement as the node being visited sees it (after its wants)."""
        if arg in self._wants:
            return self._wants[arg]
        return placement_of(arg)

    def want(self, node, arg, placement) -> None:
        """The current node needs ``arg`` in ``placement`` (``communicate`` converts it)."""
        self._wants[arg] = placement

    def fail(self, node, why: str):
        fail(node, why)

    def revisit(self, node):
        """Visit ``node`` again after a rule rewrote it in place; returns its placement."""
        self.visit(node)
        return node.meta["placement"]

    # ---------------------------------------------------------------- the walk
    def run(self) -> None:
        user_index = 0
        inputs = {i.name: i for i in self.program.inputs}
        node = next(iter(self.graph.nodes))
        while node.op != "root":  # a linked walk: nodes a rule inserts after this one are visited too
            if node.op == "placeholder":
                spec = inputs[node.name]
                if spec.kind == "user":
                    node.meta["placement"] = self.options.input_placements.get(user_index, REPLICATE)
                    user_index += 1
                else:
                    placement = self.options.placements.get(spec.target, REPLICATE)
                    self.program.param_specs[spec.target].placement = placement
                    node.meta["placement"] = placement
            elif node.op == "output":
                self.visit_output(node)
            elif node.op == "call_function":
                self.visit(node)
            node = node.next

    def visit(self, node) -> None:
        if node.target is operator.getitem:
            source = placement_of(node.args[0])
            node.meta["placement"] = source[node.args[1]] if isinstance(source, tuple) else source
            return
        if not any(isinstance(v, torch.Tensor) for v in _vals(node)):
            node.meta["placement"] = None  # sizes, asserts and other non-tensors
            if node.target in RULES:
                RULES[node.target](self, node)  # sym_size refuses a sharded dim, asserts go
            return
        self._wants = {}
        args = tensor_inputs(node)
        self.policy.adjust_inputs(self, node, args)
        if any(is_partial(self.placement(a)) for a in args) and not self.policy.keep_partial(self, node, args):
            for a in args:
                if is_partial(self.placement(a)):
                    self.want(node, a, self.policy.reduce_target(self, a, node))
        placements = [self.placement(a) for a in args]
        if all(isinstance(p, Replicate) for p in placements):
            flavour = Replicate(partial_grad=any(p.partial_grad for p in placements))
            out = tuple(flavour for _ in _vals(node)) if _multi(node) else flavour
        else:
            rule = RULES.get(node.target)
            if rule is None:
                self.fail(node, "op has no rule")
            out = rule(self, node)
        if self.options.training:
            self._sum_gradients_of_replicated_inputs(node, out)
        node.meta["placement"] = out
        node.meta["input_placements"] = {a.name: self.placement(a) for a in tensor_inputs(node)}

    def _sum_gradients_of_replicated_inputs(self, node, out) -> None:
        """Megatron's "f": a replicated activation read by an op whose output is split or
        partial gets a partial gradient on each rank; it is wanted as R~ (``communicate``
        puts a ``tp_copy`` there: identity forward, all-reduce backward). So does a replicated
        weight read by an op over this rank's tokens only (sequence parallelism's norms): its
        gradient sums over the tokens of every rank."""
        outs = out if isinstance(out, tuple) else (out,)
        if all(o == REPLICATE for o in outs):
            return
        over_own_tokens = any(isinstance(o, SeqShard) for o in outs)
        for arg in tensor_inputs(node):
            placement = self.placement(arg)
            if placement != REPLICATE or not arg.meta["val"].is_floating_point():
                continue
            if not self._is_weight(arg) or (over_own_tokens and arg.meta["val"].requires_grad):
                self.want(node, arg, PARTIAL_GRAD_REPLICATE)

    def _is_weight(self, node) -> bool:
        return node.op == "placeholder" and node.name in self._weight_names

    def visit_output(self, node) -> None:
        """Outputs: logits replicated on every rank; states keep their placement (each rank its
        own channels or heads), except partial sums, which are reduced."""
        values = node.args[0]
        flat = list(values) if isinstance(values, (tuple, list)) else [values]
        self._wants = {}
        for index, value in enumerate(flat):
            if not is_tensor(value):
                continue
            placement = placement_of(value)
            logits = self.program.mode == "forward" or index == 0
            if isinstance(placement, Partial) or (logits and not isinstance(placement, Replicate)):
                self.want(node, value, self.policy.output_target(self, value, placement))
        node.meta["input_placements"] = {a.name: self.placement(a) for a in tensor_inputs(node)}


def _vals(node):
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _multi(node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


@register("propagate", analysis_only=True)
def propagate(program, ctx):
    """Record a placement on every node of ``program`` for rank ``ctx.options['rank']``."""
    options = ShardOptions.of(ctx.options)
    PropagateContext(program, options).run()
    program.shard = {"rank": options.rank, "tp": options.tp, "group": options.group,
                     "training": options.training, "policy": type(options.policy or MegatronPolicy()).__name__}
    return program


def output_placements(program) -> list:
    """The placement of each program output as returned (after ``communicate``)."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    values = output.args[0]
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    return [placement_of(v) if isinstance(v, torch.fx.Node) else REPLICATE for v in flat]

