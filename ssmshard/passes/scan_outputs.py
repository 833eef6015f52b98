"""The ``scan_outputs`` pass: Mamba-1's scan writes only what the graph reads of it, in the dtype
the graph reads it.

``ssmshard.selective_scan`` returns its output y in float32, as the eager code it replaces does,
and its final state. A bf16 model's forward program casts y back before ``out_proj`` and reads
no final state::

    y, state = selective_scan(u, delta, ...)        # y: (b, d, l) float32; state unread
    y = cat([y], 2)                                 # transformers >= 5.25: the scan's pieces rejoined
    y = transpose(y, 1, 2).to(torch.bfloat16)       # (b, l, d)
    out = linear(y, out_proj_weight)

The cast reads the float32 output and writes it again at half the width, and the one-tensor
``cat`` copies it first: per layer, 1.2 GB of memory traffic at Mamba-2.8B's width for a batch
of 8 x 2048 tokens, for values the scan could have written rounded in the first place. The pass
gives the scan ``out_dtype=torch.bfloat16`` and takes the ``cat`` and the cast out; where
nothing reads the final state, ``final_state=False`` too::

    y, _ = selective_scan(u, delta, ..., out_dtype=torch.bfloat16, final_state=False)
    out = linear(transpose(y, 1, 2), out_proj_weight)

Both together, because the Triton kernel is slower writing bf16 y and the final state than
either alone (on an H200 at 8 x 2048 x 5120, in the eager program's layouts: 1.78 ms against
1.38 ms writing float32 y and the state, 1.46 ms writing bf16 y alone;
benchmarks/results/compile/README.md, "The scan's outputs as the graph reads them").

Same values, bit for bit: the kernel and the reference compute y in float32 and round it once
to the same dtype, to nearest even, as the cast did.

Where it applies: y has one reader, reached through one-tensor ``cat`` nodes and views (each
the only reader of the one before) and ending in a cast to a floating dtype narrower than
float32 (``aten.to.dtype``, or ``aten._to_copy`` with no other option); the cast then goes, and
so do the ``cat`` nodes. The final state is left out where no node reads it. A scan whose y is
read otherwise keeps float32 (the training forward, which autograd differentiates in float32,
is left out by the plan). ``program.scan_output_report`` lists the scans changed.
``Plan(skip_passes=["scan_outputs"])`` turns it off.
"""

from __future__ import annotations

import operator

import torch

from ..ops import SIGNATURES
from .manager import register
from .shard.context import VIEW_OPS, single_user

aten = torch.ops.aten
ssm = torch.ops.ssmshard
_SIGNATURE = SIGNATURES["selective_scan"]
_NARROW = (torch.bfloat16, torch.float16)


def _cast_dtype(node):
    """The dtype ``node`` casts its input to, when it is a plain cast (nothing else asked of it)."""
    if node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _one_tensor_cat(node) -> bool:
    return node.target is aten.cat.default and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 1


def _output_chain(scan):
    """(the cat nodes, the cast node, its dtype) between ``scan``'s first output and the cast it
    ends in, or None where the output is read any other way."""
    firsts = [user for user in scan.users if user.target is operator.getitem and user.args[1] == 0]
    if len(firsts) != 1:
        return None
    cats, node = [], firsts[0]
    while (reader := single_user(node)) is not None:
        dtype = _cast_dtype(reader)
        if dtype is not None:
            return (cats, reader, dtype) if dtype in _NARROW else None
        if _one_tensor_cat(reader):
            cats.append(reader)
        elif reader.target not in VIEW_OPS or reader.args[0] is not node:
            return None
        node = reader
    return None


def _state_unread(scan) -> bool:
    return not any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in scan.users)


@register("scan_outputs")
def scan_outputs(program, ctx):
    report = []
    for scan in list(program.graph.nodes):
        if scan.op != "call_function" or scan.target is not ssm.selective_scan.default:
            continue
        a = _SIGNATURE.bind(scan.args, scan.kwargs)
        chain = _output_chain(scan) if a["out_dtype"] is None else None
        drop_state = a["final_state"] and _state_unread(scan)
        if chain is None and not drop_state:
            continue
        changes = {"final_state": False} if drop_state else {}
        removed = []
        if chain is not None:
            cats, cast, dtype = chain
            changes["out_dtype"] = dtype
            removed = [node.name for node in (*cats, cast)]
            for node in (*cats, cast):
                node.replace_all_uses_with(node.args[0][0] if node in cats else node.args[0])
                program.graph.erase_node(node)
        scan.kwargs = {**scan.kwargs, **changes}
        out_dtype = changes.get("out_dtype", a["out_dtype"])
        report.append({"node": scan.name, "out_dtype": out_dtype and str(out_dtype).removeprefix("torch."),
                       "final_state": not drop_state and a["final_state"], "removed": removed})
    program.scan_output_report = report
    return program
