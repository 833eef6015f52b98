import os, sys
sys.path.insert(0, "tests"); sys.path.insert(0, "scratch")
import torch
import test_kernel_ssd_scan as T
from ssmshard.kernels.ssd_scan import ssd_scan
import dt_variants
for variant in dt_variants.VARIANTS:
    dt_variants.use(variant)
    res = []
    for seed in range(20):
        torch.manual_seed(seed)
        for case in ("full", "aligned"):
            spec = T.BATCH_CASES[case]
            inputs = T.make_inputs(**spec["shape"])
            leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
            leaves64 = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
            want_out, want_final = T.sequential_ssd(**leaves64, **spec["options"])
            got_out, got_final = ssd_scan(chunk_size=spec["chunk"], **leaves, **spec["options"], return_final_states=True)
            go = torch.randn_like(want_out); gf = torch.randn_like(want_final)
            names = list(leaves)
            w = dict(zip(names, torch.autograd.grad((want_out * go).sum() + (want_final * gf).sum(), [leaves64[k] for k in names])))
            g = dict(zip(names, torch.autograd.grad((got_out.double() * go).sum() + (got_final.double() * gf).sum(), [leaves[k] for k in names])))
            res.append({k: T.rel_err(g[k], w[k]) for k in ("A", "dt_bias", "dt", "x", "B")})
    print(variant, {k: f"max {max(r[k] for r in res):.2e} mean {sum(r[k] for r in res)/len(res):.2e}" for k in res[0]}, flush=True)
