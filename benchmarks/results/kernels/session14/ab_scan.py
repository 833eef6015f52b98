"""A/B of the Mamba-1 scan between two trees (PYTHONPATH picks the tree): CUDA-graph medians of
forward and forward+backward at the benchmark shapes, and mamba-ssm's beside them (--peer).

    PYTHONPATH=<tree>/benchmarks:<peers> python benchmarks/results/kernels/session14/ab_scan.py TAG [--peer]

<tree>/benchmarks must hold bench_selective_scan.py: it puts its own tree first on sys.path, so the
ssmshard imported is that tree's (each run prints which).
"""
import json
import sys

import torch

import os
from bench_selective_scan import D_MODEL, N_STATE, ORDER, graph_time, log_uniform_lengths, make_inputs, mamba_ssm_scan, theirs
from ssmshard.kernels.selective_scan import selective_scan

tag, peer = sys.argv[1], "--peer" in sys.argv
import ssmshard
print(json.dumps(dict(tag=tag, tree=os.path.dirname(ssmshard.__file__))), flush=True)
device = torch.device("cuda")
cases = [(8, 2048, None), (1, 2048, None), (1, 4096, None), (1, 8192, None), (1, 16384, None), (1, 16384, "packed")]
peer_fn = mamba_ssm_scan() if peer else None
for b, l, kind in cases:
    x = make_inputs(b, D_MODEL, l, N_STATE, device)
    cu = None
    if kind == "packed":
        lengths = log_uniform_lengths(l, 64, 4096)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    args = [x[k] for k in ORDER]
    leaves = [a.detach().requires_grad_(True) for a in args]
    dy = torch.randn_like(x["u"])

    def fwd():
        with torch.no_grad():
            selective_scan(*args, True, cu_seqlens=cu)

    def fwd_bwd():
        y = selective_scan(*leaves, True, cu_seqlens=cu)
        torch.autograd.grad(y, leaves, dy)

    row = dict(tag=tag, b=b, l=l, kind=kind or "", fwd=graph_time(fwd), fwd_bwd=graph_time(fwd_bwd))
    if peer_fn is not None and cu is None:
        p_fwd, p_fwd_bwd = theirs(x, peer_fn)
        row.update(peer_fwd=graph_time(p_fwd), peer_fwd_bwd=graph_time(p_fwd_bwd))
    print(json.dumps(row), flush=True)
