"""Batch-1 Mamba-1 forward+backward when the forward and the backward split the row differently
(ScanConfig.bwd_segments): the default, and narrow one-pass-ish forwards (B and C read a tile ahead)
under the default's backward split. CUDA-graph and eager medians, one JSON line per config.

    PYTHONPATH=benchmarks python benchmarks/results/kernels/session15/fwd_bwd_split.py [L ...]
"""
import json
import sys

import torch

from bench_selective_scan import D_MODEL, N_STATE, ORDER, make_inputs, rel_err
from ssmshard.kernels.selective_scan import ScanConfig, _segments, default_config, selective_scan
from sweep_scan_split import fwd_bwd_times

device = torch.device("cuda")
for l in [int(a) for a in sys.argv[1:]] or [2048, 4096, 8192, 16384]:
    x = make_inputs(1, D_MODEL, l, N_STATE, device)
    inputs = [x[k] for k in ORDER]
    base = default_config(1, D_MODEL, l, device)
    g_bwd = _segments(l, base)[0]
    configs = [("default", base)]
    for block_d, fwd_segments in [(8, 1), (8, 2), (8, 4), (16, 4)]:
        configs.append((f"fwd bd{block_d} B/C ahead G={fwd_segments}, bwd G={g_bwd}",
                        ScanConfig(**{**base.__dict__, "par_block_d": block_d, "par_prefetch_bc": True,
                                      "segments": fwd_segments, "bwd_segments": g_bwd})))
    leaves = [a.detach().requires_grad_(True) for a in inputs]
    dy = torch.randn_like(inputs[0])
    want = torch.autograd.grad(selective_scan(*leaves, True, config=base), leaves, dy)
    for label, cfg in configs:
        got = torch.autograd.grad(selective_scan(*leaves, True, config=cfg), leaves, dy)
        diff = max(rel_err(a.float(), b.float()) for a, b in zip(got, want))
        print(json.dumps(dict(l=l, config=label, grad_max_rel_diff=diff, **fwd_bwd_times(inputs, cfg))), flush=True)
