"""Mamba-1's dt_proj folded into the state update kernel (the ``fuse_dt_proj`` pass) against the two
kernels it replaces (the decode GEMV, or cuBLAS above one row, then the state update), one
Mamba-2.8B layer's shapes: d = 5120 channels, dt rank r = 160, n = 16 states, bf16 activations and
weight, float32 state.

    PYTHONPATH=$PWD python benchmarks/results/decode_profile/dt_proj_fold_experiment.py   # one GPU; writes $OUT/dt_proj_fold.json

Each time is the median of 7 replays of a CUDA graph that runs the step once per copy of the
layer's weight and state (enough copies to defeat L2), divided by the copies, with
programmatic dependent launch as the decode step has it (kernels/pdl.py). The folded kernel is
timed at every batch (``FUSED_DT_MAX_BATCH`` lifted) and over a sweep of tilings, to choose the
default tiling and the batch above which the projection runs first.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from ssmshard.kernels import gemv as gv, state_update as ksu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_gemv import graphed_us  # noqa: E402  (benchmarks/bench_gemv.py)

D, R, N = 5120, 160, 16
COPIES = 64  # 64 x (1.6 MB weight + state): over twice the H200's L2 at batch 1


def layer(batch, device="cuda"):
    """One layer's step inputs (activations shared by the copies) and COPIES (state, weight) pairs."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    shared = dict(x=torch.randn(batch, D, **bf16), low=torch.randn(batch, R, **bf16) * 0.5,
                  A=-torch.exp(torch.randn(D, N, device=device) * 0.5), B=torch.randn(batch, N, **bf16),
                  C=torch.randn(batch, N, **bf16), D=torch.randn(D, device=device), z=torch.randn(batch, D, **bf16),
                  dt_bias=torch.randn(D, device=device))
    copies = [(torch.randn(batch, D, N, device=device), torch.randn(D, R, **bf16) / R ** 0.5) for _ in range(COPIES)]
    return shared, copies


def unfused(a, copy):
    state, weight = copy
    dt = gv.decode_linear(a["low"][:, None, :], weight)[:, 0]  # as the decode graph runs it
    return ksu.selective_state_update(state, a["x"], dt, a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True,
                                      out_state=state)


def fused(config):
    def step(a, copy):
        state, weight = copy
        return ksu.selective_state_update(state, a["x"], a["low"], a["A"], a["B"], a["C"], a["D"], a["z"],
                                          a["dt_bias"], True, dt_proj_weight=weight, out_state=state, config=config)
    return step


def main():
    out_dir = os.environ.get("OUT", ".")
    ksu.FUSED_DT_MAX_BATCH = 1 << 30  # the folded kernel at every batch
    rows = []
    for batch in (1, 2, 4, 8, 16, 64):
        a, copies = layer(batch)
        # The same outputs: dt rounded to bf16 either way; only the projection's summation order differs.
        ref_out, _ = unfused(a, (copies[0][0].clone(), copies[0][1]))
        got_out, _ = fused(None)(a, (copies[0][0].clone(), copies[0][1]))
        err = ((got_out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        row = dict(batch=batch, unfused_us=graphed_us(unfused, copies, a), rel_err_vs_unfused=err,
                   default=ksu.default_config(D, N, batch), fused={})
        row["fused_default_us"] = graphed_us(fused(None), copies, a)
        for block_p, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4)):
            key = f"BLOCK_P={block_p},num_warps={warps}"
            row["fused"][key] = graphed_us(fused(dict(BLOCK_P=block_p, num_warps=warps)), copies, a)
        best = min(row["fused"], key=row["fused"].get)
        print(f"batch {batch:3d}: unfused {row['unfused_us']:7.2f} us, fused default {row['fused_default_us']:7.2f} us, "
              f"best {best} {row['fused'][best]:7.2f} us, rel err {err:.2e}", flush=True)
        rows.append(row)
    device = torch.cuda.get_device_name()
    with open(os.path.join(out_dir, "dt_proj_fold.json"), "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, shapes=dict(d=D, r=R, n=N), copies=COPIES,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
