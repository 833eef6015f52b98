"""Host time of the Mamba-1 scan against the GPU's, beside mamba-ssm (sixteenth session).

    PYTHONPATH=benchmarks:/tmp/peers python benchmarks/results/kernels/session16/host_overhead.py

For each shape: eager medians (do_bench) and CUDA-graph medians of the forward and of
forward+backward, ours and the peer's; then the host's own time per call (a tiny shape whose
GPU work is a few us, 200 calls queued, one sync) and a torch.profiler table of one
forward+backward at B=1 L=2048 (CPU time per op, CUDA launches per call). JSON lines on stdout.
"""
import json
import os
import time

import torch
import triton

from bench_selective_scan import D_MODEL, N_STATE, ORDER, graph_time, make_inputs, mamba_ssm_scan
import ssmshard.kernels.selective_scan as scan_module
from ssmshard.kernels.selective_scan import selective_scan

device = torch.device("cuda")
peer = mamba_ssm_scan()


def steps(fn, x):
    args = [x[k] for k in ORDER]
    leaves = [a.detach().requires_grad_(True) for a in args]
    dy = torch.randn_like(args[0])

    def fwd():
        with torch.no_grad():
            fn(*args, delta_softplus=True)

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves, delta_softplus=True), leaves, dy)

    return fwd, fwd_bwd


def host_us(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


print(json.dumps({"tree": scan_module.__file__, "device": torch.cuda.get_device_name()}), flush=True)
impls = {"ours": selective_scan, **({"peer": peer} if peer else {})}
for b, d, l in [(1, D_MODEL, 2048), (1, D_MODEL, 4096), (8, D_MODEL, 2048), (1, 256, 128)]:
    x = make_inputs(b, d, l, N_STATE, device)
    row = {"b": b, "d": d, "l": l}
    for name, fn in impls.items():
        fwd, fwd_bwd = steps(fn, x)
        for what, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{name}_{what}_eager_ms"] = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            row[f"{name}_{what}_graph_ms"] = graph_time(f)
            row[f"{name}_{what}_host_us"] = host_us(f)
    print(json.dumps(row), flush=True)

# Where the host time goes: one forward+backward at B=1 L=2048 under the profiler.
x = make_inputs(1, D_MODEL, 2048, N_STATE, device)
for name, fn in impls.items():
    _, fwd_bwd = steps(fn, x)
    for _ in range(5):
        fwd_bwd()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fwd_bwd()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(os.path.join(os.environ.get("OUT", "."), f"profile_{name}.txt"), "w") as fh:
        fh.write(table)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(json.dumps({"profile": name, "cuda_kernels_per_call": len(kernels) / 10,
                      "kernels": sorted({e.name[:60] for e in kernels})}), flush=True)
