"""GPU probe: a Mamba-1 scan forward with the state indices split over lanes (one pass, no
segments) against the current kernels at batch 1.

    PYTHONPATH=$PWD python benchmarks/results/kernels/state_lanes/probe_gpu.py
"""
import json, os, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scan_probe_inputs import scan_inputs
from state_lanes_kernel import launch
from ssmshard.kernels.selective_scan import selective_scan, _bc4, _fp32_rows, default_config

dev = torch.device("cuda")
torch.manual_seed(0)
rows = []
d, n = 5120, 16
variants = [
    dict(name="lanes4 T4 bd8 w1 spread pf", block_d=8, num_warps=1, spread=True, prefetch=True),
    dict(name="lanes4 T4 bd16 w2 spread pf", block_d=16, num_warps=2, spread=True, prefetch=True),
    dict(name="lanes4 T4 bd32 w4 spread pf", block_d=32, num_warps=4, spread=True, prefetch=True),
    dict(name="lanes4 T4 bd8 w1 spread", block_d=8, num_warps=1, spread=True, prefetch=False),
    dict(name="lanes4 T4 bd8 w1", block_d=8, num_warps=1, spread=False, prefetch=False),
    dict(name="lanes8 T8 bd4 w1 spread pf", block_d=4, num_warps=1, spread=True, prefetch=True, lanes=8, tokens=8),
]
for b, l in ((1, 2048), (1, 4096), (1, 16384), (8, 2048)):
    u, delta, z, A, B, C, D, bias = scan_inputs(b, d, l, n, dev)
    with torch.no_grad():
        ref32 = selective_scan(u, delta, A, B, C, D, z, bias, True, out_dtype=torch.float32)
        cur = lambda: selective_scan(u, delta, A, B, C, D, z, bias, True, out_dtype=torch.bfloat16)
        y_cur = cur()
        t_cur = triton.testing.do_bench_cudagraph(cur, rep=200, return_mode="median")
        cfg = default_config(b, d, l, dev)
        row = dict(b=b, l=l, current_ms=t_cur, current_segments=cfg.segments,
                   current_err=((y_cur.float() - ref32).norm() / ref32.norm()).item())
        print(f"B={b} L={l}: current {t_cur:.4f} ms (segments {cfg.segments}, err {row['current_err']:.2e})", flush=True)
        for v in variants:
            y = torch.empty(b, d, l, device=dev, dtype=torch.bfloat16)
            opts = {k: v[k] for k in v if k != "name"}
            def run():
                B32, C32 = _fp32_rows(_bc4(B)), _fp32_rows(_bc4(C))
                launch(u, delta, A, B32, C32, D, z, bias, True, None, y, None, **opts)
            try:
                run(); torch.cuda.synchronize()
                err = ((y.float() - ref32).norm() / ref32.norm()).item()
                t = triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"  {v['name']}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            row[v["name"]] = dict(ms=t, err=err)
            print(f"  {v['name']:<32} {t:.4f} ms  ({t_cur / t:.2f}x current)  err {err:.2e}", flush=True)
    rows.append(row)
    del u, delta, z, B, C
out = os.environ.get("OUT", ".")
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d"), rows=rows), open(os.path.join(out, "state_lanes_probe.json"), "w"), indent=1)
