"""GPU benchmark of a decode step's attention: the decode-attention kernel
(ssmshard.kernels.decode_attention) against PyTorch's ``scaled_dot_product_attention`` backends.

For the attention shapes of the Zamba2-2.7B (32 heads of 160, as many key/value heads) and
Llama-3-8B (32 query heads over 8 key/value heads of 128) configurations, one query position
against caches of ``--positions`` slots with a left-padding additive mask, at batch 1 to 256:
the device time of one call inside a CUDA graph that walks enough cache copies to overflow the
L2 cache (``bench_gemv.graphed_us``), beside the time the cache's bytes take at the copy
bandwidth measured in the same run. Every variant is first checked against a float64 reference.
``--sweep`` also times the kernel's launch shapes (positions per block, warps, splits).

    python benchmarks/bench_decode_attention.py [--out results.json] [--batches 1 16 64 256] [--sweep] [--smoke]

Writes JSON to --out (else $OUT/bench_decode_attention.json), a plot beside it (.png: each
variant's time over the floor per shape, with matplotlib) and prints a table. ``--smoke``
runs tiny shapes on the CPU interpreter (checks the script; its times mean nothing).

Dimension letters: b batch, h query heads, k key/value heads, s cache positions, p head dim.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ssmshard.kernels.decode_attention import decode_attention  # noqa: E402
from bench_gemv import graphed_us  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402

# model -> (query heads h, key/value heads k, head dim p)
SHAPES = {"zamba2-2.7b": (32, 32, 160), "llama-3-8b": (32, 8, 128)}
BATCHES, POSITIONS = (1, 16, 64, 256), (80, 1024, 4096)
DEVICE, DTYPE = "cuda", torch.bfloat16
L2_OVERFLOW_BYTES = 256 << 20
MAX_CACHE_BYTES = 8 << 30  # shapes whose one cache copy is larger are left out
if bench_common.SMOKE:
    SHAPES = {"tiny": (4, 2, 20)}
    BATCHES, POSITIONS, DEVICE, DTYPE = (1, 3), (9, 40), "cpu", torch.float32


def sdpa(backend):
    def run(q, cache):
        k, v, mask = cache
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return run


def kernel(**launch):
    def run(q, cache):
        k, v, mask = cache
        return decode_attention(q, k, v, mask, enable_gqa=k.shape[1] != q.shape[1], **launch)
    return run


def caches(b, kv, s, p, copies, generator):
    """``copies`` (k, v, additive mask) triples; the mask masks a random left padding per row."""
    out = []
    for _ in range(copies):
        k, v = (torch.randn(b, kv, s, p, generator=generator).to(DEVICE, DTYPE) for _ in range(2))
        pad = torch.randint(0, max(1, s // 2), (b,), generator=generator)
        keep = (torch.arange(s)[None, :] >= pad[:, None])[:, None, None, :].to(DEVICE)
        out.append((k, v, torch.zeros(keep.shape, device=DEVICE, dtype=DTYPE).masked_fill(~keep, float("-inf"))))
    return out


def rel_err(fn, q, cache) -> float:
    k, v, mask = cache
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(),
                                         enable_gqa=k.shape[1] != q.shape[1])
    return ((fn(q, cache).double() - ref).norm() / ref.norm()).item()


def variants(sweep: bool, s: int):
    found = {"kernel": kernel()}
    if not bench_common.SMOKE:
        found.update({"sdpa (default)": lambda q, c: F.scaled_dot_product_attention(
                          q, *c[:2], attn_mask=c[2], enable_gqa=c[0].shape[1] != q.shape[1]),
                      "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                      "sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)})
    if sweep:
        for block_s, warps, stages, splits in itertools.product((16, 32, 64), (2, 4), (1, 2), (1, 4, 16)):
            if splits == 1 or s >= 64 * splits:
                found[f"kernel s{block_s} w{warps} st{stages} n{splits}"] = kernel(
                    block_s=block_s, num_warps=warps, num_stages=stages, splits=splits)
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_decode_attention.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--positions", type=int, nargs="+", default=list(POSITIONS))
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args(argv)
    bandwidth = None if bench_common.SMOKE else copy_bandwidth(torch.device(DEVICE))
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    generator = torch.Generator().manual_seed(0)
    print(f"{'model':12} {'b':>4} {'s':>5} {'variant':26} {'us':>9} {'floor us':>9} {'x floor':>8} {'rel err':>9}")
    for model, b, s in itertools.product(args.models, args.batches, args.positions):
        h, kv, p = SHAPES[model]
        cache_bytes = 2 * b * kv * s * p * torch.finfo(DTYPE).bits // 8
        if cache_bytes > MAX_CACHE_BYTES:
            continue
        copies = 1 if bench_common.SMOKE else max(2, -(-L2_OVERFLOW_BYTES // cache_bytes))
        cache_list = caches(b, kv, s, p, copies, generator)
        q = torch.randn(b, 1, h, p, generator=generator).to(DEVICE, DTYPE).transpose(1, 2)  # (b, h, 1, p) as HF views it
        floor_us = None if bandwidth is None else cache_bytes / bandwidth * 1e6
        for name, fn in variants(args.sweep and b in (1, 64), s).items():
            try:
                err = rel_err(fn, q, cache_list[0])
                us = graphed_us(fn, cache_list, q)
            except Exception as exc:  # a backend refusing the shape, a launch shape out of resources
                print(f"{model:12} {b:4} {s:5} {name:26} refused: {str(exc).splitlines()[0][:80]}")
                continue
            row = {"model": model, "batch": b, "positions": s, "variant": name, "us": us, "floor_us": floor_us,
                   "rel_err": err, "cache_bytes": cache_bytes}
            result["rows"].append(row)
            ratio = f"{us / floor_us:8.2f}" if floor_us else f"{'-':>8}"
            print(f"{model:12} {b:4} {s:5} {name:26} {us:9.2f} {floor_us or 0:9.2f} {ratio} {err:9.2e}", flush=True)
        del cache_list
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    plot(result, os.path.splitext(args.out)[0] + ".png")


def plot(result: dict, path: str) -> None:
    """Per shape, each variant's time (the launch-shape sweep left out), in multiples of the floor
    (in us where there is no floor: the smoke run)."""
    rows = [r for r in result["rows"] if r["variant"] == "kernel" or r["variant"].startswith("sdpa")]
    shapes = list(dict.fromkeys((r["model"], r["batch"], r["positions"]) for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["model"], r["batch"], r["positions"], r["variant"]): r for r in rows}
    relative = result["copy_bandwidth_bytes_per_s"] is not None

    def value(shape, name):
        row = by.get((*shape, name))
        return None if row is None else row["us"] / row["floor_us"] if relative else row["us"]

    bench_common.bar_chart(path, f"decode attention, one query position, {result['device']}",
                           [f"{m} b{b} s{s}" for m, b, s in shapes],
                           {name: [value(shape, name) for shape in shapes] for name in names},
                           "time / floor (keys and values at copy bandwidth)" if relative else "us", log=True)


if __name__ == "__main__":
    main()
