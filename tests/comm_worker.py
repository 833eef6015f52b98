"""Workers for tests/test_comm.py: every collective op on every rank, and its oracles.

A case is one call of one op. Rank k's input is drawn from (seed, case, k) so any rank (and the
oracle) can rebuild every rank's input. The oracles use no ssmshard collective:
* ``global_expected``: the whole N-rank computation written as one plain torch function of all
  ranks' inputs, differentiated by autograd: outputs and exact gradients of the global loss;
* ``direct``: each op's output computed on a process group with torch.distributed calls.

One launch serves every world size: a group of the last N processes per N, so group ranks
differ from global ranks where N is less than the number launched.

Losses: a "replicated" case gives every rank the same upstream weight w (one loss, the same on
every rank); a "sharded" case gives rank r its own w_r and the global loss sums over ranks.
"""

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ssmshard import comm
from ssmshard.testing import rel_err

B, H = 2, 3  # batch and hidden sizes around the dim being communicated


@dataclass
class Case:
    name: str
    local_shape: tuple
    call: Callable  # (x, group) -> y, through ssmshard.comm
    combine: Callable  # (all ranks' inputs) -> all ranks' outputs, plain torch
    direct: Callable  # (x, rank, world, process group) -> y, through torch.distributed
    replicated_loss: bool = False
    replicated_input: bool = False


def _pad(x, dim, size):
    return torch.cat([x, x.new_zeros(*x.shape[:dim], size - x.shape[dim], *x.shape[dim + 1:])], dim)


def _summed(xs):
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total


def _dist_sum(x, pg):
    out = x.clone()
    dist.all_reduce(out, group=pg)
    return out


def _dist_gather(x, dim, pg):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim)


def _dist_all_to_all(x, split_dim, concat_dim, rank, world, pg):
    everyone = _dist_gather(x[None], 0, pg)
    return torch.cat([x_k.chunk(world, split_dim)[rank] for x_k in everyone], concat_dim)


def _dist_shift(x, offset, rank, world, pg):
    if offset % world == 0:
        return x.clone()  # to itself
    received = torch.empty_like(x)
    works = [dist.isend(x.contiguous(), group=pg, group_dst=(rank + offset) % world),
             dist.irecv(received, group=pg, group_src=(rank - offset) % world)]
    for work in works:
        work.wait()
    return received


def _dist_broadcast(x, root, pg):
    out = x.clone()
    dist.broadcast(out, group=pg, group_src=root)
    return out


def _dist_reduce(x, root, rank, pg):
    out = x.clone()
    dist.reduce(out, group=pg, group_dst=root)
    return out if rank == root else torch.zeros_like(x)


def cases(world):
    n = world
    out = [
        Case("all_reduce", (B, 5, H), comm.all_reduce, lambda xs: [_summed(xs)] * n,
             lambda x, r, w, pg: _dist_sum(x, pg), replicated_loss=True),
        Case("tp_copy", (B, 5, H), comm.tp_copy, lambda xs: list(xs), lambda x, r, w, pg: x.clone(),
             replicated_input=True),
    ]
    for length in sorted({1, n - 1, n, n + 1, 2 * n + 1}):  # N divides only n
        c = -(-length // n)  # rows per rank: the padded split (ssmshard.comm.ops)
        out.append(Case(
            f"reduce_scatter.L{length}", (B, length, H), lambda x, g: comm.reduce_scatter(x, 1, g),
            lambda xs, c=c: [_pad(_summed(xs), 1, n * c).narrow(1, r * c, c) for r in range(n)],
            lambda x, r, w, pg, c=c: _pad(_dist_sum(x, pg), 1, w * c).narrow(1, r * c, c)))
        for name, op, replicated in (("all_gather", comm.all_gather, True),
                                     ("all_gather_partial_grad", comm.all_gather_partial_grad, False)):
            out.append(Case(
                f"{name}.L{length}", (B, c, H), lambda x, g, op=op, length=length: op(x, 1, g, length),
                lambda xs, length=length: [torch.cat(xs, 1)[:, :length]] * n,
                lambda x, r, w, pg, length=length: _dist_gather(x, 1, pg)[:, :length],
                replicated_loss=replicated))
    out += [
        Case("all_gather.last_dim", (B, H, 2), lambda x, g: comm.all_gather(x, -1, g),
             lambda xs: [torch.cat(xs, -1)] * n, lambda x, r, w, pg: _dist_gather(x, -1, pg), replicated_loss=True),
        Case("all_to_all.heads_to_seq", (B, 5, 2 * n, H), lambda x, g: comm.all_to_all(x, 2, 1, g),
             lambda xs: [torch.cat([x.chunk(n, 2)[r] for x in xs], 1) for r in range(n)],
             lambda x, r, w, pg: _dist_all_to_all(x, 2, 1, r, w, pg)),
        Case("all_to_all.same_dim", (B, 2 * n, H), lambda x, g: comm.all_to_all(x, 1, 1, g),
             lambda xs: [torch.cat([x.chunk(n, 1)[r] for x in xs], 1) for r in range(n)],
             lambda x, r, w, pg: _dist_all_to_all(x, 1, 1, r, w, pg)),
        Case("broadcast", (B, 4, H), lambda x, g: comm.broadcast(x, n - 1, g), lambda xs: [xs[n - 1]] * n,
             lambda x, r, w, pg: _dist_broadcast(x, w - 1, pg)),
        Case("reduce", (B, 4, H), lambda x, g: comm.reduce(x, 1, g),
             lambda xs: [_summed(xs) if r == 1 else torch.zeros_like(xs[0]) for r in range(n)],
             lambda x, r, w, pg: _dist_reduce(x, 1, r, pg)),
    ]
    for offset in (1, -1, 2):
        out.append(Case(f"shift.{offset:+d}", (B, 4, H), lambda x, g, offset=offset: comm.shift(x, g, offset),
                        lambda xs, offset=offset: [xs[(r - offset) % n] for r in range(n)],
                        lambda x, r, w, pg, offset=offset: _dist_shift(x, offset, r, w, pg)))
    return out


def _draw(seed, index, tag, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1000 + index * 10 + tag))


def _input(case, index, seed, rank):
    return _draw(seed, index, 0 if case.replicated_input else 1 + rank, case.local_shape)


def _weight(case, index, seed, rank, shape):
    return _draw(seed, index, 5 if case.replicated_loss else 6 + rank, shape) * 0.5 + 1.0


def exercise(rank, world, group, seed):
    """Every case through ssmshard.comm on this rank: {case.value, case.grad}."""
    results = {}
    for index, case in enumerate(cases(world)):
        x = _input(case, index, seed, rank).requires_grad_(True)
        y = case.call(x, group)
        (grad,) = torch.autograd.grad((y * _weight(case, index, seed, rank, y.shape)).sum(), x)
        results[f"{case.name}.value"], results[f"{case.name}.grad"] = y.detach(), grad
    return results


def global_expected(rank, world, seed):
    """The same cases as one plain torch computation over all ranks' inputs."""
    results = {}
    for index, case in enumerate(cases(world)):
        if case.replicated_input:
            xs = [_input(case, index, seed, 0).requires_grad_(True)] * world
        else:
            xs = [_input(case, index, seed, k).requires_grad_(True) for k in range(world)]
        ys = case.combine(xs)
        ranks = [0] if case.replicated_loss else range(world)  # one loss, or the sum of every rank's
        loss = sum((ys[r] * _weight(case, index, seed, r, ys[r].shape)).sum() for r in ranks)
        grads = torch.autograd.grad(loss, xs[rank], materialize_grads=True)  # unused input (broadcast): zeros
        results[f"{case.name}.value"], results[f"{case.name}.grad"] = ys[rank].detach(), grads[0]
    return results


def direct(rank, world, seed, pg):
    return {f"{case.name}.value": case.direct(_input(case, index, seed, rank), rank, world, pg)
            for index, case in enumerate(cases(world))}


def errors(actual, expected):
    return {key: rel_err(actual[key], value) if actual[key].shape == value.shape else float("inf")
            for key, value in expected.items()}


def gloo_ranks(global_rank, launched, seed, out_dir, worlds):
    """For each N in ``worlds``, on a process group of the last N processes: run every case,
    save this rank's results and its errors against both oracles."""
    groups = {world: dist.new_group(list(range(launched - world, launched))) for world in worlds}  # all ranks
    for world, pg in groups.items():
        rank = global_rank - (launched - world)
        if rank < 0:
            continue
        assert rank == dist.get_rank(pg)
        name = f"gloo_{world}"
        comm.register_group(name, pg)
        results = exercise(rank, world, name, seed)
        torch.save(results, os.path.join(out_dir, f"world{world}_rank{rank}.pt"))
        report = {"global": errors(results, global_expected(rank, world, seed)),
                  "direct": errors(results, direct(rank, world, seed, pg))}
        with open(os.path.join(out_dir, f"world{world}_rank{rank}.json"), "w") as f:
            json.dump(report, f)
