"""The summed segment pass (segment_end_kernel.py): its end states and decays against a float64
recurrence on the CPU (Triton's interpreter), then its SASS instructions per element beside the
forward kernels' segment pass, compiled offline for sm_90 (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/results/kernels/segment_passes/segment_end_check.py --values
    PYTHONPATH=<triton 3.6 site-packages>:$PWD python benchmarks/results/kernels/segment_passes/segment_end_check.py --sass
"""
import argparse
import contextlib
import io
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from segment_end_kernel import segment_end_kernel  # noqa: E402
from ssmshard.kernels.launch_math import cdiv  # noqa: E402
from ssmshard.kernels.selective_scan import _aligned_rows, _fp32_rows  # noqa: E402


def reference(u, delta, A, B, bias, init, seg_len, num_segments):
    """Each segment's end state from zero (segment 0 from init) and its total decay, (b, G, n, d),
    by the recurrence in float64; the last segment is left at zero, as the launch skips it."""
    b, d, l = u.shape
    n, e = A.shape[1], d // B.shape[1]
    dt = torch.nn.functional.softplus(delta.double() + bias.double()[:, None])
    B_of_channel = B.double()[:, torch.arange(d) // e]  # (b, d, n, l)
    end = torch.zeros(b, num_segments, n, d, dtype=torch.float64)
    decay = torch.zeros_like(end)
    for s in range(num_segments - 1):
        h = init.double().clone() if init is not None and s == 0 else torch.zeros(b, d, n, dtype=torch.float64)
        tokens = range(s * seg_len, (s + 1) * seg_len)
        for t in tokens:
            h = torch.exp(A.double() * dt[:, :, t, None]) * h + (dt[:, :, t] * u.double()[:, :, t])[:, :, None] * \
                B_of_channel[:, :, :, t]
        end[:, s] = h.transpose(1, 2)
        decay[:, s] = torch.exp(A.double() * dt[:, :, tokens].sum(-1)[:, :, None]).transpose(1, 2)
    return end, decay


def check_values():
    torch.manual_seed(0)
    for b, d, l, n, g, segments, with_init, block_d, t in ((2, 8, 200, 16, 1, 4, True, 4, 4),
                                                            (1, 12, 256, 12, 1, 3, False, 8, 4),
                                                            (1, 8, 130, 16, 2, 2, True, 4, 8)):
        u, delta = torch.randn(b, d, l), torch.randn(b, d, l) * 0.5 - 1
        A, B, bias = -torch.exp(torch.randn(d, n) * 0.5), torch.randn(b, g, n, l), torch.randn(d) * 0.1
        init = torch.randn(b, d, n) if with_init else None
        seg_len = cdiv(cdiv(l, segments), 64) * 64
        num_segments = cdiv(l, seg_len)
        ref_end, ref_decay = reference(u, delta, A, B, bias, init, seg_len, num_segments)
        end, decay = (torch.zeros(b, num_segments, n, d) for _ in range(2))
        B32, u_rows, delta_rows = _fp32_rows(B), _aligned_rows(u), _aligned_rows(delta)
        segment_end_kernel[(g * cdiv(d // g, block_d), b, num_segments - 1)](
            u_rows, delta_rows, A, B32, bias, init if init is not None else end, end, decay,
            d, l, d // g, n, seg_len, num_segments, *u_rows.stride(), *delta_rows.stride(), *A.stride(),
            *B32.stride()[:3], *(init.stride() if init is not None else (0, 0, 0)),
            HAS_BIAS=True, SOFTPLUS=True, HAS_INIT=init is not None, BLOCK_D=block_d, T=t, N_PAD=16)
        rel = lambda x, y: ((x.double() - y).norm() / y.norm()).item()  # noqa: E731
        print(f"b={b} d={d} l={l} n={n} g={g} segments={num_segments} init={with_init} T={t}: "
              f"end {rel(end, ref_end):.2e}, decay {rel(decay[:, :-1], ref_decay[:, :-1]):.2e} relative")


def count_sass():
    with contextlib.redirect_stdout(io.StringIO()):  # sass_counts prints its own table on import
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "state_lanes"))
        import sass_counts
    from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel
    segment_pass = dict(HAS_D=False, HAS_Z=False, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False,
                        STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=False, HAS_CARRY=False, RANGED=False,
                        N_PAD=16, ckpt_chunk=64)
    summed = dict(HAS_BIAS=True, SOFTPLUS=True, HAS_INIT=False, N_PAD=16)
    for block_d in (16, 32):
        sass_counts.report(f"scanned (parallel kernel), {block_d} ch, T 4", scan_fwd_parallel_kernel,
                           dict(segment_pass, BLOCK_D=block_d, T=4), 1, block_d * 4 * 16 // 32)
        sass_counts.report(f"summed, {block_d} ch, T 4", segment_end_kernel, dict(summed, BLOCK_D=block_d, T=4), 1,
                           block_d * 4 * 16 // 32)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", action="store_true")
    parser.add_argument("--sass", action="store_true")
    args = parser.parse_args()
    if args.values:
        check_values()
    if args.sass:
        count_sass()
