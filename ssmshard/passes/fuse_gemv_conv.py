"""The ``fuse_gemv_conv`` pass: a Mamba layer's ``in_proj`` and conv update as one launch at batch 1.

A Mamba or Mamba-2 decode step, after ``decode_gemv``, ``swap_kernels`` and
``inplace_decode_states``, runs per layer::

    y = decode_linear(h, in_proj_weight)                 # (b, 1, n)
    x = <views of y>                                     # features lo .. lo + d: Mamba's x, Mamba-2's xBC
    out, conv_state = conv_update_into_state(x, conv_state, conv_weight, conv_bias, "silu")

where the conv update is one launch that moves a few KiB: at batch 1 its cost is a launch's
latency, not its bytes (Mamba-2.8B: 112 us of a 2395 us step without PDL, 64 launches; the
profile in benchmarks/results/decode_profile/). Channel c of the depthwise conv needs only feature
``lo + c`` of y, and the GEMV kernel's programs own whole features, so ``kernels.gemv_conv``
finishes each conv channel in the program that computed its feature. The pass makes the two
nodes one call of ``gemv_conv_kernel``, which returns ``(y, out, conv_state)``: y whole (the
other features' readers take it as before), the conv's output and its state written in place.
Graphed batch-1 step on an H200: Mamba-2.8B 2.023 ms with the pass against 2.050 without,
Mamba2-2.7B 2.112 against 2.174, Zamba2-2.7B 2.788 against 2.825
(benchmarks/results/decode_profile/README.md).

On a CUDA tensor of one row outside grad mode, with the GEMV kernel allowed at one row
(``SSMSHARD_GEMV_ROWS`` not 0) and x and the weight of one dtype, the call runs the fused kernel,
whose values are the two kernels' bits; anything else (several rows, where the projection goes to
cuBLAS or the tensor-core path; CPU tensors; fake values) runs the two adapters the nodes called.

Where it applies: a conv update on the Triton adapter writing its state in place, whose x is
reached from a ``decode_linear`` adapter's output through views alone (transpose, split, view,
...) and selects, per row, a contiguous range of the output features at one token; its state,
weight and bias defined before the projection, and nothing reading the state between the two.
Decode programs under the Triton kernels, after ``inplace_decode_states`` and ``fold_weights``;
not under ``Plan(compile=True)``, whose opaque ops this does not match.
``program.gemv_conv_report`` lists the fused conv nodes. ``Plan(skip_passes=["fuse_gemv_conv"])``
turns it off.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops import SIGNATURES
from .inplace_states import _WRITERS
from .manager import register
from .shard.context import data_readers, new_node, node_order, value_of, view_source
from .swap_kernels import KERNEL_DTYPES, KERNELS, _on_gpu

aten = torch.ops.aten
ssm = torch.ops.ssmshard

LINEAR = KERNELS[ssm.decode_linear.default][0]
CONV = _WRITERS[KERNELS[ssm.causal_conv1d_update.default][0]][0]
_CONV_SIGNATURE = SIGNATURES["causal_conv1d_update"]


def gemv_conv_kernel(x, weight, bias, conv_state, conv_weight, conv_bias, activation, lo, conv_input_dims):
    """``y = decode_linear(x, weight, bias)`` and the conv update of ``y``'s features ``lo .. lo + d``
    (as a ``conv_input_dims``-d tensor, (b, d, 1) or (b, d)), its new state written into
    ``conv_state``: ``(y, out, conv_state)``. One launch of ``kernels.gemv_conv`` on one CUDA row
    (module docstring), the two adapters otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _on_gpu(x) and not torch.is_grad_enabled() and rows == 1 and x.dtype == weight.dtype:
        from ..kernels.gemv import kernel_max_rows
        from ..kernels.gemv_conv import gemv_conv

        if kernel_max_rows() >= 1:
            y, out = gemv_conv(x, weight, bias, conv_state, conv_weight, conv_bias, activation, lo)
            return y, (out.unsqueeze(-1) if conv_input_dims == 3 else out), conv_state
    y = LINEAR(x, weight, bias)
    conv_input = y.reshape(rows, y.shape[-1])[:, lo:lo + conv_weight.shape[0]]
    out, conv_state = CONV(conv_input.unsqueeze(-1) if conv_input_dims == 3 else conv_input, conv_state,
                           conv_weight, conv_bias, activation)
    return y, out, conv_state


def _projection_of(x):
    """The ``decode_linear`` node ``x`` is a view of, or None."""
    node = x
    while node is not None and not (node.op == "call_function" and node.target is LINEAR):
        node = view_source(node)
    return node


def _channel_offset(y, x, conv_weight):
    """``lo`` when ``x`` selects, per row of the projection's output ``y``, its features ``lo ..
    lo + d`` at one token (their values' strides and storage offsets say so), else None."""
    y_val, x_val, w_val = value_of(y), value_of(x), value_of(conv_weight)
    if not all(isinstance(v, torch.Tensor) for v in (y_val, x_val, w_val)) or w_val.dim() != 2:
        return None
    if y_val.dim() not in (2, 3) or not y_val.is_contiguous() or y_val.storage_offset() != 0:
        return None
    if x_val.dtype != y_val.dtype or y_val.dtype not in KERNEL_DTYPES or x_val.dim() not in (2, 3):
        return None
    n, d, lo = y_val.shape[-1], w_val.shape[0], x_val.storage_offset()
    one_token = x_val.dim() == 2 or x_val.shape[2] == 1
    if not (isinstance(n, int) and isinstance(lo, int) and one_token and x_val.shape[1] == d
            and x_val.stride(1) == 1 and x_val.stride(0) == n and 0 <= lo <= n - d
            and statically_known_true(y_val.shape[0] == x_val.shape[0])):
        return None
    return lo


def _fuse(graph, conv) -> bool:
    a = _CONV_SIGNATURE.bind(conv.args, conv.kwargs)
    x, state = a["x"], a["conv_state"]
    linear = _projection_of(x)
    if linear is None or linear.kwargs or a["activation"] not in (None, "silu"):
        return False
    lo = _channel_offset(linear, x, a["weight"])
    if lo is None or any(u.target is not operator.getitem for u in conv.users):
        return False
    # The fused call stands where the projection stood: what the conv reads must exist by then,
    # and nothing between the two may read the state it now writes earlier.
    order = node_order(graph)
    inputs = [n for n in (state, a["weight"], a["bias"]) if isinstance(n, torch.fx.Node)]
    if any(order[n] >= order[linear] for n in inputs):
        return False
    if any(order[linear] < order[r] < order[conv] for r in data_readers(state)):
        return False
    x_in, weight, bias = (list(linear.args) + [None])[:3]
    with graph.inserting_before(linear):
        fused = new_node(graph, gemv_conv_kernel,
                         (x_in, weight, bias, state, a["weight"], a["bias"], a["activation"], lo,
                          value_of(x).dim()), linear)
        outputs = [new_node(graph, operator.getitem, (fused, i), linear if i == 0 else conv) for i in range(3)]
    for new, old in [(outputs[0], linear)] + [(outputs[1 + g.args[1]], g) for g in conv.users]:
        if "placement" in old.meta:
            new.meta["placement"] = old.meta["placement"]
        old.replace_all_uses_with(new)
    for getter in list(conv.users):
        graph.erase_node(getter)
    graph.erase_node(conv)
    graph.erase_node(linear)
    # The views that led to the conv's input, now read by nothing (the walk stops at a node that
    # is still read: the projection's output, a split whose other parts are).
    node = x
    while not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source
    return True


@register("fuse_gemv_conv")
def fuse_gemv_conv(program, ctx):
    """Fuse each decode program's projection and conv update (module docstring). Option:
    ``compile`` (the opaque ops stay as they are)."""
    fused = []
    compiled = ctx is not None and ctx.options.get("compile", False)
    if program.mode == "decode" and not compiled:
        graph = program.graph
        for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is CONV]:
            if _fuse(graph, conv):
                fused.append(conv.name)
    program.gemv_conv_report = fused
    return program
