"""GPU repro: NaN gradients with bf16 inputs in Zamba2's mixer layout (g == h = 8, n = 32).

Runs Zamba2's mixer chain (in_proj slice -> causal conv + silu -> SSD scan) at the zamba2
benchmark sizes with each combination of {Triton, reference} conv and {Triton, reference}
SSD, bf16 activations and fp32 parameters as autocast hands them over, and prints for each
which gradients are non-finite (the op boundary tensors first, then the parameters), and
the error against the fp32 reference chain. About 60 s on an H200 (autotuning included).

Usage: python scratch/ssd_bf16_nan_repro.py [ngroups=G] [dstate=N] [batch=B]
Force one config of every tuned SSD kernel with SSMSHARD_SSD_AUTOTUNE=0 SSMSHARD_SSD_CONFIG=i.
Before the MIN_SPLIT_BLOCK_N fix (ssd_scan_bwd.py) this printed, on an H200 with Triton 3.6:
bf16 with the Triton SSD (either conv): non-finite conv_out, dt, C, proj, conv_w, conv_b,
dt_bias, A_log; bf16 with the Triton conv and reference SSD, and every fp32 run: finite;
with ngroups=1 the dC kernel's autotuning hit an illegal memory access.
"""
import math, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn.functional as F
from ssmshard.kernels import reference as ref
from ssmshard.kernels.ssd_scan import ssd_scan
from ssmshard.kernels.causal_conv1d import causal_conv1d

dev = "cuda"
b, l, h, p, g, n, T, k = 16, 512, 8, 64, 8, 32, 256, 4
if len(sys.argv) > 1:  # e.g. "ngroups=1" / "dstate=64" variations
    for kv in sys.argv[1:]:
        key, val = kv.split("=")
        if key == "ngroups": g = int(val)
        if key == "dstate": n = int(val)
        if key == "batch": b = int(val)
d = h * p
conv_dim = d + 2 * g * n
torch.manual_seed(0)


def params():
    proj = (torch.randn(b, l, d + conv_dim + h, device=dev) * 0.5)
    w = torch.randn(conv_dim, k, device=dev) * 0.5
    bias = torch.randn(conv_dim, device=dev) * 0.1
    dt0 = torch.exp(torch.rand(h, device=dev) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    A_log = torch.log(torch.arange(1, h + 1, device=dev, dtype=torch.float32))
    D = torch.ones(h, device=dev)
    return dict(proj=proj, conv_w=w, conv_b=bias, dt_bias=dt_bias, A_log=A_log, D=D)


BASE = params()
GOUT = torch.randn(b, l, h, p, device=dev)


def chain(conv_impl, ssd_impl, act_dtype):
    leaves = {name: t.detach().clone().requires_grad_() for name, t in BASE.items()}
    proj = leaves["proj"].to(act_dtype)
    xbc_in, dt = proj[..., d:d + conv_dim], proj[..., d + conv_dim:]
    conv = causal_conv1d if conv_impl == "triton" else ref.causal_conv1d
    xbc = conv(xbc_in.transpose(1, 2), leaves["conv_w"], leaves["conv_b"], activation="silu").transpose(1, 2)
    x, B, C = torch.split(xbc, [d, g * n, g * n], dim=-1)
    x, B, C = x.view(b, l, h, p), B.view(b, l, g, n), C.view(b, l, g, n)
    A = -torch.exp(leaves["A_log"].float())
    bound = {}
    for name, t in (("conv_out", xbc), ("x", x), ("dt", dt), ("B", B), ("C", C)):
        t.retain_grad(); bound[name] = t
    if ssd_impl == "triton":
        out = ssd_scan(x, dt, A, B, C, T, D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True,
                       dt_limit=(0.001, math.inf), out_dtype=torch.float32)
    else:
        out, _ = ref.ssd_scan(x, dt, A, B, C, T, D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True,
                              dt_min=0.001, dt_max=math.inf)
    (out.float() * GOUT).sum().backward()
    grads = {name: t.grad for name, t in bound.items()}
    grads.update({name: t.grad for name, t in leaves.items()})
    return out.detach().float(), grads


def report(tag, out, grads, ref_out, ref_grads):
    bad = [name for name, gr in grads.items() if gr is None or not torch.isfinite(gr).all()]
    errs = " ".join(f"{name}={((gr.float() - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item():.1e}"
                    for name, gr in grads.items() if name not in bad)
    print(f"{tag:28s} out finite={bool(torch.isfinite(out).all())} "
          f"out err={((out - ref_out).abs().max() / ref_out.abs().max()).item():.1e}")
    print(f"    NON-FINITE grads: {bad or 'none'}")
    print(f"    rel err vs fp32 reference: {errs}")


t0 = time.time()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; b={b} l={l} h={h} p={p} g={g} n={n} chunk={T}")
ref_out, ref_grads = chain("reference", "reference", torch.float32)
for act in (torch.bfloat16, torch.float32):
    for conv_impl, ssd_impl in (("triton", "triton"), ("reference", "triton"), ("triton", "reference")):
        out, grads = chain(conv_impl, ssd_impl, act)
        torch.cuda.synchronize()
        report(f"{str(act)[6:]} conv={conv_impl} ssd={ssd_impl}", out, grads, ref_out, ref_grads)
print(f"done in {time.time() - t0:.1f}s")
