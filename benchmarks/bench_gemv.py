"""GPU benchmark of the decode GEMV (ssmshard.kernels.gemv) against cuBLAS (``F.linear``).

For the projections of the Mamba-2.8B, Mamba2-2.7B and Llama-3-8B configurations at 1 to 64
rows (the decode batch): the device time of one call as a decode step sees it, i.e. inside a
CUDA graph, back to back with other weights (each call reads its weight from HBM: the graph
walks enough weight copies to overflow the L2 cache), beside the time the weight's bytes take
at the copy bandwidth measured in the same run. Checks every variant against a float64
reference first, then sweeps the kernel's tile configurations (``--sweep``).

    python benchmarks/bench_gemv.py [--out results.json] [--rows 1 2 4 ...] [--sweep] [--sweep-rows 1 16 64] [--smoke]

Writes JSON to --out (else $OUT/bench_gemv.json), a plot beside it (.png, with matplotlib) and
prints a table. ``--smoke`` runs tiny shapes on the CPU interpreter (checks the script; its
times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ssmshard.kernels import gemv as kgemv  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402  (the decode benchmarks' floor uses the same)

# (model, projection, n, k): weight (n, k)
SHAPES = [
    ("mamba-2.8b", "in_proj", 10240, 2560), ("mamba-2.8b", "x_proj", 192, 5120),
    ("mamba-2.8b", "dt_proj", 5120, 160), ("mamba-2.8b", "out_proj", 2560, 5120),
    ("mamba2-2.7b", "in_proj", 10576, 2560), ("mamba2-2.7b", "out_proj", 2560, 5120),
    ("llama-3-8b", "q_proj", 4096, 4096), ("llama-3-8b", "k_proj", 1024, 4096),
    ("llama-3-8b", "gate_proj", 14336, 4096), ("llama-3-8b", "down_proj", 4096, 14336),
    ("mamba-2.8b", "lm_head", 50280, 2560),
]
ROWS = (1, 2, 4, 8, 16, 64)
DEVICE, DTYPE = "cuda", torch.bfloat16
L2_OVERFLOW_BYTES = 256 << 20  # the weights one graph walks through: several times the H200's L2
if bench_common.SMOKE:
    SHAPES = [("tiny", "proj", 24, 40), ("tiny", "narrow", 5, 70)]
    ROWS, DEVICE, DTYPE = (1, 3), "cpu", torch.float32


# Split-k is swept only where the feature blocks alone start fewer programs than this (an H200 has 132 SMs).
SPLIT_BELOW_BLOCKS = 528


def sweep_configs(rows: int, n: int):
    if rows == 1:
        grid = itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8), (1,))
        return [dict(BLOCK_N=bn, BLOCK_K=k, num_warps=w, num_stages=s) for bn, k, w, s in grid]
    # 64 rows: wider feature blocks (each program re-reads x, as many bytes as the weight's at in_proj);
    # narrow weights (x_proj's 192 features) also 16-feature blocks and k split 16 or 32 ways.
    narrow = n <= 1024
    grid = itertools.product(((16,) if narrow else ()) + ((32, 64, 128) if rows > 16 else (16, 32, 64)),
                             (64, 128) if rows > 16 else (128, 256), (4,), (3, 4),
                             (1, 4, 8) + ((16, 32) if narrow else ()))
    return [dict(BLOCK_N=bn, BLOCK_K=k, num_warps=w, num_stages=s, SPLIT_K=sk) for bn, k, w, s, sk in grid
            if sk == 1 or -(-n // bn) < SPLIT_BELOW_BLOCKS]


def graphed_us(fn, weights, x, replays: int = 7) -> float:
    """Median device time of one ``fn(x, w)`` in a CUDA graph that calls it for every weight copy."""
    if bench_common.SMOKE:
        return bench_common.cpu_median_ms(lambda: [fn(x, w) for w in weights]) * 1e3 / len(weights)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return statistics.median(times)


def rel_err(y, x, w) -> float:
    ref = x.double() @ w.double().T
    return ((y.double() - ref).norm() / ref.norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_gemv.json"))
    parser.add_argument("--sweep", action="store_true", help="also time every tile configuration at --sweep-rows")
    parser.add_argument("--rows", type=int, nargs="+", help=f"rows (decode batch) to time (default {ROWS})")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 16, 64], help="rows the sweep runs at")
    parser.add_argument("--shapes", nargs="+", help="only these projections (model:proj, e.g. mamba-2.8b:x_proj)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    bandwidth = None if bench_common.SMOKE else copy_bandwidth(torch.device(DEVICE))
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "dtype": str(DTYPE),
              "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    shapes = [s for s in SHAPES if not args.shapes or f"{s[0]}:{s[1]}" in args.shapes]
    for (model, proj, n, k), rows in itertools.product(shapes, args.rows or ROWS):
        w_bytes = n * k * DTYPE.itemsize
        copies = max(2, min(64, L2_OVERFLOW_BYTES // w_bytes)) if DEVICE == "cuda" else 2
        weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        row = {"model": model, "proj": proj, "n": n, "k": k, "rows": rows, "weight_bytes": w_bytes,
               "floor_us": w_bytes / bandwidth * 1e6 if bandwidth else None,
               "err_cublas": rel_err(F.linear(x, weights[0]), x, weights[0]),
               "err_gemv": rel_err(kgemv.gemv(x, weights[0]), x, weights[0]),
               "cublas_us": graphed_us(F.linear, weights, x),
               "gemv_us": graphed_us(kgemv.gemv, weights, x),
               "default_config": kgemv.default_config(rows, n, k)}
        if args.sweep and rows in args.sweep_rows:
            sweep = []
            for cfg in sweep_configs(rows, n):
                try:
                    us = graphed_us(lambda a, b, c=cfg: kgemv.gemv(a, b, config=c), weights, x)
                    err = rel_err(kgemv.gemv(x, weights[0], config=cfg), x, weights[0])
                except Exception as e:  # noqa: BLE001 - a config the compiler rejects (shared memory) is skipped
                    sweep.append({**cfg, "error": f"{type(e).__name__}"})
                    continue
                sweep.append({**cfg, "us": us, "err": err})
            # A wrong result is never the best; split-k counters must be back at 0 after the replays.
            timed = [s for s in sweep if "us" in s and s["err"] < 2e-2]
            row["split_counters_nonzero"] = int(sum(int(c.count_nonzero()) for c in kgemv._SPLIT_COUNTERS.values()))
            row["best"] = min(timed, key=lambda s: s["us"]) if timed else None
            row["sweep"] = sweep
        result["rows"].append(row)
        best = f" best {row['best']['us']:7.2f} {row['best']}" if row.get("best") else ""
        floor = f"{row['floor_us']:7.2f}" if row["floor_us"] else "-"
        print(f"{model:12s} {proj:9s} {n:6d}x{k:<6d} rows {rows:2d}  floor {floor}  cublas {row['cublas_us']:8.2f}"
              f"  gemv {row['gemv_us']:8.2f}  err {row['err_cublas']:.1e}/{row['err_gemv']:.1e}{best}", flush=True)
        del weights
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    one = [r for r in result["rows"] if r["rows"] == 1]
    bench_common.bar_chart(os.path.splitext(args.out)[0] + ".png", f"batch-1 GEMV, {result['device']}",
                           [f"{r['model']} {r['proj']}" for r in one],
                           {"cuBLAS": [r["cublas_us"] for r in one], "ssmshard gemv": [r["gemv_us"] for r in one],
                            "weight bytes at copy bandwidth": [r["floor_us"] for r in one]}, "us per call", log=True)


if __name__ == "__main__":
    main()
