"""dA / d dt_bias relative errors of ssd_scan (fp32) against float64, Mamba-2 init regime."""
import os, sys, math
sys.path.insert(0, "tests"); sys.path.insert(0, "scratch")
import torch
import prec_patch  # noqa (PREC env)
import test_kernel_ssd_scan as T
from ssmshard.kernels.ssd_scan import ssd_scan
dev = T.DEVICE
res = []
for seed in range(int(os.environ.get("SEEDS", "10"))):
    torch.manual_seed(seed)
    h = 8
    inputs = T.make_inputs(b=2, l=64, h=h, p=16, g=1, n=16, D="h")
    dt0 = torch.exp(torch.rand(h) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inputs["dt_bias"] = (dt0 + torch.log(-torch.expm1(-dt0))).to(dev)
    inputs["dt"] = (torch.randn(2, 64, h) * 0.3).to(dev)
    inputs["A"] = -torch.arange(1, h + 1, dtype=torch.float32).to(dev)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
    leaves64 = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    want_out, want_final = T.sequential_ssd(**leaves64, dt_softplus=True)
    got_out, got_final = ssd_scan(chunk_size=16, **leaves, dt_softplus=True, return_final_states=True)
    go = torch.randn_like(want_out); gf = torch.randn_like(want_final)
    names = list(leaves)
    w = dict(zip(names, torch.autograd.grad((want_out * go).sum() + (want_final * gf).sum(), [leaves64[k] for k in names])))
    g = dict(zip(names, torch.autograd.grad((got_out.double() * go).sum() + (got_final.double() * gf).sum(), [leaves[k] for k in names])))
    r = {k: T.rel_err(g[k], w[k]) for k in ("A", "dt_bias", "dt", "x")}
    r["out"] = T.rel_err(got_out, want_out)
    # per head, relative to that head's own gradient
    r["A_per_head"] = ((g["A"].double() - w["A"]).abs() / w["A"].abs()).max().item()
    res.append(r)
print(os.environ.get("PREC"), dev, {k: f"max {max(r[k] for r in res):.2e} mean {sum(r[k] for r in res)/len(res):.2e}" for k in res[0]}, flush=True)
