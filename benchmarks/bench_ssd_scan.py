"""Benchmark the Triton SSD scan (ssmshard.kernels.ssd_scan) on one GPU.

Mamba2-2.7B mixer shapes (80 heads x 64, state 128, 1 group, chunk 256), bf16, with D,
dt_bias and softplus (z off unless --z): B=8 x L=2048, B=1 x L in {2048, 4096, 8192,
16384}, and one packed row of 16384 tokens cut into sequences of log-uniform lengths
64..4096 (cu_seqlens; mamba_ssm gets the same boundaries as seq_idx).

For each case: correctness at full size against the float32 torch reference
(ssmshard.kernels.reference.ssd_scan, run per sequence for the packed case; gradients
too for the first case), triton.testing.do_bench medians of the forward and of
forward + backward, mamba_ssm's mamba_chunk_scan_combined side by side when it imports,
achieved bandwidth (unique input + output bytes / time, against a measured device copy)
and FLOP rate (the SSD algorithm's useful FLOPs / time).

    python benchmarks/bench_ssd_scan.py [--out results.json] [--z] [--quick] [--no-autotune] [--no-mamba] [--profile]
                                        [--cb-min-heads N] [--smoke]

JSON goes to --out, else $OUT/bench_ssd_scan.json (./ without $OUT), a plot beside it (.png,
with matplotlib); a short table is printed last. ``--smoke`` runs tiny shapes on the CPU
interpreter in seconds (checks the script; its times mean nothing).

Dimension letters: b batch, l length, h heads, p head dim, g groups, n state size, T chunk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402
from profiling import profile_kernels, summary  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HEADS, HEADDIM, GROUPS, DSTATE, CHUNK = 80, 64, 1, 128, 256
PACKED_TOKENS, PACKED_LO, PACKED_HI = 16384, 64, 4096
if bench_common.SMOKE:  # the script's flow on the CPU interpreter, at sizes it runs in seconds
    HEADS, HEADDIM, GROUPS, DSTATE, CHUNK = 2, 16, 1, 16, 16
    PACKED_TOKENS, PACKED_LO, PACKED_HI = 40, 4, 16


def median_ms(fn, **kwargs) -> float:
    if bench_common.SMOKE:
        return bench_common.cpu_median_ms(fn)
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median", **kwargs)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON output path (default: $OUT/bench_ssd_scan.json)")
    parser.add_argument("--z", action="store_true", help="also gate by z (out * silu(z))")
    parser.add_argument("--quick", action="store_true", help="only B=8 x 2048 and the packed case")
    parser.add_argument("--no-autotune", action="store_true", help="run each kernel's first config")
    parser.add_argument("--no-mamba", action="store_true", help="skip mamba_ssm even if it imports")
    parser.add_argument("--profile", action="store_true",
                        help="also record each forward's kernels (torch.profiler: device ms per call, ours and the peer's)")
    parser.add_argument("--cb-min-heads", type=int, default=None,
                        help="store C.B once per group when at least this many heads share one "
                             "(default: the library's CB_STORED_MIN_HEADS_PER_GROUP; a large value computes it per head)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU interpreter in seconds: checks the script, measures nothing")
    return parser.parse_args()


def make_inputs(b, l, use_z, device, dtype=torch.bfloat16):
    """Inputs with Mamba-2's initialisation ranges: A in [-16, -1], softplus(dt + bias) in [1e-3, 0.1]."""
    h, p, g, n = HEADS, HEADDIM, GROUPS, DSTATE
    dt_init = torch.exp(torch.rand(h, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "x": torch.randn(b, l, h, p, device=device, dtype=dtype),
        "dt": (0.1 * torch.randn(b, l, h, device=device)).to(dtype),
        "A": -torch.exp(torch.rand(h, device=device) * math.log(16.0)),
        "B": torch.randn(b, l, g, n, device=device, dtype=dtype),
        "C": torch.randn(b, l, g, n, device=device, dtype=dtype),
        "D": torch.randn(h, device=device),
        "z": torch.randn(b, l, h, p, device=device, dtype=dtype) if use_z else None,
        "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
    }


def packed_lengths(total, generator):
    """Log-uniform lengths in [PACKED_LO, PACKED_HI] until `total` tokens; the last one is cut to fit."""
    lengths = []
    while sum(lengths) < total:
        u = torch.rand((), generator=generator).item()
        lengths.append(int(round(math.exp(math.log(PACKED_LO) + u * (math.log(PACKED_HI) - math.log(PACKED_LO))))))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < 1:
        lengths.pop()
        lengths[-1] += total - sum(lengths)
    return lengths


def model_flops(n_tokens, n_chunks, with_backward):
    """Useful FLOPs of the chunked algorithm: causal halves of the two T x T products, chunk
    states, state read-out. The backward does about twice the forward's products."""
    h, p, g, n, T = HEADS, HEADDIM, GROUPS, DSTATE, CHUNK
    tri = T * (T + 1) / 2
    fwd = n_chunks * (g * tri * n * 2 + h * tri * p * 2) + n_tokens * h * p * n * 2 * 2
    return fwd * (3 if with_backward else 1)


def io_bytes(inp, with_backward):
    """Unique bytes a scan must read and write (inputs, outputs; gradients in the backward)."""
    tensors = [t for k, t in inp.items() if t is not None and k in ("x", "dt", "B", "C", "z")]
    read = sum(t.numel() * t.element_size() for t in tensors)
    out = inp["x"].numel() * inp["x"].element_size()
    fwd = read + out
    # backward: reads the inputs and dout, writes a gradient per input
    return fwd + (read + out + read) if with_backward else fwd


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def reference_check(inp, cu_seqlens, with_grads):
    """Errors of the bf16 kernel against the fp32 torch reference on the same (bf16) values."""
    from ssmshard.kernels import reference
    from ssmshard.kernels.ssd_scan import ssd_scan

    names = ["x", "dt", "A", "B", "C", "D", "dt_bias"]
    leaves = {k: inp[k].detach().clone().requires_grad_(with_grads) for k in names}
    z = inp["z"]
    out, final = ssd_scan(**leaves, z=z, chunk_size=CHUNK, dt_softplus=True, cu_seqlens=cu_seqlens,
                          return_final_states=True)
    ref_leaves = {k: v.detach().float().requires_grad_(with_grads) for k, v in leaves.items()}
    spans = [(0, inp["x"].shape[1])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    outs, finals = [], []
    for lo, hi in spans:
        r = {k: (v[:, lo:hi] if k in ("x", "dt", "B", "C") else v) for k, v in ref_leaves.items()}
        o, f = reference.ssd_scan(r["x"], r["dt"], r["A"], r["B"], r["C"], CHUNK, r["D"], r["dt_bias"], None,
                                  True, 0.0, math.inf)
        outs.append(o if z is None else o * torch.nn.functional.silu(z[:, lo:hi].float()))
        finals.append(f)
    want_out = torch.cat(outs, 1)
    want_final = torch.cat(finals, 0)
    errors = {"out": rel_err(out, want_out), "final": rel_err(final, want_final)}
    if with_grads:
        g_out = torch.randn_like(want_out)
        got = torch.autograd.grad((out.float() * g_out).sum(), list(leaves.values()))
        want = torch.autograd.grad((want_out * g_out).sum(), list(ref_leaves.values()))
        errors.update({"d" + k: rel_err(a, b) for k, a, b in zip(names, got, want)})
    return errors


def bench_case(name, b, l, lengths, args, device, mamba_fn):
    from ssmshard.kernels.ssd_scan import ssd_scan

    inp = make_inputs(b, l, args.z, device)
    cu_seqlens = seq_idx = None
    if lengths is not None:
        cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32),
                                          torch.tensor(lengths, device=device))[None]  # (1, l)
    n_tokens = b * l
    n_chunks = b * math.ceil(l / CHUNK) if lengths is None else sum(math.ceil(s / CHUNK) for s in lengths)
    result = {"case": name, "batch": b, "length": l, "n_sequences": len(lengths) if lengths else b,
              "z": args.z}

    t0 = time.time()
    result["errors"] = reference_check(inp, cu_seqlens, with_grads=(name == "B8xL2048"))
    result["check_s"] = round(time.time() - t0, 2)

    grad_names = ["x", "dt", "A", "B", "C", "D", "dt_bias"] + (["z"] if args.z else [])
    leaves = {k: (v.detach().clone().requires_grad_(k in grad_names) if v is not None else None)
              for k, v in inp.items()}
    grad_out = torch.randn_like(inp["x"])
    grad_leaves = [leaves[k] for k in grad_names]

    def ours_fwd():
        return ssd_scan(**leaves, chunk_size=CHUNK, dt_softplus=True, cu_seqlens=cu_seqlens)

    def ours_fwd_bwd():
        ours_fwd().backward(grad_out)

    with torch.no_grad():
        result["ours_fwd_ms"] = median_ms(ours_fwd)
    result["ours_fwd_bwd_ms"] = median_ms(ours_fwd_bwd, grad_to_none=grad_leaves)
    result["autotuned_configs"] = chosen_configs()
    if args.profile:
        with torch.no_grad():
            result["ours_fwd_kernels"] = profile_kernels(ours_fwd)

    if mamba_fn is not None:
        def mamba_fwd():
            return mamba_fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], CHUNK,
                            D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"], dt_softplus=True,
                            seq_idx=seq_idx)

        def mamba_fwd_bwd():
            mamba_fwd().backward(grad_out)

        with torch.no_grad():
            ours_out = ours_fwd().float()
            result["mamba_vs_ours_out_err"] = rel_err(mamba_fwd(), ours_out)
            result["mamba_fwd_ms"] = median_ms(mamba_fwd)
        result["mamba_fwd_bwd_ms"] = median_ms(mamba_fwd_bwd, grad_to_none=grad_leaves)
        if args.profile:
            with torch.no_grad():
                result["mamba_fwd_kernels"] = profile_kernels(mamba_fwd)
        result["fwd_speedup_vs_mamba"] = result["mamba_fwd_ms"] / result["ours_fwd_ms"]
        result["fwd_bwd_speedup_vs_mamba"] = result["mamba_fwd_bwd_ms"] / result["ours_fwd_bwd_ms"]

    for kind, with_bwd in (("fwd", False), ("fwd_bwd", True)):
        ms = result[f"ours_{kind}_ms"]
        result[f"ours_{kind}_GBps"] = io_bytes(inp, with_bwd) / ms / 1e6
        result[f"ours_{kind}_TFLOPs"] = model_flops(n_tokens, n_chunks, with_bwd) / ms / 1e9
    return result


def chosen_configs():
    from ssmshard.kernels import ssd_scan_bwd, ssd_scan_fwd

    kernels = {"chunk_states": ssd_scan_fwd.chunk_states, "chunk_output": ssd_scan_fwd.chunk_output,
               "state_grads": ssd_scan_bwd.state_grads, "dx_dB": ssd_scan_bwd.dx_dB, "dC": ssd_scan_bwd.dC}
    chosen = {}
    for name, kernel in kernels.items():
        best = getattr(kernel.tuned, "best_config", None) if kernel.tuned is not None else None
        chosen[name] = str(best) if best is not None else "first config (not tuned)"
    return chosen


def copy_bandwidth_GBps(device):
    src = torch.empty(1 << (16 if bench_common.SMOKE else 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def main():
    args = parse_args()
    if args.no_autotune:
        os.environ["SSMSHARD_SSD_AUTOTUNE"] = "0"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_ssd_scan.py needs a CUDA GPU (or --smoke to check the script on the CPU)")
    import triton

    from ssmshard.kernels import ssd_scan_fwd

    if args.cb_min_heads is not None:
        ssd_scan_fwd.CB_STORED_MIN_HEADS_PER_GROUP = args.cb_min_heads
    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    mamba_fn, mamba_note = None, "mamba_ssm skipped (--smoke)" if args.smoke else "mamba_ssm skipped (--no-mamba)"
    if not args.no_mamba and not args.smoke:
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as mamba_fn
            mamba_note = "mamba_ssm imported"
        except Exception as exc:  # any import failure: report it and bench ours alone
            mamba_note = f"mamba_ssm not available ({type(exc).__name__}: {exc}); ours only"
    print(mamba_note, flush=True)

    cases = [("B8xL2048", 8, 2048, None)] if not args.smoke else [("B2xL24", 2, 24, None)]
    if not args.quick and not args.smoke:
        cases += [(f"B1xL{l}", 1, l, None) for l in (2048, 4096, 8192, 16384)]
    lengths = packed_lengths(PACKED_TOKENS, generator)
    cases.append((f"packed{len(lengths)}xL{PACKED_TOKENS}", 1, PACKED_TOKENS, lengths))

    report = {
        "device": "cpu-interpreter" if args.smoke else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "shapes": {"heads": HEADS, "headdim": HEADDIM, "groups": GROUPS, "dstate": DSTATE, "chunk": CHUNK},
        "dtype": "bfloat16", "mamba_ssm": mamba_note, "packed_lengths": lengths,
        "cb_stored_min_heads_per_group": ssd_scan_fwd.CB_STORED_MIN_HEADS_PER_GROUP,
        "copy_GBps": copy_bandwidth_GBps(device), "cases": [],
    }
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "bench_ssd_scan.json")
    start = time.time()
    for name, b, l, lens in cases:
        t0 = time.time()
        result = bench_case(name, b, l, lens, args, device, mamba_fn)
        result["wall_s"] = round(time.time() - t0, 1)
        report["cases"].append(result)
        report["total_wall_s"] = round(time.time() - start, 1)
        print(json.dumps(result), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:  # after every case, so a run cut short still leaves its results
            json.dump(report, f, indent=2)
    print(f"wrote {out_path}")
    cases_done = report["cases"]
    bench_common.bar_chart(os.path.splitext(out_path)[0] + ".png", f"SSD chunk scan, {report['device']}",
                           [c["case"] for c in cases_done],
                           {"ours fwd": [c["ours_fwd_ms"] for c in cases_done],
                            "peer fwd": [c.get("mamba_fwd_ms") for c in cases_done],
                            "ours fwd+bwd": [c["ours_fwd_bwd_ms"] for c in cases_done],
                            "peer fwd+bwd": [c.get("mamba_fwd_bwd_ms") for c in cases_done]}, "ms (median)", log=True)

    print(f"\n{report['device']}, bf16, h={HEADS} p={HEADDIM} n={DSTATE} g={GROUPS} T={CHUNK}, "
          f"copy {report['copy_GBps']:.0f} GB/s; {mamba_note}")
    header = f"{'case':<22}{'fwd ms':>8}{'f+b ms':>8}{'mamba f':>9}{'mamba f+b':>10}{'x fwd':>7}{'x f+b':>7}" \
             f"{'fwd GB/s':>9}{'fwd TF/s':>9}{'err out':>9}"
    print(header)
    for r in report["cases"]:
        mf, mfb = r.get("mamba_fwd_ms"), r.get("mamba_fwd_bwd_ms")
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{r['case']:<22}{r['ours_fwd_ms']:>8.3f}{r['ours_fwd_bwd_ms']:>8.3f}{fmt(mf, '9.3f'):>9}"
              f"{fmt(mfb, '10.3f'):>10}{fmt(r.get('fwd_speedup_vs_mamba'), '7.2f'):>7}"
              f"{fmt(r.get('fwd_bwd_speedup_vs_mamba'), '7.2f'):>7}{r['ours_fwd_GBps']:>9.0f}"
              f"{r['ours_fwd_TFLOPs']:>9.1f}{r['errors']['out']:>9.1e}")
    for r in report["cases"]:
        for who in ("ours", "mamba"):
            if f"{who}_fwd_kernels" in r:
                print(f"{r['case']} {who} forward kernels: {summary(r[f'{who}_fwd_kernels'], 6)}")


if __name__ == "__main__":
    main()
