"""A linear layer over weight shards passed around a ring (``Plan(tsp=D, tsp_weights="ring")``).

Under ``Plan(tsp=D)`` each rank holds one shard of a weight (the tensor-parallel layout) and its
own tokens ``x``, and needs ``x @ W^T`` with the whole ``W``. :func:`ring_linear` computes it
without ever holding ``W``: in ``D`` steps, at step ``k`` rank ``r`` holds the shard of rank
``(r - k) mod D``. Each step first starts sending that shard to rank ``r + 1`` and receiving
the next one from ``r - 1`` (``CollectiveBackend.start_shifts``: non-blocking point-to-point),
then computes the part of the output that shard gives, then waits. So at most two shards are
in flight on a rank (the one in use and the one arriving), and the transfer runs while the
step's matmul does.

* weight split by output rows (``Shard(0, ...)``: in_proj, q/k/v, gate/up): the step writes the
  output columns the shard's rows are;
* weight split by input columns (``Shard(1, ...)``: out_proj, o_proj, down_proj): the step adds
  ``x[..., the shard's columns] @ shard^T`` into an accumulator.

A segment cut into fewer than ``D`` pieces is held by several ranks; each of its pieces is used
from the first rank holding it (``comm.weights.weight_pieces``, the gather's choice too), so
every row of ``W`` is used once.

Backward runs two rings per step: the shards again (``grad_x`` from the shard in use), and a
gradient accumulator per owner travelling the other way (to rank ``r - 1``): at step ``k`` rank
``r`` adds its tokens' gradient for the shard of rank ``(r + 1 + k) mod D`` and passes the sum
on; after ``D - 1`` hops the owner holds the sum over every rank's tokens, what the all-gather's
reduce-scatter gives (rows a rank holds but does not use get zeros there too).

Autograd saves ``x`` and the local shard, never the whole weight.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from ..placement import Shard
from .groups import backend_of, rank_of, world_of
from .weights import weight_pieces


def ring_layout(placement: Shard, world: int) -> list[int]:
    """:func:`~ssmshard.comm.weights.weight_pieces` flattened (a custom op takes a list of ints):
    which rank's shard each piece of the whole weight is used from, and where it sits in that
    shard and in the whole weight. ``world`` is checked against the placement's pieces."""
    pieces = weight_pieces(placement)
    if any(owner >= world for owner, *_ in pieces):
        raise ValueError(f"{placement} names ranks beyond a ring of {world}")
    return [value for piece in pieces for value in piece]


def _pieces_by_owner(layout: list[int], world: int) -> list[list[tuple[int, int, int]]]:
    by_owner = [[] for _ in range(world)]
    for i in range(0, len(layout), 4):
        owner, local, whole, length = layout[i:i + 4]
        by_owner[owner].append((local, whole, length))
    return by_owner


# --------------------------------------------------------------------------- instrumentation
# Per thread: the ranks of a SimulatedGroup are threads of one process, each with its own count.
_RECORDERS = threading.local()


def _recorders() -> list[dict]:
    if not hasattr(_RECORDERS, "active"):
        _RECORDERS.active = []
    return _RECORDERS.active


@contextlib.contextmanager
def record_shards_in_flight():
    """Within the block, the peak bytes of received weight shards alive at once on this rank
    (``{"peak_bytes": .., "shard_bytes": ..}``), each counted from the allocation of its receive
    buffer until the tensor is freed (its lifetime, not a formula)."""
    record = {"live": 0, "peak_bytes": 0, "shard_bytes": 0}
    _recorders().append(record)
    try:
        yield record
    finally:
        _recorders().remove(record)


def _tracked(pending):
    """``pending`` (started shifts, the weight shard's first), its arriving shard counted alive
    from its allocation until it is freed."""
    shard = pending.buffers[0]
    size = shard.numel() * shard.element_size()
    for record in _recorders():
        record["live"] += size
        record["peak_bytes"] = max(record["peak_bytes"], record["live"])
        record["shard_bytes"] = max(record["shard_bytes"], size)
        weakref.finalize(shard, _release, record, size)
    return pending


def _release(record: dict, size: int) -> None:
    record["live"] -= size


# --------------------------------------------------------------------------- the op
def _output_width(shard: Tensor, dim: int, whole: int) -> int:
    """Column-parallel: the whole weight's rows; row-parallel: the shard's rows (all of them)."""
    return whole if dim == 0 else shard.shape[0]


@torch.library.custom_op("ssmshard::ring_matmul", mutates_args=())
def ring_matmul(x: Tensor, shard: Tensor, dim: int, whole: int, layout: list[int], group: str) -> Tensor:
    """``x @ W^T`` where ``W`` (``whole`` long along ``dim``) is assembled from every rank's
    ``shard`` as ``layout`` (:func:`ring_layout`) says; the shards go around the ring."""
    backend, rank, world = backend_of(group), rank_of(group), world_of(group)
    pieces = _pieces_by_owner(layout, world)
    out = x.new_zeros((*x.shape[:-1], _output_width(shard, dim, whole)))
    current = shard
    for step in range(world):
        pending = _tracked(backend.start_shifts([(current, 1)])) if step < world - 1 else None
        for local, start, length in pieces[(rank - step) % world]:
            if dim == 0:
                out.narrow(-1, start, length).copy_(F.linear(x, current.narrow(0, local, length)))
            else:
                out.add_(F.linear(x.narrow(-1, start, length), current.narrow(1, local, length)))
        if pending is not None:
            current = pending.wait()[0]
    return out


@ring_matmul.register_fake
def _(x, shard, dim, whole, layout, group):
    return x.new_empty((*x.shape[:-1], _output_width(shard, dim, whole)))


@torch.library.custom_op("ssmshard::ring_matmul_backward", mutates_args=())
def ring_matmul_backward(grad: Tensor, x: Tensor, shard: Tensor, dim: int, layout: list[int],
                         group: str) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_shard)`` of :func:`ring_matmul`: ``grad_shard`` is the sum over every
    rank's tokens of the gradient of the rows this rank's shard is used for."""
    backend, rank, world = backend_of(group), rank_of(group), world_of(group)
    pieces = _pieces_by_owner(layout, world)
    tokens, grad_tokens = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    grad_x = torch.zeros_like(x)
    current, accumulated = shard, torch.zeros_like(shard)
    for step in range(world):
        # This rank's tokens' share of the gradient of the shard the accumulator is headed for.
        for local, start, length in pieces[(rank + 1 + step) % world]:
            if dim == 0:
                accumulated.narrow(0, local, length).add_(grad_tokens.narrow(-1, start, length).T @ tokens)
            else:
                accumulated.narrow(1, local, length).add_(grad_tokens.T @ tokens.narrow(-1, start, length))
        last = step == world - 1
        pending = None if last else _tracked(backend.start_shifts([(current, 1), (accumulated, -1)]))
        for local, start, length in pieces[(rank - step) % world]:
            if dim == 0:
                grad_x.add_(grad.narrow(-1, start, length) @ current.narrow(0, local, length))
            else:
                grad_x.narrow(-1, start, length).add_(grad @ current.narrow(1, local, length))
        if pending is not None:
            current, accumulated = pending.wait()
    return grad_x, accumulated


@ring_matmul_backward.register_fake
def _(grad, x, shard, dim, layout, group):
    return torch.empty_like(x), torch.empty_like(shard)


def _ring_setup(ctx, inputs, output):
    x, shard, ctx.dim, _, ctx.layout, ctx.group = inputs
    ctx.save_for_backward(x, shard)


def _ring_backward(ctx, grad):
    x, shard = ctx.saved_tensors
    grad_x, grad_shard = ring_matmul_backward(grad.contiguous(), x, shard, ctx.dim, ctx.layout, ctx.group)
    return grad_x, grad_shard, None, None, None, None


ring_matmul.register_autograd(_ring_backward, setup_context=_ring_setup)


def ring_linear(x: Tensor, shard: Tensor, bias, dim: int, whole: int, layout: list[int], group: str) -> Tensor:
    """``F.linear(x, W, bias)`` with ``W`` from the ring of shards (:func:`ring_matmul`); ``bias`` is
    whole (a sharded bias is gathered: a vector, not worth a ring)."""
    out = ring_matmul(x, shard, dim, whole, layout, group)
    return out if bias is None else out + bias
