"""Collective ops for tensor parallelism, as graph nodes with Megatron-style autograd.

``all_reduce``   sum over the group; backward is the identity (the gradient of a replicated
                 output is already the same on every rank).
``tp_copy``      identity; backward all-reduces: where a replicated activation enters a
                 sharded region, each rank's gradient is a partial sum.
``all_gather``   concatenate every rank's shard along ``dim``; backward keeps this rank's slice.

The ``group`` argument is a name registered with :func:`register_group`, so graphs stay
plain data (no process-group objects in them) and one graph can serve any launcher.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_GROUPS: dict[str, object] = {}


def register_group(name: str, group) -> None:
    _GROUPS[name] = group


def resolve_group(name: str):
    if name not in _GROUPS:
        raise RuntimeError(f"process group {name!r} is not registered; create the DistributedModule "
                           "through ssmshard.parallelize inside an initialised process group")
    return _GROUPS[name]


@torch.library.custom_op("ssmshard::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=resolve_group(group))
    return out


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


all_reduce.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("ssmshard::tp_copy", mutates_args=())
def tp_copy(x: Tensor, group: str) -> Tensor:
    return x.clone()


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _tp_copy_setup(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(lambda ctx, grad: (all_reduce(grad, ctx.group), None), setup_context=_tp_copy_setup)


@torch.library.custom_op("ssmshard::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group: str) -> Tensor:
    pg = resolve_group(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x, dim, group):
    # The group's size is not known to the fake kernel; the pass that inserts the node sets the
    # shape itself (see passes/shard.py), so this is only used when re-propagating.
    shape = list(x.shape)
    shape[dim] = shape[dim] * _fake_world(group)
    return x.new_empty(shape)


def _fake_world(group: str) -> int:
    if group in _GROUPS:
        return dist.get_world_size(_GROUPS[group])
    return _FAKE_SIZES.get(group, 1)


_FAKE_SIZES: dict[str, int] = {}


def declare_group_size(name: str, size: int) -> None:
    """Let fake propagation know a group's size before the group exists (passes run first)."""
    _FAKE_SIZES[name] = size


def _all_gather_setup(ctx, inputs, output):
    ctx.dim, ctx.group, ctx.local = inputs[1], inputs[2], inputs[0].shape[inputs[1]]


def _all_gather_backward(ctx, grad):
    rank = dist.get_rank(resolve_group(ctx.group))
    return grad.narrow(ctx.dim, rank * ctx.local, ctx.local).contiguous(), None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)
