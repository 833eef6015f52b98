"""The Mamba-1 conv and scan kernels on the tensors a training step hands them, against the
same values in the layouts the kernel benchmarks use.

    python benchmarks/bench_train_layouts.py --out DIR      # one GPU

Why: in a Mamba-1.4B-sized training step (``profile_train_step.py``) the kernels ran several
times slower than in ``bench_selective_scan.py`` on the same number of tokens. A training step
feeds them strided views: x and z are channels-contiguous slices of in_proj's (b, l, 2d)
output, B and C slices of x_proj's (b, l, r + 2n) output, dy the transpose of out_proj's input
gradient; delta (dt_proj's matmul) is tokens-contiguous. Shapes: d = 4096, n = 16, conv width
4, bf16, one packed row of the training benchmark's length mix (seed 0), and one unpacked row
of the same length. Every variant is checked against the first before it is timed.

Dimension letters: b batch (1), d channels, l tokens, n state size, r dt rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ssmshard.kernels import causal_conv1d as conv_module  # noqa: E402
from ssmshard.kernels.causal_conv1d import causal_conv1d  # noqa: E402
from ssmshard.kernels.selective_scan import selective_scan  # noqa: E402
from ssmshard.testing import rel_err  # noqa: E402

D, N, R, WIDTH = 4096, 16, 128, 4


def packed_row(pack_len: int, seed: int) -> list[int]:
    """The first packed row of ``train_packed.py``'s step: its sequence lengths."""
    import train_packed

    lengths = train_packed.draw_lengths(32768, 64, 4096, seed)
    rows = train_packed._fill_in_order(lengths, lambda row, length: sum(row) + length <= pack_len)
    return rows[0]


def training_tensors(l: int, device, seed: int, d: int = D, r: int = R) -> dict:
    """Views laid out as a Mamba-1 layer's forward makes them (see the module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    f32 = dict(device=device, dtype=torch.float32)
    xz = torch.randn(1, l, 2 * d, generator=gen, **bf16)  # in_proj output
    proj = torch.randn(1, l, r + 2 * N, generator=gen, **bf16)  # x_proj output
    return {
        "x": xz[..., :d].transpose(1, 2), "z": xz[..., d:].transpose(1, 2),
        "B": proj[..., r:r + N].transpose(1, 2), "C": proj[..., r + N:].transpose(1, 2),
        "delta": (torch.randn(1, d, l, generator=gen, **bf16) * 0.5 - 2.0),  # dt_proj's matmul: (b, d, l)
        "A": -torch.rand(d, N, generator=gen, **f32) * 4.0 - 0.5,
        "D": torch.randn(d, generator=gen, **f32), "delta_bias": torch.randn(d, generator=gen, **f32) * 0.1,
        "weight": torch.randn(d, WIDTH, generator=gen, **bf16) * 0.5, "bias": torch.randn(d, generator=gen, **bf16),
        "dy": torch.randn(1, l, d, generator=gen, **f32).transpose(1, 2),  # out_proj's input gradient
        "dconv": torch.randn(1, d, l, generator=gen, **bf16),  # the scan's du: (b, d, l) contiguous
    }


def contiguous(t: dict) -> dict:
    return {k: v.contiguous() for k, v in t.items()}


def median_ms(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")  # --smoke: the CPU interpreter's times mean nothing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def scan_case(t: dict, cu, copy_in: bool):
    """(forward, forward+backward, outputs) of the scan as the kernel-swap pass calls it."""
    leaves = {k: t[k].detach().requires_grad_() if k in ("x", "delta", "z", "B", "C") else t[k]
              for k in t}

    def inputs():
        u, z, dy = leaves["x"], leaves["z"], t["dy"]
        if copy_in:
            u, z, dy = u.contiguous(), z.contiguous(), dy.contiguous()
        return u, z, dy

    def fwd():
        u, z, _ = inputs()
        return selective_scan(u, leaves["delta"], t["A"], leaves["B"], leaves["C"], t["D"], z, t["delta_bias"], True,
                              cu_seqlens=cu, return_final_state=True, out_dtype=torch.float32)

    def fwd_bwd():
        y, _ = fwd()
        _, _, dy = inputs()
        y.backward(dy)

    def outputs():
        for leaf in leaves.values():
            leaf.grad = None
        y, final = fwd()
        _, _, dy = inputs()
        y.backward(dy)
        # Copies: timing runs backward again and accumulates into the same .grad tensors.
        return [t.detach().clone() for t in [y, final] + [leaves[k].grad for k in ("x", "delta", "z", "B", "C")]]

    return fwd, fwd_bwd, outputs


def conv_case(t: dict, cu, matched: bool):
    x = t["x"].detach().requires_grad_()
    weight = t["weight"].detach().requires_grad_()
    bias = t["bias"].detach().requires_grad_()

    def fwd_bwd():
        real = conv_module._in_tile_layout
        if not matched:
            conv_module._in_tile_layout = lambda tensor, config: tensor  # the layout as handed in
        try:
            out = causal_conv1d(x, weight, bias, "silu", cu_seqlens=cu)
            out.backward(t["dconv"])
        finally:
            conv_module._in_tile_layout = real

    def outputs():
        x.grad = weight.grad = bias.grad = None
        fwd_bwd()
        return [g.detach().clone() for g in (x.grad, weight.grad, bias.grad)]

    return fwd_bwd, outputs


def alignment_rows(l: int, device, seed: int, d: int) -> list[dict]:
    """The scan on contiguous inputs at the packed row's length and at the nearest multiple of 16
    below it: rows that are not 16-token aligned once made the forward 3.6x slower."""
    rows = []
    for length in sorted({l, l - l % 16}):
        t = contiguous(training_tensors(length, device, seed, d))
        fwd, fwd_bwd, _ = scan_case(t, None, copy_in=False)
        with torch.no_grad():
            no_grad_ms = median_ms(fwd)
        rows.append({"kernel": "selective_scan", "packing": "unpacked", "layout": "contiguous, alignment check",
                     "l": length, "no_grad_fwd_ms": no_grad_ms, "fwd_bwd_ms": median_ms(fwd_bwd)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def worst_err(got, want) -> float:
    return max(rel_err(a.float(), b.float()) for a, b in zip(got, want) if b is not None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pack-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="d = 64, three short sequences, CPU (run with TRITON_INTERPRET=1): checks only")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/kernels"))
    args = parser.parse_args(argv)
    d, r = D, R
    if args.smoke:
        d, r = 64, 8
        device, lengths = torch.device("cpu"), [5, 17, 32]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_train_layouts.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device, lengths = torch.device("cuda"), packed_row(args.pack_len, args.seed)
    l = sum(lengths)
    offsets = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    rows = []
    for packing, cu in (("packed", offsets), ("unpacked", None)):
        t = training_tensors(l, device, args.seed, d, r)
        want = None
        for layout, tensors, copy_in in (("training", t, False), ("contiguous", contiguous(t), False),
                                         ("training, copied in", t, True)):
            fwd, fwd_bwd, outputs = scan_case(tensors, cu, copy_in)
            got = outputs()
            want = want or got
            row = {"kernel": "selective_scan", "packing": packing, "layout": layout, "l": l, "sequences": len(lengths),
                   "err_vs_first": worst_err(got, want), "fwd_ms": median_ms(fwd), "fwd_bwd_ms": median_ms(fwd_bwd)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        want = None
        for layout, matched in (("x channels-contiguous, grad tokens-contiguous, as handed in", False),
                                ("grad copied to x's layout", True)):
            fwd_bwd, outputs = conv_case(t, cu, matched)
            got = outputs()
            want = want or got
            row = {"kernel": "causal_conv1d", "packing": packing, "layout": layout, "l": l,
                   "err_vs_first": worst_err(got, want), "fwd_bwd_ms": median_ms(fwd_bwd)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows += alignment_rows(l, device, args.seed, d)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_train_layouts.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
                   "d": d, "n": N, "lengths": lengths, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
