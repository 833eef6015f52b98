"""Where the Mamba-1 scan's host time goes: cProfile of 100 forward+backward calls at a tiny
shape (B=1 d=256 L=128: the GPU work is a few us, so the host sets the pace).

    PYTHONPATH=benchmarks python benchmarks/results/kernels/session16/host_cprofile.py > host_cprofile.txt
"""
import cProfile
import io
import pstats

import torch

from bench_selective_scan import N_STATE, ORDER, make_inputs
from ssmshard.kernels.selective_scan import selective_scan

x = make_inputs(1, 256, 128, N_STATE, torch.device("cuda"))
leaves = [x[k].detach().requires_grad_(True) for k in ORDER]
dy = torch.randn_like(leaves[0])


def fwd_bwd():
    torch.autograd.grad(selective_scan(*leaves, True), leaves, dy)


for _ in range(10):
    fwd_bwd()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    fwd_bwd()
torch.cuda.synchronize()
prof.disable()
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    print(out.getvalue())
