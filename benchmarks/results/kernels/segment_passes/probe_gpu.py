"""GPU probe: the Mamba-1 scan forward's two passes at batch 1 (segments), each timed alone and
with each forward kernel, to see whether a mix (one kernel for the segment pass, another for
the main pass) beats one kernel for both.

    PYTHONPATH=$PWD python benchmarks/results/kernels/segment_passes/probe_gpu.py

d = 5120, n = 16, bf16 token-contiguous u / delta / z, bf16 y, softplus, D and z (the
Mamba-2.8B forward's scan); B and C made float32 rows once (not timed here). CUDA-graph medians.
"""
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scan_probe_inputs import scan_inputs  # noqa: E402
from ssmshard.kernels.launch_math import cdiv  # noqa: E402
from ssmshard.kernels.selective_scan import (ScanConfig, _bc4, _chain_segments, _forward_kernel,  # noqa: E402
                                             _fp32_rows, default_config, selective_scan)

dev = torch.device("cuda")
torch.manual_seed(0)
d, n = 5120, 16
KERNELS = {
    "parallel 16 ch": dict(fwd_variant="parallel", par_block_d=16, par_tokens=4, par_warps=1),
    "parallel 32 ch": dict(fwd_variant="parallel", par_block_d=32, par_tokens=4, par_warps=1),
    "sequential 32 ch, 4 tokens": dict(fwd_variant="sequential", fwd_tokens=4, fwd_warps=1),
    "sequential 32 ch, 8 tokens": dict(fwd_variant="sequential", fwd_tokens=8, fwd_warps=1),
    "sequential 64 ch, 4 tokens": dict(fwd_variant="sequential", fwd_tokens=4, fwd_warps=2),
}


def launch_pass(cfg, u, delta, A, B32, C32, D, z, bias, y, carry, seg_end, seg_decay, with_output, num_segments,
                seg_len):
    """One pass of ``selective_scan._launch_forward`` with the kernel ``cfg`` names."""
    bsz, d_, l = u.shape
    g = B32.shape[1]
    e = d_ // g
    kernel, block_d, tile_constants = _forward_kernel(u, delta, z, y, n, cfg)
    grid_segments = num_segments if with_output else num_segments - 1
    dummy = y
    opt = lambda t: t if t is not None else dummy  # noqa: E731
    kernel[(g * cdiv(e, block_d), bsz, grid_segments)](
        u, delta, A, B32, C32, D, z, bias, dummy, dummy,
        y, dummy, dummy, opt(carry), opt(seg_end), opt(seg_decay), dummy,
        d_, l, e, n, seg_len, num_segments, cfg.chunk,
        *u.stride(), *delta.stride(), *A.stride(), *B32.stride()[:3], *C32.stride()[:3], *z.stride(),
        *y.stride(), 0, 0, 0, 0, 0, 0,
        HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False,
        STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=with_output, HAS_CARRY=carry is not None, RANGED=False,
        **tile_constants)


rows = []
for l in (4096, 16384):
    b = 1
    u, delta, z, A, B, C, D, bias = scan_inputs(b, d, l, n, dev)
    B32, C32 = _fp32_rows(_bc4(B)), _fp32_rows(_bc4(C))
    with torch.no_grad():
        ref32 = selective_scan(u, delta, A, B, C, D, z, bias, True, out_dtype=torch.float32)
        full = lambda: selective_scan(u, delta, A, B, C, D, z, bias, True, out_dtype=torch.bfloat16)  # noqa: E731
        t_default = triton.testing.do_bench_cudagraph(full, rep=200, return_mode="median")
    base = default_config(b, d, l, dev)
    print(f"L={l}: ssmshard's default {t_default:.4f} ms ({base.segments} segments asked)", flush=True)
    row = dict(l=l, default_ms=t_default, default_segments=base.segments, passes={})
    for segments in (base.segments // 2, base.segments, base.segments * 2):
        unit = 64
        seg_len = cdiv(cdiv(l, segments), unit) * unit
        num_segments = cdiv(l, seg_len)
        seg_end, seg_decay, carry = (torch.empty(b, num_segments, n, d, device=dev) for _ in range(3))
        y = torch.empty(b, d, l, device=dev, dtype=torch.bfloat16)
        times = {}
        for name, kw in KERNELS.items():
            cfg = ScanConfig(segments=num_segments, **kw)
            first = lambda: launch_pass(cfg, u, delta, A, B32, C32, D, z, bias, y, None, seg_end, seg_decay,  # noqa
                                        False, num_segments, seg_len)
            second = lambda: launch_pass(cfg, u, delta, A, B32, C32, D, z, bias, y, carry, None, None,  # noqa
                                         True, num_segments, seg_len)
            chain = lambda: _chain_segments(seg_end, seg_decay, carry, reverse=False)  # noqa: E731
            first(); chain()
            t1 = triton.testing.do_bench_cudagraph(first, rep=100, return_mode="median")
            t2 = triton.testing.do_bench_cudagraph(second, rep=100, return_mode="median")
            times[name] = (t1, t2)
            print(f"  {num_segments} segments, {name:<28} segment pass {t1:.4f} ms, main pass {t2:.4f} ms", flush=True)
        t_chain = triton.testing.do_bench_cudagraph(lambda: _chain_segments(seg_end, seg_decay, carry, reverse=False),
                                                    rep=100, return_mode="median")
        best = min(((a, m) for a in KERNELS for m in KERNELS), key=lambda am: times[am[0]][0] + times[am[1]][1])
        # The best mix run end to end, its y checked against the float32 result.
        cfg_a = ScanConfig(segments=num_segments, **KERNELS[best[0]])
        cfg_m = ScanConfig(segments=num_segments, **KERNELS[best[1]])

        def mixed():
            launch_pass(cfg_a, u, delta, A, B32, C32, D, z, bias, y, None, seg_end, seg_decay, False, num_segments,
                        seg_len)
            _chain_segments(seg_end, seg_decay, carry, reverse=False)
            launch_pass(cfg_m, u, delta, A, B32, C32, D, z, bias, y, carry, None, None, True, num_segments, seg_len)
        mixed(); torch.cuda.synchronize()
        err = ((y.float() - ref32).norm() / ref32.norm()).item()
        t_mixed = triton.testing.do_bench_cudagraph(mixed, rep=200, return_mode="median")
        print(f"  {num_segments} segments: chain {t_chain:.4f} ms; best mix: segment pass {best[0]}, main pass {best[1]}:"
              f" {t_mixed:.4f} ms end to end ({t_default / t_mixed:.3f}x the default), y err {err:.2e}", flush=True)
        row["passes"][num_segments] = dict(times=times, chain_ms=t_chain, best=best, best_ms=t_mixed, best_err=err)
    rows.append(row)
out = os.environ.get("OUT", ".")
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d"), rows=rows), open(os.path.join(out, "segment_passes.json"), "w"),
          indent=1)
