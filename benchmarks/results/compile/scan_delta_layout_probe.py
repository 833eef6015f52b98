"""Does the Mamba-1 scan kernel read a channel-contiguous delta as fast as a token-contiguous
one? Eager Mamba-1 makes delta token-contiguous with a copy (``eager_copies_probe.py``); the
copy could go if the kernel takes delta in the layout its matmul produces. One GPU, the
Mamba-2.8B mixer (d=5120, N=16, dt rank 160), batch 8 x 2048, bf16 inputs laid out as in the
eager program (u and z channel-contiguous views), float32 output; also u and z
token-contiguous, and the copy as Inductor generates it. Median ms of
``triton.testing.do_bench``; the two outputs compared.

    PYTHONPATH=$PWD python benchmarks/results/compile/scan_delta_layout_probe.py
"""
import torch
from triton.testing import do_bench

from ssmshard.kernels.selective_scan import selective_scan

B, D, L, N = 8, 5120, 2048, 16


def main():
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    xz = torch.randn(B, L, 2 * D, device=dev, dtype=bf16).transpose(1, 2)   # in_proj's output
    u, z = xz[:, :D], xz[:, D:]
    bc = torch.randn(B, L, 2 * N, device=dev, dtype=bf16).transpose(1, 2)   # x_proj's B and C
    Bm, Cm = bc[:, :N], bc[:, N:]
    A = -torch.rand(D, N, device=dev).exp()
    Dskip = torch.randn(D, device=dev)
    bias = torch.randn(D, device=dev) * 0.1
    delta_channels = (torch.randn(B, L, D, device=dev, dtype=bf16) * 0.5).transpose(1, 2)
    delta_tokens = delta_channels.contiguous()

    def scan(delta, u=u, z=z):
        return selective_scan(u, delta, A, Bm, Cm, Dskip, z, bias, True, out_dtype=torch.float32)

    u_tokens, z_tokens = u.contiguous(), z.contiguous()
    compiled_copy = torch.compile(lambda t: t.contiguous())

    y_tokens, y_channels = scan(delta_tokens), scan(delta_channels)
    err = ((y_tokens - y_channels).abs().max() / y_tokens.abs().max()).item()
    # The two projections around the scan through aten matmul / linear and as explicit batched
    # GEMMs that read the transposed operand in place (cuBLAS takes either major order). The
    # weights here do not require grad, so aten takes the batched path too (no copy); with a
    # weight that requires grad it copies the operand first (eager_copies_probe.py).
    time_step = torch.randn(B, L, 2 * N + 160, device=dev, dtype=bf16)[..., :160]
    dt_weight = torch.randn(D, 160, device=dev, dtype=bf16) * 0.05
    out_weight = torch.randn(2560, D, device=dev, dtype=bf16) * 0.01
    y_bf16 = y_tokens.transpose(1, 2).to(bf16)  # (b, l, d), tokens contiguous, as cast in the program

    def dt_matmul():
        return torch.matmul(dt_weight, time_step.transpose(1, 2))

    def dt_bmm():
        return torch.bmm(dt_weight.expand(B, D, 160), time_step.transpose(1, 2))

    def out_linear():
        return torch.nn.functional.linear(y_bf16, out_weight)

    def out_bmm():
        return torch.bmm(y_bf16, out_weight.t().expand(B, D, 2560))

    for a, b in ((dt_matmul, dt_bmm), (out_linear, out_bmm)):
        x, w = a(), b()
        print(f"{a.__name__} vs {b.__name__}: strides {x.stride()} / {w.stride()}, "
              f"max rel diff {((x.float() - w.float()).abs().max() / x.float().abs().max()).item():.2e}")

    rows = {
        "dt projection, aten matmul": do_bench(dt_matmul, return_mode="median"),
        "dt projection, bmm over the expanded weight": do_bench(dt_bmm, return_mode="median"),
        "out_proj, aten linear on the transposed y": do_bench(out_linear, return_mode="median"),
        "out_proj, bmm on the transposed y": do_bench(out_bmm, return_mode="median"),
        "copy delta to token-contiguous": do_bench(lambda: delta_channels.contiguous(), return_mode="median"),
        "scan, delta token-contiguous": do_bench(lambda: scan(delta_tokens), return_mode="median"),
        "scan, delta channel-contiguous": do_bench(lambda: scan(delta_channels), return_mode="median"),
        "scan, u, z and delta token-contiguous": do_bench(
            lambda: scan(delta_tokens, u_tokens, z_tokens), return_mode="median"),
        "copy delta to token-contiguous, Inductor's kernel": do_bench(
            lambda: compiled_copy(delta_channels), return_mode="median"),
        "copy y (float32 -> bf16, token- to channel-contiguous)": do_bench(
            lambda: y_tokens.transpose(1, 2).to(bf16).contiguous(), return_mode="median"),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} D={D} L={L} N={N}")
    for name, ms in rows.items():
        print(f"{name:58s} {ms:.3f} ms")
    print(f"max |y difference| / max |y| between the two layouts: {err:.2e}")


if __name__ == "__main__":
    main()
