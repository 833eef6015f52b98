"""Mamba-2 SSD chunked scan in Triton: public function and autograd.

``ssd_scan`` takes the arguments of mamba_ssm's ``mamba_chunk_scan_combined`` (plus
``cu_seqlens`` for packed sequences) and computes the function of the reference
``ssmshard.kernels.reference.ssd_scan`` / ``torch.ops.ssmshard.ssd_scan``, extended with
the z gate and sequence packing. ``ssd_scan_like_op`` has the op's exact signature and
results, for the pass that swaps op nodes for this kernel.

Dimension letters: b batch, l length, h heads, p head dim, g groups, n state size,
S sequences, t token of the flattened (b * l) axis.

Semantics (per sequence, per head; the state starts at the sequence's initial state):
    dt_t    = clamp(softplus?(dt_t + dt_bias), dt_limit)    # always clamped, like the op
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T      # (p, n)
    out_t   = (state_t C_t + D x_t) * silu(z_t)

Output dtype: ``out_dtype`` (default x's dtype, like mamba_ssm; the reference op returns
float32, and ``ssd_scan_like_op`` asks for float32). Final states are always float32.
Math is float32 throughout; with 16-bit inputs the tensor-core products take 16-bit
operands (the decayed C.B weights, the states read out through C, x * dt), as
mamba_ssm's kernels do, and the states handed between kernels are stored in x's dtype.

Packed sequences: chunks are cut per sequence (each sequence starts a new chunk; its
last chunk may be shorter), so no chunk ever spans a boundary and every chunk's decay
mask, chunk state and carried state belong to one sequence. Sequence starts that fall
inside a fixed chunk grid of the packed row therefore need no special case, and a
packed batch computes exactly what each sequence computes alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ssmshard.kernels.interpreter import INTERPRETER_LOCK
from ssmshard.kernels.ssd_scan_bwd import ssd_backward
from ssmshard.kernels.ssd_scan_fwd import dt_kwargs, ssd_forward
from ssmshard.kernels.ssd_triton_common import INTERPRET, ChunkTable, next_pow2

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEADDIM = 128
MAX_DSTATE = 256


class _SSDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens,
                chunk_size, dt_softplus, dt_min, dt_max, out_dtype):
        bsz, l, h, p = x.shape
        g, n = B.shape[-2:]
        n_tok = bsz * l
        if cu_seqlens is None:
            # Row r is sequence r; a chunk longer than the rows would only pad. Rounded up to a
            # power of two, which pads no more than the kernels' power-of-two blocks do anyway:
            # chunk_size is an autotuning key, and training on a mix of short lengths would
            # otherwise autotune every kernel again for every distinct length.
            chunk_size = min(chunk_size, next_pow2(l))
            table = ChunkTable.for_rows(bsz, l, chunk_size, x.device)
        else:
            # Lengths live on the device: the table bounds the chunk count.
            table = ChunkTable(cu_seqlens, n_tok, chunk_size)
        dt_args = dt_kwargs(dt_bias, dt_softplus, dt_min, dt_max)
        flat = _Flat(x, dt, B, C, z)
        store_ypre = z is not None and any(ctx.needs_input_grad)
        out, final, ypre = ssd_forward(flat.x, flat.dt, A, flat.B, flat.C, D, flat.z, initial_states,
                                       table, dt_args, out_dtype, store_ypre)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, ypre)
        ctx.table, ctx.dt_args = table, dt_args
        ctx.set_materialize_grads(False)
        return out.view(bsz, l, h, p), final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_states, ypre = ctx.saved_tensors
        bsz, l, h, p = x.shape
        flat = _Flat(x, dt, B, C, z)
        dout_flat = None if dout is None else dout.reshape(bsz * l, h, p)
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        with INTERPRETER_LOCK:
            grads = ssd_backward(dout_flat, dfinal, flat.x, flat.dt, A, flat.B, flat.C, D, flat.z, ypre,
                                 initial_states, ctx.table, ctx.dt_args)

        def cast(name, like, shape=None):
            value = grads[name]
            if value is None or like is None:
                return None
            return (value if shape is None else value.view(shape)).to(like.dtype)

        return (
            cast("dx", x, x.shape), cast("ddt", dt, dt.shape), cast("dA", A),
            cast("dB", B, B.shape), cast("dC", C, C.shape), cast("dD", D),
            cast("dz", z, x.shape), cast("ddt_bias", dt_bias), cast("dinit", initial_states),
            None, None, None, None, None, None,
        )


class _Flat:
    """The (b, l, ...) inputs as views over the flattened (b * l) token axis."""

    def __init__(self, x, dt, B, C, z):
        bsz, l, h, p = x.shape
        g, n = B.shape[-2:]
        self.x = x.reshape(bsz * l, h, p)  # (b, l, h, p) -> (t, h, p); a view when strides allow
        self.dt = dt.reshape(bsz * l, h)  # (b, l, h) -> (t, h)
        self.B = B.reshape(bsz * l, g, n)  # (b, l, g, n) -> (t, g, n)
        self.C = C.reshape(bsz * l, g, n)
        self.z = None if z is None else z.reshape(bsz * l, h, p)


def _check(cond: bool, message: str, exc=ValueError) -> None:
    if not cond:
        raise exc(f"ssd_scan: {message}")


def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, cu_seqlens, initial_states, out_dtype):
    _check(x.dim() == 4, f"x must be (batch, length, heads, headdim), got shape {tuple(x.shape)}")
    bsz, l, h, p = x.shape
    _check(bsz > 0 and l > 0 and h > 0 and p > 0, f"x has an empty dimension: {tuple(x.shape)}")
    _check(x.dtype in _INPUT_DTYPES, f"x dtype {x.dtype} is not supported; use float32, bfloat16 or float16",
           TypeError)
    _check(B.dim() == 4 and B.shape[:2] == (bsz, l),
           f"B must be (batch, length, groups, dstate) = ({bsz}, {l}, g, n), got {tuple(B.shape)}")
    _check(C.shape == B.shape, f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    g, n = B.shape[-2:]
    _check(h % g == 0, f"heads ({h}) must be a multiple of B/C groups ({g})")
    _check(B.dtype == x.dtype and C.dtype == x.dtype,
           f"B and C must have x's dtype {x.dtype} (got {B.dtype}, {C.dtype}): cast them first", TypeError)
    _check(p <= MAX_HEADDIM, f"headdim {p} > {MAX_HEADDIM} is not supported by the Triton kernels",
           NotImplementedError)
    _check(n <= MAX_DSTATE, f"dstate {n} > {MAX_DSTATE} is not supported by the Triton kernels",
           NotImplementedError)
    _check(dt.shape == (bsz, l, h), f"dt must be (batch, length, heads) = {(bsz, l, h)}, got {tuple(dt.shape)}")
    _check(dt.is_floating_point(), f"dt must be floating point, got {dt.dtype}", TypeError)
    _check(A.shape == (h,) and A.is_floating_point(), f"A must be a float ({h},) tensor, got {tuple(A.shape)} {A.dtype}")
    _check(isinstance(chunk_size, int) and chunk_size >= 1, f"chunk_size must be a positive int, got {chunk_size!r}")
    if D is not None:
        _check(D.shape in ((h,), (h, p)), f"D must be ({h},) or ({h}, {p}), got {tuple(D.shape)}")
    if z is not None:
        _check(z.shape == x.shape, f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None:
        _check(dt_bias.shape == (h,), f"dt_bias must be ({h},), got {tuple(dt_bias.shape)}")
    _check(out_dtype in _INPUT_DTYPES, f"out_dtype {out_dtype} is not supported", TypeError)
    n_seqs = bsz
    if cu_seqlens is not None:
        _check(bsz == 1, f"with cu_seqlens the sequences are packed along length: batch must be 1, got {bsz}")
        _check(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2,
               f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        _check(not cu_seqlens.is_floating_point(), f"cu_seqlens must be integer, got {cu_seqlens.dtype}", TypeError)
        n_seqs = cu_seqlens.numel() - 1
        if cu_seqlens.device.type == "cpu":
            # Free to check here; on the GPU it would need a host sync, so it is the caller's contract.
            _check(int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == l
                   and bool((cu_seqlens[1:] >= cu_seqlens[:-1]).all()),
                   f"cu_seqlens must rise from 0 to length {l}, got {cu_seqlens.tolist()}")
    if initial_states is not None:
        _check(initial_states.shape == (n_seqs, h, p, n),
               f"initial_states must be ({n_seqs}, {h}, {p}, {n}) (one per {'sequence' if cu_seqlens is not None else 'batch row'}), "
               f"got {tuple(initial_states.shape)}")
    tensors = [t for t in (x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states) if t is not None]
    _check(all(t.device == x.device for t in tensors), "all tensors must be on one device")
    _check(x.is_cuda or INTERPRET,
           "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import, for the CPU interpreter)",
           RuntimeError)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
             D: Optional[Tensor] = None, z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")), *,
             cu_seqlens: Optional[Tensor] = None, initial_states: Optional[Tensor] = None,
             return_final_states: bool = False, out_dtype: Optional[torch.dtype] = None):
    """Mamba-2 SSD scan. Returns out (b, l, h, p), and final states if asked.

    x: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n); D: (h,) or (h, p);
    z: (b, l, h, p); dt_bias: (h,); dt_limit: (dt_min, dt_max), applied after bias and
    softplus. cu_seqlens: (S + 1,) int, b == 1, packed sequences; each starts from its
    initial state (initial_states (S, h, p, n), or (b, h, p, n) without cu_seqlens; zero
    when None). With return_final_states, also returns final states (S or b, h, p, n), fp32.
    cu_seqlens on the GPU is not checked (that would need a host sync): it must rise from
    0 to l. Differentiable in every tensor argument except cu_seqlens.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, cu_seqlens, initial_states, out_dtype)
    dt_min, dt_max = (float(v) for v in dt_limit)
    _check(not math.isnan(dt_min) and not math.isnan(dt_max) and dt_min <= dt_max,
           f"dt_limit must be (min, max) with min <= max, got {dt_limit}")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    with INTERPRETER_LOCK:
        out, final = _SSDScan.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens,
                                    int(chunk_size), bool(dt_softplus), dt_min, dt_max, out_dtype)
    return (out, final) if return_final_states else out


def ssd_scan_like_op(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max):
    """``torch.ops.ssmshard.ssd_scan`` on the Triton kernels: same arguments, (out, final) both fp32."""
    return ssd_scan(x, dt, A, B, C, int(chunk_size), D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                    dt_limit=(dt_min, dt_max), initial_states=initial_states, return_final_states=True,
                    out_dtype=torch.float32)
