"""A/B of the SSD backward's log-decay gradient (thirteenth session): the identity form
(dcs = C.dC - dt ddt_direct + [t = L] <dS_out, S_out>, suffix sums) against the stable
pairwise form (ssd_pair_da_kernel), on one GPU.

    PYTHONPATH=. python benchmarks/results/kernels/session13/ab_ssd_da.py OLD_BWD_MODULE_FILE

1. Precision: fp32 dA (and ddt) against float64 (torch.ops.ssmshard.ssd_scan in float64, on
   the same values), Mamba-2's regime (A in -[1, 16], dt in [1e-3, 0.1]), 10 seeds; errors in
   units of max |dA| (of |ddt|) over heads; the fp32 torch reference op beside them.
2. Speed: bf16 forward+backward at the Mamba2-2.7B mixer (80 heads x 64, N=128, chunk 256),
   B=8 L=2048 and B=1 L=16384: eager and CUDA-graph medians, and the backward kernels'
   device time (torch.profiler), both forms in the same process.
"""
import importlib.util
import json
import os
import sys

import torch
import triton

sys.path[:0] = [".", "benchmarks"]
import ssmshard.kernels.ssd_scan as ssd  # noqa: E402
from bench_selective_scan import graph_time  # noqa: E402
from bench_ssd_scan import make_inputs  # noqa: E402
from profiling import profile_kernels  # noqa: E402
from ssmshard import ops  # noqa: E402,F401

spec = importlib.util.spec_from_file_location("ssd_scan_bwd_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
FORMS = {"identity": old.ssd_backward, "stable": ssd.ssd_backward}
NAMES = ("x", "dt", "A", "B", "C")


def precision(seeds=10, b=1, l=1024, h=8, p=64, n=128, chunk=256):
    rows = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        inp = make_inputs(b, l, False, "cuda", dtype=torch.float32)
        inp = {k: (v[..., :h] if k in ("dt", "A", "D", "dt_bias") else v[..., :h, :] if k == "x" else v)
               for k, v in inp.items() if v is not None}
        grads = {}
        for name in ("f64", "torch32", *FORMS):
            cast = (lambda t: t.double()) if name == "f64" else (lambda t: t.float())
            leaves = [cast(inp[k]).detach().requires_grad_(True) for k in NAMES]
            D, bias = cast(inp["D"]), cast(inp["dt_bias"])
            if name in FORMS:
                ssd.ssd_backward = FORMS[name]
                fn = ssd.ssd_scan_like_op
            else:
                fn = torch.ops.ssmshard.ssd_scan
            y, _ = fn(*leaves, chunk, D, bias, None, True, 0.0, float("inf"))
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.device)
            dA, ddt = torch.autograd.grad((y.double() * w).sum(), [leaves[2], leaves[1]])
            grads[name] = (dA.double(), ddt.double())
        want = grads.pop("f64")
        rows.append({name: {"dA": ((g[0] - want[0]).abs().max() / want[0].abs().max()).item(),
                            "ddt": ((g[1] - want[1]).abs().max() / want[1].abs().max()).item()}
                     for name, g in grads.items()})
        print(f"seed {seed}: " + "  ".join(f"{k} dA {v['dA']:.1e} ddt {v['ddt']:.1e}" for k, v in rows[-1].items()),
              flush=True)
    return rows


def speed():
    rows = []
    for b, l in ((8, 2048), (1, 16384)):
        torch.manual_seed(0)
        inp = make_inputs(b, l, False, "cuda")
        leaves = [inp[k].detach().requires_grad_(True) for k in NAMES]
        dy = torch.randn(b, l, inp["x"].shape[2], inp["x"].shape[3], device="cuda", dtype=torch.bfloat16)
        for name, bwd in FORMS.items():
            ssd.ssd_backward = bwd

            def step():
                out = ssd.ssd_scan(*leaves, 256, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
                torch.autograd.grad(out, leaves, dy)

            step()
            eager = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
            graph = graph_time(step)
            kernels = profile_kernels(step)
            rows.append({"b": b, "l": l, "form": name, "fwd_bwd_eager_ms": eager, "fwd_bwd_graph_ms": graph,
                         "device_ms": sum(k["ms_per_call"] for k in kernels),
                         "kernels": [{k2: k[k2] for k2 in ("kernel", "ms_per_call")} for k in kernels[:10]]})
            top = ", ".join(f"{k['kernel'][:28]} {k['ms_per_call']:.3f}" for k in kernels[:6])
            print(f"B={b} L={l} {name}: fwd+bwd eager {eager:.3f} ms, graph {graph} ms, device {rows[-1]['device_ms']:.3f} ms; {top}",
                  flush=True)
    return rows


if __name__ == "__main__":
    result = {"device": torch.cuda.get_device_name(), "precision": precision(), "speed": speed()}
    with open(os.path.join(os.environ.get("OUT", "."), "ab_ssd_da.json"), "w") as fh:
        json.dump(result, fh, indent=2)
