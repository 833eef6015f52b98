"""A whole weight from the shards every rank holds (tensor and sequence parallelism, TSP).

Under ``Plan(tsp=D)`` each rank keeps only its shard of a weight (the tensor-parallel layout)
and reassembles the whole weight where an op reads it, for its own tokens. The gradient of the
whole weight is a partial sum per rank (each rank's tokens); the all-gather's backward
reduce-scatters it, so each rank's shard receives the sum over ranks of its rows.
"""

from __future__ import annotations

from torch import Tensor
import torch

from ..placement import Shard
from .ops import all_gather_partial_grad


def weight_pieces(placement: Shard) -> list[tuple[int, int, int, int]]:
    """``(owner, local_start, whole_start, length)`` along the placement's dim for each piece of
    the whole weight, in order: the rank it is taken from (the first rank that holds it), where it
    sits in that rank's shard and in the whole weight."""
    pieces, inner, whole = [], 0, 0
    for seg in placement.segments:
        for piece in range(seg.pieces):
            pieces.append((piece * seg.stride, inner, whole + piece * seg.local, seg.local))
        inner += seg.local
        whole += seg.size
    return pieces


def gathered_ranges(placement: Shard, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` along the placement's dim, in the rank-ordered concatenation of every
    rank's shard, of each piece of the whole weight in order (:func:`weight_pieces`)."""
    local = placement.local_size
    return _merged([(owner * local + inner, length) for owner, inner, _, length in weight_pieces(placement)])


def _merged(ranges):
    merged = []
    for start, length in ranges:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def gather_shards(shard: Tensor, dim: int, ranges: list, group: str) -> Tensor:
    """The whole weight from this rank's ``shard`` (ranges: :func:`gathered_ranges`)."""
    gathered = all_gather_partial_grad(shard.contiguous(), dim, group)
    if len(ranges) == 1 and ranges[0][0] == 0 and ranges[0][1] == gathered.shape[dim]:
        return gathered
    return torch.cat([gathered.narrow(dim, start, length) for start, length in ranges], dim)
