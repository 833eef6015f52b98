"""Collective ops for tensor parallelism, as graph nodes with Megatron-style autograd.

``all_reduce``   sum over the group; backward is the identity (the gradient of a replicated
                 output is already the same on every rank).
``tp_copy``      identity; backward all-reduces: where a replicated activation enters a
                 sharded region, each rank's gradient is a partial sum.
``all_gather``   concatenate every rank's shard along ``dim``; backward keeps this rank's slice.

The ``group`` argument is a name registered with :func:`register_group`, so graphs stay
plain data (no process-group objects in them) and one graph can serve any launcher.

A collective that fails (a rank left, failed, skipped it, or the process group's timeout
passed) raises :class:`CollectiveError` naming this rank, the collective and the group.
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


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank; the message names the rank, op and group."""


def _timeout_seconds(pg) -> float | None:
    """The timeout ``pg`` was created with, where this torch exposes it (a private attribute)."""
    try:
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001  (only used to word an error message)
        return None


def _run_collective(what: str, group: str, pg, run):
    """``run()``, with a failure re-raised as one that says which rank waited in what."""
    try:
        return run()
    except RuntimeError as exc:
        rank, world = dist.get_rank(), dist.get_world_size(pg)
        timeout = _timeout_seconds(pg)
        bound = f"the process group's timeout ({timeout:g} s)" if timeout else "the process group's timeout"
        # The cause's traceback only shows torch.distributed's frames: its message is kept whole.
        raise CollectiveError(
            f"rank {rank} waited in {what} over process group {group!r} ({world} ranks) and it failed. "
            f"Another rank failed, left, or did not call this {what} (every rank must run the same "
            f"collectives in the same order); a wait is bounded by {bound} (ssmshard.launch(timeout=...) "
            f"or SSMSHARD_TIMEOUT).\n{type(exc).__name__}: {str(exc).strip()}") from None


@torch.library.custom_op("ssmshard::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    out = x.contiguous().clone()
    pg = resolve_group(group)
    _run_collective("all_reduce", group, pg, lambda: dist.all_reduce(out, group=pg))
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
    _run_collective("all_gather", group, pg, lambda: dist.all_gather(parts, x.contiguous(), group=pg))
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
