"""State passing for sequence-sharded SSM layers (``ssmshard.sequence_blocks``): every rank's
outputs and gradients equal the sequential full-sequence reference ops, on simulated groups
(threads), at uneven lengths, chunks shorter than the conv halo, and packed rows whose
sequence boundaries fall on rank boundaries."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ssmshard import comm, sequence_blocks
from ssmshard.testing import rel_err
from ssmshard.token_layout import TokenLayout

from conftest import interpreted_kernels

TOL = 1e-5


def _chunk(t, dim, rank, world, order="contiguous"):
    """Rank ``rank``'s tokens of ``t`` along ``dim``, padded with zeros at the end: chunk ``rank`` of
    ``world`` (as comm.split pads), or under zigzag chunks ``rank`` and ``2 world - 1 - rank`` of
    ``2 world``."""
    chunks = world if order == "contiguous" else 2 * world
    c = -(-t.shape[dim] // chunks)
    padded = F.pad(t, [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, chunks * c - t.shape[dim]])
    if order == "contiguous":
        return padded.narrow(dim, rank * c, c)
    return torch.cat([padded.narrow(dim, rank * c, c), padded.narrow(dim, (chunks - 1 - rank) * c, c)], dim)


def _unchunk(pieces, dim, length, order="contiguous"):
    """The whole sequence (first ``length`` tokens) from every rank's tokens, in rank order."""
    if order == "zigzag":
        firsts, seconds = zip(*(p.chunk(2, dim) for p in pieces))
        pieces = [*firsts, *reversed(seconds)]
    return torch.cat(pieces, dim).narrow(dim, 0, length)


def _compare(full_fn, sharded_fn, sequence, shared, world, out_dim, seed, order="contiguous"):
    """``sequence``: {name: (tensor, seq dim)}; ``shared``: {name: tensor} held whole by every rank.
    Checks outputs and gradients (a random linear loss over the real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, (v, _) in sequence.items()}
    leaves.update({k: v.clone().requires_grad_(True) for k, v in shared.items()})
    out = full_fn(**leaves)
    probe = torch.randn(out.shape, generator=gen)
    (out * probe).sum().backward()

    def rank_fn(rank, world):
        local = {k: _chunk(v, d, rank, world, order).detach().clone().requires_grad_(v.is_floating_point())
                 for k, (v, d) in sequence.items()}
        local.update({k: v.detach().clone().requires_grad_(True) for k, v in shared.items()})
        y = sharded_fn(rank=rank, group="tsp", **local)
        (y * _chunk(probe, out_dim, rank, world, order)).sum().backward()
        return y.detach(), {k: t.grad for k, t in local.items() if t.grad is not None}

    results = comm.run_simulated(rank_fn, world, group="tsp")
    length = out.shape[out_dim]
    got = _unchunk([y for y, _ in results], out_dim, length, order)
    assert rel_err(got, out.detach()) < TOL
    for name, (v, d) in sequence.items():
        if v.is_floating_point():
            grad = _unchunk([g[name] for _, g in results], d, v.shape[d], order)
            assert rel_err(grad, leaves[name].grad) < TOL, name
    for name in shared:
        grad = sum(g[name] for _, g in results)
        assert rel_err(grad, leaves[name].grad) < TOL, name


def _packed(length):
    """cu_seqlens with a boundary on every rank boundary of a 3-way split and one inside."""
    c = -(-length // 3)
    return torch.tensor(sorted({0, c, c + 2, 2 * c, length}), dtype=torch.int32)


# Zigzag (``tsp_order="zigzag"``): rank r holds chunks r and 2D-1-r of 2D. Lengths not divisible by
# 2D, chunks of 1-2 tokens (shorter than the conv's 3-token halo: the halo spans chunks and ranks)
# and chunks at least as long as the halo (one shift per chunk; the last rank's second chunk takes
# its halo from its own first).
LAYOUTS = [(2, 7, "contiguous"), (3, 13, "contiguous"), (4, 5, "contiguous"), (4, 14, "contiguous"),
           (2, 5, "zigzag"), (2, 13, "zigzag"), (3, 7, "zigzag"), (3, 20, "zigzag"), (4, 9, "zigzag")]


@pytest.mark.parametrize("world,length,order", LAYOUTS)
def test_sharded_causal_conv(world, length, order, fresh_seed):
    b, d, k = 2, 6, 4
    x = torch.randn(b, d, length)
    w, bias = torch.randn(d, k), torch.randn(d)
    _compare(lambda x, w, bias: torch.ops.ssmshard.causal_conv1d(x, w, bias, "silu"),
             lambda x, w, bias, rank, group: sequence_blocks.causal_conv1d(x, w, bias, "silu", rank, group,
                                                                          order=order),
             {"x": (x, -1)}, {"w": w, "bias": bias}, world, -1, fresh_seed, order)


@pytest.mark.parametrize("world,length,order", LAYOUTS)
@pytest.mark.parametrize("groups", [1, 2])
def test_sharded_selective_scan(world, length, order, groups, fresh_seed):
    _check_selective_scan(world, length, order, 2, 8, groups, "reference", fresh_seed)


def _check_selective_scan(world, length, order, b, d, groups, kernels, seed):
    n = 4
    seq = {"u": (torch.randn(b, d, length), -1), "delta": (torch.randn(b, d, length) * 0.5, -1),
           "B": (torch.randn(b, groups, n, length), -1), "C": (torch.randn(b, groups, n, length), -1),
           "z": (torch.randn(b, d, length), -1)}
    shared = {"A": -torch.rand(d, n) - 0.1, "D": torch.randn(d), "bias": torch.randn(d) * 0.1}
    _compare(lambda u, delta, A, B, C, D, z, bias: torch.ops.ssmshard.selective_scan(
                 u, delta, A, B, C, D, z, bias, True, None)[0],
             lambda u, delta, A, B, C, D, z, bias, rank, group: sequence_blocks.selective_scan(
                 u, delta, A, B, C, D, z, bias, True, rank, group, order=order, kernels=kernels)[0],
             seq, shared, world, -1, seed, order)


@pytest.mark.parametrize("world,length,order", LAYOUTS)
@pytest.mark.parametrize("groups", [1, 2])
def test_sharded_ssd_scan(world, length, order, groups, fresh_seed):
    _check_ssd_scan(world, length, order, groups, "reference", fresh_seed)


def _check_ssd_scan(world, length, order, groups, kernels, seed):
    b, h, p, n = 2, 4, 3, 4
    seq = {"x": (torch.randn(b, length, h, p), 1), "dt": (torch.randn(b, length, h) * 0.5, 1),
           "B": (torch.randn(b, length, groups, n), 1), "C": (torch.randn(b, length, groups, n), 1)}
    shared = {"A": -torch.rand(h) - 0.1, "D": torch.randn(h), "bias": torch.randn(h) * 0.1}
    _compare(lambda x, dt, A, B, C, D, bias: torch.ops.ssmshard.ssd_scan(
                 x, dt, A, B, C, 4, D, bias, None, True, 0.0, float("inf"))[0],
             lambda x, dt, A, B, C, D, bias, rank, group: sequence_blocks.ssd_scan(
                 x, dt, A, B, C, 4, D, bias, True, 0.0, float("inf"), rank, group, order=order, kernels=kernels)[0],
             seq, shared, world, 1, seed, order)


@pytest.mark.parametrize("length", [12, 14])
def test_packed_state_passing_stops_at_sequence_starts(length, fresh_seed):
    """A packed row split 3 ways with a sequence starting exactly on a rank boundary (and one
    inside a chunk): conv halo and carried state never cross into the next sequence."""
    world, cu = 3, _packed(length)
    d, n, h, p, k = 4, 4, 2, 3, 4
    conv = {"x": (torch.randn(1, d, length), -1)}
    _compare(lambda x, w: torch.ops.ssmshard.causal_conv1d(x, w, None, None, cu),
             lambda x, w, rank, group: sequence_blocks.causal_conv1d(x, w, None, None, rank, group, cu),
             conv, {"w": torch.randn(d, k)}, world, -1, fresh_seed)
    seq = {"u": (torch.randn(1, d, length), -1), "delta": (torch.randn(1, d, length) * 0.5, -1),
           "B": (torch.randn(1, n, length), -1), "C": (torch.randn(1, n, length), -1)}
    _compare(lambda u, delta, A, B, C: torch.ops.ssmshard.selective_scan(
                 u, delta, A, B, C, None, None, None, True, None, cu)[0],
             lambda u, delta, A, B, C, rank, group: sequence_blocks.selective_scan(
                 u, delta, A, B, C, None, None, None, True, rank, group, cu)[0],
             seq, {"A": -torch.rand(d, n) - 0.1}, world, -1, fresh_seed)
    seq = {"x": (torch.randn(1, length, h, p), 1), "dt": (torch.randn(1, length, h) * 0.5, 1),
           "B": (torch.randn(1, length, 1, n), 1), "C": (torch.randn(1, length, 1, n), 1)}
    _compare(lambda x, dt, A, B, C: torch.ops.ssmshard.ssd_scan(
                 x, dt, A, B, C, 4, None, None, None, True, 0.0, float("inf"), cu)[0],
             lambda x, dt, A, B, C, rank, group: sequence_blocks.ssd_scan(
                 x, dt, A, B, C, 4, None, None, True, 0.0, float("inf"), rank, group, cu)[0],
             seq, {"A": -torch.rand(h) - 0.1}, world, 1, fresh_seed)


def _per_sequence(op, cu, dim, sequence_args):
    """The sequential reference of a packed row: ``op`` over each sequence on its own (no
    cu_seqlens, a zero initial state), outputs concatenated in order."""
    def full(**kwargs):
        pieces = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            sliced = {k: (v.narrow(dim, start, end - start) if k in sequence_args else v) for k, v in kwargs.items()}
            pieces.append(op(**sliced))
        return torch.cat(pieces, dim)
    return full


@pytest.mark.parametrize("world,length", [(2, 8), (3, 12), (3, 14)])
def test_packed_state_passing_equals_each_sequence_alone(world, length, fresh_seed):
    """Packed rows against each sequence scanned on its own: boundaries on every rank boundary of
    a 3-way split (and one inside a chunk); values and gradients."""
    _check_packed_scans(world, length, "reference", fresh_seed)


def _check_packed_scans(world, length, kernels, seed):
    cu = _packed(length)
    d, n, h, p = 4, 4, 2, 3
    seq = {"u": (torch.randn(1, d, length), -1), "delta": (torch.randn(1, d, length) * 0.5, -1),
           "B": (torch.randn(1, n, length), -1), "C": (torch.randn(1, n, length), -1)}
    _compare(_per_sequence(lambda u, delta, A, B, C: torch.ops.ssmshard.selective_scan(
                 u, delta, A, B, C, None, None, None, True, None)[0], cu, -1, seq),
             lambda u, delta, A, B, C, rank, group: sequence_blocks.selective_scan(
                 u, delta, A, B, C, None, None, None, True, rank, group, cu, kernels=kernels)[0],
             seq, {"A": -torch.rand(d, n) - 0.1}, world, -1, seed)
    seq = {"x": (torch.randn(1, length, h, p), 1), "dt": (torch.randn(1, length, h) * 0.5, 1),
           "B": (torch.randn(1, length, 1, n), 1), "C": (torch.randn(1, length, 1, n), 1)}
    _compare(_per_sequence(lambda x, dt, A, B, C: torch.ops.ssmshard.ssd_scan(
                 x, dt, A, B, C, 4, None, None, None, True, 0.0, float("inf"))[0], cu, 1, seq),
             lambda x, dt, A, B, C, rank, group: sequence_blocks.ssd_scan(
                 x, dt, A, B, C, 4, None, None, True, 0.0, float("inf"), rank, group, cu, kernels=kernels)[0],
             seq, {"A": -torch.rand(h) - 0.1}, world, 1, seed)


@pytest.mark.parametrize("world,length,order", [(2, 7, "contiguous"), (4, 5, "contiguous"), (2, 7, "zigzag"),
                                                (3, 20, "zigzag")])
def test_sharded_causal_attention(world, length, order, fresh_seed):
    b, hq, hk, e = 2, 4, 2, 8
    seq = {"q": (torch.randn(b, hq, length, e), 2), "k": (torch.randn(b, hk, length, e), 2),
           "v": (torch.randn(b, hk, length, e), 2)}
    _compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             lambda q, k, v, rank, group: sequence_blocks.causal_attention(q, k, v, rank, group, enable_gqa=True,
                                                                           order=order),
             seq, {}, world, 2, fresh_seed, order)


@pytest.mark.parametrize("world,order,key_lengths", [(4, "contiguous", [2, 4, 6, 8]),
                                                     (2, "zigzag", [2, 4, 6, 8])])
def test_causal_attention_skips_the_keys_after_each_chunk(world, order, key_lengths, monkeypatch):
    """Each query chunk ``j`` (2 tokens of 8) attends to the keys before its end only, ``2 (j + 1)``
    of them: every call's key length, over all ranks, is one chunk's end (zigzag: two calls a rank,
    chunks 0 and 3 on rank 0, 1 and 2 on rank 1)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(q, k, v, **kwargs):
        calls.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(sequence_blocks.F, "scaled_dot_product_attention", counted)
    b, h, length, e = 1, 2, 8, 4
    q, k, v = (torch.randn(b, h, length, e) for _ in range(3))

    def rank_main(rank, world):
        layout = TokenLayout(rank, world, order)
        return sequence_blocks.causal_attention(layout.split(q, 2), layout.split(k, 2), layout.split(v, 2), rank,
                                                "tsp", order=order)

    comm.run_simulated(rank_main, world, group="tsp")
    assert sorted(calls) == [(2, n) for n in key_lengths], calls


def test_zigzag_refuses_packed_rows():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        comm.run_simulated(lambda rank, world: sequence_blocks.causal_conv1d(
            torch.randn(1, 2, 4), torch.randn(2, 3), None, None, rank, "tsp", cu, order="zigzag"), 2, group="tsp")


# --------------------------------------------------------------------------- on the Triton kernels
# Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py) runs the kernels: sizes tiny.
# Each interpreted kernel program costs seconds: batch 2 with two B/C groups (4x the programs) in
# the slow set.
@interpreted_kernels
@pytest.mark.parametrize("world,length,b,groups,order", [
    (2, 7, 1, 1, "contiguous"), pytest.param(3, 13, 2, 2, "contiguous", marks=pytest.mark.slow),
    pytest.param(2, 11, 1, 1, "zigzag", marks=pytest.mark.slow)])
def test_sharded_selective_scan_on_triton_kernel(world, length, b, groups, order, fresh_seed):
    """The rerun from the carried-in state (two kernel scans per chunk; z gate, bias, D, grouped
    B/C in the slow case) equals the sequential reference op over the whole sequence: values and
    gradients."""
    _check_selective_scan(world, length, order, b, 4, groups, "triton", fresh_seed)


@interpreted_kernels
@pytest.mark.parametrize("world,length", [(2, 7), pytest.param(3, 13, marks=pytest.mark.slow)])
def test_sharded_ssd_scan_on_triton_kernel(world, length, fresh_seed):
    _check_ssd_scan(world, length, "contiguous", 2, "triton", fresh_seed)


# Interpreted kernels over three ranks take most of a minute: the slow set (the reference path's
# packed test above runs by default).
@interpreted_kernels
@pytest.mark.slow
@pytest.mark.parametrize("world,length", [(3, 12), (3, 14)])
def test_packed_state_passing_on_triton_kernels_equals_each_sequence_alone(world, length, fresh_seed):
    """Packed rows on the kernels (per-piece initial states of the rerun) against each sequence
    scanned alone by the reference op: a sequence starts on each rank boundary and one inside a
    chunk; values and gradients."""
    _check_packed_scans(world, length, "triton", fresh_seed)


class _Shapes(TorchDispatchMode):
    """The shape of every tensor a torch op produces while active (this thread's ops)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=interpreted_kernels)])
def test_mamba1_state_passing_on_triton_kernels_makes_no_decay_tensor(kernels, fresh_seed):
    """Forward and backward of a rank's Mamba-1 block: the reference correction materialises a
    (b, d, c, n) decay tensor (checked here, so the check can fail), the rerun on the kernel none:
    no tensor holds the chunk's tokens, the channels and the state size together."""
    world, b, d, c, n = 2, 1, 4, 5, 8
    length = world * c

    def rank_fn(rank, world):
        gen = torch.Generator().manual_seed(fresh_seed)  # the same weights on every rank
        u, delta, B, C = (torch.randn(b, *shape, generator=gen)[..., rank * c:(rank + 1) * c].requires_grad_()
                          for shape in ((d, length), (d, length), (n, length), (n, length)))
        A = (-torch.rand(d, n, generator=gen) - 0.1).requires_grad_()
        with _Shapes() as seen:
            y, _ = sequence_blocks.selective_scan(u, delta, A, B, C, None, None, None, True, rank, "tsp",
                                                  kernels=kernels)
            y.sum().backward()
        return seen.shapes

    for shapes in comm.run_simulated(rank_fn, world, group="tsp"):
        decay_like = [s for s in shapes if all(s.count(size) >= 1 for size in (d, c, n))]
        assert bool(decay_like) == (kernels == "reference"), (kernels, decay_like)
