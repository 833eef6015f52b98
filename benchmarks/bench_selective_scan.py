"""Benchmark of the Triton selective-scan kernels (ssmshard.kernels.selective_scan) on one GPU.

    python benchmarks/bench_selective_scan.py [--out FILE] [--graphs] [--profile] [--sweep] [--sweep-sequential] [--no-mamba]

1. Correctness at full size: the bf16 kernel against the fp32 torch reference
   (ssmshard.kernels.reference.selective_scan) on the same rounded inputs; gradients at a
   smaller size (the reference's autograd keeps every chunk's intermediates).
2. triton.testing.do_bench medians, forward and forward+backward, bf16 Mamba-1 shapes
   (d=5120, N=16 is the Mamba-2.8B mixer), packed sequences, and the same shapes with
   mamba_ssm's CUDA selective_scan_fn when it imports (ratio = theirs / ours).
3. Achieved bandwidth: counted bytes / time, against a device-to-device copy measured here.
4. The decode-step kernel at batch 1 and 64.
``--sweep`` also times the parallel forward (ScanConfig.fwd_variant="parallel") over a few
tiles, with and without segments, on the first two shapes (forward median and max relative
error of y against the fp32 reference per config); ``--sweep-sequential`` the sequential
forward's and the backward's launch configurations.
Writes JSON to --out (default $OUT/bench_selective_scan.json, else ./bench_selective_scan.json),
a plot beside it (.png, with matplotlib) and prints a table. ``--smoke`` runs tiny shapes on the
CPU interpreter in seconds (checks the script; its times mean nothing).

Dimension letters: b batch, d channels, l tokens, n state size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ssmshard.kernels import reference  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import profile_kernels, summary  # noqa: E402
from ssmshard.kernels.selective_scan import ScanConfig, default_config, selective_scan  # noqa: E402
from ssmshard.kernels.state_update import selective_state_update  # noqa: E402

D_MODEL, N_STATE = 5120, 16  # Mamba-2.8B mixer: d_inner 5120, state 16


def mamba_ssm_scan():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as exc:  # optional dependency: any import failure means "not available"
        print(f"note: mamba_ssm not importable ({type(exc).__name__}: {exc}); comparing with nothing")
        return None
    return selective_scan_fn


def make_inputs(b, d, l, n, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return dict(
        u=rnd(b, d, l).to(device, dtype),
        delta=(rnd(b, d, l) * 0.5 - 1.0).to(device, dtype),
        A=(-torch.exp(rnd(d, n) * 0.5)).to(device),
        B=rnd(b, n, l).to(device, dtype),
        C=rnd(b, n, l).to(device, dtype),
        D=rnd(d).to(device),
        z=rnd(b, d, l).to(device, dtype),
        delta_bias=(rnd(d) * 0.5).to(device),
    )


ORDER = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def log_uniform_lengths(total, lo, hi, seed=0):
    """Sequence lengths, log-uniform in [lo, hi], summing to exactly ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(math.exp(math.log(lo) + torch.rand((), generator=g).item() * math.log(hi / lo))))
    lengths[-1] -= sum(lengths) - total
    return [x for x in lengths if x > 0]


def timer(smoke):
    if not smoke:
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    return bench_common.cpu_median_ms


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# --- byte counts ---------------------------------------------------------------------------


def essential_bytes(b, d, l, n, elem=2):
    """Inputs read once, outputs written once (bf16 activations, B/C, fp32 parameters)."""
    per_token = b * d * l * elem
    bc = 2 * b * n * l * elem
    fwd = 3 * per_token + bc + per_token  # u, delta, z, B, C -> y
    bwd = 4 * per_token + bc + 3 * per_token + bc  # u, delta, z, dy, B, C -> du, ddelta, dz, dB, dC
    return fwd, fwd + bwd


def extra_bytes(b, d, l, n, cfg: ScanConfig):
    """What this design moves beyond that: checkpoints (written, read), dB/dC block partials
    (written, read by the torch sum)."""
    ckpt = b * d * n * triton.cdiv(l, cfg.chunk) * 4
    partials = 2 * b * n * l * 4 * triton.cdiv(d, cfg.bwd_block_d)
    return 2 * ckpt + 2 * partials


def copy_roofline(device, smoke):
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    numel = (1 << 16) if smoke else (1 << 28)  # 1 GiB of fp32
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = timer(smoke)(lambda: dst.copy_(src))
    return 2 * numel * 4 / (ms * 1e-3)


# --- measurements ----------------------------------------------------------------------------


def check_correctness(device, smoke, results):
    b, d, l = (1, 8, 24) if smoke else (8, D_MODEL, 2048)
    x = make_inputs(b, d, l, N_STATE, device)
    with torch.no_grad():
        y = selective_scan(*(x[k] for k in ORDER), True, out_dtype=torch.float32)
        y_ref, _ = reference.selective_scan(*(x[k] for k in ORDER), True)
    err = rel_err(y, y_ref)
    print(f"forward  b={b} d={d} l={l}: rel err vs fp32 torch reference {err:.2e}")
    results["correctness"] = {"forward": {"shape": [b, d, l, N_STATE], "rel_err": err}}

    # Gradients in fp32 (bf16 would only show the rounding of the returned gradients).
    b, d, l = (1, 8, 24) if smoke else (2, 1024, 1024)
    x = make_inputs(b, d, l, N_STATE, device, dtype=torch.float32, seed=1)
    init = torch.randn(b, d, N_STATE, device=device)
    grads = []
    for fn in ("kernel", "reference"):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
        s0 = init.clone().requires_grad_(True)
        args = [leaves[k] for k in ORDER]
        if fn == "kernel":
            y, fin = selective_scan(*args, True, initial_state=s0, return_final_state=True, out_dtype=torch.float32)
        else:
            y, fin = reference.selective_scan(*args, True, s0)
        gen = torch.Generator(device="cpu").manual_seed(2)
        w_y = torch.randn(y.shape, generator=gen).to(device)
        w_f = torch.randn(fin.shape, generator=gen).to(device)
        grads.append(torch.autograd.grad((y * w_y).sum() + (fin * w_f).sum(), args + [s0]))
    errs = {k: rel_err(a, r) for k, a, r in zip(list(ORDER) + ["initial_state"], *grads)}
    print(f"backward b={b} d={d} l={l}: rel err of grads vs fp32 torch reference: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    results["correctness"]["backward"] = {"shape": [b, d, l, N_STATE], "rel_err": errs}


def launch_config(b, d, l, device, fwd_block_d=None, packed=False):
    """The default config, with the forward tile's channel count replaced where asked. On the
    CPU interpreter (``--smoke``) the tiles are cut to the smoke shapes' 8 channels: it pays for
    every masked lane of the GPU's 32-channel tiles (the timings mean nothing there anyway)."""
    cfg = default_config(b, d, l, device, packed)
    if device.type == "cpu":
        cfg = ScanConfig(**{**cfg.__dict__, "par_block_d": 8, "bwd_block_d": 8, "chunk": 16})
    return cfg if fwd_block_d is None else ScanConfig(**{**cfg.__dict__, "par_block_d": fwd_block_d})


def time_scan(fn_fwd, fn_fwd_bwd, bench):
    return bench(fn_fwd), bench(fn_fwd_bwd)


def graph_time(fn):
    """Median of ``fn`` replayed from a CUDA graph: the GPU's time without the host's launch
    overhead (``--graphs``), or None where capture fails."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # a host sync or an uncapturable op: report, do not guess
        print(f"note: CUDA graph capture failed ({type(exc).__name__}: {exc})")
        return None


def ours(x, cfg=None, cu_seqlens=None):
    args = [x[k] for k in ORDER]
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    dy = torch.randn_like(x["u"])

    def fwd():
        with torch.no_grad():
            selective_scan(*args, True, cu_seqlens=cu_seqlens, config=cfg)

    def fwd_bwd():
        y = selective_scan(*leaves, True, cu_seqlens=cu_seqlens, config=cfg)
        torch.autograd.grad(y, leaves, dy)

    return fwd, fwd_bwd


def theirs(x, scan_fn):
    args = [x[k] for k in ORDER]
    leaves = [a.detach().requires_grad_(True) for a in args]
    dy = torch.randn_like(x["u"])

    def fwd():
        with torch.no_grad():
            scan_fn(*args, delta_softplus=True)

    def fwd_bwd():
        y = scan_fn(*leaves, delta_softplus=True)
        torch.autograd.grad(y, leaves, dy)

    return fwd, fwd_bwd


def sweep_sequential_configs(b, d, l):
    """The sequential forward's warps / segments and the backward's tiles (``--sweep-sequential``)."""
    base = default_config(b, d, l, torch.device("cuda"))
    configs = {"default": base}
    for warps in (1, 2, 4):
        for segments in sorted({1, 2, 4, 8, base.segments}):
            if l // segments >= 256:
                configs[f"fwd w{warps} seg{segments}"] = ScanConfig(**{**base.__dict__, "fwd_warps": warps,
                                                                       "segments": segments})
    for chunk, block, warps in ((64, 16, 4), (128, 16, 8), (32, 32, 4), (64, 32, 8), (64, 8, 2), (128, 8, 4)):
        configs[f"bwd T{chunk} bd{block} w{warps}"] = ScanConfig(**{**base.__dict__, "chunk": chunk,
                                                                    "bwd_block_d": block, "bwd_warps": warps})
    return configs


# (channels, tokens, warps) of the parallel forward. T=4 with 32 channels per warp keeps a
# step in one thread per channel; T=8 spreads the tokens over 2 lanes (more threads, shuffles).
PARALLEL_TILES = ((32, 4, 1), (64, 4, 2), (128, 4, 4), (32, 8, 2), (64, 8, 4))


def sweep_configs(b, d, l):
    """The default (sequential) configuration and the parallel forward over PARALLEL_TILES,
    without segments and with the default's segment count (at least 2)."""
    base = default_config(b, d, l, torch.device("cuda"))
    configs = {"default": base}
    for segments in sorted({1, max(2, base.segments)}):
        for block_d, tokens, warps in PARALLEL_TILES:
            configs[f"par bd{block_d} T{tokens} w{warps} seg{segments}"] = ScanConfig(
                **{**base.__dict__, "fwd_variant": "parallel", "par_block_d": block_d,
                   "par_tokens": tokens, "par_warps": warps, "segments": segments})
    return configs


# (channels, tokens) per program of the parallel backward (one warp); the forward is the default's.
PARALLEL_BWD_TILES = ((4, 2), (4, 4), (8, 2), (8, 4), (16, 2), (16, 4))


def backward_sweep_configs(b, d, l):
    """(forward configs, forward+backward configs) of ``--sweep-backward``: none, and the
    default against each parallel-backward tile."""
    base = default_config(b, d, l, torch.device("cuda"))
    configs = {"default": base}
    for block_d, tokens in PARALLEL_BWD_TILES:
        configs[f"parallel bwd bd{block_d} T{tokens}"] = ScanConfig(
            **{**base.__dict__, "bwd_variant": "parallel", "bwd_block_d": block_d, "bwd_tokens": tokens, "bwd_warps": 1})
    return {}, configs


# Register caps (ScanConfig.par_maxnreg / bwd_maxnreg) and tiles. Offline sm_90 compiles under
# triton 3.6: the forward's 32 x 4 tile uses 254 registers uncapped (8 warps per SM) and spills
# in its loop when capped; the 16 x 4 tile uses 168 without a cap (12 warps). The backward's
# 8 x 4 tile uses 227 uncapped, 192 and 168 with no spill in its loops, 152 and 128 with a few.
REGISTER_SWEEP_FWD = (("bd32", 32, None), ("bd32 cap232", 32, 232), ("bd32 cap192", 32, 192), ("bd16", 16, None))
REGISTER_SWEEP_BWD = (None, 192, 168, 152, 128)
# Segment counts, as multiples of the default's, for the forward tiles and backward caps that
# the register sweep left in the running.
SEGMENT_MULTIPLES = (1, 2, 3, 4)
SEGMENT_SWEEP_FWD = (("bd32", 32), ("bd16", 16))
SEGMENT_SWEEP_BWD = (None, 168)
MIN_SWEEP_SEGMENT_TOKENS = 128


def register_sweep_configs(b, d, l):
    """(forward configs, forward+backward configs) of ``--sweep-registers``: the forward per
    tile / register cap (and, at batch 1, with twice the default's segments); the backward per
    register cap on the default forward."""
    base = default_config(b, d, l, torch.device("cuda"))
    fwd = {}
    for name, block_d, cap in REGISTER_SWEEP_FWD:
        fwd[f"fwd {name}"] = ScanConfig(**{**base.__dict__, "par_block_d": block_d, "par_maxnreg": cap})
        if b == 1 and l // (2 * base.segments) >= 256:
            fwd[f"fwd {name} seg{2 * base.segments}"] = ScanConfig(
                **{**base.__dict__, "par_block_d": block_d, "par_maxnreg": cap, "segments": 2 * base.segments})
    fwd_bwd = {f"bwd cap{cap}" if cap else "bwd uncapped": ScanConfig(**{**base.__dict__, "bwd_maxnreg": cap})
               for cap in REGISTER_SWEEP_BWD}
    return fwd, fwd_bwd


def segment_sweep_configs(b, d, l):
    """(forward configs, forward+backward configs) of ``--sweep-segments``: SEGMENT_MULTIPLES of
    the default's segment count (at least 2 at batch > 1, segments of at least
    MIN_SWEEP_SEGMENT_TOKENS), per forward tile and per backward register cap."""
    base = default_config(b, d, l, torch.device("cuda"))
    counts = sorted({min(max(m * base.segments, m), max(1, l // MIN_SWEEP_SEGMENT_TOKENS)) for m in SEGMENT_MULTIPLES})
    fwd, fwd_bwd = {}, {}
    for segments in counts:
        for name, block_d in SEGMENT_SWEEP_FWD:
            fwd[f"fwd {name} seg{segments}"] = ScanConfig(**{**base.__dict__, "par_block_d": block_d, "segments": segments})
        for cap in SEGMENT_SWEEP_BWD:
            fwd_bwd[f"f+b {f'cap{cap}' if cap else 'uncapped'} seg{segments}"] = ScanConfig(
                **{**base.__dict__, "bwd_maxnreg": cap, "segments": segments})
    return fwd, fwd_bwd


def sweep_launch(x, configs, bench, cu_seqlens=None):
    """Forward medians over ``configs[0]``, forward+backward medians over ``configs[1]``, each
    with the largest relative difference of y (or of any input gradient) from the first
    config's."""
    fwd_configs, fwd_bwd_configs = configs
    args = [x[k] for k in ORDER]
    dy = torch.randn_like(x["u"])
    out, y_want, g_want = {}, None, None
    for name, cfg in fwd_configs.items():
        with torch.no_grad():
            y = selective_scan(*args, True, out_dtype=torch.float32, cu_seqlens=cu_seqlens, config=cfg)
        y_want = y if y_want is None else y_want
        f, _ = ours(x, cfg, cu_seqlens)
        out[name] = {"config": cfg.__dict__, "fwd_ms": bench(f), "max_rel_diff": rel_err(y, y_want)}
        print(f"    sweep {name:<28} fwd     {out[name]['fwd_ms']:8.3f} ms  diff {out[name]['max_rel_diff']:.1e}",
              flush=True)
        del y
    del y_want
    for name, cfg in fwd_bwd_configs.items():
        leaves = [a.detach().requires_grad_(True) for a in args]
        grads = torch.autograd.grad(selective_scan(*leaves, True, cu_seqlens=cu_seqlens, config=cfg), leaves, dy)
        g_want = g_want or grads
        _, fb = ours(x, cfg, cu_seqlens)
        out[name] = {"config": cfg.__dict__, "fwd_bwd_ms": bench(fb),
                     "max_rel_diff": max(rel_err(g, w) for g, w in zip(grads, g_want))}
        print(f"    sweep {name:<28} fwd+bwd {out[name]['fwd_bwd_ms']:8.3f} ms  diff {out[name]['max_rel_diff']:.1e}",
              flush=True)
        del grads, leaves
    return out


def sweep_forward(x, configs, bench):
    """Forward median and max relative error (y against the fp32 torch reference) per config."""
    args = [x[k] for k in ORDER]
    with torch.no_grad():
        y_ref, _ = reference.selective_scan(*args, True)
    out = {}
    for name, cfg in configs.items():
        with torch.no_grad():
            y = selective_scan(*args, True, out_dtype=torch.float32, config=cfg)
        f, _ = ours(x, cfg)
        out[name] = {"config": cfg.__dict__, "fwd_ms": bench(f), "rel_err": rel_err(y, y_ref)}
        del y
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file (default $OUT/bench_selective_scan.json)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the parallel forward's tiles (forward median and error per config)")
    parser.add_argument("--sweep-sequential", action="store_true",
                        help="also time the sequential forward's and the backward's launch configurations")
    parser.add_argument("--sweep-backward", action="store_true",
                        help="also time the parallel backward's tiles (forward+backward median per config)")
    parser.add_argument("--sweep-registers", action="store_true",
                        help="also time register caps and tiles of the parallel kernels (headline shapes and the packed row)")
    parser.add_argument("--sweep-segments", action="store_true",
                        help="also time segment counts with the forward tiles and backward caps left by --sweep-registers "
                             "(every shape and the packed row)")
    parser.add_argument("--fwd-block-d", type=int, default=None,
                        help="channels per forward tile in place of the default's (every row; for A/B runs)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each forward's kernels (torch.profiler: device ms per call, ours and the peer's)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time each forward replayed from a CUDA graph (ours and the peer's: GPU time without "
                             "host launch overhead)")
    parser.add_argument("--only-sweeps", action="store_true", help="time only the two headline shapes (with the sweeps asked for)")
    parser.add_argument("--no-mamba", action="store_true", help="skip the mamba_ssm comparison")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args()
    out = args.out or os.path.join(os.environ.get("OUT", "."), "bench_selective_scan.json")
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --smoke to check the script on CPU")
    bench = timer(args.smoke)
    results = {
        "device": "cpu-interpreter" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
    }
    t_start = time.time()
    roofline = copy_roofline(device, args.smoke)
    results["copy_roofline_GBps"] = roofline / 1e9
    print(f"device-to-device copy: {roofline / 1e9:.0f} GB/s")
    check_correctness(device, args.smoke, results)
    scan_fn = None if (args.no_mamba or args.smoke) else mamba_ssm_scan()

    if args.smoke:
        shapes = [(1, 8, 32)]  # the CPU interpreter takes seconds per launch
        packed_total, packed_lo, packed_hi = 32, 4, 16
    else:
        shapes = [(8, D_MODEL, 2048), (1, D_MODEL, 16384)] + [(1, D_MODEL, l) for l in (2048, 4096, 8192)]
        packed_total, packed_lo, packed_hi = 16384, 64, 4096
    rows = []
    for b, d, l in shapes[:2] if args.only_sweeps else shapes:
        x = make_inputs(b, d, l, N_STATE, device)
        cfg = launch_config(b, d, l, device, args.fwd_block_d)
        f, fb = ours(x, cfg)
        row = {"shape": f"B={b} d={d} L={l} N={N_STATE}", "config": cfg.__dict__}
        row["ours_fwd_ms"], row["ours_fwd_bwd_ms"] = time_scan(f, fb, bench)
        ess_f, ess_fb = essential_bytes(b, d, l, N_STATE)
        row["fwd_GBps"] = ess_f / (row["ours_fwd_ms"] * 1e-3) / 1e9
        row["fwd_bwd_GBps"] = (ess_fb + extra_bytes(b, d, l, N_STATE, cfg)) / (row["ours_fwd_bwd_ms"] * 1e-3) / 1e9
        if scan_fn is not None:
            f2, fb2 = theirs(x, scan_fn)
            row["mamba_fwd_ms"], row["mamba_fwd_bwd_ms"] = time_scan(f2, fb2, bench)
        if args.profile and not args.smoke:
            row["ours_fwd_kernels"] = profile_kernels(f)
            if scan_fn is not None:
                row["mamba_fwd_kernels"] = profile_kernels(f2)
            for who in ("ours", "mamba"):
                if f"{who}_fwd_kernels" in row:
                    print(f"    {row['shape']} {who} forward kernels: {summary(row[f'{who}_fwd_kernels'])}", flush=True)
        if args.graphs and not args.smoke:
            row["ours_fwd_graph_ms"] = graph_time(f)
            if scan_fn is not None:
                row["mamba_fwd_graph_ms"] = graph_time(f2)
            print(f"    {row['shape']}: forward from a CUDA graph, ours {row['ours_fwd_graph_ms']} ms, "
                  f"peer {row.get('mamba_fwd_graph_ms')} ms", flush=True)
        # Sweeps on the two headline shapes only (compiles dominate: ~11 configs each).
        if args.sweep and (b, d, l) in shapes[:2]:
            t_sweep = time.time()
            row["sweep"] = sweep_forward(x, sweep_configs(b, d, l) if not args.smoke else
                                         {"parallel": ScanConfig(fwd_variant="parallel", par_block_d=16)}, bench)
            row["sweep_s"] = time.time() - t_sweep
        if args.sweep_registers and not args.smoke and (b, d, l) in shapes[:2]:
            row["sweep_registers"] = sweep_launch(x, register_sweep_configs(b, d, l), bench)
        if args.sweep_segments and not args.smoke:
            row["sweep_segments"] = sweep_launch(x, segment_sweep_configs(b, d, l), bench)
        if args.sweep_backward and not args.smoke and (b, d, l) in shapes[:2]:
            row["sweep_backward"] = sweep_launch(x, backward_sweep_configs(b, d, l), bench)
        if args.sweep_sequential and not args.smoke:
            row["sweep_sequential"] = {}
            for name, c in sweep_sequential_configs(b, d, l).items():
                f3, fb3 = ours(x, c)
                row["sweep_sequential"][name] = dict(zip(("fwd_ms", "fwd_bwd_ms"), time_scan(f3, fb3, bench)))
        rows.append(row)
        del x

    # Packed: log-uniform lengths summing to packed_total, one row.
    lengths = log_uniform_lengths(packed_total, packed_lo, packed_hi)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    x = make_inputs(1, D_MODEL if not args.smoke else 8, packed_total, N_STATE, device)
    cfg = launch_config(1, x["u"].shape[1], packed_total, device, args.fwd_block_d, packed=True)
    f, fb = ours(x, cfg, cu_seqlens=cu)
    row = {"shape": f"packed {len(lengths)} seqs ({min(lengths)}..{max(lengths)}) d={x['u'].shape[1]} "
                    f"L={packed_total} N={N_STATE}", "config": cfg.__dict__}
    row["ours_fwd_ms"], row["ours_fwd_bwd_ms"] = time_scan(f, fb, bench)
    ess_f, ess_fb = essential_bytes(1, x["u"].shape[1], packed_total, N_STATE)
    row["fwd_GBps"] = ess_f / (row["ours_fwd_ms"] * 1e-3) / 1e9
    row["fwd_bwd_GBps"] = ((ess_fb + extra_bytes(1, x["u"].shape[1], packed_total, N_STATE, cfg))
                           / (row["ours_fwd_bwd_ms"] * 1e-3) / 1e9)
    if scan_fn is not None:
        row["note"] = "mamba_ssm selective_scan_fn takes no cu_seqlens: not compared"
    if args.sweep_registers and not args.smoke:
        row["sweep_registers"] = sweep_launch(x, register_sweep_configs(1, x["u"].shape[1], packed_total), bench, cu)
    if args.sweep_segments and not args.smoke:
        row["sweep_segments"] = sweep_launch(x, segment_sweep_configs(1, x["u"].shape[1], packed_total), bench, cu)
    rows.append(row)
    del x

    # Decode step, Mamba-1 layout (the Mamba-2.8B mixer), state updated in place.
    decode = {}
    for b in (1,) if args.smoke else (1, 64):
        d = D_MODEL if not args.smoke else 8
        state = torch.randn(b, d, N_STATE, device=device)
        xs = [torch.randn(b, d, device=device, dtype=torch.bfloat16) for _ in range(3)]
        A = -torch.rand(d, N_STATE, device=device)
        Bv, Cv = (torch.randn(b, N_STATE, device=device, dtype=torch.bfloat16) for _ in range(2))
        D, bias = torch.randn(d, device=device), torch.randn(d, device=device)
        ms = bench(lambda: selective_state_update(state, xs[0], xs[1], A, Bv, Cv, D, xs[2], bias, True,
                                                  out_state=state))
        decode[f"batch {b}"] = {"ms": ms, "GBps": (2 * state.numel() * 4 + 4 * b * d * 2) / (ms * 1e-3) / 1e9}
    results["scan"], results["decode"] = rows, decode
    results["wall_s"] = time.time() - t_start

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"\n{'shape':<52} {'fwd ms':>8} {'f+b ms':>8} {'mamba fwd':>9} {'mamba f+b':>9} "
          f"{'x fwd':>6} {'x f+b':>6} {'fwd GB/s':>8} {'f+b GB/s':>8}")
    for r in rows:
        their_f, their_fb = r.get("mamba_fwd_ms"), r.get("mamba_fwd_bwd_ms")
        ratio = lambda a, b: f"{a / b:6.2f}" if a else f"{'-':>6}"  # noqa: E731
        print(f"{r['shape']:<52} {r['ours_fwd_ms']:8.3f} {r['ours_fwd_bwd_ms']:8.3f} "
              f"{f'{their_f:.3f}' if their_f else '-':>9} {f'{their_fb:.3f}' if their_fb else '-':>9} "
              f"{ratio(their_f, r['ours_fwd_ms'])} {ratio(their_fb, r['ours_fwd_bwd_ms'])} "
              f"{r['fwd_GBps']:8.0f} {r['fwd_bwd_GBps']:8.0f}")
        for name, t in r.get("sweep", {}).items():
            print(f"    sweep {name:<40} {t['fwd_ms']:8.3f}  rel err {t['rel_err']:.1e}")
        for name, t in {**r.get("sweep_registers", {}), **r.get("sweep_segments", {})}.items():
            kind, ms = ("fwd", t["fwd_ms"]) if "fwd_ms" in t else ("f+b", t["fwd_bwd_ms"])
            print(f"    {name:<46} {kind} {ms:8.3f}  diff {t['max_rel_diff']:.1e}")
        for name, t in r.get("sweep_sequential", {}).items():
            print(f"    sweep {name:<40} {t['fwd_ms']:8.3f} {t['fwd_bwd_ms']:8.3f}")
    bench_common.bar_chart(os.path.splitext(out)[0] + ".png", f"Mamba-1 selective scan, {results['device']}",
                           [r["shape"].split(" N=")[0] for r in rows],
                           {"ours fwd": [r["ours_fwd_ms"] for r in rows], "peer fwd": [r.get("mamba_fwd_ms") for r in rows],
                            "ours fwd+bwd": [r["ours_fwd_bwd_ms"] for r in rows],
                            "peer fwd+bwd": [r.get("mamba_fwd_bwd_ms") for r in rows]}, "ms (median)", log=True)
    print(f"copy roofline {roofline / 1e9:.0f} GB/s; decode: "
          + ", ".join(f"{k} {v['ms'] * 1e3:.1f} us" for k, v in decode.items()))
    print(f"wrote {out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
