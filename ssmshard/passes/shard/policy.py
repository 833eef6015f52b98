"""Reduce policies: where partial sums are reduced, into what, and with which collectives.

A policy is consulted by ``propagate`` (which placement each op gets its inputs in) and by
``communicate`` (which collectives turn one placement into another). A plan carries one
(``Plan(sequence_parallel=True)`` picks ``SequenceParallelPolicy``); a user can subclass
``ReducePolicy`` and pass it as ``Plan(policy=...)``.

* ``MegatronPolicy`` (the default): a partial sum is all-reduced at its first consumer that
  is not an add of partial sums, once per producer, and replicated from there on.
* ``SequenceParallelPolicy``: Megatron's sequence parallelism. Between blocks the residual
  stream, its norms and adds hold ``SeqShard(1)`` (each rank 1/tp of the tokens): a partial
  sum that enters the residual stream is reduce-scattered along the sequence, a sharded
  stream entering a block is all-gathered first, a replicated activation entering the stream
  is cut locally. Inside blocks placements are as with Megatron.
"""

from __future__ import annotations

import torch

from ...placement import REPLICATE, Partial, Replicate, SeqShard

aten = torch.ops.aten


class ReducePolicy:
    """The default decisions; subclasses override what they change."""

    def prepare(self, program, options) -> None:
        """Called once per program before propagation."""

    def adjust_inputs(self, cx, node, args) -> None:
        """May ``cx.want(node, arg, placement)`` before the op's rule runs."""

    def keep_partial(self, cx, node, args) -> bool:
        """Whether ``node`` consumes its partial inputs as they are (its output then partial)."""
        return node.target is aten.add.Tensor and all(isinstance(cx.placement(a), Partial) for a in args)

    def reduce_target(self, cx, producer, consumer):
        """The placement a partial ``producer`` is reduced to for ``consumer``."""
        return REPLICATE

    def output_target(self, cx, value, placement):
        """The placement a program output (logits) is returned in."""
        return REPLICATE

    def lower(self, comm, value, have, want, consumer):
        """Insert the collectives turning ``value`` from ``have`` into ``want``; returns the new
        node (``comm``: the ``communicate`` pass's builder, see ``communicate.Collectives``)."""
        return comm.standard(value, have, want, consumer)


class MegatronPolicy(ReducePolicy):
    """Reduce a partial sum at its first consumer that needs it whole (the default)."""


class SequenceParallelPolicy(ReducePolicy):
    """Residual stream sharded along the sequence between blocks (see the module docstring)."""

    def prepare(self, program, options) -> None:
        users = [n for n in program.graph.nodes if n.op == "placeholder"
                 and next(i for i in program.inputs if i.name == n.name).kind == "user"]
        ids = users[0].meta["val"]
        if program.mode != "forward" or ids.dim() < 2:
            raise ValueError(f"sequence parallelism applies to forward programs over (batch, sequence, ...) "
                             f"inputs, not a {program.mode} program of {tuple(ids.shape)}")
        self.seq = ids.shape[1]

    def _carries_sequence(self, node) -> bool:
        val = node.meta.get("val")
        return (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() == 3
                and _same_size(val.shape[1], self.seq))

    def in_residual_stream(self, node) -> bool:
        """Glue between blocks: residual adds, norms, the embedding's output path, the head's input."""
        tags = node.meta.get("ssmshard", {})
        between_blocks = tags.get("role") == "residual_add" or tags.get("block") in ("norm", "embed", "glue", "head")
        return between_blocks and self._carries_sequence(node)

    def adjust_inputs(self, cx, node, args) -> None:
        if not self.in_residual_stream(node):
            return
        for arg in args:
            placement = cx.placement(arg)
            if isinstance(placement, Replicate) and not placement.partial_grad and self._carries_sequence(arg):
                cx.want(node, arg, SeqShard(1))

    def reduce_target(self, cx, producer, consumer):
        if self.in_residual_stream(consumer) and self._carries_sequence(producer):
            return SeqShard(1)
        return REPLICATE


def _same_size(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.node.expr == b.node.expr
