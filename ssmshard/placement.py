"""Placements of a value across the ranks of one tensor-parallel mesh axis of size ``tp``.

* ``Replicate()``: every rank holds the whole value.
* ``Partial()``: every rank holds a summand; the value is their sum (after a row-parallel matmul).
* ``SeqShard(dim)``: the sequence dim ``dim`` (symbolic length L) is cut into ``tp`` equal
  chunks of ceil(L / tp) tokens after padding it with zeros to a multiple of ``tp``; rank ``r``
  holds chunk ``r``. Sequence parallelism keeps the residual stream like this between blocks;
  the padding lives only between the collectives that create and remove it, so any length
  (also L < tp) runs with the same local shape on every rank.
* ``Shard(dim, segments)``: dimension ``dim`` is a concatenation of ``segments``; each segment
  is cut into ``pieces`` equal chunks and rank ``r`` holds chunk ``(r // stride) % pieces`` of
  every segment, concatenated in order. One segment with ``pieces == tp`` is the usual
  even split. A packed projection such as Mamba-2's ``in_proj`` rows ``[z, x, B, C, dt]`` is
  five segments; B and C have ``pieces = n_groups, stride = tp // n_groups`` when fewer
  groups than ranks exist (each rank holds the one group its heads read), and
  ``pieces = 1`` when every rank needs all of them.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Segment:
    size: int  # global length of this segment along the sharded dim
    pieces: int  # chunks the segment is cut into (1: every rank holds it whole)
    stride: int = 1  # consecutive ranks that hold the same chunk

    def __post_init__(self):
        if self.size % self.pieces:
            raise ValueError(f"segment of {self.size} cannot be cut into {self.pieces} equal pieces")

    @property
    def local(self) -> int:
        return self.size // self.pieces

    def chunk(self, rank: int) -> int:
        return (rank // self.stride) % self.pieces

    def offset(self, rank: int) -> int:
        return self.chunk(rank) * self.local

    def scaled(self, factor: int) -> "Segment":
        """The same cut of a dim ``factor`` times longer (merging an unsharded inner dim)."""
        return Segment(self.size * factor, self.pieces, self.stride)


@dataclasses.dataclass(frozen=True)
class Replicate:
    # True when every rank holds the whole value but uses it only for its own shard of the
    # work (Mamba-2's B/C with fewer groups than ranks, a lone key/value head): its gradient
    # is then a partial sum per rank, so no tp_copy may be put on it, and the weight rows
    # behind it are summed after backward (DistributedModule.sync_replicated_grads).
    partial_grad: bool = False

    def __str__(self):
        return "R~" if self.partial_grad else "R"


@dataclasses.dataclass(frozen=True)
class Partial:
    def __str__(self):
        return "P"


@dataclasses.dataclass(frozen=True)
class Shard:
    dim: int  # non-negative
    segments: tuple[Segment, ...]

    @property
    def global_size(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def local_size(self) -> int:
        return sum(s.local for s in self.segments)

    def with_dim(self, dim: int) -> "Shard":
        return Shard(dim, self.segments)

    def __str__(self):
        segs = ",".join(f"{s.size}/{s.pieces}" + (f"@{s.stride}" if s.stride > 1 else "") for s in self.segments)
        return f"S({self.dim}:{segs})"


@dataclasses.dataclass(frozen=True)
class SeqShard:
    dim: int  # non-negative; the sequence dim of an activation

    def with_dim(self, dim: int) -> "SeqShard":
        return SeqShard(dim)

    def __str__(self):
        return f"S({self.dim}:seq)"


Placement = Replicate | Partial | Shard | SeqShard
REPLICATE = Replicate()
PARTIAL = Partial()


def even(size: int, tp: int) -> Segment:
    return Segment(size, tp, 1)


def normalize(placement: Placement) -> Placement:
    """A shard whose every segment is held whole by every rank is replication (with partial grads)."""
    if isinstance(placement, Shard) and all(s.pieces == 1 for s in placement.segments):
        return Replicate(partial_grad=True)
    return placement


def same_data(a: Placement, b: Placement) -> bool:
    """Whether two placements put the same values on every rank (gradient flavour aside)."""
    a, b = normalize(a), normalize(b)
    return (isinstance(a, Replicate) and isinstance(b, Replicate)) or a == b


def local_ranges(placement: Shard, rank: int) -> list[tuple[int, int]]:
    """``(start, length)`` along ``placement.dim`` of each piece rank ``rank`` holds, in order."""
    ranges, start = [], 0
    for seg in placement.segments:
        ranges.append((start + seg.offset(rank), seg.local))
        start += seg.size
    return ranges


def local_slice(tensor: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """This rank's part of a global tensor."""
    if not isinstance(placement, Shard):
        return tensor
    parts = [tensor.narrow(placement.dim, start, length) for start, length in local_ranges(placement, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=placement.dim)


def local_shape(shape, placement: Placement) -> tuple:
    shape = list(shape)
    if isinstance(placement, Shard):
        if shape[placement.dim] != placement.global_size:
            raise ValueError(f"shard of {placement.global_size} does not match dim {placement.dim} of {tuple(shape)}")
        shape[placement.dim] = placement.local_size
    return tuple(shape)
