"""Block-scaled int8 / fp8-e4m3 two-shot all-reduce: ``torch.ops.ssmshard.quantized_all_reduce``.

N ranks, each with a partial x_k of n values (any shape; flattened). With blocks of B values
and c = ceil(n / (N * B)) * B values per rank's slice (the vector padded with zeros to N * c):

1. quantize: every block of B values becomes B code bytes and one float32 scale
   (s = block max / 127 for int8, / 448 for fp8); row j of the (N, c) codes is slice j;
2. all-to-all: rank r receives slice r of every rank (codes and scales in one byte buffer);
3. dequantize and sum the N slices in float32 (rank order), then re-quantize the sum;
4. all-gather the re-quantized slices, dequantize, trim to n values, cast to x's dtype.

Every rank dequantizes the same gathered bytes, so the result is identical on every rank (a
replicated value), as an exact all-reduce's is. Per element, with A_k the max |x_k| over the
element's block, S = sum_k A_k, M the max |exact sum| over the block, delta = 1/254 (int8) or
1/16 (fp8) and eps the output dtype's unit roundoff (0 for float32):

    |result - exact| <= delta (1 + delta) S + delta M + eps (M + 2 delta S) + (N + 8) 2**-23 S
                     <= delta (2 + delta) N max_k A_k   (float32 output, fp32 rounding aside)

(:func:`error_bound`; derivation in docs/quantized_sync.md). Backward: the gradient is that of
the exact all-reduce (straight-through; identity, as ``all_reduce``'s), never quantized.

``min_bytes``: a call whose message (x's bytes) is smaller runs the exact all-reduce instead,
decided per call: one graph serves every batch and sequence length, so the size is only known
when it runs, and every rank sees the same shape, so all ranks decide alike.

Bytes leaving a rank per call: 2 (N - 1) (c + 4 c / B) (payload and scales of both phases);
a ring all-reduce of bf16 values sends 2 (N - 1) ceil(n / N) 2. :func:`record_quantized_syncs`
records both for every call, and with ``measure_errors=True`` the error against the exact
all-reduce per sync point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch import Tensor

from .groups import backend_of
from .ops import padded_chunk

FORMATS = ("int8", "fp8")
BLOCK_SIZES = (32, 64, 128)
QMAX = {"int8": 127.0, "fp8": 448.0}
# Largest |x - dequantized(x)| per unit of block max: half an int8 step; 2**-4 relative for
# e4m3's 3 mantissa bits (at most 448 / 16 scale units; subnormals err by 2**-10 units).
DELTA = {"int8": 1.0 / 254.0, "fp8": 1.0 / 16.0}
_FP32_ROUNDING = 2.0 ** -23
_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def check_format(fmt, block: int = 64) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized all-reduce format {fmt!r}; use one of {', '.join(FORMATS)}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"quantization block of {block!r} values; use one of {BLOCK_SIZES}")


# --------------------------------------------------------------------------- the torch codec
class TorchCodec:
    """The local steps in torch (CPU, or any device): the contract and results of
    ``ssmshard.kernels.quantize`` (the Triton codec), bit for bit."""

    @staticmethod
    def _codes_of(values: Tensor, fmt: str, block: int):
        blocks = values.unflatten(-1, (-1, block))  # (..., blocks, b)
        block_max = blocks.abs().amax(-1)
        # A tensor divisor, not a Python number: CUDA divides by a scalar as a multiply by its
        # float32 reciprocal (one ulp off IEEE division), while the Triton codec and the CPU divide.
        scales = block_max / torch.full_like(block_max, QMAX[fmt])
        scaled = blocks / torch.where(scales > 0, scales, 1.0)[..., None]
        if fmt == "int8":
            codes = torch.round(scaled).clamp(-127, 127).to(torch.int8)
        else:
            codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8).flatten(-2), scales

    @staticmethod
    def _values_of(codes: Tensor, scales: Tensor, fmt: str, block: int) -> Tensor:
        values = codes.contiguous().view(_CODE_DTYPES[fmt]).float().unflatten(-1, (-1, block))
        return (values * scales[..., None]).flatten(-2)

    @classmethod
    def quantize(cls, flat, codes, scales, fmt, block):
        padded = torch.zeros(codes.numel(), dtype=torch.float32, device=flat.device)
        padded[:flat.numel()] = flat
        new_codes, new_scales = cls._codes_of(padded.view(codes.shape), fmt, block)
        codes.copy_(new_codes)
        scales.copy_(new_scales)

    @classmethod
    def reduce_requantize(cls, codes, scales, out_codes, out_scales, fmt, block):
        total = torch.zeros(codes.shape[-1], dtype=torch.float32, device=codes.device)
        for k in range(codes.shape[0]):  # rank order
            total = total + cls._values_of(codes[k], scales[k], fmt, block)
        new_codes, new_scales = cls._codes_of(total, fmt, block)
        out_codes.copy_(new_codes)
        out_scales.copy_(new_scales)

    @classmethod
    def dequantize(cls, codes, scales, out, fmt, block):
        out.copy_(cls._values_of(codes, scales, fmt, block).flatten()[:out.numel()])


def _codec_for(x: Tensor, codec):
    if codec is not None:
        return codec
    if x.is_cuda:
        from ..kernels import quantize as triton_codec

        return triton_codec
    return TorchCodec


# --------------------------------------------------------------------------- the algorithm
def _wire(rows: int, chunk: int, block: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """A (rows, chunk + 4 chunk / block) byte buffer: each row's codes, then its float32 scales."""
    wire = torch.empty(rows, chunk + 4 * (chunk // block), dtype=torch.uint8, device=device)
    return wire, *_views(wire, chunk)


def _views(wire: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    return wire[..., :chunk], wire[..., chunk:].view(torch.float32)


def two_shot_all_reduce(x: Tensor, backend, fmt: str, block: int, *, codec=None, name: str = "") -> Tensor:
    """The quantized sum of every rank's ``x`` over ``backend`` (module docstring). ``codec``:
    :class:`TorchCodec` or ``ssmshard.kernels.quantize`` (default: Triton for CUDA tensors)."""
    check_format(fmt, block)
    codec = _codec_for(x, codec)
    world, n = backend.world(), x.numel()
    if n == 0:
        return x.clone()
    chunk = padded_chunk(n, world * block) * block
    wire, codes, scales = _wire(world, chunk, block, x.device)
    codec.quantize(x.reshape(-1).contiguous(), codes, scales, fmt, block)
    received = backend.all_to_all_stacked(wire)  # row k: rank k's codes of this rank's slice
    mine, my_codes, my_scales = _wire(1, chunk, block, x.device)
    codec.reduce_requantize(*_views(received, chunk), my_codes[0], my_scales[0], fmt, block)
    gathered = backend.all_gather_stacked(mine[0])  # row k: rank k's slice of the sum
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    codec.dequantize(*_views(gathered, chunk), out, fmt, block)
    out = out.view(x.shape)
    if _RECORDERS:
        _record(name, x, out, backend, fmt, block, quantized=True, sent=2 * (world - 1) * wire.shape[1])
    return out


@torch.library.custom_op("ssmshard::quantized_all_reduce", mutates_args=())
def quantized_all_reduce(x: Tensor, group: str, fmt: str, block: int, min_bytes: int, name: str) -> Tensor:
    """The sum over ranks, block-quantized to ``fmt`` (``int8`` | ``fp8``) in blocks of ``block``
    values when x has at least ``min_bytes`` bytes, exact otherwise. ``name``: the sync point,
    for :func:`record_quantized_syncs`. Backward: identity, as ``all_reduce``'s (exact)."""
    check_format(fmt, block)
    backend = backend_of(group)
    if x.numel() * x.element_size() >= min_bytes:
        return two_shot_all_reduce(x, backend, fmt, block, name=name)
    out = backend.all_reduce(x)
    if _RECORDERS:
        world = backend.world()
        _record(name, x, out, backend, fmt, block, quantized=False,
                sent=2 * (world - 1) * padded_chunk(x.numel(), world) * x.element_size())
    return out


quantized_all_reduce.register_fake(lambda x, group, fmt, block, min_bytes, name: torch.empty_like(x))
quantized_all_reduce.register_autograd(lambda ctx, grad: (grad, None, None, None, None, None))


# --------------------------------------------------------------------------- error bound
def error_bound(sum_of_block_max: Tensor, block_max_of_sum: Tensor, fmt: str, world: int,
                out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The largest |quantized - exact| the all-reduce allows in each block, from S = sum over
    ranks of the block's max |x_k| and M = the block's max |exact sum| (module docstring)."""
    delta = DELTA[fmt]
    eps = 0.0 if out_dtype == torch.float32 else torch.finfo(out_dtype).eps / 2
    s, m = sum_of_block_max.double(), block_max_of_sum.double()
    return (delta * (1 + delta) * s + delta * m + eps * (m + 2 * delta * s)
            + (world + 8) * _FP32_ROUNDING * s)


# --------------------------------------------------------------------------- records
@dataclasses.dataclass
class QuantizedCall:
    """One call of the op on one rank."""
    name: str  # the sync point
    rank: int
    world: int
    fmt: str
    block: int
    numel: int
    dtype: str
    quantized: bool  # False: below min_bytes, the exact all-reduce ran
    bytes_sent: int  # leaving this rank: codes + scales, or the exact ring all-reduce's payload
    bf16_bytes: int  # leaving this rank in a ring all-reduce of the same values in bf16
    max_error: float | None = None  # max |result - exact| (measure_errors)
    max_exact: float | None = None  # max |exact|
    bound_ratio: float | None = None  # max over blocks of (max error / error_bound); <= 1


class SyncRecorder:
    """The calls made while recording; :meth:`summary` / :meth:`report` per sync point."""

    def __init__(self, measure_errors: bool):
        self.measure_errors = measure_errors
        self.calls: list[QuantizedCall] = []
        self._lock = threading.Lock()  # simulated ranks are threads

    def add(self, call: QuantizedCall) -> None:
        with self._lock:
            self.calls.append(call)

    def summary(self) -> dict[str, dict]:
        """Per sync point: calls, quantized calls, bytes (sent and bf16), worst errors."""
        out: dict[str, dict] = {}
        for c in self.calls:
            row = out.setdefault(c.name, {"fmt": c.fmt, "calls": 0, "quantized": 0, "bytes_sent": 0,
                                          "bf16_bytes": 0, "max_error": None, "rel_error": None,
                                          "bound_ratio": None})
            row["calls"] += 1
            row["quantized"] += c.quantized
            row["bytes_sent"] += c.bytes_sent
            row["bf16_bytes"] += c.bf16_bytes
            if c.max_error is not None:
                rel = c.max_error / c.max_exact if c.max_exact else 0.0
                for key, value in (("max_error", c.max_error), ("rel_error", rel), ("bound_ratio", c.bound_ratio)):
                    row[key] = value if row[key] is None else max(row[key], value)
        return out

    def report(self) -> str:
        lines = [f"{'sync point':<24} {'format':<6} {'calls':>5} {'quant':>5} {'bf16/sent':>9} "
                 f"{'max error':>10} {'rel error':>10} {'of bound':>8}"]
        for name, r in self.summary().items():
            def shown(v, fmt):
                return format(v, fmt) if v is not None else "-"
            lines.append(f"{name:<24} {r['fmt']:<6} {r['calls']:>5} {r['quantized']:>5} "
                         f"{r['bf16_bytes'] / max(r['bytes_sent'], 1):>9.2f} {shown(r['max_error'], '10.3e')} "
                         f"{shown(r['rel_error'], '10.3e')} {shown(r['bound_ratio'], '8.3f')}")
        return "\n".join(lines)


_RECORDERS: list[SyncRecorder] = []


@contextlib.contextmanager
def record_quantized_syncs(measure_errors: bool = False):
    """Record every ``quantized_all_reduce`` call in the block (all ranks of this process).

    ``measure_errors``: each quantized call also runs the exact all-reduce and a sum of block
    maxima to measure its error against :func:`error_bound`; it adds collectives, so enter it
    on every rank (once per process: around ``run_simulated`` for a simulated group).
    """
    recorder = SyncRecorder(measure_errors)
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


def _record(name, x, out, backend, fmt, block, *, quantized: bool, sent: int) -> None:
    world = backend.world()
    call = QuantizedCall(name=name, rank=backend.rank(), world=world, fmt=fmt, block=block, numel=x.numel(),
                         dtype=str(x.dtype).replace("torch.", ""), quantized=quantized, bytes_sent=sent,
                         bf16_bytes=2 * (world - 1) * padded_chunk(x.numel(), world) * 2)
    if quantized and any(r.measure_errors for r in _RECORDERS):
        _measure(call, x, out, backend, fmt, block)
    for recorder in list(_RECORDERS):
        recorder.add(call)


def _measure(call: QuantizedCall, x: Tensor, out: Tensor, backend, fmt: str, block: int) -> None:
    with torch.no_grad():
        exact = backend.all_reduce(x.detach().float()).reshape(-1)
        padded = padded_chunk(x.numel(), block) * block

        def block_max(flat):
            return torch.nn.functional.pad(flat, (0, padded - flat.numel())).view(-1, block).amax(-1)

        sum_of_max = backend.all_reduce(block_max(x.detach().float().reshape(-1).abs()))
        bound = error_bound(sum_of_max, block_max(exact.abs()), fmt, backend.world(), out.dtype)
        error = block_max((out.detach().double().reshape(-1) - exact.double()).abs())
        ratio = torch.where(bound > 0, error / bound.clamp_min(1e-300), error * float("inf"))
    call.max_error, call.max_exact = error.max().item(), exact.abs().max().item()
    call.bound_ratio = ratio.nan_to_num(0.0).max().item()
