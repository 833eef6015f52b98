"""Does programmatic dependent launch shorten a chain of small dependent kernels in a CUDA graph?
Chain: 64 x [norm-like kernel on one row -> batch-1 GEMV reading its output] twice per layer, at
Mamba2-2.7B's in_proj and out_proj shapes, as a decode step runs them; self-contained kernels (not
the product's), each variant checked against the same chain run eagerly.

    python benchmarks/results/pdl/pdl_probe.py          # one Hopper GPU; output: pdl_probe.log
"""
import statistics, sys, torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents
print("triton", triton.__version__, torch.__version__)

@triton.jit
def norm_k(x_ptr, w_ptr, y_ptr, K, eps, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    kk = tl.arange(0, BLOCK); m = kk < K
    x = tl.load(x_ptr + kk, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(w_ptr + kk, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + kk, (x * r * w).to(y_ptr.dtype.element_ty), mask=m)

@triton.jit
def gemv_k(x_ptr, w_ptr, y_ptr, N, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    nn = pid * BLOCK_N + tl.arange(0, BLOCK_N); nm = nn < N
    rows = w_ptr + nn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K); km = kk < K
    w0 = tl.load(rows + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
    if PDL:
        if PREFETCH:
            gdc_launch_dependents()
        gdc_wait()
    x0 = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
    acc += tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K); km = kk < K
        w = tl.load(rows + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + nn, acc.to(y_ptr.dtype.element_ty), mask=nm)

dev = "cuda"; bf = torch.bfloat16
L = 64
def run(pdl, prefetch, n=10576, k=2560, n2=2560, k2=5120):
    g = torch.Generator(dev).manual_seed(0)
    W1 = [torch.randn(n, k, device=dev, dtype=bf, generator=g) for _ in range(L)]
    W2 = [torch.randn(n2, k2, device=dev, dtype=bf, generator=g) for _ in range(L)]
    nw = torch.randn(k, device=dev, dtype=bf); nw2 = torch.randn(k2, device=dev, dtype=bf)
    h = torch.randn(k, device=dev, dtype=bf)
    bufs = [torch.empty(k, device=dev, dtype=bf), torch.empty(n, device=dev, dtype=bf), torch.empty(k2, device=dev, dtype=bf)]
    kw = dict(launch_pdl=True) if pdl else {}
    def step():
        x = h
        for l in range(L):
            norm_k[(1,)](x, nw, bufs[0], k, 1e-5, PDL=pdl, BLOCK=4096, num_warps=8, **kw)
            gemv_k[(triton.cdiv(n, 2),)](bufs[0], W1[l], bufs[1], n, k, PDL=pdl, PREFETCH=prefetch, BLOCK_N=2, BLOCK_K=1024, num_warps=2, **kw)
            norm_k[(1,)](bufs[1], nw2, bufs[2], k2, 1e-5, PDL=pdl, BLOCK=8192, num_warps=16, **kw)
            gemv_k[(triton.cdiv(n2, 2),)](bufs[2], W2[l], bufs[0], n2, k2, PDL=pdl, PREFETCH=prefetch, BLOCK_N=2, BLOCK_K=2048, num_warps=2, **kw)
            x = bufs[0]
        return bufs[0].clone()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(); step()
    torch.cuda.current_stream().wait_stream(s)
    ref = step(); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = step()
    gr.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); gr.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ok = torch.equal(out, ref)
    bytes_ = L * (n * k + n2 * k2) * 2
    t = statistics.median(ts)
    print(f"pdl={pdl} prefetch={prefetch}: {t:.1f} us per {L} layers ({t / L:.2f} us/layer, {bytes_ / t / 1e6:.2f} TB/s), graph == eager {ok}", flush=True)
    return t
for cfg in [(False, False), (True, False), (True, True), (False, False), (True, True)]:
    try:
        run(*cfg)
    except Exception as e:
        print(cfg, "failed:", repr(e)[:300])
