"""Host cost of the pieces of a scan call, each timed alone (sixteenth session): a Triton
launch of a 3-argument kernel, our forward kernels' launch path (_launch_forward, one segment
and 16 segments), and the torch ops the wrapper issues (empty, copy_, sum, to). Microseconds
per call, median of 5 rounds of 500 calls, tiny tensors (the GPU never sets the pace).

    PYTHONPATH=benchmarks python benchmarks/results/kernels/session16/host_parts.py
"""
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from bench_selective_scan import N_STATE, ORDER, make_inputs
from ssmshard.kernels import selective_scan as ss


@triton.jit
def _nop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def per_call_us(fn, calls=500, rounds=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


dev = torch.device("cuda")
x = make_inputs(1, 256, 128, N_STATE, dev)
u, delta, A, B, C, D, z, bias = (x[k] for k in ORDER)
small = torch.zeros(64, device=dev)
bf = torch.zeros(1, 16, 128, device=dev, dtype=torch.bfloat16)
f32 = torch.zeros(1, 16, 128, device=dev)
parts = {
    "triton nop kernel (3 args)": lambda: _nop[(1,)](small, 64, BLOCK=64),
    "torch.empty": lambda: torch.empty(1, 16, 128, device=dev),
    "torch.empty + slice (_row_buffer)": lambda: ss._row_buffer((1, 16), 128, device=dev, dtype=torch.float32),
    "copy_ bf16 -> fp32": lambda: f32.copy_(bf),
    "sum(0)": lambda: f32.sum(0),
    "A.float() (already fp32)": lambda: A.float(),
    "default_config": lambda: ss.default_config(1, 256, 128, dev),
    "_check_scan_args": lambda: ss._check_scan_args(u, delta, A, B, C, D, z, bias, None, None),
}
for segments in (1, 16):
    cfg = ss.ScanConfig(**{**ss.default_config(1, 256, 2048, dev).__dict__, "segments": segments})
    xl = make_inputs(1, 256, 2048, N_STATE, dev)
    ul, dl, Al, Bl, Cl, Dl, zl, bl = (xl[k] for k in ORDER)
    B32, C32 = ss._fp32_rows(ss._bc4(Bl)), ss._fp32_rows(ss._bc4(Cl))
    y = torch.empty_like(ul)
    parts[f"_launch_forward, {segments} segment(s), no grad"] = (
        lambda cfg=cfg, ul=ul, dl=dl, Al=Al, B32=B32, C32=C32, Dl=Dl, zl=zl, bl=bl, y=y:
        ss._launch_forward(ul, dl, Al, B32, C32, Dl, zl, bl, True, None, None, None, None, y, cfg))
    parts[f"selective_scan no grad, {segments} segment(s)"] = (
        lambda cfg=cfg, args=(ul, dl, Al, Bl, Cl, Dl, zl, bl): ss.selective_scan(*args, True, config=cfg))
    leaves = [t.detach().requires_grad_(True) for t in (ul, dl, Al, Bl, Cl, Dl, zl, bl)]
    dy = torch.randn_like(ul)
    parts[f"selective_scan fwd+bwd, {segments} segment(s)"] = (
        lambda cfg=cfg, leaves=leaves, dy=dy:
        torch.autograd.grad(ss.selective_scan(*leaves, True, config=cfg), leaves, dy))
print(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}))
for name, fn in parts.items():
    print(json.dumps({"part": name, "host_us": round(per_call_us(fn), 2)}), flush=True)
