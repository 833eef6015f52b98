"""Registration of the ``torch.ops.ssmshard`` state-space-model ops, from ``signatures``.

Each op is opaque to tracing (torch.export / torch.compile see one node), has a fake
implementation for shape propagation, and is differentiable. All ops are functional: nothing
is mutated, caches are returned as new tensors. The eager implementation is the reference in
``kernels.reference``; the arguments of every op are declared once, in ``signatures``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ssmshard.kernels import reference as ref
from ssmshard.packing import check_cu_seqlens_layout

from .signatures import SIGNATURES


def cu_seqlens_arg(node):
    """The ``cu_seqlens`` argument of a graph node calling a packing-aware op (an FX node or None)."""
    name = node.target._schema.name.split("::")[-1]
    return SIGNATURES[name].bind(node.args, node.kwargs)["cu_seqlens"]


def recompute_grads(fn: Callable, args: list, grads, wanted: list[int]) -> list[Optional[Tensor]]:
    """The gradients of ``fn(*args)``'s outputs (upstream ``grads``) with respect to ``args[i]`` for
    each ``i`` in ``wanted`` (None where none flows): ``fn`` replayed under grad mode on detached
    copies, autograd differentiating it."""
    args = list(args)
    with torch.enable_grad():
        for i in wanted:
            args[i] = args[i].detach().requires_grad_(True)
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        # Outputs nobody used come back with grad None: leave them out.
        used = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not used:
            return [None] * len(wanted)
        return list(torch.autograd.grad([o for o, _ in used], [args[i] for i in wanted], [g for _, g in used],
                                        allow_unused=True))


def _register_autograd_by_recompute(op, fn: Callable, grads_of: Optional[Callable] = None) -> None:
    """Differentiate ``op`` by re-running its eager implementation ``fn``.

    Forward keeps only the inputs; backward replays ``fn`` under grad mode on
    detached copies and lets autograd differentiate the reference. This trades
    a second forward for not having to hand-write five backward passes.
    ``grads_of(args, grads, wanted)``: what computes the gradients instead of
    ``recompute_grads(fn, ...)`` (an opaque op doing the same, for compiled graphs).
    """
    grads_of = grads_of or (lambda args, grads, wanted: recompute_grads(fn, args, grads, wanted))

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
        if wanted:
            for i, g in zip(wanted, grads_of(args, grads, wanted)):
                result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


def _define(name: str, reference: Callable, fake: Callable, differentiable: bool = True):
    """Register ``ssmshard::<name>`` with its declared schema.

    ``reference`` runs it (called with the arguments in schema order); ``fake`` gives the
    output shapes and takes the arguments by their schema names (those it needs, ``**_`` for
    the rest). ``differentiable=False``: no autograd formula (an op of decode programs only);
    a backward through it is PyTorch's error naming the op, never a silent zero gradient.
    """
    signature = SIGNATURES[name]
    FAKES[name] = fake

    def run(*args, **kwargs):
        return in_declared_layout(reference(*args, **kwargs), declared_outputs(fake, signature, args, kwargs))

    op = torch.library.custom_op(signature.qualname, run, mutates_args=(), schema=signature.schema)
    op.register_fake(lambda *args, **kwargs: fake(**signature.bind(args, kwargs)))
    if differentiable:
        _register_autograd_by_recompute(op, reference)
    return op


# Op name -> its fake implementation (taking the arguments by their schema names).
FAKES: dict[str, Callable] = {}


def declared_outputs(fake: Callable, signature, args, kwargs):
    """What ``fake`` declares for one call, evaluated on meta-device stand-ins of the arguments:
    shapes and strides only, no memory allocated (an op runs this on every call)."""
    return fake(**{name: on_meta(value) for name, value in signature.bind(args, kwargs).items()})


def on_meta(value):
    """A tensor's meta-device stand-in (same shape, strides and dtype); other values (lists
    of tensors included) as they are."""
    if isinstance(value, Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(on_meta(v) for v in value)
    return value


def in_declared_layout(outputs, declared):
    """``outputs`` with the strides of ``declared`` (what the op's fake returns for these inputs,
    on the meta device: see ``declared_outputs``).

    A compiled graph (Inductor) reads an opaque op's outputs with the strides its fake promised
    and asserts them, so what an implementation returns must have exactly those: an output laid
    out otherwise (the reference conv's contiguous output where the fake keeps a transposed
    input's layout) is copied into memory of the declared layout. Outputs already laid out so
    (the common case) are returned as they are, with nothing allocated.
    """
    if isinstance(outputs, Tensor):
        return _relaid(outputs, declared)
    return tuple(_relaid(o, d) for o, d in zip(outputs, declared))


def _relaid(output: Tensor, declared: Tensor) -> Tensor:
    if _same_strides(output, declared):
        return output
    laid_out = torch.empty_strided(declared.shape, declared.stride(), dtype=declared.dtype, device=output.device)
    return laid_out.copy_(output)


def _same_strides(a: Tensor, b: Tensor) -> bool:
    """Equal strides where it matters: a dim of one element has no stride to respect (as Inductor's
    ``assert_size_stride`` sees it)."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _check_packed_fake(cu_seqlens, batch, initial_state=None):
    """Trace-time half of the packing checks (the values are checked when the op runs)."""
    if cu_seqlens is None:
        return
    check_cu_seqlens_layout(cu_seqlens, batch)
    if initial_state is not None:
        raise ValueError("packed scans (cu_seqlens) start every sequence from a zero state; "
                         "initial states are not supported with packing")


# Scans return float32 (the eager fallbacks they replace produce float32); Mamba-1's output in
# out_dtype and its final state left out where the graph says so (``scan_outputs``).
def _selective_scan_fake(u, A, initial_state, cu_seqlens, out_dtype=None, final_state=True, **_):
    _check_packed_fake(cu_seqlens, u.shape[0], initial_state)
    bsz, d, _ = u.shape
    return (u.new_empty(u.shape, dtype=out_dtype or torch.float32),
            u.new_empty((bsz, d, A.shape[-1] if final_state else 0), dtype=torch.float32))


def _ssd_scan_fake(x, B, initial_states, cu_seqlens, **_):
    _check_packed_fake(cu_seqlens, x.shape[0], initial_states)
    bsz, _, h, p = x.shape
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty((bsz, h, p, B.shape[-1]), dtype=torch.float32)


def _causal_conv1d_fake(x, activation, cu_seqlens, **_):
    # Validate here too, so a bad activation or packing layout fails at trace time, not at run time.
    ref.check_activation(activation)
    _check_packed_fake(cu_seqlens, x.shape[0])
    return torch.empty_like(x)


def _causal_conv1d_update_fake(x, conv_state, activation, **_):
    ref.check_activation(activation)
    return torch.empty_like(x), torch.empty_like(conv_state)


def _selective_state_update_fake(state, x, **_):
    return torch.empty_like(x), torch.empty_like(state)


def _gated_rms_norm_fake(x, weight, **_):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


def _rms_norm_fake(x, weight, **_):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


def _add_rms_norm_fake(x, residual, weight, norm_dtype, **_):
    summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return summed, torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)


selective_scan = _define("selective_scan", ref.selective_scan, _selective_scan_fake)
ssd_scan = _define("ssd_scan", ref.ssd_scan, _ssd_scan_fake)
causal_conv1d = _define("causal_conv1d", ref.causal_conv1d, _causal_conv1d_fake)
causal_conv1d_update = _define("causal_conv1d_update", ref.causal_conv1d_update, _causal_conv1d_update_fake)
selective_state_update = _define("selective_state_update", ref.selective_state_update, _selective_state_update_fake)
# Mamba-2's gated norm as one node instead of a dozen, so tensor parallelism can decide in one
# place whether the normalisation groups live on one rank or span several (then an all-reduce
# of the per-group sum of squares is needed).
gated_rms_norm = _define("gated_rms_norm", ref.gated_rms_norm, _gated_rms_norm_fake)
# The plain RMSNorm, alone or with the residual add before it, as one node: the ``fuse_rmsnorm``
# pass rewrites the captured chains of small ops into these so one kernel runs each.
rms_norm = _define("rms_norm", ref.rms_norm, _rms_norm_fake)
add_rms_norm = _define("add_rms_norm", ref.add_rms_norm, _add_rms_norm_fake)


def _decode_linear_fake(x, weight, **_):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# A decode step's linear layer as its own op, so the ``decode_gemv`` pass can put it on the
# skinny-matmul kernel (``kernels/gemv.py``).
decode_linear = _define("decode_linear", ref.decode_linear, _decode_linear_fake)


def _decode_linear_group_fake(x, weights, **_):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


# Linear layers of a decode step that read the same input (Llama's q/k/v, gate/up) as one op, so
# the ``group_decode_linears`` pass can run them as one kernel launch (``kernels/gemv.py``).
decode_linear_group = _define("decode_linear_group", ref.decode_linear_group, _decode_linear_group_fake,
                              differentiable=False)


def _rotary_fake(xs, cos, sin):
    dtype = torch.promote_types(cos.dtype, sin.dtype)
    return [torch.empty_like(x, dtype=torch.promote_types(x.dtype, dtype)) for x in xs]


# Attention's rotary embedding of q and k as one op (five ATen ops each as captured), so the
# ``fuse_rotary`` pass can run it as one kernel launch (``kernels/rotary.py``).
rotary = _define("rotary", ref.rotary, _rotary_fake, differentiable=False)
