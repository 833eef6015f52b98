"""Batch 1: prefetch a layer's out_proj weight into L2 while the latency-bound kernels before it run.

Each batch-1 GEMV pays about 2.5 us over its bytes (README, "A persistent batch-1 GEMV"), and
between a Mamba layer's in_proj and out_proj the step runs kernels that move little (conv and
state updates, x_proj): HBM idles there. This probe asks whether issuing L2 prefetches of the
out_proj weight right after in_proj takes that weight's stream off the critical path.

A synthetic chain of Mamba-2.8B-shaped GEMVs (ssmshard's kernel, PDL on), LAYERS layers:
in_proj (10240 x 2560) -> [prefetch out_proj] -> three small GEMVs standing in for the
latency-bound middle (x_proj 192 x 5120, dt_proj 5120 x 160, x_proj again) -> out_proj
(2560 x 5120), each layer with its own weights (L2 overflowed). Variants of the prefetch kernel:
per-128-byte-line ``prefetch.global.L2`` or Hopper's ``cp.async.bulk.prefetch.L2``, issued after
the PDL wait (safe: the kernel completes after in_proj) or before it. Every variant's output is
checked bit for bit against the chain without prefetch.

    PYTHONPATH=$PWD python benchmarks/results/gemv/l2_prefetch_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
from bench_gemv import graphed_us  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402
from ssmshard.kernels import gemv as kgemv  # noqa: E402
from ssmshard.kernels.pdl import launch_options, start_dependents_then_wait  # noqa: E402

LINE = tl.constexpr(128)


@triton.jit
def _prefetch_kernel(w_ptr, nbytes, SEG: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr,
                     BEFORE_WAIT: tl.constexpr, EVICT_LAST: tl.constexpr, PDL: tl.constexpr):
    """Each lane prefetches SEG bytes of the weight into L2; nothing is read into registers."""
    if not BEFORE_WAIT:
        start_dependents_then_wait(PDL)
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * SEG
    live = (offs < nbytes).to(tl.int32)
    ptrs = w_ptr.to(tl.pointer_type(tl.int8)) + offs
    if BULK:
        size = tl.minimum(nbytes - offs, SEG).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, size, live], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for i in tl.static_range(SEG // LINE):
            if EVICT_LAST:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [ptrs + i * LINE, live], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [ptrs + i * LINE, live], dtype=tl.int32, is_pure=False, pack=1)
    if BEFORE_WAIT:
        start_dependents_then_wait(PDL)


def prefetch(w, SEG, LANES, BULK, BEFORE_WAIT, EVICT_LAST=False):
    nbytes = w.numel() * w.element_size()
    grid = (triton.cdiv(nbytes, SEG * LANES),)
    _prefetch_kernel[grid](w, nbytes, SEG=SEG, LANES=LANES, BULK=BULK, BEFORE_WAIT=BEFORE_WAIT,
                           EVICT_LAST=EVICT_LAST, num_warps=max(1, LANES // 32), **launch_options(w.device))


_SIDE = {}


def chain(x, layers, variant):
    """The layers; ``variant`` None (no prefetch) or the prefetch kernel's options, plus ``SIDE``
    (None: on the main stream; "join": on a side stream forked after in_proj and joined before
    out_proj; "end": forked likewise, joined only after the last layer)."""
    variant = dict(variant or {})
    side = variant.pop("SIDE", None)
    noop = variant.pop("NOOP", False)  # prefetch 16 bytes: the cost of the extra launch (and fork) alone
    main = torch.cuda.current_stream()
    stream = _SIDE.setdefault(x.device, torch.cuda.Stream(x.device)) if side else None
    for w_in, w_x, w_dt, w_out in layers:
        y = kgemv.gemv(x, w_in)
        if variant and stream is not None:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                prefetch(w_out[0, :8] if noop else w_out, **variant)
        elif variant:
            prefetch(w_out[0, :8] if noop else w_out, **variant)
        a = kgemv.gemv(y[:, :5120], w_x)
        b = kgemv.gemv(a[:, :160], w_dt)
        kgemv.gemv(b, w_x)
        if side == "join":
            main.wait_stream(stream)
        x = kgemv.gemv(b, w_out)
    if side == "end":
        main.wait_stream(stream)
    return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    bf = dict(device=dev, dtype=torch.bfloat16)
    layers = [(torch.randn(10240, 2560, **bf) / 50, torch.randn(192, 5120, **bf) / 70,
               torch.randn(5120, 160, **bf) / 13, torch.randn(2560, 5120, **bf) / 70) for _ in range(args.layers)]
    x = torch.randn(1, 2560, **bf)
    layer_bytes = sum(w.numel() * 2 for w in layers[0])
    variants = {"none": None}
    for bulk in (False, True):
        for before in (False, True):
            for seg, lanes in ((4096, 128), (16384, 128)) if bulk else ((2048, 128), (8192, 128)):
                name = f"{'bulk' if bulk else 'lines'}_{'before' if before else 'after'}_wait_seg{seg}"
                variants[name] = dict(SEG=seg, LANES=lanes, BULK=bulk, BEFORE_WAIT=before)
    variants["lines_after_wait_seg2048_evict_last"] = dict(SEG=2048, LANES=128, BULK=False, BEFORE_WAIT=False,
                                                           EVICT_LAST=True)
    variants["noop_after_wait"] = dict(SEG=2048, LANES=128, BULK=False, BEFORE_WAIT=False, NOOP=True)
    variants["side_end_noop"] = dict(SEG=2048, LANES=128, BULK=False, BEFORE_WAIT=False, SIDE="end", NOOP=True)
    # On a side stream (no PDL there: its kernel waits for in_proj through the fork's event).
    for side in ("join", "end"):
        for seg, bulk in ((512, False), (2048, False), (4096, True)):
            variants[f"side_{side}_{'bulk' if bulk else 'lines'}_seg{seg}"] = dict(
                SEG=seg, LANES=128, BULK=bulk, BEFORE_WAIT=False, SIDE=side)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth, "layers": args.layers,
              "floor_us_per_layer": layer_bytes / bandwidth * 1e6, "variants": {}}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {result['floor_us_per_layer']:.2f} us a layer",
          flush=True)
    reference = None
    for round_ in range(3):  # rounds alternate the variants so that drift hits all of them alike
        for name, variant in variants.items():
            try:
                # The whole chain as one call of a CUDA graph; its output from an eager run of it.
                us = graphed_us(lambda _x, _w, v=variant: chain(x, layers, v), [None], None, replays=15)
                out = chain(x, layers, variant)
            except Exception as e:  # noqa: BLE001 - a variant the compiler or driver rejects is recorded
                result["variants"].setdefault(name, {"error": f"{type(e).__name__}: {e}"[:300]})
                continue
            if reference is None:
                reference = out
            entry = result["variants"].setdefault(name, {"us_per_layer": [], "bitwise_equal": True})
            entry["us_per_layer"].append(us / args.layers)
            entry["bitwise_equal"] &= bool(torch.equal(out, reference))
    for name, entry in result["variants"].items():
        if "us_per_layer" in entry:
            entry["median_us_per_layer"] = statistics.median(entry["us_per_layer"])
            print(f"{name:40s} {entry['median_us_per_layer']:7.2f} us a layer  equal {entry['bitwise_equal']}",
                  flush=True)
        else:
            print(f"{name:40s} {entry['error']}", flush=True)
    with open(os.path.join(args.out, "l2_prefetch.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
