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


def gathered_ranges(placement: Shard, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` along the placement's dim, in the rank-ordered concatenation of every
    rank's shard, of each piece of the whole weight in order (each piece taken from the first
    rank that holds it)."""
    ranges, inner = [], 0
    local = placement.local_size
    for seg in placement.segments:
        for piece in range(seg.pieces):
            owner = piece * seg.stride
            ranges.append((owner * local + inner, seg.local))
        inner += seg.local
    return _merged(ranges)


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
