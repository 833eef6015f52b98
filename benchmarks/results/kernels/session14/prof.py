"""Per-launch device times (torch.profiler, median of 5) of one Mamba-1 forward+backward and one no-grad
forward, d=5120 bf16, for the tree whose benchmarks/ is on PYTHONPATH (see ab_scan.py).

    PYTHONPATH=<tree>/benchmarks python benchmarks/results/kernels/session14/prof.py TAG
"""
import json, os, sys
import torch
from bench_selective_scan import D_MODEL, N_STATE, ORDER, make_inputs
import ssmshard
from ssmshard.kernels.selective_scan import selective_scan
tag = sys.argv[1]
device = torch.device("cuda")
for b, l in [(1, 2048), (1, 4096), (1, 8192), (8, 2048)]:
    x = make_inputs(b, D_MODEL, l, N_STATE, device)
    leaves = [x[k].detach().requires_grad_(True) for k in ORDER]
    dy = torch.randn_like(x["u"])
    def step():
        y = selective_scan(*leaves, True)
        torch.autograd.grad(y, leaves, dy)
    def fwd():
        with torch.no_grad():
            selective_scan(*[a.detach() for a in leaves], True)
    for _ in range(3):
        step(); fwd()
    torch.cuda.synchronize()
    for what, fn in (("fwd_bwd", step), ("fwd", fwd)):
      runs = []
      for rep in range(5):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                    key=lambda e: e.time_range.start)
        runs.append([(e.name[:36], e.time_range.elapsed_us()) for e in ev])
      names = [n for n, _ in runs[0]]
      med = [sorted(r[i][1] for r in runs)[2] for i in range(len(names))]
      print(json.dumps(dict(tag=tag, what=what, b=b, l=l, total_us=round(sum(med), 1),
                            launches=[[n, round(m, 1)] for n, m in zip(names, med) if "scan" in n])), flush=True)
