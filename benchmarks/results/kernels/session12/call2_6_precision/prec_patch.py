"""Precision patches for a diagnosis run (GPU): PREC=log1p (accurate log1p in the SSD softplus),
exp (tl.exp with the rounding of x*log2e kept), both."""
import os
import triton
import triton.language as tl
import ssmshard.kernels.ssd_triton_common as common

@triton.jit
def softplus_log1p(v):
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    # log1p(u) = log(w) - (w - 1 - u) / w: the rounding of 1 + u taken back
    return tl.maximum(v, 0.0) + tl.log(w) - ((w - 1.0) - u) / w

_exp2 = tl.exp2
@triton.jit
def exp_split(x):
    p = x * 1.4426950216293335
    err = tl.fma(x, 1.4426950216293335, -p) + x * 1.9259629911e-08
    err = tl.where(tl.abs(x) < 1e30, err, 0.0)  # -inf (masked decays) stays exp2(-inf) = 0
    return tl.exp2(p) * (1.0 + err * 0.6931471805599453)

prec = os.environ.get("PREC", "base")
if prec in ("log1p", "both"):
    common.softplus = softplus_log1p
if prec in ("exp", "both"):
    tl.exp = exp_split
print("PREC", prec, flush=True)
