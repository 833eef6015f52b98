"""What a rank holding chunks of the sequence needs from the ranks holding the chunks before.

Under ``Plan(tsp=D)`` rank ``r`` holds tokens ``[r * c, (r + 1) * c)`` of a sequence padded with
zeros at its end to ``D * c`` tokens (``c = ceil(L / D)``, as ``comm.split`` cuts it); under
``tsp_order="zigzag"`` it holds two chunks of ``c = ceil(L / 2D)`` tokens, ``r`` and ``2D - 1 - r``
(``token_layout``: every function takes the ``order``). Every function here runs on one rank's
local tokens, is differentiable (its collectives are the autograd ops of ``comm.ops``) and
equals the same computation over the whole sequence, restricted to those tokens (docs/tsp.md).
A rank holding two chunks runs the SSM blocks on them as two batch rows, each taking its halo
and its carried state from the chunk before it in sequence order:

* ``causal_conv1d``: the depthwise causal conv reads the ``k - 1`` tokens before the chunk (a
  *halo*): one ``shift`` per slot from the rank holding the chunk before when ``c >= k - 1``, else
  every rank's chunks all-gathered (a halo that spans several chunks).
* ``selective_scan`` / ``ssd_scan``: each rank scans its chunk from a zero state, returning its
  final state ``h_r`` and its total decay ``a_r`` (the product of its steps' decays); an
  all-gather of ``(h, a)`` and a local fold ``h_in(r+1) = a_r * h_in(r) + h_r`` give each rank
  its true initial state (an exclusive prefix over the chunks). On the reference ops the chunk's
  outputs are then corrected by ``C_t . decay(chunk start -> t) . h_in`` (one contraction); on
  the Triton kernels (``kernels="triton"``) Mamba-1 scans its chunk a second time from ``h_in``
  instead (its correction would materialise a (b, d, c, n) decay tensor), Mamba-2 keeps the
  correction (a (b, c, h) decay): docs/tsp.md, "Initial state".
* ``causal_attention``: the keys and values are all-gathered along the sequence; the mask
  places this rank's queries at their global positions.

Packed rows (``cu_seqlens``: global offsets over the whole row, batch 1) are supported by the
conv, the scans and attention: no state, halo or key crosses a sequence start, also where the
start falls on a rank boundary (contiguous order only).
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
from .token_layout import TokenLayout


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


def _layout(rank: int, group: str, order: str, cu_seqlens: Optional[Tensor]) -> TokenLayout:
    layout = TokenLayout(rank, world_of(group), order)
    if cu_seqlens is not None and layout.slots > 1:
        raise ValueError(f"packed rows (cu_seqlens) run under tsp_order='contiguous' only, not {order!r}")
    return layout


def _chunks_as_batch(t: Optional[Tensor], dim: int, slots: int) -> Optional[Tensor]:
    """(b, ..., slots * c, ...) -> (b * slots, ..., c, ...): a rank's chunks as batch rows (each
    chunk is scanned or convolved on its own; they are not neighbours in the sequence)."""
    if t is None or slots == 1:
        return t
    dim %= t.dim()
    return t.unflatten(dim, (slots, -1)).movedim(dim, 1).flatten(0, 1)


def _batch_as_chunks(t: Tensor, dim: int, slots: int) -> Tensor:
    """The inverse of ``_chunks_as_batch`` (``dim``: the token dim of ``t``)."""
    if slots == 1:
        return t
    dim %= t.dim()
    return t.unflatten(0, (-1, slots)).movedim(1, dim).flatten(dim, dim + 1)


def _last_chunk(t: Tensor, slots: int) -> Tensor:
    """(b * slots, ...) -> (b, ...): the batch rows of the rank's last chunk in sequence order."""
    return t if slots == 1 else t.unflatten(0, (-1, slots))[:, -1]


# --------------------------------------------------------------------------- causal conv with a halo
def conv_halo(x: Tensor, width: int, rank: int, group: str, order: str = "contiguous") -> Tensor:
    """(b, d, slots * width): per slot, the ``width`` tokens before that chunk of this rank's
    tokens ``x`` (b, d, slots * c), zeros before the sequence start."""
    layout = TokenLayout(rank, world_of(group), order)
    c = layout.chunk_size(x.shape[-1])
    if c >= width:  # each halo lives on one rank: one point-to-point exchange per slot
        halos = []
        for slot, (chunk, offset) in enumerate(zip(layout.held, layout.halo_offsets())):
            received = shift(x[..., (slot + 1) * c - width:(slot + 1) * c].contiguous(), group, offset)
            # Where the halo is not the received tail (the sequence start, or the chunk before is
            # this rank's own), the received one still enters the graph, weighted zero: every rank
            # must run the shift's backward (a collective).
            if chunk == 0:
                received = received * 0
            elif layout.owner(chunk - 1)[0] == rank:
                own = layout.owner(chunk - 1)[1]
                received = received * 0 + x[..., (own + 1) * c - width:(own + 1) * c]
            halos.append(received)
        return torch.cat(halos, dim=-1)
    # A chunk shorter than the halo: every chunk, in sequence order, after `width` zeros.
    tails = layout.in_sequence_order(all_gather_partial_grad(x.contiguous(), -1, group), -1)
    padded = torch.cat([x.new_zeros(*x.shape[:-1], width), tails], dim=-1)
    return torch.cat([padded.narrow(-1, chunk * c, width) for chunk in layout.held], dim=-1)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str], rank: int,
                  group: str, cu_seqlens: Optional[Tensor] = None, order: str = "contiguous") -> Tensor:
    """``ops.causal_conv1d`` of this rank's tokens ``x`` (b, d, slots * c) of the whole sequence."""
    width = weight.shape[-1] - 1
    if width == 0:
        return torch.ops.ssmshard.causal_conv1d(x, weight, bias, activation)
    slots = _layout(rank, group, order, cu_seqlens).slots
    halos = conv_halo(x, width, rank, group, order)
    x = _chunks_as_batch(x, -1, slots)
    c = x.shape[-1]
    window = torch.cat([_chunks_as_batch(halos, -1, slots), x], dim=-1)  # (b * slots, d, width + c)
    # Rank 0's halo lies before the row: the row's start at 0 cuts it off as a piece of its own.
    local_cu = None if cu_seqlens is None else local_cu_seqlens(cu_seqlens, rank * c - width, width + c)
    y = torch.ops.ssmshard.causal_conv1d(window, weight, bias, activation, local_cu)
    return _batch_as_chunks(y[..., width:], -1, slots).contiguous()


# --------------------------------------------------------------------------- state passing
def exclusive_state_prefix(state: Tensor, decay: Tensor, rank: int, group: str, order: str = "contiguous") -> Tensor:
    """The state entering each of this rank's chunks ``v``: ``sum_{s<v} (prod_{s<q<v} decay_q) * state_s``
    over the chunks ``s`` in sequence order.

    ``state``: each chunk's final state from a zero start, (b * slots, ...) with the rank's chunks
    as batch rows (``_chunks_as_batch``); ``decay``: its total decay (broadcastable to ``state``).
    One all-gather of each, then a fold over the chunks before (multiply-adds of a state, cheaper
    than the sequential hops of a ring).
    """
    layout = TokenLayout(rank, world_of(group), order)

    def gathered(t):  # (chunks, b, ...) in sequence order
        by_slot = t.unflatten(0, (-1, layout.slots)).movedim(1, 0).contiguous()  # (slots, b, ...)
        return layout.in_sequence_order(all_gather_partial_grad(by_slot, 0, group), 0)

    states, decays = gathered(state), gathered(decay)
    # Every rank must run the gathers' backward (a collective) even where it reads none of the
    # gathered values (rank 0, and every chunk at or after its own): a zero-weighted use keeps
    # them in the autograd graph.
    unused = 0.0 * (states.sum(0) + decays.sum(0))
    carried, entering = torch.zeros_like(states[0]), {}
    for chunk in range(layout.chunks):
        if chunk in layout.held:
            entering[chunk] = carried + unused
            if len(entering) == layout.slots:
                break
        carried = decays[chunk] * carried + states[chunk]
    return torch.stack([entering[chunk] for chunk in layout.held], 1).flatten(0, 1)


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
                   cu_seqlens: Optional[Tensor] = None, order: str = "contiguous", *, kernels: str = "reference"):
    """``ops.selective_scan`` (Mamba-1) of this rank's tokens (b, d, slots * c) of the whole
    sequence, from a zero initial state at the sequence start. Returns (out, the state after this
    rank's last chunk). ``kernels``: "reference" (the op) or "triton" (the Triton kernel, see
    ``_on_triton``)."""
    slots = _layout(rank, group, order, cu_seqlens).slots
    u, delta, B, C, z = (_chunks_as_batch(t, -1, slots) for t in (u, delta, B, C, z))
    bsz, d, c = u.shape
    local_cu = None if cu_seqlens is None else local_cu_seqlens(cu_seqlens, rank * c, c).to(torch.int32)
    reached = _reached_by_carry(cu_seqlens, rank * c, c, u.device)
    dt = _discretise_dt(delta, delta_bias, delta_softplus, (d, 1))  # (b, d, c)
    if _on_triton(kernels, u):
        y, state = _selective_scan_rerun(u, delta, A, B, C, D, z, delta_bias, delta_softplus, rank, group, order,
                                         local_cu, dt, reached)
        return _batch_as_chunks(y, -1, slots), _last_chunk(state, slots)
    y, local_state = torch.ops.ssmshard.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, None,
                                                       local_cu)
    from_start = dt.cumsum(-1)[..., None] * A.float()[:, None, :]  # (b, d, c, n): log-decay since the chunk start
    carry = from_start.exp()
    if reached is not None:
        carry = carry * reached[:, None]
    decay = carry[:, :, -1]  # (b, d, n)
    initial = exclusive_state_prefix(local_state, decay, rank, group, order)  # (b, d, n)
    Cg = C.float().unsqueeze(1) if C.dim() == 3 else C.float()  # (b, g, n, c)
    g = Cg.shape[1]
    Ch = Cg.repeat_interleave(d // g, dim=1)  # (b, d, n, c): channel i reads group i // (d / g)
    correction = torch.einsum("bdnc,bdcn,bdn->bdc", Ch, carry, initial)
    if z is not None:
        correction = correction * F.silu(z.float())
    return _batch_as_chunks(y + correction, -1, slots), _last_chunk(decay * initial + local_state, slots)


def _selective_scan_rerun(u, delta, A, B, C, D, z, delta_bias, delta_softplus, rank, group, order, local_cu, dt,
                          reached):
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
    initial = exclusive_state_prefix(local_state, decay, rank, group, order)  # (b, d, n)
    return scan(_packed_initial(initial, reached, local_cu))


def ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float, rank: int,
             group: str, cu_seqlens: Optional[Tensor] = None, order: str = "contiguous", *,
             kernels: str = "reference"):
    """``ops.ssd_scan`` (Mamba-2) of this rank's tokens (b, slots * c, h, p) of the whole sequence,
    from a zero initial state at the sequence start. Returns (out, the states after this rank's
    last chunk). ``kernels``: "reference" (the op) or "triton" (the Triton kernel for the chunk's
    scan from a zero state, see ``_on_triton``); the carried-in state is applied by the correction
    either way."""
    slots = _layout(rank, group, order, cu_seqlens).slots
    x, dt, B, C = (_chunks_as_batch(t, 1, slots) for t in (x, dt, B, C))
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
    initial = exclusive_state_prefix(local_state, decay[..., None, None], rank, group, order)  # (b, h, p, n)
    Ch = C.float().repeat_interleave(h // g, dim=2)  # (b, c, h, n): head i reads group i // (h / g)
    correction = torch.einsum("bchn,bch,bhpn->bchp", Ch, carry, initial)
    return (_batch_as_chunks(y + correction, 1, slots),
            _last_chunk(decay[..., None, None] * initial + local_state, slots))


# --------------------------------------------------------------------------- attention
def causal_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, group: str, *, scale=None,
                     enable_gqa: bool = False, key_mask: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None, order: str = "contiguous") -> Tensor:
    """Causal ``scaled_dot_product_attention`` of this rank's queries (b, h, slots * c, e) over every
    rank's keys and values, all-gathered along the sequence and put in sequence order. Each slot's
    queries (chunk ``j``) attend only to the keys before its chunk's end, ``(j + 1) c`` of them: the
    later keys are masked for every one of its queries, so they are skipped, not computed and
    masked (rank ``r`` of contiguous chunks reads ``(r + 1) / D`` of the keys; under zigzag every
    rank reads ``(2D + 1) / 4D`` of them). The padding past the sequence end has the last
    positions, so causality already hides it from every real query.

    ``key_mask``: this rank's chunk (b, c) of a prompt's attention mask (0 at padding, as HF's
    left-padded prompts have): no query sees a padding key, except a padding query its own key
    (its output is never read by a real token, but a row that sees nothing would be NaN).

    ``cu_seqlens``: a packed row's global offsets (batch 1): a query sees only the keys of its own
    sequence (the block-diagonal causal mask, by global position). The padding past the row's end
    counts as one more sequence, so a padding query still sees its own key."""
    layout = TokenLayout(rank, world_of(group), order)
    c = layout.chunk_size(q.shape[-2])
    keys = all_gather_partial_grad(k.contiguous(), -2, group)  # (b, hk, D * slots * c, e), rank order
    values = all_gather_partial_grad(v.contiguous(), -2, group)
    valid = all_gather(key_mask.contiguous(), 1, group).bool() if key_mask is not None else None  # (b, D * c)
    if layout.slots > 1:  # rank order is not sequence order: the keys of chunks 0..j must be a prefix
        keys, values = layout.in_sequence_order(keys, -2), layout.in_sequence_order(values, -2)
        valid = layout.in_sequence_order(valid, 1) if valid is not None else None
    key_seq = None  # with packed rows: each key position's sequence index
    if cu_seqlens is not None:
        starts = cu_seqlens.to(q.device)
        key_seq = torch.searchsorted(starts, torch.arange(keys.shape[-2], device=q.device).to(starts.dtype),
                                     right=True)
    outputs = []
    for slot, chunk in enumerate(layout.held):
        end = (chunk + 1) * c  # keys at global positions < end
        query_pos = torch.arange(c, device=q.device) + chunk * c
        key_pos = torch.arange(end, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # (c, end)
        if key_seq is not None:
            mask = mask & (key_seq[None, :end] == key_seq.narrow(0, chunk * c, c)[:, None])
        if valid is not None:
            mask = (mask & valid[:, None, None, :end]) | (key_pos[None, :] == query_pos[:, None])  # (b, 1, c, end)
        outputs.append(F.scaled_dot_product_attention(q.narrow(-2, slot * c, c), keys[..., :end, :],
                                                      values[..., :end, :], attn_mask=mask, scale=scale,
                                                      enable_gqa=enable_gqa))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, -2)
