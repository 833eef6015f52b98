"""``torch.ops.ssmshard`` custom ops for state-space-model kernels.

Each op is opaque to tracing (torch.export / torch.compile see one node), has
a fake implementation for shape propagation, and is differentiable. All ops
are functional: nothing is mutated, caches are returned as new tensors.

Dimension letters: b batch, l length, d channels, n state size, g groups,
h heads, p head dim, k conv width, s conv state length, S packed sequences.

Registered schemas:
    ssmshard::selective_scan(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C,
        Tensor? D, Tensor? z, Tensor? delta_bias, bool delta_softplus,
        Tensor? initial_state, Tensor? cu_seqlens=None) -> (Tensor, Tensor)
    ssmshard::ssd_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, SymInt chunk_size,
        Tensor? D, Tensor? dt_bias, Tensor? initial_states, bool dt_softplus,
        float dt_min, float dt_max, Tensor? cu_seqlens=None) -> (Tensor, Tensor)
    ssmshard::causal_conv1d(Tensor x, Tensor weight, Tensor? bias, str? activation,
        Tensor? cu_seqlens=None) -> Tensor
    ssmshard::causal_conv1d_update(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias,
        str? activation) -> (Tensor, Tensor)
    ssmshard::selective_state_update(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B,
        Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> (Tensor, Tensor)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ssmshard.kernels import reference as ref
from ssmshard.packing import check_cu_seqlens_layout


def cu_seqlens_arg(node):
    """The ``cu_seqlens`` argument of a graph node calling a packing-aware op (an FX node or None)."""
    names = [a.name for a in node.target._schema.arguments]
    index = names.index("cu_seqlens")
    return node.args[index] if len(node.args) > index else node.kwargs.get("cu_seqlens")


def _register_autograd_by_recompute(op, fn: Callable) -> None:
    """Differentiate ``op`` by re-running its eager implementation ``fn``.

    Forward keeps only the inputs; backward replays ``fn`` under grad mode on
    detached copies and lets autograd differentiate the reference. This trades
    a second forward for not having to hand-write five backward passes.
    """

    def setup_context(ctx, inputs, output):
        is_tensor = [isinstance(a, Tensor) for a in inputs]
        ctx.save_for_backward(*(a if t else None for a, t in zip(inputs, is_tensor)))
        ctx.non_tensors = [None if t else a for a, t in zip(inputs, is_tensor)]

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = [t if t is not None else a for t, a in zip(saved, ctx.non_tensors)]
        wanted = [
            i
            for i, a in enumerate(args)
            if isinstance(a, Tensor) and ctx.needs_input_grad[i] and a.is_floating_point()
        ]
        result: list[Optional[Tensor]] = [None] * len(args)
        if not wanted:
            return tuple(result)
        with torch.enable_grad():
            for i in wanted:
                args[i] = args[i].detach().requires_grad_(True)
            outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            # Outputs nobody used come back with grad None: leave them out.
            used = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            if not used:
                return tuple(result)
            input_grads = torch.autograd.grad(
                [o for o, _ in used],
                [args[i] for i in wanted],
                [g for _, g in used],
                allow_unused=True,
            )
        for i, g in zip(wanted, input_grads):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


# --- Mamba-1 selective scan -------------------------------------------------


@torch.library.custom_op("ssmshard::selective_scan", mutates_args=())
def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    delta_softplus: bool,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return ref.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)


def _check_packed_fake(cu_seqlens, batch, initial_state=None):
    """Trace-time half of the packing checks (the values are checked when the op runs)."""
    if cu_seqlens is None:
        return
    check_cu_seqlens_layout(cu_seqlens, batch)
    if initial_state is not None:
        raise ValueError("packed scans (cu_seqlens) start every sequence from a zero state; "
                         "initial states are not supported with packing")


@selective_scan.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens=None):
    _check_packed_fake(cu_seqlens, u.shape[0], initial_state)
    bsz, d, _ = u.shape
    # Float32 always: the eager fallback this replaces produces float32.
    return u.new_empty(u.shape, dtype=torch.float32), u.new_empty(
        (bsz, d, A.shape[-1]), dtype=torch.float32
    )


_register_autograd_by_recompute(selective_scan, ref.selective_scan)


# --- Mamba-2 SSD chunked scan -----------------------------------------------


@torch.library.custom_op("ssmshard::ssd_scan", mutates_args=())
def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_states: Optional[Tensor],
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return ref.ssd_scan(
        x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max, cu_seqlens
    )


@ssd_scan.register_fake
def _(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max, cu_seqlens=None):
    _check_packed_fake(cu_seqlens, x.shape[0], initial_states)
    bsz, _, h, p = x.shape
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty(
        (bsz, h, p, B.shape[-1]), dtype=torch.float32
    )


_register_autograd_by_recompute(ssd_scan, ref.ssd_scan)


# --- depthwise causal conv ----------------------------------------------------


@torch.library.custom_op("ssmshard::causal_conv1d", mutates_args=())
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    activation: Optional[str],
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    return ref.causal_conv1d(x, weight, bias, activation, cu_seqlens)


@causal_conv1d.register_fake
def _(x, weight, bias, activation, cu_seqlens=None):
    # Validate here too, so a bad activation or packing layout fails at trace time, not at run time.
    ref.check_activation(activation)
    _check_packed_fake(cu_seqlens, x.shape[0])
    return torch.empty_like(x)


_register_autograd_by_recompute(causal_conv1d, ref.causal_conv1d)


@torch.library.custom_op("ssmshard::causal_conv1d_update", mutates_args=())
def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    activation: Optional[str],
) -> tuple[Tensor, Tensor]:
    return ref.causal_conv1d_update(x, conv_state, weight, bias, activation)


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias, activation):
    ref.check_activation(activation)
    return torch.empty_like(x), torch.empty_like(conv_state)


_register_autograd_by_recompute(causal_conv1d_update, ref.causal_conv1d_update)


# --- single-step recurrent update ---------------------------------------------


@torch.library.custom_op("ssmshard::selective_state_update", mutates_args=())
def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    dt_bias: Optional[Tensor],
    dt_softplus: bool,
) -> tuple[Tensor, Tensor]:
    return ref.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


@selective_state_update.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    return torch.empty_like(x), torch.empty_like(state)


_register_autograd_by_recompute(selective_state_update, ref.selective_state_update)


# --- Mamba-2 gated RMSNorm ------------------------------------------------------
# One node instead of a dozen, so tensor parallelism can decide in one place whether the
# normalisation groups live on one rank or span several (then an all-reduce of the
# per-group sum of squares is needed).


@torch.library.custom_op("ssmshard::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: Tensor, gate: Optional[Tensor], weight: Tensor, eps: float, group_size: int) -> Tensor:
    return ref.gated_rms_norm(x, gate, weight, eps, group_size)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps, group_size):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


_register_autograd_by_recompute(gated_rms_norm, ref.gated_rms_norm)
