"""Packed variable-length batches: several sequences laid end to end in one row.

``pack(sequences)`` concatenates token sequences into ``input_ids`` of shape (1, T) and
describes the boundaries with ``cu_seqlens``, the int32 offsets (S+1,) that varlen kernels
take (``cu_seqlens[s]`` is where sequence s starts, ``cu_seqlens[-1] == T``), plus
``position_ids`` restarting at 0 in every sequence (what rotary attention needs).
``pack(..., pad_to_multiple_of=16)`` rounds T up with filler tokens at the row's end, as a
padding collator does: token rows whose length is a multiple of 8 or 16 let cuBLAS pick its
aligned GEMM kernels and the scan kernels their vector loads. The filler is a sequence of its
own in ``cu_seqlens`` (the kernels need offsets that reach T) and comes last, so no real
token's output depends on it; ``lengths``, ``num_sequences`` and ``unpack`` leave it out.

A program captured with ``capture(model, packed=True)`` runs such a batch as if every
sequence were run on its own: scans restart from a zero state at each sequence start, conv
taps never reach into the previous sequence, and attention is block-diagonal causal.

The helpers below turn ``cu_seqlens`` into per-token facts. They are plain torch ops with no
data-dependent Python control flow, so the captured graph computes them from its
``cu_seqlens`` input, and the reference kernels use the same definitions.

Dimension letters: T packed length (tokens of all sequences), S number of sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor


@dataclasses.dataclass
class PackedBatch:
    """Sequences packed into one row. ``unpack`` splits a (1, T, ...) result back per sequence."""

    input_ids: Tensor  # (1, T) token ids of all sequences, end to end
    cu_seqlens: Tensor  # (S + 1,) int32 offsets: sequence s is input_ids[0, cu[s]:cu[s+1]]
    position_ids: Tensor  # (1, T) position of each token inside its own sequence
    padding: int = 0  # filler tokens at the end (the last entry of cu_seqlens when > 0)

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1 - bool(self.padding)

    @property
    def lengths(self) -> list[int]:
        """Lengths of the real sequences (the filler left out)."""
        return torch.diff(self.cu_seqlens).tolist()[:self.num_sequences]

    def unpack(self, packed: Tensor) -> list[Tensor]:
        """Split ``packed`` (1, T, ...) into one (1, L_s, ...) view per sequence, in packing order
        (the filler dropped).

        The batch dim is kept so that each piece has the shape a batch-1 run of that sequence
        alone would produce.
        """
        total = int(self.cu_seqlens[-1])
        if packed.dim() < 2 or packed.shape[0] != 1 or packed.shape[1] != total:
            raise ValueError(f"unpack expects a (1, {total}, ...) tensor (batch 1, the packed length), "
                             f"got {tuple(packed.shape)}")
        return list(torch.split(packed, torch.diff(self.cu_seqlens).tolist(), dim=1))[:self.num_sequences]

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.cu_seqlens.to(device), self.position_ids.to(device),
                           self.padding)


def pack(sequences: Sequence, pad_to_multiple_of: int = 1, pad_id: int = 0) -> PackedBatch:
    """Pack token sequences (1-D tensors, (1, L) tensors or lists of ints) into one row.

    ``pad_to_multiple_of``: append filler tokens (``pad_id``) as one more sequence until the
    row's length is a multiple of this (see the module docstring); 1 adds none."""
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if len(sequences) == 0:
        raise ValueError("pack() needs at least one sequence")
    rows = []
    for index, seq in enumerate(sequences):
        ids = torch.as_tensor(seq)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]  # (1, L) -> (L,)
        if ids.dim() != 1:
            raise ValueError(f"sequence {index} has shape {tuple(ids.shape)}; expected (L,) or (1, L) token ids")
        if ids.numel() == 0:
            raise ValueError(f"sequence {index} is empty; every packed sequence needs at least one token")
        if ids.is_floating_point():
            raise TypeError(f"sequence {index} holds {ids.dtype} values; token ids must be integers")
        rows.append(ids.long())
    device = rows[0].device
    padding = -sum(r.numel() for r in rows) % pad_to_multiple_of
    if padding:
        rows.append(torch.full((padding,), pad_id, dtype=torch.long, device=device))
    lengths = torch.tensor([r.numel() for r in rows], device=device)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (S + 1,)
    input_ids = torch.cat([r.to(device) for r in rows])[None]  # (T,) -> (1, T)
    position_ids = positions_in_sequence(cu_seqlens, input_ids.shape[1])[None]  # (T,) -> (1, T)
    return PackedBatch(input_ids, cu_seqlens, position_ids, padding)


# ----------------------------------------------------------------- per-token facts (traceable)


def sequence_ids(cu_seqlens: Tensor, length: int) -> Tensor:
    """(T,) int64: the index of the sequence each token belongs to."""
    tokens = torch.arange(length, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    # Token t belongs to sequence s when cu[s] <= t < cu[s+1]: s + 1 offsets are <= t. (No
    # slicing of cu_seqlens: a slice's contiguity check would narrow the traced range of S.)
    return torch.searchsorted(cu_seqlens, tokens, right=True) - 1


def positions_in_sequence(cu_seqlens: Tensor, length: int) -> Tensor:
    """(T,) int64: each token's offset from the start of its own sequence."""
    tokens = torch.arange(length, device=cu_seqlens.device)
    return tokens - cu_seqlens.long()[sequence_ids(cu_seqlens, length)]


def block_causal_mask(cu_seqlens: Tensor, length: int) -> Tensor:
    """(1, 1, T, T) bool attention mask, True where query i may attend key j.

    Causal within a sequence, nothing across sequences: the block-diagonal mask that makes a
    packed attention equal to separate runs.
    """
    seq = sequence_ids(cu_seqlens, length)
    tokens = torch.arange(length, device=cu_seqlens.device)
    allowed = (seq[:, None] == seq[None, :]) & (tokens[:, None] >= tokens[None, :])  # (T, T)
    return allowed[None, None]  # (T, T) -> (1, 1, T, T)


# ----------------------------------------------------------------- validation (eager only)


def check_cu_seqlens(cu_seqlens: Tensor, length: int, batch: int = 1) -> None:
    """Raise unless ``cu_seqlens`` describes non-empty sequences covering all ``length`` tokens.

    Reads values, so it runs in eager code (program calls, reference kernels), never in a graph.
    """
    check_cu_seqlens_layout(cu_seqlens, batch)
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != length:
        raise ValueError(f"cu_seqlens must run from 0 to the packed length {length}; "
                         f"got {first} .. {last}")
    if not bool((torch.diff(cu_seqlens) > 0).all()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequences); got {cu_seqlens.tolist()}")


def check_cu_seqlens_layout(cu_seqlens: Tensor, batch: int) -> None:
    """The shape-and-dtype part of :func:`check_cu_seqlens` (safe on fake tensors)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of sequence offsets, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens needs at least two entries (0 and the packed length)")
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {batch}: pack all "
                         "sequences into one row with ssmshard.pack")


def packed_call_inputs(input_ids, cu_seqlens=None, position_ids=None) -> tuple[Tensor, Tensor]:
    """(input_ids (1, T), cu_seqlens int32) for a packed program, from a PackedBatch or tensors.

    Given ``position_ids`` must be the ones ``cu_seqlens`` implies (restarting at 0 in every
    sequence): a packed program derives positions from ``cu_seqlens``, so any other positions
    would be silently replaced.
    """
    if isinstance(input_ids, PackedBatch):
        if cu_seqlens is not None or position_ids is not None:
            raise TypeError("pass either a PackedBatch or input_ids with cu_seqlens/position_ids, not both")
        input_ids, cu_seqlens, position_ids = input_ids.input_ids, input_ids.cu_seqlens, input_ids.position_ids
    if cu_seqlens is None:
        raise ValueError("this program was captured for packed sequences (packed=True): call it with a "
                         "PackedBatch from ssmshard.pack(...), or with input_ids of shape (1, T) and "
                         "cu_seqlens=")
    if input_ids.dim() != 2:
        raise ValueError(f"packed input_ids must have shape (1, T), got {tuple(input_ids.shape)}")
    check_cu_seqlens(cu_seqlens, input_ids.shape[1], batch=input_ids.shape[0])
    cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
    if position_ids is not None:
        expected = positions_in_sequence(cu_seqlens, input_ids.shape[1])[None]  # (1, T)
        if position_ids.shape != expected.shape or not torch.equal(position_ids.to(expected), expected):
            raise ValueError("position_ids must restart at 0 at every sequence start given by cu_seqlens "
                             "(ssmshard.pack builds them); a packed program derives positions from "
                             "cu_seqlens and cannot honour others")
    return input_ids, cu_seqlens


def refuse_packing_info(mode: str, input_ids, cu_seqlens=None, position_ids=None) -> None:
    """For a program captured without packing: raise if the call carries sequence boundaries.

    ``position_ids`` are accepted only when they say what the program assumes anyway
    (0 .. L-1 in every row); restarts mean packed sequences, which this program would mix.
    """
    how = "capture the model with ssmshard.capture(model, packed=True) (or parallelize(..., packed=True))"
    if isinstance(input_ids, PackedBatch) or cu_seqlens is not None:
        raise ValueError(f"this {mode} program was captured without packing and would run packed "
                         f"sequences as one: {how}")
    if position_ids is None:
        return
    if mode == "decode":
        raise ValueError("decode programs take their positions from the states; do not pass position_ids")
    batch, length = input_ids.shape
    plain = torch.arange(length, device=position_ids.device).expand(batch, length)
    if tuple(position_ids.shape) not in ((batch, length), (1, length)) or not torch.equal(
            position_ids.expand(batch, length).to(plain), plain):
        raise ValueError("position_ids other than 0..L-1 per row (e.g. restarts of packed sequences) "
                         f"are not supported by an unpacked program: {how}")
