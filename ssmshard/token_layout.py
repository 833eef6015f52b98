"""Which chunks of the sequence each rank holds under ``Plan(tsp=D)``: ``tsp_order`` (docs/tsp.md).

* ``"contiguous"``: the sequence, padded with zeros at its end, is cut into ``D`` chunks of
  ``c = ceil(L / D)`` tokens; rank ``r`` holds chunk ``r``.
* ``"zigzag"``: it is cut into ``2 D`` chunks of ``c = ceil(L / 2D)`` tokens; rank ``r`` holds
  chunks ``r`` and ``2D - 1 - r``, in that order (its first and second *slot*). Under causal
  attention every rank then has the same number of (query, earlier key) pairs: one early and one
  late chunk each.

Either way a rank's local tokens are its slots' chunks concatenated, and the padding sits at
global positions ``>= L``, after every real token. The functions here run on one rank's local
tokens, inside the rewritten graph (positions, the ids' split, the logits' order) and inside
``sequence_blocks`` (which chunk precedes which).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

ORDERS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    rank: int
    world: int
    order: str = "contiguous"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"tsp_order must be one of {ORDERS}, got {self.order!r}")

    @property
    def slots(self) -> int:
        """Chunks per rank."""
        return 2 if self.order == "zigzag" else 1

    @property
    def chunks(self) -> int:
        """Chunks the (padded) sequence is cut into."""
        return self.world * self.slots

    def held_by(self, rank: int) -> tuple[int, ...]:
        """The chunk indices ``rank`` holds, in its local order (slot 0 first)."""
        return (rank, 2 * self.world - 1 - rank) if self.order == "zigzag" else (rank,)

    @property
    def held(self) -> tuple[int, ...]:
        return self.held_by(self.rank)

    def gathered_chunks(self) -> list[int]:
        """The chunk indices of an all-gather of every rank's local tokens, in its (rank) order."""
        return [chunk for rank in range(self.world) for chunk in self.held_by(rank)]

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot) holding ``chunk``."""
        return divmod(self.gathered_chunks().index(chunk), self.slots)

    def halo_offsets(self) -> tuple[int, ...]:
        """Per slot, the ring offset from the rank holding the chunk before that slot's chunk to
        this rank, the same on every rank that receives it from another rank (``comm.shift``'s
        ``offset``): contiguous chunk ``r - 1`` is on rank ``r - 1``; zigzag's first slot's
        predecessor is on rank ``r - 1``, its second slot's (chunk ``2D - 2 - r``) on rank ``r + 1``
        (the last rank's is its own first slot)."""
        return (1, -1) if self.order == "zigzag" else (1,)

    def chunk_size(self, local_length):
        """Tokens per chunk from the local length (works on SymInts)."""
        return local_length // self.slots

    def positions(self, chunk_size, device=None, rank: int | None = None) -> Tensor:
        """(slots * c,) the global positions of ``rank``'s (default: this rank's) local tokens."""
        rank = self.rank if rank is None else rank
        local = torch.arange(chunk_size, device=device)
        return torch.cat([local + chunk * chunk_size for chunk in self.held_by(rank)])

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's local tokens of a replicated ``x`` (dim ``dim`` the whole sequence), padded
        with zeros at the sequence end to ``chunks * c`` tokens. No traffic. Used for the ids,
        which carry no gradient: the backward is the local one (not ``comm.split``'s gather)."""
        dim %= x.dim()
        chunk = (x.shape[dim] + self.chunks - 1) // self.chunks
        shape = list(x.shape)
        shape[dim] = self.chunks * chunk - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(shape)], dim)  # a zero-width pad when L divides evenly
        return torch.cat([padded.narrow(dim, chunk * c, chunk) for c in self.held], dim)

    def in_sequence_order(self, gathered: Tensor, dim: int, length=None) -> Tensor:
        """An all-gather of every rank's local tokens along ``dim`` (rank order) put back in
        sequence order, and its first ``length`` tokens (default: all, padding included)."""
        dim %= gathered.dim()
        chunk = gathered.shape[dim] // self.chunks
        rows = self.gathered_chunks()
        ordered = torch.cat([gathered.narrow(dim, rows.index(c) * chunk, chunk) for c in range(self.chunks)], dim)
        return ordered if length is None else ordered.narrow(dim, 0, length)

    def real_local(self, local: Tensor, dim: int, length) -> Tensor:
        """This rank's local tokens along ``dim`` without the padding: each slot's chunk cut to
        its tokens below ``length`` (a chunk wholly past the end gives none)."""
        dim %= local.dim()
        chunk = self.chunk_size(local.shape[dim])
        pieces = [local.narrow(dim, slot * chunk, torch.sym_max(0, torch.sym_min(chunk, length - c * chunk)))
                  for slot, c in enumerate(self.held)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def real_positions(self, length: int, device=None) -> Tensor:
        """The global positions of :meth:`real_local`'s tokens of a ``length``-token sequence."""
        chunk = -(-length // self.chunks)
        positions = self.positions(chunk, device)
        return positions[positions < length]


def local_positions(arange: Tensor, rank: int, world: int, order: str) -> Tensor:
    """``arange(local length)`` of the rewritten graph made global: each local token's position
    in the whole sequence (rotary embeddings read it)."""
    layout = TokenLayout(rank, world, order)
    return layout.positions(layout.chunk_size(arange.shape[0]), arange.device).to(arange.dtype)


def split_sequence(x: Tensor, dim: int, rank: int, world: int, order: str) -> Tensor:
    """``TokenLayout.split`` as one graph node (the ``tsp`` pass's split of the ids)."""
    return TokenLayout(rank, world, order).split(x, dim)


def sequence_ordered(gathered: Tensor, dim: int, world: int, order: str, length) -> Tensor:
    """``TokenLayout.in_sequence_order`` as one graph node (the ``tsp`` pass's logits)."""
    return TokenLayout(0, world, order).in_sequence_order(gathered, dim, length)


def real_local_tokens(local: Tensor, dim: int, rank: int, world: int, order: str, length) -> Tensor:
    """``TokenLayout.real_local`` as one graph node (the ``tsp`` pass's local logits)."""
    return TokenLayout(rank, world, order).real_local(local, dim, length)
