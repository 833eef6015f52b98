"""Prefill under ``Plan(tsp=D)``: the prompt's tokens split over the ranks, the states handed to
the tensor-parallel decode program (docs/tsp.md, "Generation").

The prefill program is the ``tsp`` pass's (``shard_program(..., sequence_sharded=True)``): each
rank runs ``c`` tokens of the prompt. Decode feeds one token per step, which cannot be split
over ranks, so generation decodes with ``Plan(tp=D)``'s decode program over the same weight
shards (the TSP layout *is* the TP layout). What connects them:

* the prompt is left-padded (masked, positions 0, as HF pads a batch) to fill every chunk: ``D``
  chunks of ``c`` tokens (``2 D`` under ``tsp_order="zigzag"``) with ``c >= `` the widest conv
  kernel, so the prompt's last token is the last token of the rank holding the last chunk (the
  last rank; rank 0 under zigzag) and that chunk holds the whole conv window before it: the
  last-token logits and the SSM and conv states after the prompt are that rank's, which the
  program broadcasts;
* attention keys and values are all-gathered along the positions (in sequence order) by the
  program; the padding added here is cut off again (it is masked, so nothing read it);
* every state, now whole on every rank, is cut to this rank's part of the tensor-parallel
  prefill's state placement, which is what the decode program takes.
"""

from __future__ import annotations

import torch.nn.functional as F

from ..placement import local_slice
from ..token_layout import TokenLayout
from .static_kv import KV_KINDS, KV_POSITIONS


class SequenceShardedPrefill:
    """``(last-token logits, states in the tensor-parallel layout)`` of a prompt, prefilled with
    the tokens split over the ranks. ``program``: this rank's TSP prefill program (bound to the
    local weights); ``tp_prefill``: the tensor-parallel prefill program whose state placements
    the decode program takes."""

    def __init__(self, program, tp_prefill, rank: int):
        self.program = program
        self.rank = rank
        self.world = program.shard["tsp"]
        self.min_chunk = program.shard["min_chunk"]
        self.chunks = TokenLayout(rank, self.world, program.shard["order"]).chunks
        self.state_kinds = [spec.kind for spec in tp_prefill.state_specs]
        self.placements = tp_prefill.shard["outputs"][1:]

    @property
    def config(self):
        return self.program.config

    def __call__(self, input_ids, attention_mask, position_ids, check_inputs: bool = True):
        length = input_ids.shape[1]
        chunk = max(-(-length // self.chunks), self.min_chunk)
        pad = self.chunks * chunk - length
        ids, mask, positions = (F.pad(t, (pad, 0)) for t in (input_ids, attention_mask, position_ids))
        logits, states = self.program(ids, attention_mask=mask, position_ids=positions, check_inputs=check_inputs)
        local = []
        for state, kind, placement in zip(states, self.state_kinds, self.placements):
            if kind in KV_KINDS:
                state = state.narrow(KV_POSITIONS, pad, length)
            local.append(local_slice(state, placement, self.rank).contiguous())
        return logits, local
