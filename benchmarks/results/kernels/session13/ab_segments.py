"""A/B of the Mamba-1 scan's segment count at batch 1 (thirteenth session, call 5): eager and
CUDA-graph medians of forward and forward+backward, interleaved over rounds, and the summed
device time of one forward+backward's kernels (torch.profiler).

    PYTHONPATH=.:<peers> python benchmarks/results/kernels/session13/ab_segments.py
"""
import json
import os
import sys

import torch
import triton

sys.path[:0] = [".", "benchmarks"]
from bench_selective_scan import D_MODEL, N_STATE, ORDER, graph_time, make_inputs  # noqa: E402
from profiling import profile_kernels  # noqa: E402
from ssmshard.kernels.selective_scan import ScanConfig, _segments, default_config, selective_scan  # noqa: E402

CASES = {2048: (8, 16), 4096: (16, 27)}  # nominal segment counts: the old rule's, the new one's
ROUNDS = 5


def main():
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "rounds": ROUNDS, "rows": []}
    for l, counts in CASES.items():
        x = make_inputs(1, D_MODEL, l, N_STATE, device)
        inputs = [x[k] for k in ORDER]
        leaves = [a.detach().requires_grad_(True) for a in inputs]
        dy = torch.randn_like(inputs[0])
        base = default_config(1, D_MODEL, l, device)
        fns = {}
        for nominal in counts:
            cfg = ScanConfig(**{**base.__dict__, "segments": nominal})

            def fwd(cfg=cfg):
                with torch.no_grad():
                    selective_scan(*inputs, True, config=cfg)

            def step(cfg=cfg):
                torch.autograd.grad(selective_scan(*leaves, True, config=cfg), leaves, dy)

            fns[_segments(l, cfg)[0]] = (fwd, step)
        times = {g: {"fwd_eager": [], "fwd_bwd_eager": [], "fwd_graph": [], "fwd_bwd_graph": []} for g in fns}
        for _ in range(ROUNDS):
            for g, (fwd, step) in fns.items():
                bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
                times[g]["fwd_eager"].append(bench(fwd))
                times[g]["fwd_bwd_eager"].append(bench(step))
                times[g]["fwd_graph"].append(graph_time(fwd))
                times[g]["fwd_bwd_graph"].append(graph_time(step))
        for g, (fwd, step) in fns.items():
            kernels = profile_kernels(step)
            row = {"l": l, "segments": g, **{k: sorted(v) for k, v in times[g].items()},
                   "fwd_bwd_device_ms": sum(k["ms"] for k in kernels) / 5, "kernels": kernels[:8]}
            out["rows"].append(row)
            med = {k: sorted(v)[ROUNDS // 2] for k, v in times[g].items()}
            print(f"L={l} G={g}: median of {ROUNDS} rounds " + ", ".join(f"{k} {v:.4f}" for k, v in med.items())
                  + f"; fwd+bwd device time {row['fwd_bwd_device_ms']:.4f} ms", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "ab_segments.json"), "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
