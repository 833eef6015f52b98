"""What a rank holding one contiguous chunk of the sequence needs from the ranks before it.

Under ``Plan(tsp=D)`` rank ``r`` holds tokens ``[r * c, (r + 1) * c)`` of a sequence padded with
zeros at its end to ``D * c`` tokens (``c = ceil(L / D)``, as ``comm.split`` cuts it). Every
function here runs on one rank's chunk, is differentiable (its collectives are the autograd
ops of ``comm.ops``) and equals the same computation over the whole sequence, restricted to the
chunk (docs/tsp.md):

* ``causal_conv1d``: the depthwise causal conv reads the ``k - 1`` tokens before the chunk (a
  *halo*): one ``shift`` from the previous rank when ``c >= k - 1``, else the chunks' tails
  all-gathered (a halo that spans several ranks).
* ``selective_scan`` / ``ssd_scan``: each rank scans its chunk from a zero state, returning its
  final state ``h_r`` and its total decay ``a_r`` (the product of its steps' decays); an
  all-gather of ``(h, a)`` and a local fold ``h_in(r+1) = a_r * h_in(r) + h_r`` give each rank
  its true initial state (an exclusive prefix over ranks). On the reference ops the chunk's
  outputs are then corrected by ``C_t . decay(chunk start -> t) . h_in`` (one contraction); on
  the Triton kernels (``kernels="triton"``) Mamba-1 scans its chunk a second time from ``h_in``
  instead (its correction would materialise a (b, d, c, n) decay tensor), Mamba-2 keeps the
  correction (a (b, c, h) decay): docs/tsp.md, "Initial state".
* ``causal_attention``: the keys and values are all-gathered along the sequence; the mask
  places this rank's queries at their global positions.

Packed rows (``cu_seqlens``: global offsets over the whole row, batch 1) are supported by the
conv, the scans and attention: no state, halo or key crosses a sequence start, also where the
start falls on a rank boundary.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.nn.functional as F
from torch import Tensor

from .comm.ops import all_gather, all_gather_partial_grad, shift
from .comm.groups import world_of
from .kernels.reference import _discretise_dt


def local_cu_seqlens(cu_seqlens: Tensor, start: int, length: int) -> Tensor:
    """Offsets of the (pieces of) sequences inside tokens ``[start, start + length)`` of a packed
    row, from the row's global ``cu_seqlens``; tokens past the row's end form one more piece."""
    with _data_dependent_length(cu_seqlens):
        inside = cu_seqlens[(cu_seqlens > start) & (cu_seqlens < start + length)] - start
    edges = cu_seqlens.new_tensor([0]), inside, cu_seqlens.new_tensor([length])
    return torch.cat(edges)


def _data_dependent_length(tensor: Tensor):
    """Where the graph's fake values are propagated (the ``tsp`` pass), the number of sequence starts
    in a chunk is an unbacked size that no output of the sequence block carries (the offsets only
    feed the scan or conv, whose output shapes do not depend on them): say so to the shape
    environment, which otherwise refuses a fresh unbacked size that never reaches an output."""
    from contextlib import nullcontext

    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([tensor])
    if mode is None or mode.shape_env is None:
        return nullcontext()
    return mode.shape_env.ignore_fresh_unbacked_symbols()


def _reached_by_carry(cu_seqlens: Optional[Tensor], start: int, length: int, device) -> Optional[Tensor]:
    """(length,) float: 1 where the state carried into the chunk still reaches step t (no sequence
    starts in [start, start + t]), else 0; None when not packed (it reaches every step)."""
    if cu_seqlens is None:
        return None
    steps = torch.arange(start, start + length, device=device)
    starts = cu_seqlens.to(device).long()
    before = torch.searchsorted(starts, torch.tensor([start], device=device))  # starts < start
    upto = torch.searchsorted(starts, steps, right=True)  # starts <= start + t
    return (upto == before).float()


# --------------------------------------------------------------------------- causal conv with a halo
def conv_halo(x: Tensor, width: int, rank: int, group: str) -> Tensor:
    """(b, d, width): the ``width`` tokens before this rank's chunk ``x`` (b, d, c), zeros before
    the sequence start."""
    c = x.shape[-1]
    if c >= width:  # the whole halo lives on the previous rank: one point-to-point exchange
        halo = shift(x[..., c - width:].contiguous(), group, 1)
        return halo * (rank > 0)  # rank 0 received the last rank's tail (the ring wraps)
    # A chunk shorter than the halo: every rank's whole chunk, in order, after `width` zeros.
    tails = all_gather_partial_grad(x.contiguous(), -1, group)  # (b, d, world * c)
    padded = torch.cat([x.new_zeros(*x.shape[:-1], width), tails], dim=-1)
    return padded.narrow(-1, rank * c, width)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str], rank: int,
                  group: str, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """``ops.causal_conv1d`` of this rank's chunk ``x`` (b, d, c) of the whole sequence."""
    width = weight.shape[-1] - 1
    if width == 0:
        return torch.ops.ssmshard.causal_conv1d(x, weight, bias, activation)
    c = x.shape[-1]
    window = torch.cat([conv_halo(x, width, rank, group), x], dim=-1)  # (b, d, width + c)
    # Rank 0's halo lies before the row: the row's start at 0 cuts it off as a piece of its own.
    local_cu = None if cu_seqlens is None else local_cu_seqlens(cu_seqlens, rank * c - width, width + c)
    y = torch.ops.ssmshard.causal_conv1d(window, weight, bias, activation, local_cu)
    return y[..., width:].contiguous()


# --------------------------------------------------------------------------- state passing
def exclusive_state_prefix(state: Tensor, decay: Tensor, rank: int, group: str) -> Tensor:
    """The state entering this rank's chunk: ``sum_{s<r} (prod_{s<q<r} decay_q) * state_s``.

    ``state``: this chunk's final state from a zero start; ``decay``: its total decay
    (broadcastable to ``state``). One all-gather of each, then a fold over the ranks before
    this one (D - 1 multiply-adds of a state, cheaper than the D - 1 sequential hops of a ring).
    """
    states = all_gather_partial_grad(state.unsqueeze(0).contiguous(), 0, group)  # (D, ...)
    decays = all_gather_partial_grad(decay.unsqueeze(0).contiguous(), 0, group)
    carried = torch.zeros_like(state)
    for source in range(rank):
        carried = decays[source] * carried + states[source]
    # Every rank must run the gathers' backward (a collective) even where it reads none of the
    # gathered values (rank 0, and every rank's own and later slots): a zero-weighted use
    # keeps them in the autograd graph.
    unused = states[rank:].sum(0) + decays[rank:].sum(0)
    return carried + 0.0 * unused


KERNELS = ("reference", "triton")


def _on_triton(kernels: str, tensor: Tensor) -> bool:
    """Whether a scan runs on its Triton kernel: ``kernels == "triton"`` and real tensors a kernel
    runs on (CUDA ones, or any under Triton's CPU interpreter, TRITON_INTERPRET=1). The fake
    tensors of the ``tsp`` pass's shape propagation take the reference op (the same output
    shapes), and so do CPU tensors without the interpreter, as ``swap_kernels``' adapters do
    (a program moved to the CPU stays correct)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "reference" or isinstance(tensor, FakeTensor):
        return False
    from .kernels.ssd_triton_common import INTERPRET  # imports Triton: only when asked for

    return tensor.is_cuda or INTERPRET


def _last_sequence(final: Tensor, local_cu: Optional[Tensor]) -> Tensor:
    """The kernels return one final state per packed sequence; the chunk's is its last one's."""
    return final[-1:] if local_cu is not None else final


def _packed_initial(initial: Tensor, reached: Optional[Tensor], local_cu: Optional[Tensor]) -> Tensor:
    """The kernels' initial states: ``initial`` (b, ...) unpacked; packed, one per piece of a
    sequence in the chunk (``local_cu``): the carried state for the first piece where it still
    reaches it (no sequence starts on the chunk's first token), zeros for the others."""
    if local_cu is None:
        return initial
    first = initial * reached[0]
    return torch.cat([first, first.new_zeros(local_cu.numel() - 2, *initial.shape[1:])])


def selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, rank: int, group: str,
                   cu_seqlens: Optional[Tensor] = None, *, kernels: str = "reference"):
    """``ops.selective_scan`` (Mamba-1) of this rank's chunk (b, d, c) of the whole sequence, from
    a zero initial state at the sequence start. Returns (out, the state after this chunk).
    ``kernels``: "reference" (the op) or "triton" (the Triton kernel, see ``_on_triton``)."""
    bsz, d, c = u.shape
    local_cu = None if cu_seqlens is None else local_cu_seqlens(cu_seqlens, rank * c, c).to(torch.int32)
    reached = _reached_by_carry(cu_seqlens, rank * c, c, u.device)
    dt = _discretise_dt(delta, delta_bias, delta_softplus, (d, 1))  # (b, d, c)
    if _on_triton(kernels, u):
        return _selective_scan_rerun(u, delta, A, B, C, D, z, delta_bias, delta_softplus, rank, group, local_cu,
                                     dt, reached)
    y, local_state = torch.ops.ssmshard.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, None,
                                                       local_cu)
    from_start = dt.cumsum(-1)[..., None] * A.float()[:, None, :]  # (b, d, c, n): log-decay since the chunk start
    carry = from_start.exp()
    if reached is not None:
        carry = carry * reached[:, None]
    decay = carry[:, :, -1]  # (b, d, n)
    initial = exclusive_state_prefix(local_state, decay, rank, group)  # (b, d, n)
    Cg = C.float().unsqueeze(1) if C.dim() == 3 else C.float()  # (b, g, n, c)
    g = Cg.shape[1]
    Ch = Cg.repeat_interleave(d // g, dim=1)  # (b, d, n, c): channel i reads group i // (d / g)
    correction = torch.einsum("bdnc,bdcn,bdn->bdc", Ch, carry, initial)
    if z is not None:
        correction = correction * F.silu(z.float())
    return y + correction, decay * initial + local_state


def _selective_scan_rerun(u, delta, A, B, C, D, z, delta_bias, delta_softplus, rank, group, local_cu, dt, reached):
    """``selective_scan`` on the Triton kernel: the chunk is scanned from a zero state for its final
    state only, then again from the carried-in state for its output (no (b, d, c, n) tensor; twice
    the scan's time: docs/tsp.md). Gradients reach the carried-in state through the kernel's
    initial-state gradient, and the earlier ranks through the first scan's final-state gradient."""
    from .kernels.selective_scan import selective_scan as scan_kernel

    def scan(initial):
        y, final = scan_kernel(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens=local_cu,
                               initial_state=initial, return_final_state=True, out_dtype=torch.float32)
        return y, _last_sequence(final, local_cu)

    _, local_state = scan(None)  # its output is not read: the second scan's replaces it
    decay = (dt.sum(-1)[..., None] * A.float()).exp()  # (b, d, n): the chunk's total decay
    if reached is not None:
        decay = decay * reached[-1]  # a sequence starts inside the chunk: nothing carried passes it
    initial = exclusive_state_prefix(local_state, decay, rank, group)  # (b, d, n)
    return scan(_packed_initial(initial, reached, local_cu))


def ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float, rank: int,
             group: str, cu_seqlens: Optional[Tensor] = None, *, kernels: str = "reference"):
    """``ops.ssd_scan`` (Mamba-2) of this rank's chunk (b, c, h, p) of the whole sequence, from a
    zero initial state at the sequence start. Returns (out, the states after this chunk).
    ``kernels``: "reference" (the op) or "triton" (the Triton kernel for the chunk's scan from a
    zero state, see ``_on_triton``); the carried-in state is applied by the correction either way."""
    bsz, c, h, p = x.shape
    g = B.shape[-2]
    local_cu = None if cu_seqlens is None else local_cu_seqlens(cu_seqlens, rank * c, c).to(torch.int32)
    if _on_triton(kernels, x):
        from .kernels.ssd_scan import ssd_scan as scan_kernel

        y, final = scan_kernel(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                               dt_limit=(dt_min, dt_max), cu_seqlens=local_cu, return_final_states=True,
                               out_dtype=torch.float32)
        local_state = _last_sequence(final, local_cu)
    else:
        y, local_state = torch.ops.ssmshard.ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, None, dt_softplus,
                                                     dt_min, dt_max, local_cu)
    dt32 = _discretise_dt(dt, dt_bias, dt_softplus, (h,)).clamp(dt_min, dt_max)  # (b, c, h)
    carry = (dt32 * A.float()).cumsum(1).exp()  # (b, c, h): decay from the chunk start to step t
    reached = _reached_by_carry(cu_seqlens, rank * c, c, x.device)
    if reached is not None:
        carry = carry * reached[:, None]
    decay = carry[:, -1]  # (b, h)
    initial = exclusive_state_prefix(local_state, decay[..., None, None], rank, group)  # (b, h, p, n)
    Ch = C.float().repeat_interleave(h // g, dim=2)  # (b, c, h, n): head i reads group i // (h / g)
    correction = torch.einsum("bchn,bch,bhpn->bchp", Ch, carry, initial)
    return y + correction, decay[..., None, None] * initial + local_state


# --------------------------------------------------------------------------- attention
def causal_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, group: str, *, scale=None,
                     enable_gqa: bool = False, key_mask: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Causal ``scaled_dot_product_attention`` of this rank's queries (b, h, c, e) over every
    rank's keys and values (all-gathered along the sequence; the padding past the sequence end
    comes last, so causality already hides it from every real query).

    ``key_mask``: this rank's chunk (b, c) of a prompt's attention mask (0 at padding, as HF's
    left-padded prompts have): no query sees a padding key, except a padding query its own key
    (its output is never read by a real token, but a row that sees nothing would be NaN).

    ``cu_seqlens``: a packed row's global offsets (batch 1): a query sees only the keys of its own
    sequence (the block-diagonal causal mask, by global position). The padding past the row's end
    counts as one more sequence, so a padding query still sees its own key."""
    c = q.shape[-2]
    keys = all_gather_partial_grad(k.contiguous(), -2, group)  # (b, hk, D * c, e)
    values = all_gather_partial_grad(v.contiguous(), -2, group)
    query_pos = torch.arange(c, device=q.device) + rank * c
    key_pos = torch.arange(world_of(group) * c, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (c, D * c)
    if cu_seqlens is not None:
        starts = cu_seqlens.to(q.device)
        key_seq, query_seq = (torch.searchsorted(starts, pos.to(starts.dtype), right=True)
                              for pos in (key_pos, query_pos))
        mask = mask & (key_seq[None, :] == query_seq[:, None])
    if key_mask is not None:
        valid = all_gather(key_mask.contiguous(), 1, group).bool()  # (b, D * c)
        mask = (mask & valid[:, None, None, :]) | (key_pos[None, :] == query_pos[:, None])  # (b, 1, c, D * c)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
