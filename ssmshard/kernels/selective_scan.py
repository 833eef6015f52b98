"""Mamba-1 selective scan on Triton kernels: public functions, launch configuration and the
autograd Function. The kernels are in ``selective_scan_fwd`` (the sequential forward, the
default), ``selective_scan_fwd_parallel`` (``ScanConfig(fwd_variant="parallel")``) and
``selective_scan_bwd`` (one backward for both: the forwards write the same checkpoints).

Dimension letters: b batch, d channels, l tokens, n state size, g groups of B / C,
e channels per group (d // g), S packed sequences, G segments of the sequence,
K checkpoint chunks (ceil(l / chunk)).

Semantics (per channel c and state index i, A < 0):
    dt_t = softplus(delta_t + bias)          (or delta_t + bias)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t,   h_{-1} = initial state (or 0)
    y_t  = sum_i C_t * h_t  (+ D * u_t),  times silu(z_t) if z is given.
With ``cu_seqlens`` (packed sequences) the state restarts at every sequence start, from that
sequence's initial state or 0, so nothing crosses a boundary, forward or backward.

Bytes and passes (bf16, B=8, d=5120, L=2048, N=16; one (b, d, l) bf16 tensor is 168 MB).
Forward: reads u, delta, z once and writes y once, 671 MB, 0.16 ms at the 4.25 TB/s copy
roofline. Its arithmetic is b*d*l*n = 1.34 G exp2 (~0.32 ms on the SFUs) plus ~4 FP32
instructions each (SASS: ~10 instructions per element in all), so it is compute bound and the
design goal is one pass with nothing beyond that arithmetic; ``selective_scan_fwd`` has the
layout that gets there, and the sequence segments used when b * d is too small to fill the
GPU (B=1, d=5120: 160 warps); segments cost a second read of u and delta and one more exp2
per element, and buy G-fold parallelism (on packed rows the segment passes walk only the tokens
whose effect can cross a segment boundary: ``_segment_pass_ranges``). With gradients
the forward also writes the state at every chunk start: b*d*n*l*4/chunk = 84 MB at chunk=64.
Backward: reads u, delta, z, dy, checkpoints, writes du, ddelta, dz: 1.26 GB; plus the dB/dC
per-channel-block partials, 2*b*n*l*4 bytes per block = 671 MB at 16-channel blocks, written
by the kernel and read back by torch's sum (wider blocks halve that but give fewer
programs; ``ScanConfig.bwd_block_d``). Its arithmetic (two scans per element, one of them
reversed, and two channel sums per state index) is ~70-85 SASS instructions per element, so it
too is compute bound.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ssmshard.kernels.interpreter import INTERPRETER_LOCK
from ssmshard.kernels.launch_math import cdiv, next_power_of_2, sm_count
from ssmshard.kernels.selective_scan_bwd import scan_bwd_kernel
from ssmshard.kernels.selective_scan_bwd_parallel import scan_bwd_parallel_kernel
from ssmshard.kernels.selective_scan_fwd import scan_fwd_kernel, segment_carry_kernel
from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel


# --- launch configuration ------------------------------------------------------------------


FWD_VARIANTS = ("sequential", "parallel", "auto")
BWD_VARIANTS = ("tile", "parallel")


@dataclass(frozen=True)
class ScanConfig:
    """Launch shapes. ``chunk`` (tokens) is the checkpoint spacing, shared by the forward and
    the backward tile. ``segments``: 0 lets ``default_config`` pick; 1 disables the split.

    ``fwd_variant`` picks the forward kernel: "sequential" (``selective_scan_fwd``: one channel
    per thread, tokens walked in order, the state loop over n) or "parallel"
    (``selective_scan_fwd_parallel``: (par_block_d, n, par_tokens) tiles scanned over time with
    ``tl.associative_scan``, par_warps warps). Both write the same checkpoints, so the
    backward is the same for either. "auto" resolves at launch (``_resolve_forward``): the
    sequential kernel at 4 tokens a step where an inference call's u, delta and z are
    token-contiguous and the row is one segment, the parallel kernel otherwise.

    ``bwd_variant`` picks the backward kernel: "tile" (``selective_scan_bwd``: (bwd_block_d,
    chunk) tiles with tokens over threads, a loop over state indices) or "parallel"
    (``selective_scan_bwd_parallel``: (bwd_block_d, bwd_tokens, n) tiles scanned over their
    in-thread token axis, the sequence split into the same segments as the forward). Both run bwd_block_d
    channels per program on bwd_warps warps."""

    chunk: int = 64
    fwd_warps: int = 1
    segments: int = 1
    bwd_block_d: int = 16
    bwd_warps: int = 4
    unroll_n_max: int = 16  # unroll the state-index loop when n <= this
    # Channels per forward program. The layout wants one per thread (None: 32 * fwd_warps);
    # smaller blocks are for the CPU interpreter, where masked lanes cost real time.
    fwd_block_d: Optional[int] = None
    fwd_variant: str = "sequential"
    # Tokens the sequential forward advances per step; None: one 16-byte vector of the widest
    # per-token tensor, y included (4 with float32 y, 8 when all are bf16). On token-contiguous
    # inputs at 8 x 2048 x 5120 on an H200 it took 1.037 ms at 4 tokens (float32 y) and 2.695 ms
    # at 8 (bf16 y; benchmarks/results/compile/scan_tiles_in_program.log). "auto" sets 4.
    fwd_tokens: Optional[int] = None
    # One channel per lane (par_block_d = 32 * par_warps) with par_tokens = 4 keeps a step's
    # tokens and states in one thread (see selective_scan_fwd_parallel).
    par_block_d: int = 128
    par_tokens: int = 4
    par_warps: int = 4
    bwd_variant: str = "tile"
    bwd_tokens: int = 4
    # Register caps (ptxas .maxnreg) for the parallel kernels; None leaves ptxas free. The
    # kernels are latency bound with one warp per program, and a cap trades a few spills for
    # more resident warps per SM (65536 / (32 * registers)).
    par_maxnreg: Optional[int] = None
    bwd_maxnreg: Optional[int] = None

    @property
    def fwd_channels(self) -> int:
        return self.fwd_block_d or 32 * self.fwd_warps

    def __post_init__(self):
        for name in ("chunk", "fwd_warps", "bwd_block_d", "bwd_warps", "fwd_channels",
                     "par_block_d", "par_tokens", "par_warps", "bwd_tokens"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ScanConfig.{name} must be a power of two, got {value}")
        if self.fwd_tokens is not None and (self.fwd_tokens < 1 or self.fwd_tokens & (self.fwd_tokens - 1)):
            raise ValueError(f"ScanConfig.fwd_tokens must be None or a power of two, got {self.fwd_tokens}")
        for name in ("par_maxnreg", "bwd_maxnreg"):
            value = getattr(self, name)
            if value is not None and not 24 <= value <= 255:
                raise ValueError(f"ScanConfig.{name} must be None or a register count in 24..255, got {value}")
        if self.chunk < 8:
            raise ValueError(f"ScanConfig.chunk must be at least 8 tokens, got {self.chunk}")
        if self.segments < 1:
            raise ValueError(f"ScanConfig.segments must be >= 1, got {self.segments}")
        if self.fwd_variant not in FWD_VARIANTS:
            raise ValueError(f"ScanConfig.fwd_variant must be one of {FWD_VARIANTS}, got {self.fwd_variant!r}")
        if self.bwd_variant not in BWD_VARIANTS:
            raise ValueError(f"ScanConfig.bwd_variant must be one of {BWD_VARIANTS}, got {self.bwd_variant!r}")
        if self.bwd_tokens > self.chunk:
            raise ValueError(f"ScanConfig.bwd_tokens ({self.bwd_tokens}) must not exceed chunk ({self.chunk})")


# Below this many forward warps per SM the sequence is split into segments (each at least
# _MIN_SEGMENT_TOKENS long), as many as give _SPLIT_WARPS_PER_SM warps per SM. A split costs a
# second pass over each segment (from a zero state, without output), so it pays only when the
# SMs would otherwise idle: at B=8 d=5120 L=2048 (9.7 warps per SM) two segments slowed the
# forward from 1.32 to 1.62 ms.
_FWD_WARPS_PER_SM = 8
_SPLIT_WARPS_PER_SM = 32
_MIN_SEGMENT_TOKENS = 128
# Register cap of the parallel backward on split sequences (on whole ones it slowed it).
_SPLIT_BWD_MAXNREG = 168


def default_config(b: int, d: int, l: int, device: torch.device, packed: bool = False) -> ScanConfig:
    """Counted at 32 channels per warp, the parallel forward runs b * d / 32 warps. With fewer
    than 8 per SM the sequence is split into segments to make up the difference (and a
    one-sequence row gets 16-channel tiles, see below); the backward uses the
    same segments, with its registers capped at 168 (227 uncapped: 12 resident warps per SM
    instead of 8; no spills in its loops).

    Every pick won a sweep on an H200 (docs/kernels.md; benchmarks/results/kernels/):
    - forward: "auto" (``_resolve_forward``). On channel-contiguous inputs, split rows and
      training calls that is the parallel variant with 32-channel, 4-token tiles on one warp
      (1.343 ms against the sequential 2.719 ms at B=8 d=5120 L=2048); on token-contiguous
      inference inputs in one segment, the sequential variant at 4 tokens a step;
    - backward: the parallel variant with 8-channel, 4-token tiles on one warp (forward+backward
      10.81 ms against the tile backward's 17.58 ms at B=8 L=2048, before later changes);
    - segments and the cap (d=5120): at B=1 L=16384, 26 segments and the cap
      took forward+backward from 10.94 ms (7 segments, uncapped) to 9.03 ms and the forward
      from 2.24 to 1.55 ms; on a packed row of 16384 tokens 11.56 -> 9.53 ms; at L=8192
      5.29 -> 4.61 ms. At B=8 L=2048 the cap alone slowed it (8.46 -> 9.05 ms), and splits
      between 2 and 7 warps per SM were not measured.
    - forward tile on split rows: 16 channels where the row is one sequence
      (B=1 d=5120, one run, CUDA-graph medians: L=2048 0.265 -> 0.250 ms, 16384 1.543 ->
      1.497 ms), 32 on packed rows (16 took the 16384-token row from 1.703 to 1.966 ms, in a
      run that shared its host with a compile).
    - segments of at least 128 tokens, not 256 (B=1 d=5120, CUDA-graph medians; the sweep is
      benchmarks/results/kernels/mamba1_scan_batch1_split_sweep.json): L=2048 gets 16 segments
      instead of 8, forward 0.2509 -> 0.2234 ms and forward+backward 1.321 -> 1.260 ms; L=4096 gets 22
      instead of 16, forward 0.4242 -> 0.4199 ms, forward+backward 2.376 -> 2.353 ms; longer
      rows keep their split. The sweep's times zigzag with the segment count (whole waves of
      one-warp programs), reproducibly to about 1%: its best, 11 segments at L=2048
      (0.2220 ms) and 13 at L=4096 (0.4001 ms), follow no rule this function could state."""
    if type(b) is int and type(d) is int and type(l) is int:  # not symbolic sizes (tracing): cacheable
        return _cached_config(b, d, l, device, packed)
    return _pick_config(b, d, l, device, packed)


def _pick_config(b: int, d: int, l: int, device: torch.device, packed: bool) -> ScanConfig:
    """``default_config``'s pick, uncached."""
    warps = b * cdiv(d, 32)
    sms = sm_count(device)
    segments = 1
    if warps < _FWD_WARPS_PER_SM * sms:
        segments = max(1, min(cdiv(_SPLIT_WARPS_PER_SM * sms, warps), l // _MIN_SEGMENT_TOKENS))
    fwd_block_d = 16 if segments > 1 and not packed else 32
    return ScanConfig(segments=segments, fwd_variant="auto", par_block_d=fwd_block_d, par_tokens=4, par_warps=1,
                      bwd_variant="parallel", bwd_block_d=8, bwd_tokens=4, bwd_warps=1,
                      bwd_maxnreg=_SPLIT_BWD_MAXNREG if segments > 1 else None)


# Every layer of a model asks with the same shape; picking took 20 us of host time per call on
# an H200 host (timed per host section; docs/kernels.md).
_cached_config = functools.lru_cache(maxsize=1024)(_pick_config)


# --- argument checks ---------------------------------------------------------------------


def _check_scan_args(u, delta, A, B, C, D, z, delta_bias, cu_seqlens, initial_state):
    if u.dim() != 3:
        raise ValueError(f"u must be (b, d, l), got shape {tuple(u.shape)}")
    bsz, d, l = u.shape
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.shape != u.shape:
            raise ValueError(f"{name} must have u's shape {tuple(u.shape)}, got {tuple(t.shape)}")
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must be (d={d}, n), got shape {tuple(A.shape)}")
    if A.is_complex():
        raise ValueError("complex A is not supported: pass a real (d, n) A")
    n = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if t.dim() not in (3, 4) or t.shape[0] != bsz or t.shape[-2:] != (n, l):
            raise ValueError(
                f"{name} must be (b={bsz}, n={n}, l={l}) or (b, g, n, l), got {tuple(t.shape)}"
            )
    if B.shape != C.shape:
        raise ValueError(f"B and C must have one shape, got {tuple(B.shape)} and {tuple(C.shape)}")
    g = B.shape[1] if B.dim() == 4 else 1
    if d % g:
        raise ValueError(f"channels ({d}) must be a multiple of B/C groups ({g})")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and t.shape != (d,):
            raise ValueError(f"{name} must be (d={d},), got {tuple(t.shape)}")
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("delta_bias", delta_bias), ("initial_state", initial_state)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != u.device:
            raise ValueError(f"{name} is on {t.device}, u on {u.device}: move them to one device")
    num_seqs = bsz
    if cu_seqlens is not None:
        if bsz != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along l, so b must be 1, got {bsz}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be an int32 (S + 1,) tensor of offsets, got {cu_seqlens.dtype} "
                f"{tuple(cu_seqlens.shape)}"
            )
        num_seqs = cu_seqlens.numel() - 1
        _check_offsets(cu_seqlens, l)
    if initial_state is not None and initial_state.shape != (num_seqs, d, n):
        what = "S" if cu_seqlens is not None else "b"
        raise ValueError(
            f"initial_state must be ({what}={num_seqs}, d={d}, n={n}), got {tuple(initial_state.shape)}"
        )
    return bsz, d, l, n, g, num_seqs


# The offsets tensor checked last, its version and l: a packed model hands every layer the same
# cu_seqlens, so one device sync per forward checks them all instead of one per layer. A weak
# reference, so a new tensor that happens to reuse the memory is never taken for it.
_last_checked_offsets: tuple = (lambda: None, -1, -1)


def _check_offsets(cu_seqlens: Tensor, l: int) -> None:
    global _last_checked_offsets
    # Reading the offsets costs a device sync; skip it while a CUDA graph is being captured.
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    ref, version, checked_l = _last_checked_offsets
    if ref() is cu_seqlens and version == cu_seqlens._version and checked_l == l:
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != l or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to l={l} without decreasing, got {offsets[:8]}"
            f"{'...' if len(offsets) > 8 else ''} (last {offsets[-1]})"
        )
    _last_checked_offsets = (weakref.ref(cu_seqlens), cu_seqlens._version, l)


def _sequence_index(cu_seqlens: Tensor, l: int) -> Tensor:
    # seq[t] = s for cu_seqlens[s] <= t < cu_seqlens[s + 1]; empty sequences own no token.
    tokens = torch.arange(l, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).to(torch.int32)


def _segment_pass_ranges(cu_seqlens: Tensor, l: int, num_segments: int, seg_len: int) -> tuple[Tensor, Tensor]:
    """The tokens the two segment passes need on a packed row (device tensors, no host sync).

    The forward's segment pass finds each segment's end state from a zero start: only tokens
    from the last sequence start in the segment on count, and none when the next segment opens
    with a sequence start (it restarts there) or no segment follows. The backward's adjoint-only
    pass finds lam at a segment's first token from lam = 0 after it: only tokens up to the first
    sequence end in the segment count, and none when the segment opens with a sequence start
    (the previous segment's last token ends a sequence and cuts the adjoint) or is the first.
    Skipped work is the share of those passes that packing makes useless; results are the same.

    Returns fwd (G, 2) int32 [lo, hi) and bwd (G,) int32 hi (from the segment's start); an
    empty range is [start, start).
    """
    begin = torch.arange(num_segments, device=cu_seqlens.device, dtype=torch.int32) * seg_len  # (G,)
    end = torch.clamp(begin + seg_len, max=l)
    ends = cu_seqlens[1:].contiguous()

    def start_of_sequence_holding(t):  # the sequence holding token t starts at cu_seqlens[that]
        return cu_seqlens[torch.searchsorted(ends, t, right=True)]

    restart_next = start_of_sequence_holding(torch.clamp(end, max=l - 1)) == end  # never true at end = l
    fwd_lo = torch.maximum(begin, start_of_sequence_holding(end - 1))
    fwd_skip = (end >= l) | restart_next
    fwd = torch.stack([torch.where(fwd_skip, begin, fwd_lo), torch.where(fwd_skip, begin, end)], dim=1)
    first = torch.searchsorted(ends, begin, right=True)  # the sequence holding each segment's first token
    bwd_skip = (begin == 0) | (cu_seqlens[first] == begin)
    bwd = torch.where(bwd_skip, begin, torch.minimum(end, cu_seqlens[first + 1]))
    return fwd.to(torch.int32).contiguous(), bwd.to(torch.int32).contiguous()


# --- launches ---------------------------------------------------------------------------


def _bc4(t: Tensor) -> Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)  # (b, n, l) -> (b, 1, n, l)


# Rows of token-contiguous tensors start on multiples of this many elements. The kernels move
# a few consecutive tokens per thread as one vector, and Triton only emits vector accesses when
# it can prove the row start aligned, i.e. when every stride but the last is a multiple of 16.
# Packed rows have arbitrary lengths: measured on an H200 (d=4096, bf16), the forward took
# 2.812 ms at l=8130 against 0.776 ms at l=8128; with aligned rows and whole tiles scanned
# unmasked (scan_common.token_mask), 1.065 ms (docs/kernels.md).
_ROW_ALIGN = 16


def _row_buffer(leading: tuple, l: int, **like) -> Tensor:
    """An uninitialised (*leading, l) tensor whose rows are _ROW_ALIGN-aligned: a view of a
    buffer padded to a multiple of _ROW_ALIGN tokens (a plain contiguous tensor when l is one)."""
    if l % _ROW_ALIGN == 0:
        return torch.empty(*leading, l, **like)  # no slice: a view costs the host more than the check
    return torch.empty(*leading, cdiv(l, _ROW_ALIGN) * _ROW_ALIGN, **like)[..., :l]


def _has_aligned_rows(t: Tensor) -> bool:
    return t.stride(-1) == 1 and all(s % _ROW_ALIGN == 0 for s in t.stride()[:-1])


def _aligned_rows(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t``, or a copy with aligned rows where its tokens are contiguous but its rows are not
    aligned (one pass over t: far cheaper than the scalar accesses it saves). Channel-contiguous
    views (Mamba's x and z) are left alone: their tokens are not the vector axis."""
    if t is None or t.stride(-1) != 1 or _has_aligned_rows(t):
        return t
    return _row_buffer(t.shape[:-1], t.shape[-1], device=t.device, dtype=t.dtype).copy_(t)


def _fp32_rows(t: Tensor) -> Tensor:
    # The kernels read B and C as fp32 with unit stride along l and aligned rows (b * g * n * l
    # values: cheap to copy where they are not so already).
    if t.dtype == torch.float32 and _has_aligned_rows(t):
        return t
    return _row_buffer(t.shape[:-1], t.shape[-1], device=t.device, dtype=torch.float32).copy_(t)


def _state_strides(t: Optional[Tensor]) -> tuple[int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0)


def _tokens_per_step(*tensors: Optional[Tensor]) -> int:
    # One 16-byte vector of the widest of the per-token tensors.
    return 16 // max(t.element_size() for t in tensors if t is not None)


def _static_n(n: int, cfg: ScanConfig) -> int:
    return n if n <= cfg.unroll_n_max else 0


def _segments(l: int, cfg: ScanConfig) -> tuple[int, int]:
    """(number of segments, tokens per segment); segments are whole checkpoint chunks, and
    whole tiles of the parallel forward ("auto" counts as parallel: it resolves to it on split rows)."""
    unit = max(cfg.chunk, cfg.par_tokens) if cfg.fwd_variant != "sequential" else cfg.chunk
    seg_len = cdiv(cdiv(l, cfg.segments), unit) * unit
    return cdiv(l, seg_len), seg_len


def _launch_options(num_warps: int, maxnreg: Optional[int]) -> dict:
    # maxnreg is passed only when set: older launchers and the CPU interpreter never see it.
    return dict(num_warps=num_warps) if maxnreg is None else dict(num_warps=num_warps, maxnreg=maxnreg)


def _token_contiguous(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or t.stride(-1) == 1 for t in tensors)


def _resolve_forward(cfg: ScanConfig, u, delta, z, num_segments: int, keep_checkpoints: bool) -> ScanConfig:
    """``fwd_variant="auto"`` made concrete for one call. The sequential kernel loads each
    thread's tokens as one vector, so it wants u, delta and z token-contiguous (as
    ``token_major_in_proj`` leaves them); with 4 tokens a step it beat the parallel kernel on
    those inputs at 8 x 2048 x 5120 on an H200 (benchmarks/results/compile/, "The scan kernel
    picked by layout"). On split rows the parallel kernel stays: there it won with either
    layout. Training calls stay on the parallel kernel: the pick was timed without
    checkpoints."""
    if cfg.fwd_variant != "auto":
        return cfg
    return _concrete_forward(cfg, num_segments == 1 and not keep_checkpoints and _token_contiguous(u, delta, z))


@functools.lru_cache(maxsize=1024)
def _concrete_forward(cfg: ScanConfig, sequential: bool) -> ScanConfig:
    # Cached as default_config is: a replace() validates the config again, 4.4 us a call here (1 us cached).
    if sequential:
        return dataclasses.replace(cfg, fwd_variant="sequential", fwd_tokens=cfg.fwd_tokens or 4)
    return dataclasses.replace(cfg, fwd_variant="parallel")


def _forward_kernel(u, delta, z, y, n, cfg: ScanConfig):
    """The forward kernel for ``cfg.fwd_variant``, its channels per program and the launch
    constants that differ between the two kernels (the arguments are the same)."""
    n_pad = next_power_of_2(n)
    if cfg.fwd_variant == "parallel":
        return scan_fwd_parallel_kernel, cfg.par_block_d, dict(
            BLOCK_D=cfg.par_block_d, T=cfg.par_tokens, N_PAD=n_pad, **_launch_options(cfg.par_warps, cfg.par_maxnreg))
    return scan_fwd_kernel, cfg.fwd_channels, dict(
        BLOCK_D=cfg.fwd_channels, V=cfg.fwd_tokens or _tokens_per_step(u, delta, z, y), N_PAD=n_pad,
        N_STATIC=_static_n(n, cfg), num_warps=cfg.fwd_warps)


def _launch_forward(u, delta, A, B32, C32, D, z, delta_bias, softplus, seq_idx, initial_state,
                    final, ckpt, y, cfg: ScanConfig, pass_ranges: Optional[Tensor] = None):
    """``pass_ranges``: the segment pass's token ranges on packed rows (``_segment_pass_ranges``)."""
    bsz, d, l = u.shape
    g, n = B32.shape[1], A.shape[1]
    e = d // g
    kernel, block_d, tile_constants = _forward_kernel(u, delta, z, y, n, cfg)
    num_segments, seg_len = _segments(l, cfg)
    dummy = y  # stands in for absent operands; never read
    opt = lambda t: t if t is not None else dummy  # noqa: E731
    zs = z.stride() if z is not None else (0, 0, 0)

    def launch(carry, seg_end, seg_decay, with_output, ranges=None):
        # The segment pass skips the last segment: no later segment reads its end state.
        grid_segments = num_segments if with_output else num_segments - 1
        kernel[(g * cdiv(e, block_d), bsz, grid_segments)](
            u, delta, A, B32, C32, opt(D), opt(z), opt(delta_bias), opt(seq_idx), opt(initial_state),
            y, opt(final), opt(ckpt), opt(carry), opt(seg_end), opt(seg_decay), opt(ranges),
            d, l, e, n, seg_len, num_segments, cfg.chunk,
            *u.stride(), *delta.stride(), *A.stride(), *B32.stride()[:3], *C32.stride()[:3], *zs,
            *y.stride(), *_state_strides(initial_state), *_state_strides(final),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            SOFTPLUS=softplus, PACKED=seq_idx is not None, HAS_INIT=initial_state is not None,
            STORE_FINAL=with_output and final is not None,
            STORE_CKPT=with_output and ckpt is not None, WITH_OUTPUT=with_output,
            HAS_CARRY=carry is not None, RANGED=ranges is not None, **tile_constants,
        )

    carry = None
    if num_segments > 1:
        # Pass 1: each segment from a zero state; then each segment's true starting state.
        seg_end, seg_decay, carry = (
            torch.empty(bsz, num_segments, n, d, device=u.device, dtype=torch.float32) for _ in range(3)
        )
        launch(None, seg_end, seg_decay, with_output=False, ranges=pass_ranges)
        _chain_segments(seg_end, seg_decay, carry, reverse=False)
    launch(carry, None, None, with_output=True)


def _chain_segments(seg_end: Tensor, seg_decay: Tensor, carry: Tensor, reverse: bool) -> None:
    """carry[:, s] = the state (or, reversed, the adjoint) entering segment s, from the segment
    passes' (b, G, n, d) results. A kernel of its own: chaining inside the main passes (each
    program folding the segments before its own) cost more, measured on an H200 at B=1 d=5120
    L=2048: the training forward's main pass took 208 us with the chain against 167 us without,
    where this kernel took 8.0 us before its loads were unrolled (docs/kernels.md)."""
    bsz, num_segments, n, d = seg_end.shape
    block = 1024
    segment_carry_kernel[(cdiv(n * d, block), bsz)](
        seg_end, seg_decay, carry, num_segments, n * d, REVERSE=reverse, BLOCK=block, UNROLL=8
    )


def _new_states(num_seqs, d, n, like: Tensor, initial_state: Optional[Tensor]) -> Tensor:
    # Sequences with no token keep their initial state (or 0): the kernel never writes them.
    if initial_state is not None:
        return initial_state.detach().to(torch.float32).clone()
    return torch.zeros(num_seqs, d, n, device=like.device, dtype=torch.float32)


def _forward(u, delta, A, B, C, D, z, delta_bias, softplus, cu_seqlens, initial_state,
             return_final_state, out_dtype, cfg, keep_checkpoints):
    bsz, d, l, n, g, num_seqs = _check_scan_args(u, delta, A, B, C, D, z, delta_bias, cu_seqlens,
                                                 initial_state)
    seq_idx = _sequence_index(cu_seqlens, l) if cu_seqlens is not None else None
    num_segments, seg_len = _segments(l, cfg)
    cfg = _resolve_forward(cfg, u, delta, z, num_segments, keep_checkpoints)
    fwd_ranges = bwd_ranges = None
    if cu_seqlens is not None and num_segments > 1:
        fwd_ranges, bwd_ranges = _segment_pass_ranges(cu_seqlens, l, num_segments, seg_len)
    y = _row_buffer((bsz, d), l, device=u.device, dtype=out_dtype or u.dtype)  # aligned rows: vector stores
    final = _new_states(num_seqs, d, n, u, initial_state) if return_final_state else None
    ckpt = None
    if keep_checkpoints:
        ckpt = torch.empty(bsz, cdiv(l, cfg.chunk), n, d, device=u.device, dtype=torch.float32)
    B32, C32 = _fp32_rows(_bc4(B)), _fp32_rows(_bc4(C))
    _launch_forward(_aligned_rows(u), _aligned_rows(delta), A.float(), B32, C32, D, _aligned_rows(z), delta_bias,
                    softplus, seq_idx, initial_state, final, ckpt, y, cfg, fwd_ranges)
    return y, final, seq_idx, ckpt, bwd_ranges, B32, C32


class _SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, cu_seqlens,
                return_final_state, out_dtype, cfg):
        y, final, seq_idx, ckpt, bwd_ranges, B32, C32 = _forward(
            u, delta, A, B, C, D, z, delta_bias, softplus, cu_seqlens, initial_state, return_final_state,
            out_dtype, cfg, True)
        # B and C are kept as the forward's fp32 (b, g, n, l) rows, not copied again in the backward:
        # 2 * b * n * l floats (under 1% of the (b, d, l) tensors saved beside them at d=5120, n=16)
        # for two copies fewer on the backward's host path.
        ctx.save_for_backward(u, delta, A, B32, C32, D, z, delta_bias, initial_state, seq_idx, ckpt, bwd_ranges)
        ctx.softplus, ctx.cfg, ctx.bc_like = softplus, cfg, (B.dim(), B.dtype, C.dtype)
        return (y, final) if return_final_state else y

    @staticmethod
    def backward(ctx, dy, dfinal=None):
        u, delta, A, B32, C32, D, z, delta_bias, initial_state, seq_idx, ckpt, bwd_ranges = ctx.saved_tensors
        with INTERPRETER_LOCK:
            grads = _backward(u, delta, A, B32, C32, ctx.bc_like, D, z, delta_bias, initial_state, seq_idx, ckpt,
                              dy, dfinal, ctx.softplus, ctx.cfg, bwd_ranges)
        needed = ctx.needs_input_grad
        return tuple(gr if needed[i] else None for i, gr in enumerate(grads)) + (None,) * 5


# All n state indices sit in each thread of the parallel backward; past this many the tile
# backward (a loop over state indices) is used instead, whatever the config says.
_PARALLEL_BWD_MAX_N = 32


class _Grads:
    """The backward kernels' outputs: du, ddelta, dz (b, d, l) in the inputs' dtypes; fp32
    per-block dB / dC partials (b, g, blocks, n, l), per-row dA (rows, d, n), dD and
    d(delta_bias) (rows, d) partials, and d(initial state)."""

    def __init__(self, u, delta, z, g, blocks_per_group, n, rows, initial_state, dfinal, num_seqs):
        bsz, d, l = u.shape
        f32 = dict(device=u.device, dtype=torch.float32)
        # Per-token outputs in aligned rows (_row_buffer): one row length, ``row_len``, for all.
        self.du = _row_buffer((bsz, d), l, device=u.device, dtype=u.dtype)
        self.ddelta = _row_buffer((bsz, d), l, device=u.device, dtype=delta.dtype)
        self.dz = _row_buffer((bsz, d), l, device=u.device, dtype=z.dtype) if z is not None else None
        self.dB_part = _row_buffer((bsz, g, blocks_per_group, n), l, **f32)
        self.dC_part = _row_buffer((bsz, g, blocks_per_group, n), l, **f32)
        self.row_len = self.du.stride(1)
        self.dA_part = torch.empty(rows, d, n, **f32)
        self.dD_part = torch.empty(rows, d, **f32)
        self.dbias_part = torch.empty(rows, d, **f32)
        self.dinit = None
        if initial_state is not None:
            # A sequence with no token passes its final-state gradient straight to its initial state.
            self.dinit = dfinal.float().clone() if dfinal is not None else torch.zeros(num_seqs, d, n, **f32)

    def outputs(self):
        opt = lambda t: t if t is not None else self.du  # noqa: E731  (absent: never written)
        return (self.du, self.ddelta, opt(self.dz), self.dB_part, self.dC_part, self.dA_part, self.dD_part,
                self.dbias_part, opt(self.dinit))

    def reduced(self, A, bc_like, D, delta_bias, initial_state):
        """The gradients autograd expects, partial sums added up (deterministically).
        ``bc_like``: (dims, dtype of B, dtype of C) of the caller's B and C."""
        bc_dims, b_dtype, c_dtype = bc_like
        dB = self.dB_part.sum(2)  # (b, g, blocks, n, l) -> (b, g, n, l)
        dC = self.dC_part.sum(2)
        if bc_dims == 3:
            dB, dC = dB.squeeze(1), dC.squeeze(1)  # (b, 1, n, l) -> (b, n, l)
        return (
            self.du,
            self.ddelta,
            self.dA_part.sum(0).to(A.dtype),
            dB.to(b_dtype),
            dC.to(c_dtype),
            self.dD_part.sum(0).to(D.dtype) if D is not None else None,
            self.dz,
            self.dbias_part.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
            self.dinit.to(initial_state.dtype) if self.dinit is not None else None,
        )


def _backward(u, delta, A, B32, C32, bc_like, D, z, delta_bias, initial_state, seq_idx, ckpt, dy, dfinal,
              softplus, cfg: ScanConfig, lam_ranges: Optional[Tensor] = None):
    """B32, C32: the forward's fp32 (b, g, n, l) rows; ``bc_like``: see ``_Grads.reduced``.
    ``lam_ranges``: where the adjoint-only pass may stop on packed rows (``_segment_pass_ranges``)."""
    bsz, d, l = u.shape
    if dy is None:
        dy = torch.zeros((), device=u.device, dtype=u.dtype).expand(bsz, d, l)
    # Copied again rather than kept from the forward: saving the forward's copies would hold
    # three more (b, d, l) tensors per layer until the backward.
    u, delta, z, dy = (_aligned_rows(t) for t in (u, delta, z, dy))
    A32 = A.float()
    g, n = B32.shape[1], A.shape[1]
    e = d // g
    num_seqs = initial_state.shape[0] if initial_state is not None else bsz
    dummy = dy
    opt = lambda t: t if t is not None else dummy  # noqa: E731
    common = (u, delta, A32, B32, C32, opt(D), opt(z), opt(delta_bias), opt(seq_idx), opt(initial_state),
              dy, opt(dfinal), ckpt)
    strides = (*u.stride(), *delta.stride(), *A32.stride(), *B32.stride()[:3], *C32.stride()[:3],
               *(z.stride() if z is not None else (0, 0, 0)), *dy.stride(),
               *_state_strides(initial_state), *_state_strides(dfinal))
    flags = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                 SOFTPLUS=softplus, PACKED=seq_idx is not None, HAS_INIT=initial_state is not None,
                 HAS_DFINAL=dfinal is not None, N_PAD=next_power_of_2(n))

    if cfg.bwd_variant == "parallel" and n <= _PARALLEL_BWD_MAX_N:
        blocks_per_group = cdiv(e, cfg.bwd_block_d)
        num_segments, seg_len = _segments(l, cfg)
        grid = (g * blocks_per_group, bsz, num_segments)
        grads = _Grads(u, delta, z, g, blocks_per_group, n, bsz * num_segments, initial_state, dfinal, num_seqs)
        f32 = dict(device=u.device, dtype=torch.float32)
        tiles = cfg.chunk // cfg.bwd_tokens
        scratch = torch.empty(grid[0] * bsz * num_segments * tiles * flags["N_PAD"] * cfg.bwd_block_d, **f32)

        def launch(carry, seg_lam, seg_decay, lam_only, ranges=None):
            # The adjoint-only pass skips segment 0: no earlier segment reads its lam.
            scan_bwd_parallel_kernel[(grid[0], grid[1], num_segments - 1 if lam_only else num_segments)](
                *common, scratch, opt(carry), opt(seg_lam), opt(seg_decay), opt(ranges), *grads.outputs(),
                d, l, e, n, ckpt.shape[1], seg_len, num_segments, cfg.chunk, grads.row_len, *strides,
                HAS_CARRY=carry is not None, LAM_ONLY=lam_only, RANGED=ranges is not None,
                # Loading a tile ahead pays only with registers to spare (see the kernel).
                BLOCK_D=cfg.bwd_block_d, T=cfg.bwd_tokens, PREFETCH=cfg.bwd_maxnreg is None,
                **_launch_options(cfg.bwd_warps, cfg.bwd_maxnreg), **flags,
            )

        carry = None
        if num_segments > 1:
            # lam entering each segment from the later one: each segment's adjoint from zero,
            # then chained from the last segment backwards.
            seg_lam, seg_decay, carry = (torch.empty(bsz, num_segments, n, d, **f32) for _ in range(3))
            launch(None, seg_lam, seg_decay, lam_only=True, ranges=lam_ranges)
            _chain_segments(seg_lam, seg_decay, carry, reverse=True)
        launch(carry, None, None, lam_only=False)
        return grads.reduced(A, bc_like, D, delta_bias, initial_state)

    blocks_per_group = cdiv(e, cfg.bwd_block_d)
    grads = _Grads(u, delta, z, g, blocks_per_group, n, bsz, initial_state, dfinal, num_seqs)
    scan_bwd_kernel[(g * blocks_per_group, bsz)](
        *common, *grads.outputs(), d, l, e, n, ckpt.shape[1], blocks_per_group, grads.row_len, *strides,
        BLOCK_D=cfg.bwd_block_d, T=cfg.chunk, N_STATIC=_static_n(n, cfg), num_warps=cfg.bwd_warps, **flags,
    )
    return grads.reduced(A, bc_like, D, delta_bias, initial_state)


# --- public functions ------------------------------------------------------------------------


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                   z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                   delta_softplus: bool = False, *, cu_seqlens: Optional[Tensor] = None,
                   initial_state: Optional[Tensor] = None, return_final_state: bool = False,
                   out_dtype: Optional[torch.dtype] = None, config: Optional[ScanConfig] = None):
    """Mamba-1 selective scan on Triton kernels (layouts of mamba_ssm's ``selective_scan_fn``).

    u, delta, z: (b, d, l), any float dtype; A: (d, n) real; B, C: (b, n, l) or (b, g, n, l)
    (channel c reads group c // (d // g)); D, delta_bias: (d,). All arithmetic is fp32.
    cu_seqlens: int32 (S + 1,) offsets of packed sequences along l (then b must be 1); the
    state restarts at every sequence start. initial_state: (b, d, n), or (S, d, n) with
    cu_seqlens. Returns y (b, d, l) in ``out_dtype`` (default u's dtype, as mamba_ssm; pass
    torch.float32 for what ``torch.ops.ssmshard.selective_scan`` returns), and with
    ``return_final_state`` also the final states (b or S, d, n) fp32.
    Differentiable in every tensor argument; the backward is a Triton kernel too. Where l is
    not a multiple of 16, y and the gradients of u, delta and z are views into rows padded to
    one (the kernels' aligned rows), not contiguous tensors.
    """
    cfg = config or default_config(u.shape[0], u.shape[1], u.shape[-1], u.device, packed=cu_seqlens is not None)
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    with INTERPRETER_LOCK:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return _SelectiveScanFn.apply(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                          delta_softplus, cu_seqlens, return_final_state, out_dtype, cfg)
        y, final, *_ = _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens,
                                initial_state, return_final_state, out_dtype, cfg, False)
    return (y, final) if return_final_state else y


def selective_scan_as_op(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, *,
                         config: Optional[ScanConfig] = None):
    """Drop-in for ``torch.ops.ssmshard.selective_scan`` (same arguments, same outputs:
    (y, final_state), both fp32), for the kernel-swap pass."""
    return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                          initial_state=initial_state, return_final_state=True,
                          out_dtype=torch.float32, config=config)
