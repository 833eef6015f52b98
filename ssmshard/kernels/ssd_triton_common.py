"""Shared pieces of the Triton SSD (Mamba-2) scan kernels.

Holds the Triton helpers every SSD kernel uses (dt discretisation, per-block log-decays,
the tensor-core product), the chunk table that cuts packed sequences into chunks, and
the launcher that autotunes a kernel on the GPU and runs one fixed config elsewhere.

Dimension letters:
    t  token index into the flattened (b * l) token axis
    h  heads, g groups (B / C shared by h // g heads), p head dim, n state size
    k  chunk slot, s sequence, T chunk size
    i  target (row) position inside a chunk, j source (column) position inside a chunk

Chunks never span a sequence boundary: each sequence is cut into chunks of T tokens
from its own start (its last chunk may be shorter). Row r of a (b, l) batch is sequence r.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl

from ssmshard.kernels.launch_math import cdiv, next_power_of_2
from ssmshard.kernels.scan_common import softplus

from ssmshard.kernels.interpreter import INTERPRET  # noqa: F401  (re-exported: the SSD kernels read it here)

AUTOTUNE_ENV = "SSMSHARD_SSD_AUTOTUNE"
# Run config i (modulo each kernel's config count) instead of tuning: for tests and debugging.
FORCE_CONFIG_ENV = "SSMSHARD_SSD_CONFIG"


def autotune_enabled() -> bool:
    """Autotune on the GPU unless SSMSHARD_SSD_AUTOTUNE=0 (then the first config runs)."""
    return not INTERPRET and os.environ.get(AUTOTUNE_ENV, "1") != "0"


def next_pow2(v: int, floor: int = 16) -> int:
    """Smallest power of two >= max(v, floor); tl.dot needs every block dim >= 16."""
    return max(floor, next_power_of_2(max(int(v), 1)))


def dot_modes(dtype: torch.dtype) -> dict:
    """Constexprs choosing how tl.dot multiplies for inputs of ``dtype``.

    float32 inputs use exact fp32 products (``ieee``) rather than tf32, so fp32 results
    match a float32 reference; 16-bit inputs use tensor cores with fp32 accumulation.
    Under the interpreter, Triton 3.9's tl.dot returns garbage for bfloat16 operands,
    so operands (already rounded to 16 bits) are multiplied as float32 there.
    """
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": INTERPRET}


class TunableKernel:
    """A @triton.jit kernel launched with the best of ``configs`` (GPU) or the first one.

    ``clamp(kwargs, args) -> kwargs`` shrinks a config's block sizes to the problem (a
    64-wide block for a 16-wide dim only wastes work) so small shapes compile small
    kernels. Only kernels whose outputs are pure writes may be tuned: the autotuner runs
    a kernel several times on the same buffers.
    """

    def __init__(self, fn, configs, key, clamp):
        self.fn = fn
        self.configs = configs
        self.clamp = clamp
        self.tuned = None
        # Triton's autotuner keeps the arguments of the call it is tuning on itself: two threads
        # launching at once (a SimulatedMesh's ranks on one GPU) would see each other's.
        self._lock = threading.Lock()
        if not INTERPRET:
            self.tuned = triton.autotune(
                configs=configs, key=key, prune_configs_by={"early_config_prune": self._prune},
                # Each tuning's timings go to Triton's on-disk cache (keyed by the kernel's source,
                # the GPU, the tuning key and the configs): a later process on the machine reads the
                # choice instead of benchmarking again (docs/startup.md). Every CUDA build of
                # torch >= 2.11 brings a Triton that has this (3.6 and later).
                cache_results=True,
            )(fn)

    def _clamped(self, config, args):
        kwargs = self.clamp(dict(config.kwargs), args)
        return triton.Config(kwargs, num_warps=config.num_warps, num_stages=config.num_stages)

    def _prune(self, configs, named_args, **kwargs):
        # The autotuner passes positional arguments by name and keyword arguments as kwargs.
        args = {**named_args, **kwargs}
        seen, kept = set(), []
        for config in configs:
            c = self._clamped(config, args)
            ident = (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages)
            if ident not in seen:
                seen.add(ident)
                kept.append(c)
        return kept

    def __call__(self, grid, **kwargs):
        forced = os.environ.get(FORCE_CONFIG_ENV)
        if forced is None and self.tuned is not None and autotune_enabled():
            with self._lock:
                self.tuned[grid](**kwargs)
            return
        index = 0 if forced is None else int(forced) % len(self.configs)
        config = self._clamped(self.configs[index], kwargs)
        meta = {**kwargs, **config.kwargs}
        self.fn[grid(meta)](
            **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
        )


# --- Triton helpers -------------------------------------------------------------------


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with float32 accumulation (see dot_modes for the two switches)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def discretise_dt(raw, dt_min, dt_max, SOFTPLUS: tl.constexpr):
    """dt = clamp(softplus?(raw), dt_min, dt_max) and d dt / d raw (raw already has dt_bias added).

    The slope follows torch: softplus' derivative is sigmoid, and torch.clamp passes the
    gradient where dt_min <= value <= dt_max (both ends included).
    """
    if SOFTPLUS:
        value = softplus(raw)
        slope = tl.sigmoid(raw)
    else:
        value = raw
        slope = tl.full(raw.shape, 1.0, tl.float32)
    inside = (value >= dt_min) & (value <= dt_max)
    return tl.minimum(tl.maximum(value, dt_min), dt_max), tl.where(inside, slope, 0.0)


@triton.jit
def load_chunk_dt_heads(dt_ptr, dt_bias_ptr, heads, head_mask, tok0, length, stride_dt_t, stride_dt_h,
                        dt_min, dt_max, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK_PAD: tl.constexpr):
    """Discretised dt of one chunk for a block of heads, its slope d dt / d dt_raw, positions
    and mask: (offs, mask, dt, slope), the last three (CHUNK_PAD, heads).

    dt and slope are 0 at padded positions (>= length) and masked heads, so those neither
    decay nor feed the state. The heads of a token are adjacent in a (t, h) dt, so a block of
    them shares sectors where one head per program read 2 of every 32 bytes.
    """
    offs = tl.arange(0, CHUNK_PAD)
    mask = (offs < length)[:, None] & head_mask[None, :]
    raw = tl.load(dt_ptr + (tok0 + offs)[:, None] * stride_dt_t + heads[None, :] * stride_dt_h, mask=mask,
                  other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(dt_bias_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)[None, :]
    dt, slope = discretise_dt(raw, dt_min, dt_max, SOFTPLUS)
    return offs, mask, tl.where(mask, dt, 0.0), tl.where(mask, slope, 0.0)


@triton.jit
def load_chunk_dt(dt_ptr, dt_bias_ptr, h, tok0, length, stride_dt_t, stride_dt_h, dt_min, dt_max,
                  HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK_PAD: tl.constexpr):
    """load_chunk_dt_heads for the one head h: (offs, mask, dt, slope), each (CHUNK_PAD,)."""
    heads = h + tl.arange(0, 1)
    offs, mask, dt, slope = load_chunk_dt_heads(dt_ptr, dt_bias_ptr, heads, heads >= 0, tok0, length, stride_dt_t,
                                                stride_dt_h, dt_min, dt_max, HAS_BIAS, SOFTPLUS, CHUNK_PAD)
    return (offs, tl.reshape(mask, (CHUNK_PAD,)), tl.reshape(dt, (CHUNK_PAD,)),
            tl.reshape(slope, (CHUNK_PAD,)))


@triton.jit
def load_tile(ptr, rows, row_mask, stride_row, cols, col_mask, stride_col):
    """The (rows, cols) tile ptr[rows, cols]; 0 outside the masks.

    Kernels pass a base pointer already moved to their chunk (64-bit scalar arithmetic)
    and int32 offsets inside it: a tile of 64-bit offsets would cost two registers per
    element.
    """
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def load_block_decay(cs_chunk_ptr, dtd_chunk_ptr, start, length, BLOCK: tl.constexpr):
    """Chunk positions [start, start + BLOCK) of one head: (offs, mask, cs, dt).

    The pointers point at the chunk's row of the dt kernel's buffers (decay_row);
    cs and dt are 0 where mask is false.
    """
    offs = start + tl.arange(0, BLOCK)
    mask = offs < length
    cs = tl.load(cs_chunk_ptr + offs, mask=mask, other=0.0)
    dt = tl.load(dtd_chunk_ptr + offs, mask=mask, other=0.0)
    return offs, mask, cs, dt


@triton.jit
def decay_row(ptr, h, k, n_slots, decay_stride):
    """Chunk k's row of head h in a (h, slot, decay_stride) buffer of the dt kernel (cs or dt).

    Slot-major rows of a power of two make every chunk's values start aligned wherever the
    chunk starts in the token axis, so kernels read them as vectors; a (h, t) layout left the
    rows of packed chunks unaligned, and each thread loaded them 4 bytes at a time (sm_90 SASS).
    """
    return ptr + (tl.cast(h, tl.int64) * n_slots + k) * decay_stride


@triton.jit
def load_chunk_decay(cs_row_ptr, dtd_row_ptr, start, decay_stride, BLOCK: tl.constexpr):
    """Positions [start, start + BLOCK) of one chunk's cs and dt rows (decay_row): (offs, cs, dt).

    The dt kernel writes whole rows (dt 0, and cs equal to its last value up to rounding, past
    the chunk's length), so no length mask is needed and the loads are vectors. The mask on
    the row's size is a guard only: callers' blocks lie inside the row (start is a multiple
    of BLOCK below the chunk's length, BLOCK <= next_pow2(chunk_size) = decay_stride by the
    launchers' clamps). Were it ever to mask, cs would read 0 there, not its last value.
    """
    offs = start + tl.arange(0, BLOCK)
    in_row = offs < decay_stride
    return offs, tl.load(cs_row_ptr + offs, mask=in_row, other=0.0), tl.load(dtd_row_ptr + offs, mask=in_row, other=0.0)


@triton.jit
def chunk_block(chunk_start_ptr, chunk_len_ptr, n_slots, chunk_size,
                BLOCK: tl.constexpr, LAST_BLOCKS_FIRST: tl.constexpr):
    """A block of BLOCK positions of one chunk, from program axis 0 = block * n_slots + chunk.

    Returns (k, tok0, length, start, offs, mask): chunk slot, its first token, its length,
    the block's first position, its positions inside the chunk and which of them exist. Blocks are the slow axis,
    so one block index of every chunk is launched before the next: with
    LAST_BLOCKS_FIRST the blocks with the longest causal prefix (the most work) go first.
    """
    n_blocks = tl.cdiv(chunk_size, BLOCK)
    k = tl.program_id(0) % n_slots
    blk = tl.program_id(0) // n_slots
    if LAST_BLOCKS_FIRST:
        blk = n_blocks - 1 - blk
    tok0 = tl.load(chunk_start_ptr + k).to(tl.int64)
    length = tl.load(chunk_len_ptr + k)
    start = blk * BLOCK
    offs = start + tl.arange(0, BLOCK)
    return k, tok0, length, start, offs, offs < length


@triton.jit
def state_coords(headdim, dstate, length, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets and masks over a whole (p, n) state: (offs_p, mask_p, offs_n, mask_n, mask_p_state).

    mask_p_state is mask_p, but empty for an unused chunk slot (length 0) whose state was
    never written: such loads are skipped rather than reading garbage.
    """
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    return offs_p, offs_p < headdim, offs_n, offs_n < dstate, offs_p < tl.where(length > 0, headdim, 0)


# --- chunk table ------------------------------------------------------------------------


@triton.jit
def chunk_table_kernel(
    cu_seqlens_ptr, n_seqs, n_slots, chunk_size,
    chunk_start_ptr, chunk_len_ptr, seq_first_chunk_ptr,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Fill the chunk table: slot k -> (first token, length); sequence s -> its first slot.

    Sequence s owns ceil(len_s / T) consecutive slots. Slot k belongs to the sequence
    whose slots end first after k, found by counting sequences whose slots end at or
    before k. Slots past the last chunk get length 0. Every program rebuilds the running
    chunk count over all sequences (cheap for up to ~10^4 sequences) and program 0
    also writes the per-sequence first slots.
    """
    pid = tl.program_id(0)
    k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    seqs_before = tl.zeros((BLOCK_K,), tl.int32)  # sequences whose slots all lie before k
    slots_before = tl.zeros((BLOCK_K,), tl.int32)  # and how many slots they own
    total = tl.sum(tl.zeros((BLOCK_S,), tl.int32), 0)  # a scalar tensor: loop-carried values keep one type
    for s0 in range(0, n_seqs, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        in_range = s < n_seqs
        lo = tl.load(cu_seqlens_ptr + s, mask=in_range, other=0)
        hi = tl.load(cu_seqlens_ptr + s + 1, mask=in_range, other=0)
        n_chunks = tl.where(in_range, (hi - lo + chunk_size - 1) // chunk_size, 0)
        ends = total + tl.cumsum(n_chunks, 0)  # slot after the last slot of each sequence
        if pid == 0:
            tl.store(seq_first_chunk_ptr + s, ends - n_chunks, mask=in_range)
        done = (ends[None, :] <= k[:, None]) & in_range[None, :]  # (k, s)
        seqs_before += tl.sum(done.to(tl.int32), 1)
        slots_before += tl.sum(tl.where(done, n_chunks[None, :], 0), 1)
        total += tl.sum(n_chunks, 0)
    if pid == 0:
        tl.store(seq_first_chunk_ptr + n_seqs, total)
    in_table = k < n_slots
    used = k < total
    seq_lo = tl.load(cu_seqlens_ptr + seqs_before, mask=used & in_table, other=0)
    seq_hi = tl.load(cu_seqlens_ptr + seqs_before + 1, mask=used & in_table, other=0)
    start = seq_lo + (k - slots_before) * chunk_size
    length = tl.where(used, tl.minimum(seq_hi - start, chunk_size), 0)
    tl.store(chunk_start_ptr + k, tl.where(used, start, 0), mask=in_table)
    tl.store(chunk_len_ptr + k, length, mask=in_table)


class ChunkTable:
    """Chunks of T tokens cut per sequence, built on the device without a host sync.

    chunk_start / chunk_len: (n_slots,) int32; seq_first_chunk: (S + 1,) int32, sequence s
    owns slots [seq_first_chunk[s], seq_first_chunk[s + 1]). n_slots is an upper bound on
    the chunk count (slots past the end have length 0), so no value needs to reach the host.
    A caller that knows the exact count (rows of one length) passes it as ``n_chunks``: every
    kernel launches programs per slot, and empty slots would be launched for nothing.
    ``n_chunks`` must be at least the true count (a smaller one makes kernels index past the
    table); it is exact for rows of one length.
    """

    def __init__(self, cu_seqlens: torch.Tensor, n_tokens: int, chunk_size: int, n_chunks: int | None = None):
        n_seqs = cu_seqlens.numel() - 1
        # sum ceil(len_s / T) <= (n_tokens + n_seqs * (T - 1)) // T
        bound = (n_tokens + n_seqs * (chunk_size - 1)) // chunk_size
        self.n_slots = max(1, bound if n_chunks is None else n_chunks)
        self.n_seqs = n_seqs
        self.chunk_size = chunk_size
        # Length of one chunk's cs / dt row (decay_row): a power of two, so rows start aligned
        # and every kernel's whole blocks fit inside a row.
        self.decay_stride = next_pow2(chunk_size)
        device = cu_seqlens.device
        self.chunk_start = torch.empty(self.n_slots, dtype=torch.int32, device=device)
        self.chunk_len = torch.empty(self.n_slots, dtype=torch.int32, device=device)
        self.seq_first_chunk = torch.empty(n_seqs + 1, dtype=torch.int32, device=device)
        block_k = 128
        chunk_table_kernel[(cdiv(self.n_slots, block_k),)](
            cu_seqlens, n_seqs, self.n_slots, chunk_size,
            self.chunk_start, self.chunk_len, self.seq_first_chunk,
            BLOCK_K=block_k, BLOCK_S=64,
        )

    def tensors(self):
        return self.chunk_start, self.chunk_len, self.seq_first_chunk

    @staticmethod
    def for_rows(n_rows: int, length: int, chunk_size: int, device: torch.device) -> "ChunkTable":
        """The table of a (n_rows, length) batch (row r is sequence r), reused across calls.

        Building it takes two kernels (cu_seqlens, then the table): 4 us of device time, 4%
        of a B=1 x 2048 Mamba2-2.7B forward (H200). Tables are read-only, so one per shape
        is kept (per stream, so no stream reads a table another stream is still writing).
        A table built while a CUDA graph is being captured is not kept: its memory belongs
        to the graph.
        """
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ChunkTable._build_for_rows(n_rows, length, chunk_size, device)
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        return ChunkTable._cached_for_rows(n_rows, length, chunk_size, device, stream)

    @staticmethod
    def _build_for_rows(n_rows, length, chunk_size, device):
        cu_seqlens = torch.arange(0, n_rows * length + 1, length, device=device, dtype=torch.int32)
        return ChunkTable(cu_seqlens, n_rows * length, chunk_size, n_rows * -(-length // chunk_size))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _cached_for_rows(n_rows, length, chunk_size, device, unused_stream):
        return ChunkTable._build_for_rows(n_rows, length, chunk_size, device)
