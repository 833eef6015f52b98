"""The ``localize`` pass: turn the placed global program into this rank's local program.

* Sharded placeholders (weights, decode's state inputs) get their local shapes, and the
  program's shape ranges say so (a decode step must keep hitting the same graph).
* The edits the rules left (``node.meta["localize"]``) run in graph order: local sizes in
  view/reshape/expand/split/slice arguments and in allocations, rank-dependent constants
  (the vocab-parallel lookup's row range, a gated norm's group slot), dropped shape asserts.

Collectives are not inserted yet, so between this pass and ``communicate`` partial sums flow
unreduced: every shape is already the local one, which is what lets ``communicate`` insert
collectives whose fake shapes are exact (a sequence-sharded stream gets its local length from
the collective that creates it).
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

from ...placement import Shard, local_shape
from ..manager import register
from .context import ShardOptions


class LocalizeContext:
    def __init__(self, program, options: ShardOptions):
        self.program = program
        self.graph = program.graph
        self.rank = options.rank
        self.tp = options.tp

    def record(self, node, placement) -> None:
        """Placement of a node an edit creates (its inputs keep theirs)."""
        node.meta["placement"] = placement
        node.meta["input_placements"] = {a.name: a.meta.get("placement") for a in node.all_input_nodes
                                         if isinstance(a.meta.get("val"), torch.Tensor)}


def _make_local(node, placement) -> None:
    """Give a sharded placeholder or allocation its local fake value."""
    val = node.meta["val"]
    with detect_fake_mode([val]):
        local = torch.empty(local_shape(val.shape, placement), dtype=val.dtype, device=val.device)
    # Keep requires_grad: at::matmul folds a 3-D input into one mm only for weights that need
    # grad like the parameter did, and its other path cannot run on symbolic sizes (CUDA).
    node.meta["val"] = local.requires_grad_(val.requires_grad) if val.is_floating_point() else local


def _localize_range(program, user_index, placement) -> None:
    """A sharded user input (decode's states) arrives with its local size: the range the program
    admits must say so, or every call would miss the shape-bucket cache and capture a sibling."""
    key = (user_index, placement.dim)
    if program.ranges.get(key) == (placement.global_size,) * 2:
        program.ranges[key] = (placement.local_size,) * 2


@register("localize")
def localize(program, ctx):
    """Local sizes and rank-dependent constants for rank ``ctx.options['rank']``."""
    options = ShardOptions.of(ctx.options)
    lcx = LocalizeContext(program, options)
    user_index = 0
    kinds = {i.name: i.kind for i in program.inputs}
    for node in list(program.graph.nodes):
        if node.op == "placeholder":
            placement = node.meta.get("placement")
            if isinstance(placement, Shard):
                _make_local(node, placement)
                if kinds[node.name] == "user":
                    _localize_range(program, user_index, placement)
            user_index += kinds[node.name] == "user"
            continue
        for edit in node.meta.pop("localize", []):
            edit(lcx, node)
    program.graph.eliminate_dead_code()
    return program
