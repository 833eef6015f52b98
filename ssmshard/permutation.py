"""A weight's rows (or columns) re-ordered on the way to a rank, composed with its slice.

A head permutation that a plan carries (``Plan(head_permutations=...)``, docs/spd.md) re-orders
some weights of a block along one dimension. The ranks never see the re-ordered weight whole:
each rank's local tensor is read straight from the unpermuted source (the model in memory, or
a safetensors checkpoint) through the composition of the permutation and its slice. Where the
permuted dimension is the sharded one, rank ``r``'s piece ``[start, start + length)`` of the
permuted weight is the source's rows ``index[start:start + length]``: read as the runs of
consecutive rows they form (a head is ``head_dim`` consecutive rows, so one read per head).
Elsewhere (a replicated weight, or one sharded along another dimension) the rank's slice is read
as usual and re-ordered locally: it holds that dimension whole.
"""

from __future__ import annotations

import dataclasses

import torch

from .placement import Placement, Shard, local_ranges, local_slice


@dataclasses.dataclass(frozen=True)
class WeightPermutation:
    """Position ``j`` along ``dim`` of the permuted weight holds the source's ``index[j]``."""

    dim: int
    index: torch.Tensor  # int64, a permutation of range(size along dim)


@dataclasses.dataclass(frozen=True)
class LocalReads:
    """How to build a rank's local tensor from the unpermuted source: ``ranges`` (``(start,
    length)`` along ``dim``, concatenated in order; ``dim`` None: the whole tensor), then, when
    ``reorder`` is set, an ``index_select`` of the result along ``reorder.dim``."""

    dim: int | None
    ranges: list[tuple[int, int]] | None
    reorder: WeightPermutation | None = None


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """``indices`` as ``(start, length)`` runs of consecutive values, in order."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(start, length) for start, length in runs]


def local_reads(placement: Placement, rank: int, permutation: WeightPermutation | None = None) -> LocalReads:
    """The reads that give rank ``rank``'s local tensor of a weight placed at ``placement`` and
    re-ordered by ``permutation`` (None: not re-ordered)."""
    sharded = isinstance(placement, Shard)
    if permutation is None or not sharded or placement.dim != permutation.dim:
        return LocalReads(placement.dim if sharded else None, local_ranges(placement, rank) if sharded else None,
                          permutation)
    positions = [p for start, length in local_ranges(placement, rank) for p in range(start, start + length)]
    return LocalReads(placement.dim, _runs(permutation.index[positions].tolist()))


def permuted_local_slice(tensor: torch.Tensor, placement: Placement, rank: int,
                         permutation: WeightPermutation | None = None) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor`` re-ordered by ``permutation`` (``local_slice`` when None),
    without re-ordering the whole tensor."""
    if permutation is None:
        return local_slice(tensor, placement, rank)
    reads = local_reads(placement, rank, permutation)
    local = tensor
    if reads.dim is not None:
        parts = [tensor.narrow(reads.dim, start, length) for start, length in reads.ranges]
        local = parts[0] if len(parts) == 1 else torch.cat(parts, dim=reads.dim)
    if reads.reorder is not None:
        local = local.index_select(reads.reorder.dim, reads.reorder.index.to(local.device))
    return local
