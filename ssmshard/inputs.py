"""Checks of what a user hands a program, before anything runs.

A sharded program can turn bad input into plausible numbers: a vocab-parallel embedding
masks the ids outside each rank's slice, so an id >= vocab_size (or < 0) is outside every
slice and embeds as zeros instead of failing as ``nn.Embedding`` does. Every entry point
therefore checks its ids here, on every rank, before the first op: the same ids reach every
rank, so all ranks raise alike and none is left waiting in a collective.

The checks cost one reduction over the ids (a host sync on GPU), so the generation loop skips
them for the tokens it picked itself (always in range), not for the prompt.
"""

from __future__ import annotations

import torch


def check_input_ids(input_ids, vocab_size: int | None, device: torch.device | None = None, *,
                    what: str = "input_ids") -> None:
    """Raise for ids that are not a (batch, seq) integer tensor of real tokens on ``device``.

    ``IndexError`` (what ``nn.Embedding`` raises in eager HF) for an id outside
    ``[0, vocab_size)``, naming the id, where it is and the vocabulary size.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"{what} must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"{what} must have shape (batch, sequence), got {tuple(input_ids.shape)}"
                         + ("; add a batch dim with ids[None]" if input_ids.dim() == 1 else ""))
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{what} of shape {tuple(input_ids.shape)} is empty: every row needs at least one token")
    if input_ids.device.type == "meta":
        raise ValueError(f"{what} is on the meta device (shapes only, no values); pass real token ids")
    if device is not None and device.type != "meta" and input_ids.device != device:
        raise ValueError(f"{what} is on {input_ids.device} but the weights are on {device}; "
                         f"move it with {what}.to({str(device)!r})")
    if vocab_size is None:
        return
    low, high = torch.aminmax(input_ids)
    low, high = int(low), int(high)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        where = tuple(int(i) for i in (input_ids == bad).nonzero()[0])
        raise IndexError(f"token id {bad} at {what}{list(where)} is out of range: the vocabulary has "
                         f"{vocab_size} entries (ids 0..{vocab_size - 1})")

