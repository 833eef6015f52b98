"""The ``fuse_rmsnorm`` pass: each captured RMSNorm (and the residual add before it) as one node.

Hugging Face's ``MambaRMSNorm`` / ``Mamba2RMSNorm`` / ``Zamba2RMSNorm`` / ``LlamaRMSNorm`` capture
as a chain of small ATen ops::

    h = x.to(float32); v = mean(h.pow(2), [-1], keepdim); y = (h * rsqrt(v + eps)).to(x.dtype)
    out = weight * y

which a GPU runs as 6-8 kernels. The chain becomes one ``ssmshard.rms_norm(x, weight, eps)``
node. Where ``x`` is a residual add (``residual + hidden``, possibly cast to the norm's dtype:
Mamba's ``residual_in_fp32``), add and norm become one ``ssmshard.add_rms_norm`` node returning
both the sum (for every other reader of the residual stream) and the norm. The new nodes carry
the reference ops; ``swap_kernels``, run after, puts them on the Triton kernel
(``kernels/rms_norm.py``). Each new node takes the tags and placement of the node it replaces.

A norm whose input is split along its channels (``Shard``: a placement other than replicated,
partial or sequence-sharded) is left as it is: its mean needs every channel.

``program.norm_fusion_report`` lists every fused norm: node, module, call site, whether the add was fused.
"""

from __future__ import annotations

import operator

import torch

from ..placement import Partial, Replicate, SeqShard
from .manager import register
from .shard.context import single_user, value_of

aten = torch.ops.aten
ssm = torch.ops.ssmshard
_CASTS = (aten.to.dtype, aten._to_copy.default)


def _cast_dtype(node):
    """The dtype ``node`` casts to, or None when it is not a plain dtype cast."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    if node.target is aten.to.dtype:
        extra = set(node.kwargs) - {"non_blocking", "copy", "memory_format"}
        return node.args[1] if len(node.args) > 1 and not extra else None
    extra = set(node.kwargs) - {"dtype", "memory_format"}
    return node.kwargs.get("dtype") if not extra else None


def _other(node, known):
    """The argument of a two-argument ``node`` that is not ``known`` (None if none or both are)."""
    a, b = node.args[:2]
    return b if a is known and b is not known else a if b is known and a is not known else None


def _match_norm(rsqrt):
    """The RMSNorm chain around ``rsqrt``: {x, weight, eps, h (the cast of x to float32, which other
    nodes may read too; None where x is float32 without one), nodes (the rest of the chain, in
    order), out}, or None."""
    add_eps = rsqrt.args[0]
    if not (isinstance(add_eps, torch.fx.Node) and add_eps.target is aten.add.Tensor and not add_eps.kwargs
            and isinstance(add_eps.args[1], float) and len(add_eps.users) == 1):
        return None
    mean = add_eps.args[0]
    if not (isinstance(mean, torch.fx.Node) and mean.target is aten.mean.dim and len(mean.users) == 1
            and list(mean.args[1]) in ([-1], [len(value_of(mean).shape) - 1]) and mean.args[2:3] == (True,)
            and not mean.kwargs):
        return None
    power = mean.args[0]
    if not (power.target is aten.pow.Tensor_Scalar and power.args[1] == 2 and len(power.users) == 1):
        return None
    h = power.args[0]
    scale = single_user(rsqrt)
    if scale is None or scale.target is not aten.mul.Tensor or _other(scale, rsqrt) is not h:
        return None
    if _cast_dtype(h) is torch.float32:
        x = h.args[0]
    elif isinstance(value_of(h), torch.Tensor) and value_of(h).dtype == torch.float32:
        # Already float32 without a cast of its own: SPD's ``base + pending``, whose parts it cast.
        x, h = h, None
    else:
        return None
    back = single_user(scale)
    if back is None or _cast_dtype(back) != value_of(x).dtype or back.args[0] is not scale:
        return None
    out = single_user(back)
    if out is None or out.target is not aten.mul.Tensor or out.kwargs:
        return None
    weight = _other(out, back)
    if weight is None or weight.op != "placeholder" or tuple(value_of(weight).shape) != (value_of(x).shape[-1],):
        return None
    return {"x": x, "weight": weight, "eps": add_eps.args[1],
            "nodes": [power, mean, add_eps, rsqrt, scale, back, out], "h": h, "out": out}


def _match_residual_add(x):
    """The residual add feeding norm input ``x`` (directly or through one dtype cast): (add, cast or
    None), or None. Both operands must have the sum's shape: a broadcast add is no residual."""
    cast, add = (x, x.args[0]) if _cast_dtype(x) is not None else (None, x)
    if not (isinstance(add, torch.fx.Node) and add.target is aten.add.Tensor and not add.kwargs
            and all(isinstance(a, torch.fx.Node) for a in add.args[:2])):
        return None
    shape = str(tuple(value_of(add).shape))
    if any(str(tuple(value_of(a).shape)) != shape for a in add.args[:2]):
        return None
    return add, cast


def _every_channel_local(*nodes) -> bool:
    """Every channel of these values is on this rank (no placement: the program is not sharded).
    A partial sum holds every channel too: SPD's pending partials enter the residual add before a
    norm (``base + pending``), and the fused node computes the same local arithmetic."""
    return all(n.meta.get("placement") is None or isinstance(n.meta["placement"], (Replicate, SeqShard, Partial))
               for n in nodes)


def _call(graph, target, args, like, val, placement):
    node = graph.call_function(target, tuple(args))
    node.meta["ssmshard"] = dict(like.meta["ssmshard"])
    node.meta["val"] = val
    if placement is not None:
        node.meta["placement"] = placement
    return node


def _fuse(graph, match) -> bool:
    """Rewrite one matched norm; True if its residual add was fused too."""
    x, weight, eps, out = match["x"], match["weight"], match["eps"], match["out"]
    residual = _match_residual_add(x)
    if residual is not None and not _every_channel_local(residual[0], *residual[0].args[:2]):
        residual = None
    if residual is None:
        with graph.inserting_before(out):
            fused = _call(graph, ssm.rms_norm.default, (x, weight, eps), out, value_of(out), out.meta.get("placement"))
        out.replace_all_uses_with(fused)
    else:
        add, cast = residual
        norm_dtype = value_of(x).dtype
        with graph.inserting_after(add):
            both = _call(graph, ssm.add_rms_norm.default, (add.args[1], add.args[0], weight, eps, norm_dtype),
                         out, (value_of(add), value_of(out)),
                         (add.meta.get("placement"), out.meta.get("placement")) if "placement" in out.meta else None)
        with graph.inserting_after(both):
            summed = _call(graph, operator.getitem, (both, 0), add, value_of(add), add.meta.get("placement"))
        with graph.inserting_after(summed):
            normed = _call(graph, operator.getitem, (both, 1), out, value_of(out), out.meta.get("placement"))
        out.replace_all_uses_with(normed)
    for node in reversed(match["nodes"]):
        graph.erase_node(node)
    # Export shares one float32 cast between the norm and the block's residual: erase it when unread.
    if match["h"] is not None and not match["h"].users:
        graph.erase_node(match["h"])
    if residual is not None:
        if cast is not None and not cast.users:
            graph.erase_node(cast)
        add.replace_all_uses_with(summed)
        graph.erase_node(add)
    return residual is not None


@register("fuse_rmsnorm")
def fuse_rmsnorm(program, ctx):
    """Replace every RMSNorm chain (and the residual add before it) by one node (module docstring)."""
    graph = program.graph
    report = []
    for rsqrt in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.rsqrt.default]:
        match = _match_norm(rsqrt)
        if match is None or not _every_channel_local(match["x"], match["out"]):
            continue
        tags = match["out"].meta.get("ssmshard", {})
        entry = {"node": rsqrt.name, "module": tags.get("module"), "call_site": tags.get("call_site")}
        entry["residual_add"] = _fuse(graph, match)
        report.append(entry)
    program.norm_fusion_report = report
    return program
