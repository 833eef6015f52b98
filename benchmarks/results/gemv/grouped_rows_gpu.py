"""Linear layers that read one input, at 2 to 64 rows: one grouped launch (``kernels/gemv.py``,
``grouped_gemv``) against the per-weight path a decode step took before (``decode_linear`` per
weight: the kernel or cuBLAS, ``prefers_cublas``), each call alone in a CUDA graph.

    PYTHONPATH=$PWD python benchmarks/results/gemv/grouped_rows_gpu.py --out $OUT/gemv/grouped_rows.json

Groups: Llama-3-8B's q/k/v (4096 + 1024 + 1024 features of k 4096) and gate/up (2 x 14336).
Per rows: the per-weight path, then every swept tiling of the grouped launch (the chosen one,
``grouped_config``, among them), each output checked against a float64 product first. Each
time is the median of 7 replays of a graph calling the group once per weight copy, enough
copies to overflow the L2 cache (``bench_gemv.graphed_us``). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from bench_gemv import L2_OVERFLOW_BYTES, graphed_us, rel_err  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402

from ssmshard.kernels import gemv as kgemv  # noqa: E402

GROUPS = {"llama-3-8b q/k/v": ((4096, 1024, 1024), 4096), "llama-3-8b gate/up": ((14336, 14336), 4096)}
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((32, 64), (64, 128, 256), (4, 8), (3, 4))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64])
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results = dict(device=torch.cuda.get_device_name(), copy_bandwidth_bytes_per_s=bandwidth, groups=[])
    for (name, (features, k)), rows in itertools.product(GROUPS.items(), args.rows):
        group_bytes = sum(features) * k * 2
        copies = max(2, -(-L2_OVERFLOW_BYTES // group_bytes))
        groups = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in features] for _ in range(copies)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

        def per_weight(x, ws):
            return [kgemv.decode_linear(x, w) for w in ws]

        row = dict(group=name, rows=rows, features=list(features), k=k, floor_us=group_bytes / bandwidth * 1e6,
                   per_weight_us=graphed_us(per_weight, groups, x), grouped=[])
        for config in CONFIGS:
            try:
                outs = kgemv.grouped_gemv(x, groups[0], config=config)
            except triton.runtime.errors.OutOfResources as exc:  # a tiling beyond shared memory
                row["grouped"].append(dict(config=config, us=None, error=str(exc)))
                continue
            error = max(rel_err(out, x, w) for out, w in zip(outs, groups[0]))
            us = graphed_us(lambda x, ws, c=config: kgemv.grouped_gemv(x, ws, config=c), groups, x)
            row["grouped"].append(dict(config=config, us=us, rel_err=error))
        chosen = kgemv.grouped_config(rows, sum(features), k)
        row["chosen"] = chosen
        row["chosen_us"] = graphed_us(lambda x, ws: kgemv.grouped_gemv(x, ws), groups, x)
        best = min((r for r in row["grouped"] if r["us"] is not None), key=lambda r: r["us"])
        results["groups"].append(row)
        print(f"{name:20s} rows {rows:3d}: floor {row['floor_us']:6.2f} us, per weight {row['per_weight_us']:6.2f}, "
              f"grouped chosen {row['chosen_us']:6.2f}, best {best['us']:6.2f} {best['config']} "
              f"(errors <= {max(r['rel_err'] for r in row['grouped'] if 'rel_err' in r):.1e})", flush=True)
        del groups
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
