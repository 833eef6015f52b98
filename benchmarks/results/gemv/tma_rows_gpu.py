"""16 and 64 rows through wide decode projections: a TMA-fed tensor-core kernel and a read-only
probe of the same weight, against cuBLAS and ssmshard's several-row GEMV (one H200).

At batch 64 the projections run on cuBLAS at 57-75% of the copy bandwidth
(benchmarks/results/decode_profile/, "Batch 64, kernel by kernel"), and the several-row GEMV
(pointer loads, tl.dot) did not beat it on the wide weights (../gemv/README.md, "2 to 64 rows").
This asks two questions per weight: how fast can one kernel launch of this size *read* the weight
at all (``read_probe``: the same tiles, TMA-loaded and summed, no x), and does a GEMM fed by TMA
descriptors with a deeper software pipeline (``tma_rows``) get closer to that than cuBLAS?

    PYTHONPATH=$PWD python benchmarks/results/gemv/tma_rows_gpu.py --out $OUT

Each call is timed as the decode step sees it: inside a CUDA graph, back to back over enough
weight copies to overflow the L2 cache (``bench_gemv.graphed_us``). Every variant is checked
against a float64 product first. Writes ``tma_rows.json`` and prints one line per shape and rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from bench_gemv import graphed_us, rel_err, L2_OVERFLOW_BYTES  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402
from ssmshard.kernels import gemv as kgemv  # noqa: E402

# (model, projection, n, k): the wide weights, where one block of output features per program
# already starts enough programs (no split of k needed).
SHAPES = [
    ("mamba-2.8b", "in_proj", 10240, 2560), ("mamba2-2.7b", "in_proj", 10576, 2560),
    ("zamba2-2.7b", "in_proj", 10448, 2560), ("llama-3-8b", "gate_proj", 14336, 4096),
    ("mamba-2.8b", "lm_head", 50280, 2560),
]


@triton.jit
def _tma_rows_kernel(x_desc, w_desc, y_ptr, M, N, K, sy_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """y[:, block] = x @ w[block].T for one block of BLOCK_N output features, k streamed in
    BLOCK_K tiles through a STAGES-deep TMA pipeline."""
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        x = x_desc.load([0, k0])
        acc = tl.dot(x, w.T, acc)
    mm = tl.arange(0, BLOCK_M)
    nn = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + mm[:, None] * sy_m + nn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(mm < M)[:, None] & (nn < N)[None, :])


@triton.jit
def _read_probe_kernel(w_desc, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Reads the same weight tiles as ``_tma_rows_kernel`` and sums them: the weight stream alone."""
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc += w_desc.load([n0, k0]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def tma_rows(x, w, BLOCK_N, BLOCK_K, STAGES, num_warps):
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K])
    _tma_rows_kernel[(triton.cdiv(n, BLOCK_N),)](x_desc, w_desc, y, m, n, k, y.stride(0), BLOCK_M=block_m,
                                                 BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=STAGES,
                                                 num_warps=num_warps)
    return y


def read_probe(w, BLOCK_N, BLOCK_K, STAGES, num_warps, out):
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K])
    _read_probe_kernel[(triton.cdiv(w.shape[0], BLOCK_N),)](w_desc, out, w.shape[1], BLOCK_N=BLOCK_N,
                                                            BLOCK_K=BLOCK_K, STAGES=STAGES, num_warps=num_warps)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    # Tilings whose pipeline fits an H200's 227 KB of shared memory (64 rows of x per stage).
    fits = lambda bn, bk, stages: (bn + 64) * bk * 2 * stages <= 220 << 10  # noqa: E731
    gemm_grid = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 6), (4, 8)) if fits(*c[:3])]
    probe_grid = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 6), (4,)) if fits(*c[:3])]
    for model, proj, n, k in SHAPES:
        w_bytes = n * k * 2
        copies = max(2, min(64, L2_OVERFLOW_BYTES // w_bytes))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        probe_out = torch.empty(triton.cdiv(n, 32), device=device, dtype=torch.float32)
        probe = []
        for bn, bk, stages, warps in probe_grid:
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps)
            try:
                us = graphed_us(lambda _x, w, c=cfg: read_probe(w, out=probe_out, **c), weights, None)
            except Exception as e:  # noqa: BLE001 - a tiling the compiler rejects (shared memory) is recorded
                probe.append({**cfg, "error": type(e).__name__})
                continue
            probe.append({**cfg, "us": us})
        probe_best = min((p for p in probe if "us" in p), key=lambda p: p["us"])
        for rows in args.rows:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            row = {"model": model, "proj": proj, "n": n, "k": k, "rows": rows, "weight_bytes": w_bytes,
                   "floor_us": w_bytes / bandwidth * 1e6, "read_probe_best": probe_best,
                   "cublas_us": graphed_us(F.linear, weights, x), "gemv_us": graphed_us(kgemv.gemv, weights, x),
                   "err_cublas": rel_err(F.linear(x, weights[0]), x, weights[0]), "sweep": []}
            for bn, bk, stages, warps in gemm_grid:
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps)
                try:
                    err = rel_err(tma_rows(x, weights[0], **cfg), x, weights[0])
                    us = graphed_us(lambda a, w, c=cfg: tma_rows(a, w, **c), weights, x)
                except Exception as e:  # noqa: BLE001
                    row["sweep"].append({**cfg, "error": type(e).__name__})
                    continue
                row["sweep"].append({**cfg, "us": us, "err": err})
            timed = [s for s in row["sweep"] if "us" in s and s["err"] < 2e-2]
            row["best"] = min(timed, key=lambda s: s["us"]) if timed else None
            result["rows"].append(row)
            best = row["best"]
            print(f"{model:12s} {proj:9s} {n:6d}x{k:<5d} rows {rows:2d} floor {row['floor_us']:7.2f}"
                  f"  read probe {probe_best['us']:7.2f} ({row['floor_us'] / probe_best['us']:.0%})"
                  f"  cublas {row['cublas_us']:7.2f} ({row['floor_us'] / row['cublas_us']:.0%})"
                  f"  gemv {row['gemv_us']:7.2f}  tma best {best['us'] if best else float('nan'):7.2f} {best}",
                  flush=True)
            with open(os.path.join(args.out, "tma_rows.json"), "w") as f:
                json.dump(result, f, indent=1)
        del weights


if __name__ == "__main__":
    main()
