"""Collective ops as ``torch.ops.ssmshard.*`` graph nodes, with fake kernels and autograd.

N is the group's size, r this rank, x_k rank k's input, y_r rank r's output. ``group`` is a
name (see :mod:`ssmshard.comm.groups`). Every backward is made of these same ops (and local
slicing), so every rank runs the same collectives in the same order and a traced backward stays
a graph of them.

Gradient conventions: a *replicated* output is used identically by every rank (one loss, the
same upstream gradient everywhere); a *sharded* output feeds per-rank computation whose losses
add up over ranks (the upstream gradient differs by rank). Each op says which it assumes.

Uneven splits (reduce_scatter / all_gather along a dim of length L, any L >= 0 and N): the dim
is padded with zeros up to N * c, c = ceil(L / N), and rank r owns rows [r*c, (r+1)*c) of the
padded dim. Every rank's local shape is the same; rows at or past L are zeros, so when N does
not divide L the last rank holds some zero rows, and a rank with r*c >= L holds only zeros
(ranks 1.. when L = 1). ``all_gather(..., length=L)`` drops those rows again; their gradient is
zero.

=====================================  =====================================  ===========================
op                                     forward                                backward (gradient in)
=====================================  =====================================  ===========================
all_reduce(x, group)                   sum_k x_k                              identity (replicated out)
tp_copy(x, group)                      x (replicated in)                      all_reduce (sharded out)
reduce_scatter(x, dim, group)          rows of rank r of pad(sum_k x_k)       all_gather_partial_grad
split(x, dim, group)                   rows of rank r of pad(x) (replicated   all_gather
                                       in, no traffic)
all_gather(x, dim, group, length)      cat_k x_k along dim, first length      rows of rank r (replicated)
all_gather_partial_grad(same args)     same as all_gather                     reduce_scatter (sharded out)
all_to_all(x, split_dim, concat_dim,   chunk r of every x_k (split_dim cut    all_to_all(concat_dim,
           group)                      into N), cat over k along concat_dim   split_dim): the inverse
broadcast(x, src, group)               x_src                                  reduce(dst=src)
reduce(x, dst, group)                  sum_k x_k on dst, zeros elsewhere      broadcast(src=dst)
shift(x, group, offset=1)              x_(r - offset mod N)                   shift(-offset)
=====================================  =====================================  ===========================
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .groups import backend_of, rank_of, world_of


def padded_chunk(length, world: int):
    """Rows per rank when a dim of ``length`` is split over ``world`` ranks (works on SymInts)."""
    return (length + world - 1) // world


def _pad_dim(x: Tensor, dim: int, size) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` rows."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim)


def _stack_chunks(x: Tensor, dim: int, world: int) -> Tensor:
    return x.unflatten(dim, (world, -1)).movedim(dim, 0)  # (.., N*c, ..) -> (N, .., c, ..)


def _unstack(stacked: Tensor, dim: int) -> Tensor:
    return stacked.movedim(0, dim).flatten(dim, dim + 1)  # (N, .., c, ..) -> (.., N*c, ..)


def _fake_resized(x: Tensor, dim: int, size) -> Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


# --------------------------------------------------------------------------- all_reduce / tp_copy
@torch.library.custom_op("ssmshard::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    """Megatron's g: the sum over ranks. Backward: identity (the output is replicated)."""
    return backend_of(group).all_reduce(x)


@torch.library.custom_op("ssmshard::tp_copy", mutates_args=())
def tp_copy(x: Tensor, group: str) -> Tensor:
    """Megatron's f: identity on a replicated value entering sharded computation.
    Backward: all_reduce (each rank's gradient is a partial sum)."""
    return x.clone()


for _op in (all_reduce, tp_copy):
    _op.register_fake(lambda x, group: torch.empty_like(x))


def _save_group(ctx, inputs, output):
    ctx.group = inputs[-1]


all_reduce.register_autograd(lambda ctx, grad: (grad, None), setup_context=_save_group)
tp_copy.register_autograd(lambda ctx, grad: (all_reduce(grad, ctx.group), None), setup_context=_save_group)


# --------------------------------------------------------------------------- reduce_scatter / all_gather
@torch.library.custom_op("ssmshard::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, group: str) -> Tensor:
    """Sum over ranks, then this rank's ceil(L/N) rows of ``dim`` (padded with zeros; module
    docstring). Backward: all_gather_partial_grad of the gradient, trimmed to L."""
    dim, world = dim % x.dim(), world_of(group)
    padded = _pad_dim(x, dim, world * padded_chunk(x.shape[dim], world))
    return backend_of(group).reduce_scatter_stacked(_stack_chunks(padded, dim, world).contiguous())


@reduce_scatter.register_fake
def _(x, dim, group):
    dim = dim % x.dim()
    return _fake_resized(x, dim, padded_chunk(x.shape[dim], world_of(group)))


def _reduce_scatter_setup(ctx, inputs, output):
    x, ctx.dim, ctx.group = inputs
    ctx.dim %= x.dim()
    ctx.length = x.shape[ctx.dim]


reduce_scatter.register_autograd(
    lambda ctx, grad: (all_gather_partial_grad(grad, ctx.dim, ctx.group, ctx.length), None, None),
    setup_context=_reduce_scatter_setup)


def _gather(x: Tensor, dim: int, group: str, length: Optional[int]) -> Tensor:
    dim, world = dim % x.dim(), world_of(group)
    local = x.shape[dim]
    if length is None:
        length = world * local
    elif padded_chunk(length, world) != local:
        raise ValueError(f"all_gather of {local} rows per rank over {world} ranks cannot have length {length}: "
                         f"reduce_scatter gives ceil(length / {world}) rows per rank")
    gathered = _unstack(backend_of(group).all_gather_stacked(x), dim)
    return gathered if length == world * local else gathered.narrow(dim, 0, length).contiguous()


def _gather_fake(x, dim, group, length=None):
    dim = dim % x.dim()
    return _fake_resized(x, dim, world_of(group) * x.shape[dim] if length is None else length)


@torch.library.custom_op("ssmshard::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group: str, length: Optional[int] = None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order and keep the first ``length``
    rows (default: all). For a REPLICATED result (every rank computes the same loss from it,
    e.g. a program's logits): backward returns this rank's rows of the gradient."""
    return _gather(x, dim, group, length)


@torch.library.custom_op("ssmshard::all_gather_partial_grad", mutates_args=())
def all_gather_partial_grad(x: Tensor, dim: int, group: str, length: Optional[int] = None) -> Tensor:
    """Forward as :func:`all_gather`. For a result that feeds SHARDED computation whose per-rank
    losses add up (Megatron sequence parallelism: the gather before a column-parallel linear):
    each rank's gradient is a partial sum, so backward reduce-scatters it (padding included)."""
    return _gather(x, dim, group, length)


all_gather.register_fake(_gather_fake)
all_gather_partial_grad.register_fake(_gather_fake)


def _gather_setup(ctx, inputs, output):
    x, dim, ctx.group, _ = inputs
    ctx.dim = dim % x.dim()
    ctx.local = x.shape[ctx.dim]


def _rows_of_this_rank(ctx, grad):
    world = world_of(ctx.group)
    padded = _pad_dim(grad, ctx.dim, world * ctx.local)
    return padded.narrow(ctx.dim, rank_of(ctx.group) * ctx.local, ctx.local).contiguous(), None, None, None


all_gather.register_autograd(_rows_of_this_rank, setup_context=_gather_setup)
all_gather_partial_grad.register_autograd(
    lambda ctx, grad: (reduce_scatter(grad, ctx.dim, ctx.group), None, None, None), setup_context=_gather_setup)


# --------------------------------------------------------------------------- split
@torch.library.custom_op("ssmshard::split", mutates_args=())
def split(x: Tensor, dim: int, group: str) -> Tensor:
    """This rank's ceil(L/N) rows of ``dim`` of a REPLICATED ``x`` (padded as reduce_scatter
    pads), with no traffic: Megatron's split entering a sequence-parallel region. Backward:
    all_gather of the gradient, trimmed to L (the replicated input's whole gradient)."""
    dim, world = dim % x.dim(), world_of(group)
    chunk = padded_chunk(x.shape[dim], world)
    padded = _pad_dim(x, dim, world * chunk)
    # A clone, not .contiguous(): a chunk of a batch-1 row is already contiguous, and a custom
    # op may not return a view of its input.
    return padded.narrow(dim, rank_of(group) * chunk, chunk).clone(memory_format=torch.contiguous_format)


split.register_fake(lambda x, dim, group: _fake_resized(x, dim % x.dim(), padded_chunk(x.shape[dim % x.dim()],
                                                                                         world_of(group))))


def _split_setup(ctx, inputs, output):
    x, dim, ctx.group = inputs
    ctx.dim = dim % x.dim()
    ctx.length = x.shape[ctx.dim]


split.register_autograd(lambda ctx, grad: (all_gather(grad, ctx.dim, ctx.group, ctx.length), None, None),
                        setup_context=_split_setup)


# --------------------------------------------------------------------------- all_to_all
@torch.library.custom_op("ssmshard::all_to_all", mutates_args=())
def all_to_all(x: Tensor, split_dim: int, concat_dim: int, group: str) -> Tensor:
    """Cut ``split_dim`` into N equal chunks, send chunk j to rank j, and concatenate what
    arrives along ``concat_dim`` in rank order. Backward: the inverse all_to_all (split
    ``concat_dim``, concatenate along ``split_dim``)."""
    split_dim, concat_dim, world = split_dim % x.dim(), concat_dim % x.dim(), world_of(group)
    if x.shape[split_dim] % world:
        raise ValueError(f"all_to_all cuts dim {split_dim} of size {x.shape[split_dim]} into {world} equal chunks: "
                         f"pad it to a multiple of {world} first")
    received = backend_of(group).all_to_all_stacked(_stack_chunks(x, split_dim, world).contiguous())
    return _unstack(received, concat_dim).contiguous()


@all_to_all.register_fake
def _(x, split_dim, concat_dim, group):
    split_dim, concat_dim, world = split_dim % x.dim(), concat_dim % x.dim(), world_of(group)
    shape = list(x.shape)
    shape[split_dim] = shape[split_dim] // world
    shape[concat_dim] = shape[concat_dim] * world
    return x.new_empty(shape)


def _all_to_all_setup(ctx, inputs, output):
    x, split_dim, concat_dim, ctx.group = inputs
    ctx.split_dim, ctx.concat_dim = split_dim % x.dim(), concat_dim % x.dim()


all_to_all.register_autograd(
    lambda ctx, grad: (all_to_all(grad, ctx.concat_dim, ctx.split_dim, ctx.group), None, None, None),
    setup_context=_all_to_all_setup)


# --------------------------------------------------------------------------- broadcast / reduce
@torch.library.custom_op("ssmshard::broadcast", mutates_args=())
def broadcast(x: Tensor, src: int, group: str) -> Tensor:
    """Rank ``src``'s ``x`` on every rank. Backward: reduce to ``src`` (the sum of every rank's
    gradient; the other ranks' inputs get zeros)."""
    return backend_of(group).broadcast(x, src)


@torch.library.custom_op("ssmshard::reduce", mutates_args=())
def reduce(x: Tensor, dst: int, group: str) -> Tensor:
    """The sum over ranks on rank ``dst``, zeros on the others (broadcast's adjoint).
    Backward: broadcast from ``dst``."""
    return backend_of(group).reduce(x, dst)


broadcast.register_fake(lambda x, src, group: torch.empty_like(x))
reduce.register_fake(lambda x, dst, group: torch.empty_like(x))


def _root_setup(ctx, inputs, output):
    _, ctx.root, ctx.group = inputs


broadcast.register_autograd(lambda ctx, grad: (reduce(grad, ctx.root, ctx.group), None, None),
                            setup_context=_root_setup)
reduce.register_autograd(lambda ctx, grad: (broadcast(grad, ctx.root, ctx.group), None, None),
                         setup_context=_root_setup)


# --------------------------------------------------------------------------- shift
@torch.library.custom_op("ssmshard::shift", mutates_args=())
def shift(x: Tensor, group: str, offset: int = 1) -> Tensor:
    """Ring shift: send ``x`` to rank r + offset, receive from rank r - offset (mod N), as one
    batch of isend/irecv on a process group (both posted before either is waited on, so no
    deadlock). Backward: the reverse shift (offset -> -offset)."""
    return backend_of(group).shift(x, offset)


shift.register_fake(lambda x, group, offset=1: torch.empty_like(x))


def _shift_setup(ctx, inputs, output):
    _, ctx.group, ctx.offset = inputs


shift.register_autograd(lambda ctx, grad: (shift(grad, ctx.group, -ctx.offset), None, None),
                        setup_context=_shift_setup)
