"""The ``fuse_gated_activation`` pass: a gated MLP's ``act(gate) * up`` as one node.

A gated MLP (Llama's SiLU, Zamba2's GELU) captures its activation and product as two ops::

    act = silu(gate)            # or gelu(gate), gelu(gate, approximate="tanh")
    hidden = mul(act, up)       # then down_proj(hidden)

two launches a layer on a GPU, each a few microseconds for a few KiB at decode
(benchmarks/results/decode_profile/). Where ``act`` is read by the product alone and gate, up and
the product share one shape and dtype (no broadcasting), the two become one call of
``gated_activation_kernel``, which on CUDA tensors runs ``kernels.gated_activation`` and elsewhere
the same two torch ops. The kernel computes the activation with torch's CUDA formulas and rounds
where torch rounds; its exp and erf are libdevice's, whose last bits differ from torch's kernels'
in places, so on a GPU the values are within one rounding step of eager's, not equal (greedy
tokens can differ where two logits nearly tie). Graphed and eager runs of one program use the same
kernel. Llama-3-8B-sized graphed step on an H200: 4.179 / 5.584 ms at batch 1 / 64 with the pass,
4.284 / 5.643 ms without; Zamba2-2.7B (its nine shared MLPs) 2.831 / 7.154 against 2.835 / 7.183 ms
(benchmarks/results/decode_profile/README.md).

Runs on decode programs under the Triton kernels (where launches, not bytes, are the cost),
after the sharding passes; not under ``Plan(compile=True)``, whose Inductor fuses these itself.
``program.gated_activation_report`` counts the fused products by activation.
``Plan(skip_passes=["fuse_gated_activation"])`` turns it off.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .manager import register
from .shard.context import calls, single_user, value_of
from .swap_kernels import KERNEL_DTYPES, _on_gpu

aten = torch.ops.aten


def gated_activation_kernel(gate, up, activation):
    """``act(gate) * up`` (``activation``: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``): one Triton
    launch on CUDA tensors outside grad mode, torch's two ops elsewhere."""
    if _on_gpu(gate) and not torch.is_grad_enabled():
        from ..kernels.gated_activation import gated_activation

        return gated_activation(gate, up, activation)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def _activation(node):
    """``(gate, name)`` when ``node`` is an activation the kernel computes, else None."""
    if calls(node, aten.silu.default) and len(node.args) == 1 and not node.kwargs:
        return node.args[0], "silu"
    if calls(node, aten.gelu.default) and len(node.args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approximate in ("none", "tanh"):
            return node.args[0], "gelu" if approximate == "none" else "gelu_tanh"
    return None


def _alike(values) -> bool:
    """One dtype and shapes known equal (symbolic sizes included)."""
    first = values[0]
    return all(v.dtype == first.dtype and v.dim() == first.dim()
               and all(statically_known_true(x == y) for x, y in zip(v.shape, first.shape)) for v in values)


def _match(product):
    """``(act, gate, up, name)`` for ``product = mul(act(gate), up)`` (either order), or None."""
    if not calls(product, aten.mul.Tensor) or product.kwargs or len(product.args) != 2:
        return None
    for act, up in (product.args, product.args[::-1]):
        found = _activation(act) if isinstance(act, torch.fx.Node) else None
        if found is None or single_user(act) is not product or not isinstance(up, torch.fx.Node):
            continue
        gate, name = found
        values = [value_of(n) for n in (gate, up, product)]
        if all(isinstance(v, torch.Tensor) for v in values) and values[0].dtype in KERNEL_DTYPES and _alike(values):
            return act, gate, up, name
    return None


@register("fuse_gated_activation")
def fuse_gated_activation(program, ctx):
    """Fuse each decode program's ``act(gate) * up`` into one node (module docstring). Option:
    ``compile`` (leave them to Inductor)."""
    report = collections.Counter()
    compiled = ctx is not None and ctx.options.get("compile", False)
    if program.mode == "decode" and not compiled:
        graph = program.graph
        for product in [n for n in graph.nodes if calls(n, aten.mul.Tensor)]:
            found = _match(product)
            if found is None:
                continue
            act, gate, up, name = found
            with graph.inserting_before(product):
                fused = graph.call_function(gated_activation_kernel, (gate, up, name))
            fused.meta.update(product.meta)
            product.replace_all_uses_with(fused)
            graph.erase_node(product)
            graph.erase_node(act)
            report[name] += 1
    program.gated_activation_report = dict(report)
    return program
