"""The ``collectives`` pass: account for every collective the ``shard`` pass inserted.

Each collective node gets ``meta["ssmshard"]["sync"]`` (all_reduce | all_gather), the bytes
it moves per token, and a stable ``sync_id`` that later passes (sync-point drop, quantised
all-reduce) use to name it. ``program.collectives`` lists them for reports.
"""

from __future__ import annotations

import torch

from .manager import register

_COLLECTIVES = {torch.ops.ssmshard.all_reduce.default: "all_reduce",
                torch.ops.ssmshard.all_gather.default: "all_gather"}


def _bytes_per_token(val) -> int:
    # Activations are (batch, seq, ...) or (batch, ..., seq) at these sites; per token is
    # everything but batch and sequence: the static sizes.
    numel = 1
    for size in val.shape:
        if isinstance(size, int):
            numel *= size
    return numel * val.dtype.itemsize


@register("collectives", analysis_only=True)
def collectives(program, ctx):
    rows = []
    for node in program.graph.nodes:
        kind = _COLLECTIVES.get(node.target)
        if kind is None:
            continue
        tags = node.meta["ssmshard"]
        val = node.args[0].meta["val"]
        tags.update(sync=kind, sync_id=len(rows), bytes_per_token=_bytes_per_token(val))
        rows.append({"id": len(rows), "op": kind, "node": node.name, "layer": tags["layer"],
                     "block": tags["block"], "role": tags["role"], "dtype": str(val.dtype).replace("torch.", ""),
                     "bytes_per_token": tags["bytes_per_token"]})
    program.collectives = rows
    return program
