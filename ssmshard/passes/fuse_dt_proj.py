"""The ``fuse_dt_proj`` pass: Mamba-1's ``dt_proj`` folded into the decode step's state update.

Dimension letters: b batch, r dt rank (``dt_proj``'s input features), d channels (of this rank).

A Mamba-1 decode step projects dt from rank r to the d channels and hands it to the state
update. The projection reads 2 d r bytes (1.6 MB for Mamba-2.8B) yet, as a kernel of its own,
costs a dependent launch like any other (benchmarks/results/decode_profile/). The state update
kernel computes its channels' dt itself when given ``dt_proj_weight`` (``kernels/state_update.py``),
rounded to dt's dtype as the projection's output was: after ``decode_gemv`` the step reads::

    rows (b, 1, r) -> decode_linear(rows, W (d, r), None) (b, 1, d) -> transpose (b, d, 1)
                   -> select(-1, 0) (b, d) -> selective_state_update(state, x, dt=that, ...)

and becomes ``selective_state_update(state, x, select(rows, 1, 0) (b, r), ..., dt_proj_weight=W)``.
Each intermediate must be read only by the next; anything else is left as it is. Mamba-2 layers
(dt per head, no projection) and Zamba's stacked mixers do not have the pattern.

Runs after the sharding passes (the state update's sharding rule refuses the folded form) and
``decode_gemv``, before ``swap_kernels``. ``program.dt_proj_fusion_report`` names the fused state
updates. ``Plan(skip_passes=["fuse_dt_proj"])`` turns it off.
"""

from __future__ import annotations

import torch

from ..ops import SIGNATURES
from ..placement import Replicate
from .manager import register
from .shard.context import new_node, single_user, value_of

aten = torch.ops.aten
ssm = torch.ops.ssmshard
_ARGUMENTS = SIGNATURES["selective_state_update"].names
_DT, _WEIGHT = _ARGUMENTS.index("dt"), _ARGUMENTS.index("dt_proj_weight")


def _shape(node):
    value = value_of(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _projection(update):
    """``(rows, weight)`` of the ``dt_proj`` whose output is ``update``'s dt, or None."""
    if update.kwargs or len(update.args) <= _DT or (len(update.args) > _WEIGHT and update.args[_WEIGHT] is not None):
        return None
    dt = update.args[_DT]
    if not (single_user(dt) is update and dt.target is aten.select.int and dt.args[2] == 0):
        return None
    transposed = dt.args[0]
    if not (single_user(transposed) is dt and transposed.target is aten.transpose.int):
        return None
    linear = transposed.args[0]
    if not (single_user(linear) is transposed and linear.target is ssm.decode_linear.default):
        return None
    rows, weight, bias = (list(linear.args) + [None])[:3]
    b, d = _shape(dt) or (None, None)
    if bias is not None or linear.kwargs or _shape(rows) is None or len(_shape(rows)) != 3:
        return None
    r = _shape(rows)[2]
    # (b, 1, r) -> (b, 1, d) -> (b, d, 1) -> (b, d): the projection of one token, transposed back
    if (_shape(rows) != (b, 1, r) or _shape(linear) != (b, 1, d) or _shape(transposed) != (b, d, 1)
            or _shape(weight) != (d, r) or update.args[0].meta["val"].dim() != 3):
        return None
    if not isinstance(rows.meta.get("placement", Replicate()), Replicate):
        return None  # a split rank dim would need a reduction inside the kernel
    return rows, weight


@register("fuse_dt_proj")
def fuse_dt_proj(program, ctx):
    """Fold each Mamba-1 ``dt_proj`` of a decode program into its state update (module docstring)."""
    if program.mode != "decode":
        return program
    graph = program.graph
    report = []
    for update in list(graph.nodes):
        if update.op != "call_function" or update.target is not ssm.selective_state_update.default:
            continue
        found = _projection(update)
        if found is None:
            continue
        rows, weight = found
        dt = update.args[_DT]
        transposed, linear = dt.args[0], dt.args[0].args[0]
        with graph.inserting_before(update):
            low = new_node(graph, aten.select.int, (rows, 1, 0), dt)
        if "placement" in rows.meta:
            low.meta["placement"] = rows.meta["placement"]
        args = list(update.args) + [None] * max(0, _WEIGHT + 1 - len(update.args))
        args[_DT], args[_WEIGHT] = low, weight
        update.args = tuple(args)
        for node in (dt, transposed, linear):
            graph.erase_node(node)
        report.append(update.name)
    program.dt_proj_fusion_report = report
    return program
