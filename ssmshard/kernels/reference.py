"""Pure-torch reference implementations of the state-space-model kernels.

Each op's function takes the op's arguments in the order ``ssmshard.ops.signatures`` declares
them (tests/test_op_signatures.py checks it); parameters after those are options of the
reference alone. Every function is vectorised over tokens: the only Python loops run over
chunks of the sequence, never over single time steps. Scans compute in
float32 whatever the input dtype, because the eager fallbacks these ops
replace do the same and their outputs are float32.

Dimension letters used in shape comments and einsum strings:
    b  batch
    l  sequence length
    d  channels (Mamba-1 inner dimension)
    n  SSM state size
    g  groups: B and C are shared by a group of channels / heads
    e  members of one group (d // g channels, or h // g heads)
    h  heads (Mamba-2)
    p  head dim (Mamba-2)
    k  conv width
    s  conv state length
    c  number of chunks
    i  target position inside a chunk
    j  source position inside a chunk

Packed sequences: the scans and ``causal_conv1d`` take an optional ``cu_seqlens`` (int32
(S+1,) offsets of S sequences laid end to end in a batch-1 row, see ``ssmshard.packing``).
The chunked algorithms stay as they are and mask by sequence index: a decay from step j to
step i is kept only when both lie in the same sequence, and a state carried into a chunk
reaches a step only if no sequence starts between. The result equals running each sequence
on its own (from a zero state); the returned final state is the last sequence's.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..packing import check_cu_seqlens, positions_in_sequence, sequence_ids

# Upper bound on elements of the (b, g, e, i, j, n) decay tensor of selective_scan;
# several tensors of that size are alive per chunk.
_SCAN_CHUNK_BUDGET = 1 << 19
_SCAN_CHUNK_MIN, _SCAN_CHUNK_MAX = 4, 64


def segsum(a: Tensor) -> Tensor:
    """Segment sums of log-decays: (..., T) -> (..., T, T).

    out[..., i, j] = a[j+1] + ... + a[i] for j <= i (0 on the diagonal) and
    -inf for j > i, so exp(out) is the causal decay matrix. The sums are
    built by a masked cumsum rather than as cumsum[i] - cumsum[j]: that
    avoids cancelling two large numbers, and with a <= 0 no positive number
    is ever exponentiated.
    """
    T = a.shape[-1]
    strictly_lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    # (..., i, j): a[i] in every column j, kept only where i > j
    terms = a[..., :, None].expand(*a.shape, T).masked_fill(~strictly_lower, 0.0)
    sums = terms.cumsum(dim=-2)  # (..., i, j): sum of a[r] for j < r <= i
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, -math.inf)


def _discretise_dt(
    dt: Tensor, bias: Optional[Tensor], softplus: bool, bias_shape: tuple[int, ...]
) -> Tensor:
    dt = dt.float()
    if bias is not None:
        dt = dt + bias.float().reshape(bias_shape)
    if softplus:
        dt = F.softplus(dt)
    return dt


def _auto_scan_chunk(elements_per_step: int) -> int:
    # The decay tensor has elements_per_step * T * T entries; pick the largest T
    # that keeps it under the budget, within sane limits.
    t = int(math.sqrt(_SCAN_CHUNK_BUDGET / max(elements_per_step, 1)))
    return max(_SCAN_CHUNK_MIN, min(_SCAN_CHUNK_MAX, t))


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                   z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                   delta_softplus: bool = False, initial_state: Optional[Tensor] = None,
                   cu_seqlens: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                   final_state: bool = True, chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Mamba-1 selective scan (layouts of mamba_ssm's ``selective_scan_fn``).

    u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or (b, g, n, l);
    D, delta_bias: (d,); initial_state: (b, d, n) or None; cu_seqlens: (S+1,) or None (then b == 1).
    Returns (out (b, d, l), final_state (b, d, n)), float32; out computed in float32 and rounded
    to ``out_dtype`` when one is given; with ``final_state=False`` an empty (b, d, 0) tensor in
    the state's place (the op's contract: the Triton kernel then skips it).
    ``chunk_size`` (not part of the op) fixes the chunk length; by default it
    is chosen to bound memory.
    """
    bsz, d, l = u.shape
    n = A.shape[-1]
    # Ungrouped B / C are the single-group case.
    B = B.unsqueeze(1) if B.dim() == 3 else B  # (b, n, l) -> (b, 1, n, l)
    C = C.unsqueeze(1) if C.dim() == 3 else C
    g = B.shape[1]
    if d % g != 0:
        raise ValueError(f"channels ({d}) must be a multiple of B/C groups ({g})")
    e = d // g
    seq = _packed_sequence_ids(cu_seqlens, bsz, l, initial_state)  # (l,) or None

    dt = _discretise_dt(delta, delta_bias, delta_softplus, (d, 1))  # (b, d, l)
    # Channel c belongs to group c // e, so splitting d as (g, e) lines channels
    # up with their B / C without materialising a per-channel copy.
    dt = dt.reshape(bsz, g, e, l)  # (b, d, l) -> (b, g, e, l)
    u32 = u.float()
    dtu = dt * u32.reshape(bsz, g, e, l)  # discretised input dt * u, (b, g, e, l)
    A32 = A.float().reshape(g, e, n)  # (d, n) -> (g, e, n)
    B32, C32 = B.float(), C.float()  # (b, g, n, l)
    if initial_state is None:
        state = u32.new_zeros(bsz, g, e, n)
    else:
        state = initial_state.float().reshape(bsz, g, e, n)  # (b, d, n) -> (b, g, e, n)

    T = chunk_size or _auto_scan_chunk(bsz * d * n)
    ys = []
    # The decay depends on the state index n, so the quadratic form carries an
    # n axis; chunks keep that (b, g, e, i, j, n) tensor small. The state is
    # handed from chunk to chunk by this loop.
    for start in range(0, l, T):
        span = slice(start, min(start + T, l))
        dtu_c = dtu[..., span]  # (b, g, e, i)
        B_c = B32[..., span].transpose(-1, -2)  # (b, g, n, i) -> (b, g, i, n)
        C_c = C32[..., span].transpose(-1, -2)
        log_decay = dt[..., span, None] * A32[:, :, None, :]  # (b, g, e, i, n)
        from_start = log_decay.cumsum(-2)  # (b, g, e, i, n): log-decay since the chunk start
        # Decay from step j to step i as exp(from_start[i] - from_start[j]).
        # This is the big tensor of the op, so it is built in few passes, by
        # differencing cumsums rather than with segsum(): within a chunk the
        # sums stay small, and masking j > i to -inf before exp means no
        # positive exponent ever reaches exp.
        T_c = dtu_c.shape[-1]
        causal = torch.ones(T_c, T_c, dtype=torch.bool, device=u.device).tril()  # (i, j)
        carried_in = from_start.exp()  # (b, g, e, i, n): decay of the carried-in state up to step i
        if seq is not None:
            seq_c = seq[span]  # (i,)
            causal = causal & (seq_c[:, None] == seq_c[None, :])  # (i, j): no sequence start in (j, i]
            # The carried state belongs to the step before the chunk (chunk 0: the zero state).
            state_seq = seq[max(start - 1, 0)]
            carried_in = carried_in * (seq_c == state_seq)[:, None]  # (b, g, e, i, n)
        diff = from_start[..., :, None, :] - from_start[..., None, :, :]  # (b, g, e, i, j, n)
        decay = diff.masked_fill(~causal[..., None], -math.inf).exp()
        CB = C_c[..., :, None, :] * B_c[..., None, :, :]  # (b, g, i, j, n)
        # Sum the n axis first: it is the one that makes the tensor big.
        mix = (decay * CB[:, :, None]).sum(-1)  # (b, g, e, i, j)
        y_intra = (mix @ dtu_c[..., None]).squeeze(-1)  # (b, g, e, i)
        # The carried-in state decays by the cumulative log-decay since the chunk start.
        y_carry = torch.einsum("bgin,bgein,bgen->bgei", C_c, carried_in, state)
        ys.append(y_intra + y_carry)
        # Last row of the decay matrix = decay from each step j to the chunk end.
        to_end = decay[..., -1, :, :]  # (b, g, e, j, n)
        state = carried_in[..., -1, :] * state + torch.einsum(
            "bgejn,bgjn,bgej->bgen", to_end, B_c, dtu_c
        )

    y = torch.cat(ys, dim=-1).reshape(bsz, d, l)  # (b, g, e, l) -> (b, d, l)
    if D is not None:
        y = y + D.float()[:, None] * u32
    if z is not None:
        y = y * F.silu(z.float())
    state = state.reshape(bsz, d, n) if final_state else state.new_empty(bsz, d, 0)
    return y.to(out_dtype or torch.float32).contiguous(), state.contiguous()


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
             D: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
             initial_states: Optional[Tensor] = None, dt_softplus: bool = False, dt_min: float = 0.0,
             dt_max: float = math.inf, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Mamba-2 SSD scan (layouts of mamba_ssm's ``mamba_chunk_scan_combined``).

    x: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n);
    D: (h,) or (h, p); dt_bias: (h,); initial_states: (b, h, p, n) or None;
    cu_seqlens: (S+1,) or None (then b == 1).
    dt is always clamped to [dt_min, dt_max] (pass -inf / inf for no clamp).
    Returns (out (b, l, h, p), final_states (b, h, p, n)), both float32.
    """
    bsz, l, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    if h % g != 0:
        raise ValueError(f"heads ({h}) must be a multiple of B/C groups ({g})")
    e = h // g
    seq = _packed_sequence_ids(cu_seqlens, bsz, l, initial_states)  # (l,) or None

    dt = _discretise_dt(dt, dt_bias, dt_softplus, (h,)).clamp(dt_min, dt_max)  # (b, l, h)
    T = max(1, min(chunk_size, l))
    c = -(-l // T)
    pad = c * T - l
    # Padded steps get dt = 0: no decay and no input, so they leave the final
    # state untouched; their outputs are cut off below.
    x32 = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
    dt = F.pad(dt, (0, 0, 0, pad))
    B32 = F.pad(B.float(), (0, 0, 0, 0, 0, pad))
    C32 = F.pad(C.float(), (0, 0, 0, 0, 0, pad))

    # Head h belongs to group h // e: split h as (g, e) to meet its B / C.
    dt = dt.reshape(bsz, c, T, g, e)  # (b, l, h) -> (b, c, i, g, e)
    xdt = x32.reshape(bsz, c, T, g, e, p) * dt[..., None]  # (b, c, j, g, e, p)
    B32 = B32.reshape(bsz, c, T, g, n)  # (b, l, g, n) -> (b, c, j, g, n)
    C32 = C32.reshape(bsz, c, T, g, n)  # (b, l, g, n) -> (b, c, i, g, n)
    log_decay = (dt * A.float().reshape(g, e)).permute(0, 3, 4, 1, 2)  # (b, g, e, c, i)
    from_start = log_decay.cumsum(-1)  # (b, g, e, c, i)
    log_decay_ij = segsum(log_decay)  # (b, g, e, c, i, j)
    chunk_log_decay = F.pad(from_start[..., -1], (1, 0))  # (b, g, e, c + 1); slot 0: the initial state
    log_chunk_decay = segsum(chunk_log_decay)  # (b, g, e, c + 1, c + 1)
    carried_in = from_start.exp()  # (b, g, e, c, i): decay of the state carried into chunk c up to step i
    if seq is not None:
        # Padded steps join the last sequence (dt = 0 there: they change nothing).
        seq = torch.cat([seq, seq[-1:].expand(pad)]).reshape(c, T)  # (l + pad,) -> (c, i)
        log_decay_ij = log_decay_ij.masked_fill(seq[:, :, None] != seq[:, None, :], -math.inf)
        # The sequence each carried state belongs to: the initial state (slot 0) the first
        # sequence's, the state after chunk m that of chunk m's last step.
        state_seq = torch.cat([seq[:1, 0], seq[:, -1]])  # (c + 1,)
        log_chunk_decay = log_chunk_decay.masked_fill(state_seq[:, None] != state_seq[None, :], -math.inf)
        carried_in = carried_in * (seq == state_seq[:-1, None])  # (b, g, e, c, i)
    decay = log_decay_ij.exp()  # (b, g, e, c, i, j)

    # 1. Outputs from inputs of the same chunk: a masked quadratic form.
    CB = torch.einsum("bcign,bcjgn->bgcij", C32, B32)
    y = torch.einsum("bgcij,bgecij,bcjgep->bcigep", CB, decay, xdt)

    # 2. The state each chunk would end with if it started from zero.
    to_end = decay[..., -1, :]  # (b, g, e, c, j)
    chunk_states = torch.einsum("bgecj,bcjgn,bcjgep->bcgepn", to_end, B32, xdt)

    # 3. Pass states across chunks, again as a causal decay matrix, now over
    # chunks. Slot 0 is the initial state; it decays with every chunk after it.
    if initial_states is None:
        init = chunk_states.new_zeros(bsz, 1, g, e, p, n)
    else:
        init = initial_states.float().reshape(bsz, 1, g, e, p, n)  # (b, h, p, n) -> (b, 1, g, e, p, n)
    states = torch.cat([init, chunk_states], dim=1)  # (b, c + 1, g, e, p, n)
    chunk_decay = log_chunk_decay.exp()  # (b, g, e, c + 1, c + 1)
    # carried[:, m] is the state after m chunks.
    carried = torch.einsum("bgeij,bjgepn->bigepn", chunk_decay, states)

    # 4. Outputs from the state carried into each chunk.
    y = y + torch.einsum("bcign,bgeci,bcgepn->bcigep", C32, carried_in, carried[:, :-1])

    y = y.reshape(bsz, c * T, h, p)[:, :l]  # (b, c, i, g, e, p) -> (b, l, h, p)
    if D is not None:
        D32 = D.float()
        D32 = D32[:, None] if D32.dim() == 1 else D32  # (h,) -> (h, 1)
        y = y + D32 * x.float()
    final = carried[:, -1].reshape(bsz, h, p, n)  # (b, g, e, p, n) -> (b, h, p, n)
    return y.contiguous(), final.contiguous()


def check_activation(activation: Optional[str]) -> None:
    if activation not in (None, "silu", "swish"):
        raise ValueError(
            f"unsupported activation {activation!r}; expected None, 'silu' or 'swish'"
        )


def _activate(y: Tensor, activation: Optional[str]) -> Tensor:
    check_activation(activation)
    return y if activation is None else F.silu(y)


def _depthwise_conv(window: Tensor, weight: Tensor, bias: Optional[Tensor], padding: int) -> Tensor:
    # One length-k filter per channel: a grouped conv with groups = d.
    d = weight.shape[0]
    w = weight[:, None, :]  # (d, k) -> (d, 1, k)
    b = None if bias is None else bias.to(weight.dtype)
    return F.conv1d(window.to(weight.dtype), w, b, padding=padding, groups=d)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Depthwise causal conv. x: (b, d, l); weight: (d, k); bias: (d,); cu_seqlens: (S+1,) or None.

    Computed in weight's dtype (like an nn.Conv1d layer); returned in x's dtype. With
    ``cu_seqlens`` (batch 1), taps that would read the previous sequence read zeros instead,
    as if each sequence were convolved on its own.
    """
    check_activation(activation)
    k, l = weight.shape[-1], x.shape[-1]
    if cu_seqlens is None:
        # Symmetric padding of k - 1; the first l outputs are the causal ones.
        y = _depthwise_conv(x, weight, bias, padding=k - 1)[..., :l]
    else:
        y = _packed_depthwise_conv(x, weight, bias, cu_seqlens)
    return _activate(y, activation).to(x.dtype).contiguous()


def _packed_depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], cu_seqlens: Tensor) -> Tensor:
    """Causal depthwise conv whose windows stop at sequence starts: (b, d, l) -> (b, d, l)."""
    check_cu_seqlens(cu_seqlens, x.shape[-1], x.shape[0])
    k, l = weight.shape[-1], x.shape[-1]
    # windows[..., t, m] = x[t - (k - 1) + m]: the k inputs output t reads, zeros before the row.
    windows = F.pad(x.to(weight.dtype), (k - 1, 0)).unfold(-1, k, 1)  # (b, d, l, k)
    # Tap m reaches back k - 1 - m steps; keep it only if that stays inside t's sequence.
    reach_back = torch.arange(k - 1, -1, -1, device=x.device)  # (k,)
    inside = positions_in_sequence(cu_seqlens, l)[:, None] >= reach_back  # (l, k)
    y = torch.einsum("bdlk,dk->bdl", windows * inside, weight)
    return y if bias is None else y + bias.to(weight.dtype)[:, None]


def _packed_sequence_ids(cu_seqlens: Optional[Tensor], batch: int, length: int,
                         initial_state: Optional[Tensor]) -> Optional[Tensor]:
    """(l,) sequence index of every step for a packed scan, or None when not packed."""
    if cu_seqlens is None:
        return None
    check_cu_seqlens(cu_seqlens, length, batch)
    if initial_state is not None:
        raise ValueError("a packed scan (cu_seqlens) starts every sequence from a zero state; "
                         "per-sequence initial states are not supported: pass initial_state=None")
    return sequence_ids(cu_seqlens, length)


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         activation: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Continue a causal conv from its cached inputs.

    x: (b, d, l); conv_state: (b, d, s) with s >= k - 1, the last s inputs seen.
    Returns (out (b, d, l) in x's dtype, new_state (b, d, s) in conv_state's dtype).
    """
    check_activation(activation)
    k, l, s = weight.shape[-1], x.shape[-1], conv_state.shape[-1]
    if s < k - 1:
        raise ValueError(f"conv_state length {s} is shorter than conv width - 1 ({k - 1})")
    # The cache keeps the newest s inputs, in the cache's own dtype.
    new_state = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1)[..., l:]  # (b, d, s)
    # The l new outputs need the k - 1 inputs before them; build that window in
    # the compute dtype so a low-precision cache doesn't round x.
    history = conv_state[..., s - (k - 1) :].to(weight.dtype)  # (b, d, k - 1)
    window = torch.cat([history, x.to(weight.dtype)], dim=-1)  # (b, d, k - 1 + l)
    y = _depthwise_conv(window, weight, bias, padding=0)  # (b, d, l)
    return _activate(y, activation).to(x.dtype).contiguous(), new_state.contiguous()


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           dt_proj_weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One recurrent decode step (layouts of mamba_ssm's ``selective_state_update``).

    Mamba-2: state (b, h, p, n); x, dt, z (b, h, p); A (h, p, n);
             B, C (b, g, n); D, dt_bias (h, p).
    Mamba-1: state (b, d, n); x, dt, z (b, d); A (d, n); B, C (b, n); D, dt_bias (d,);
             with ``dt_proj_weight`` (d, r), dt is dt_proj's input (b, r), projected first.
    Returns (out in x's dtype, new_state in state's dtype); math in float32.
    """
    mamba1 = state.dim() == 3
    if dt_proj_weight is not None:
        if not mamba1:
            raise ValueError(f"dt_proj_weight is Mamba-1's (state (b, d, n)); got state {tuple(state.shape)}")
        dt = F.linear(dt, dt_proj_weight)  # (b, r) -> (b, d), in dt's dtype as the unfused step
    if mamba1:
        # Mamba-1 is the Mamba-2 layout with one head of head dim d and one group.
        state, x, dt, z = (t if t is None else t.unsqueeze(1) for t in (state, x, dt, z))
        A, D, dt_bias = (t if t is None else t.unsqueeze(0) for t in (A, D, dt_bias))
        B, C = B.unsqueeze(1), C.unsqueeze(1)  # (b, n) -> (b, 1, n)
    h, g = state.shape[1], B.shape[1]
    if h % g != 0:
        raise ValueError(f"heads ({h}) must be a multiple of B/C groups ({g})")
    # Head i reads group i // (h // g).
    Bh = B.float().repeat_interleave(h // g, dim=1)  # (b, g, n) -> (b, h, n)
    Ch = C.float().repeat_interleave(h // g, dim=1)

    dt32 = _discretise_dt(dt, dt_bias, dt_softplus, dt_bias.shape if dt_bias is not None else ())
    x32 = x.float()
    decay = torch.exp(dt32[..., None] * A.float())  # (b, h, p, n)
    new_state = state.float() * decay + (dt32 * x32)[..., None] * Bh[:, :, None, :]
    out = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        out = out + D.float() * x32
    if z is not None:
        out = out * F.silu(z.float())
    out, new_state = out.to(x.dtype), new_state.to(state.dtype)
    if mamba1:
        out, new_state = out.squeeze(1), new_state.squeeze(1)
    return out.contiguous(), new_state.contiguous()


def gated_rms_norm(x: Tensor, gate: Optional[Tensor], weight: Tensor, eps: float, group_size: int) -> Tensor:
    """Mamba-2's gated RMSNorm: normalise ``x * silu(gate)`` over groups of ``group_size`` channels.

    Same arithmetic as the Hugging Face module: float32 inside, then back to x's dtype
    before the weight multiplies (so the weight's dtype promotes the result, as there).
    """
    y = x.float()
    if gate is not None:
        y = y * torch.nn.functional.silu(gate.float())
    *prefix, d = y.shape
    grouped = y.view(*prefix, d // group_size, group_size)  # (..., groups, group_size)
    variance = grouped.pow(2).mean(-1, keepdim=True)
    y = (grouped * torch.rsqrt(variance + eps)).view(*prefix, d)
    return weight * y.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, the arithmetic of Hugging Face's ``MambaRMSNorm``,
    ``LlamaRMSNorm`` and ``Zamba2RMSNorm``: the ungated norm with one group of all channels."""
    return gated_rms_norm(x, None, weight, eps, x.shape[-1])


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 norm_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The residual add before a norm and the norm: ``summed = residual + x`` in the promoted dtype
    (float32 under Mamba's ``residual_in_fp32``), and the norm of ``summed.to(norm_dtype)`` (the
    block casts the residual stream to the norm weight's dtype before normalising it)."""
    summed = residual + x
    return summed, rms_norm(summed.to(norm_dtype), weight, eps)


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear``: the op the ``decode_gemv`` pass puts a decode step's linear layers on."""
    return F.linear(x, weight, bias)


def decode_linear_group(x: Tensor, weights: List[Tensor]) -> List[Tensor]:
    """``[F.linear(x, w) for w in weights]``: the op the ``group_decode_linears`` pass puts linear
    layers reading the same input on."""
    return [F.linear(x, w) for w in weights]


def rotary(xs: List[Tensor], cos: Tensor, sin: Tensor) -> List[Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` for each of ``xs``: ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x[..., p/2:], x[..., :p/2])``, op for op (each product rounded to
    its dtype before the sum): the op the ``fuse_rotary`` pass puts that captured chain on."""
    out = []
    for x in xs:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out.append(x * cos + rotated * sin)
    return out
