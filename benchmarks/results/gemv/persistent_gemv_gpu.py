"""Batch-1 GEMV: a persistent variant (a fixed number of programs per SM, each walking its share
of the output features) against ``kernels/gemv.py``'s one-program-per-block kernel.

Why: in a Mamba-2.8B decode step on an H200 the batch-1 GEMVs read their weights at about 72% of
the copy bandwidth (``../decode_profile/``, PDL off), and in_proj alone takes 16.0 us where its
bytes need 12.3 (``README.md``). With one program per block of two features, in_proj starts 5120
programs of three k-steps each: about 1.2 waves of the programs an H200 holds at once, so the
last, partial wave runs the memory system part-empty. A persistent grid keeps every SM's share
equal. Each call is timed as in ``benchmarks/bench_gemv.py`` (inside a CUDA graph, walking enough
weight copies to overflow the L2 cache); every variant is checked against a float64 product.

    SSMSHARD_PDL=0 PYTHONPATH=$PWD python benchmarks/results/gemv/persistent_gemv_gpu.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from bench_gemv import graphed_us, rel_err, L2_OVERFLOW_BYTES  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402
from ssmshard.kernels import gemv as kgemv  # noqa: E402
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait  # noqa: E402

SHAPES = [("mamba-2.8b", "in_proj", 10240, 2560), ("mamba-2.8b", "x_proj", 192, 5120),
          ("mamba-2.8b", "out_proj", 2560, 5120), ("mamba-2.8b", "lm_head", 50280, 2560),
          ("mamba2-2.7b", "in_proj", 10576, 2560), ("zamba2-2.7b", "q_proj", 5120, 5120),
          ("llama-3-8b", "gate_proj", 14336, 4096), ("llama-3-8b", "down_proj", 4096, 14336)]


@triton.jit
def _load_tile(rows, kk, n_mask, K, EVICT: tl.constexpr):
    mask = n_mask[:, None] & (kk < K)[None, :]
    if EVICT:  # streamed once: leave L2 to x and the outputs
        return tl.load(rows + kk[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(rows + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _rest_of_block(acc, w, x_ptr, rows, n_mask, K, k_first, EVICT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus tile ``w`` (at k_first) and every later k-step of this block's features."""
    kk = k_first + tl.arange(0, BLOCK_K)
    acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :], axis=1)
    for k0 in range(k_first + BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        w = _load_tile(rows, kk, n_mask, K, EVICT)
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def _persistent_row_kernel(x_ptr, w_ptr, y_ptr, N, K, sw_n, BLOCKS,
                           PDL: tl.constexpr, EVICT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    kk0 = tl.arange(0, BLOCK_K)
    # This program's first block: its first tile is loaded before waiting for the kernel that wrote x.
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < N
    rows = w_ptr + nn.to(tl.int64)[:, None] * sw_n
    w = _load_tile(rows, kk0, n_mask, K, EVICT)
    start_dependents_then_wait(PDL)
    acc = _rest_of_block(tl.zeros((BLOCK_N,), dtype=tl.float32), w, x_ptr, rows, n_mask, K, 0, EVICT, BLOCK_K)
    tl.store(y_ptr + nn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    for blk in range(pid + programs, BLOCKS, programs):
        nn = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = nn < N
        rows = w_ptr + nn.to(tl.int64)[:, None] * sw_n
        w = _load_tile(rows, kk0, n_mask, K, EVICT)
        acc = _rest_of_block(tl.zeros((BLOCK_N,), dtype=tl.float32), w, x_ptr, rows, n_mask, K, 0, EVICT, BLOCK_K)
        tl.store(y_ptr + nn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def persistent_gemv(x, weight, BLOCK_N, BLOCK_K, num_warps, per_sm, EVICT):
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, BLOCK_N)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    grid = min(blocks, sms * per_sm)
    _persistent_row_kernel[(grid,)](x, weight, y, n, k, weight.stride(0), blocks, EVICT=EVICT,
                                    BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=1,
                                    **launch_options(x.device))
    return y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    grid = list(itertools.product((1, 2, 4, 8), (512, 1024), (2, 4), (4, 8, 16, 32), (False, True)))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "pdl": os.environ.get("SSMSHARD_PDL", "1") != "0", "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, PDL {result['pdl']}", flush=True)
    for model, proj, n, k in SHAPES:
        w_bytes = n * k * 2
        copies = max(2, min(64, L2_OVERFLOW_BYTES // w_bytes))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        row = {"model": model, "proj": proj, "n": n, "k": k, "floor_us": w_bytes / bandwidth * 1e6,
               "default_us": graphed_us(kgemv.gemv, weights, x), "default_config": kgemv.default_config(1, n, k),
               "sweep": []}
        for bn, bk, warps, per_sm, evict in grid:
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, per_sm=per_sm, EVICT=evict)
            try:
                err = rel_err(persistent_gemv(x, weights[0], **cfg), x, weights[0])
                us = graphed_us(lambda a, b, c=cfg: persistent_gemv(a, b, **c), weights, x)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is recorded and skipped
                row["sweep"].append({**cfg, "error": type(e).__name__})
                continue
            row["sweep"].append({**cfg, "us": us, "err": err})
        timed = [s for s in row["sweep"] if "us" in s and s["err"] < 2e-2]
        row["best"] = min(timed, key=lambda s: s["us"])
        result["rows"].append(row)
        print(f"{model:12s} {proj:9s} {n:6d}x{k:<6d} floor {row['floor_us']:7.2f}  default {row['default_us']:7.2f} "
              f"({row['floor_us'] / row['default_us']:.0%})  persistent best {row['best']['us']:7.2f} "
              f"({row['floor_us'] / row['best']['us']:.0%}) {row['best']}", flush=True)
        del weights
        with open(os.path.join(args.out, f"persistent_gemv_pdl{int(result['pdl'])}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
