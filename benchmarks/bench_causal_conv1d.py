"""GPU benchmark of the Triton causal conv1d kernels (ssmshard.kernels.causal_conv1d).

Checks correctness at full size against the reference op, then times with
triton.testing.do_bench (medians) forward and forward+backward in bf16 for the Mamba shapes,
both memory layouts (tokens contiguous (b, d, l), and the channels-contiguous transposed
view Mamba / Mamba-2 pass), a packed variant (cu_seqlens + initial / final states), the
decode update kernel at batch 1 and 64, a sweep of tile configurations, and the
``causal_conv1d`` package side by side when it imports. Bandwidth is compared with a
measured device-to-device copy of the same bytes.

    python benchmarks/bench_causal_conv1d.py [--out results.json] [--no-sweep] [--smoke]

Writes JSON to --out, else to $OUT/bench_causal_conv1d.json (./ without $OUT), a plot beside it
(.png, with matplotlib); prints a short table last. About a minute on an H200. ``--smoke`` runs
tiny shapes on the CPU interpreter in seconds (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssmshard import ops  # noqa: E402,F401  (registers torch.ops.ssmshard)
from ssmshard.kernels import causal_conv1d as kconv  # noqa: E402
from ssmshard.kernels import reference  # noqa: E402

try:
    import causal_conv1d as peer  # the causal_conv1d package (CUDA kernels)
except Exception as e:  # noqa: BLE001 - any import failure just means no side-by-side
    peer = None
    PEER_NOTE = f"causal_conv1d package not importable ({type(e).__name__}: {e}); no side-by-side"
else:
    PEER_NOTE = f"causal_conv1d package {getattr(peer, '__version__', '?')} imported"

K = 4
MAMBA1_D = 5120  # Mamba-2.8B d_inner
MAMBA2_D = 80 * 64 + 2 * 128  # Mamba2-2.7B conv channels: x (80 heads x 64) + B + C (1 group x 128)
DEVICE = "cuda"
SHAPES = [(8, MAMBA1_D, 2048), (8, MAMBA2_D, 2048), (1, MAMBA2_D, 16384)]  # (b, d, l)
PACKED_SEQUENCES, PACKED_MAX_LEN = 16, 2048
UPDATE_BATCHES = (1, 64)
if bench_common.SMOKE:  # the script's flow on the CPU interpreter, at sizes it runs in seconds
    MAMBA1_D, MAMBA2_D, DEVICE = 16, 24, "cpu"
    SHAPES = [(2, MAMBA1_D, 24)]
    PACKED_SEQUENCES, PACKED_MAX_LEN, UPDATE_BATCHES = 3, 12, (2,)


def median_ms(fn) -> float:
    if bench_common.SMOKE:
        return bench_common.cpu_median_ms(fn)
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_inputs(b, d, l, layout, dtype=torch.bfloat16, grad=False):
    if layout == "tokens_contiguous":
        x = torch.randn(b, d, l, device=DEVICE, dtype=dtype)
    else:  # channels contiguous: (b, l, d) transposed, as the HF mixers hand it over
        x = torch.randn(b, l, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    w = (torch.randn(d, K, device=DEVICE) / 2).to(dtype)
    bias = torch.randn(d, device=DEVICE).to(dtype)
    if grad:
        for t in (x, w, bias):
            t.requires_grad_(True)
    return x, w, bias


def copy_bandwidth(n_bytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(n_bytes // 2, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def check_full_size(results):
    """Ours (bf16 in, bf16 out) vs the reference op run in float32 on the same inputs."""
    checks = {}
    for layout in ("tokens_contiguous", "channels_last"):
        x, w, bias = make_inputs(*SHAPES[0], layout, grad=True)
        gy = torch.randn(x.shape, device=DEVICE, dtype=x.dtype)
        ref_inputs = [t.detach().float().requires_grad_(True) for t in (x, w, bias)]
        want = torch.ops.ssmshard.causal_conv1d(*ref_inputs, "silu")
        got = kconv.causal_conv1d(x, w, bias, "silu")
        want_g = torch.autograd.grad(want, ref_inputs, gy.float())
        got_g = torch.autograd.grad(got, [x, w, bias], gy)
        errs = {n: rel_err(g, r) for n, g, r in zip(["out", "dx", "dweight", "dbias"], [got, *got_g], [want, *want_g])}
        checks[layout] = errs
        del x, w, bias, gy, ref_inputs, want, got, want_g, got_g
    # Packed: 16 sequences in one row vs each sequence alone through the reference path
    # (initial state prepended as tokens, outputs for them dropped).
    torch.manual_seed(0)
    lengths = torch.randint(1, PACKED_MAX_LEN, (PACKED_SEQUENCES,)).tolist()
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    x, w, bias = make_inputs(1, MAMBA2_D, sum(lengths), "channels_last")
    h0 = torch.randn(len(lengths), MAMBA2_D, K - 1, device=DEVICE, dtype=x.dtype)
    out, fin = kconv.causal_conv1d(x, w, bias, "silu", cu_seqlens=cu, initial_states=h0, return_final_states=True)
    worst_out = worst_fin = 0.0
    for s, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        stream = torch.cat([h0[s : s + 1], x[:, :, a:e]], -1)  # (1, d, k-1 + length)
        ref = reference.causal_conv1d(stream.float(), w.float(), bias.float(), "silu")[..., K - 1 :]
        worst_out = max(worst_out, rel_err(out[:, :, a:e], ref))
        worst_fin = max(worst_fin, rel_err(fin[s], stream[0, :, -(K - 1):]))
    checks["packed_vs_each_sequence"] = {"out": worst_out, "final_states": worst_fin}
    results["correctness"] = checks
    bad = [f"{k}.{n}={v:.3g}" for k, errs in checks.items() for n, v in errs.items() if v > 1e-2]
    return bad


def time_conv(results, bw_copy):
    rows = []
    for b, d, l in SHAPES:
        for layout in ("tokens_contiguous", "channels_last"):
            x, w, bias = make_inputs(b, d, l, layout, grad=True)
            gy = torch.randn(x.shape, device=DEVICE, dtype=x.dtype)
            n_bytes = x.numel() * x.element_size()
            entry = {"b": b, "d": d, "l": l, "layout": layout}

            def fwd():
                return kconv.causal_conv1d(x, w, bias, "silu")

            def fwd_bwd():
                torch.autograd.grad(kconv.causal_conv1d(x, w, bias, "silu"), [x, w, bias], gy)

            with torch.no_grad():
                entry["fwd_ms"] = median_ms(fwd)
            entry["fwd_bwd_ms"] = median_ms(fwd_bwd)
            # forward: read x, write out; backward: read x and dout, write dx.
            entry["fwd_TBps"] = 2 * n_bytes / entry["fwd_ms"] / 1e9
            entry["fwd_bwd_TBps"] = 5 * n_bytes / entry["fwd_bwd_ms"] / 1e9
            entry["fwd_copy_ms"] = 2 * n_bytes / bw_copy * 1e3
            entry["fwd_bwd_copy_ms"] = 5 * n_bytes / bw_copy * 1e3
            if peer is not None:
                try:
                    def peer_fwd():
                        return peer.causal_conv1d_fn(x, w, bias, activation="silu")

                    def peer_fwd_bwd():
                        torch.autograd.grad(peer.causal_conv1d_fn(x, w, bias, activation="silu"), [x, w, bias], gy)

                    with torch.no_grad():
                        entry["peer_fwd_ms"] = median_ms(peer_fwd)
                        entry["peer_vs_ours_out_err"] = rel_err(fwd(), peer_fwd())
                    entry["peer_fwd_bwd_ms"] = median_ms(peer_fwd_bwd)
                except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                    entry["peer_error"] = f"{type(e).__name__}: {e}"
            rows.append(entry)
    results["conv"] = rows


def time_packed(results, bw_copy):
    torch.manual_seed(1)
    lengths = torch.randint(1, PACKED_MAX_LEN, (PACKED_SEQUENCES,)).tolist()
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    x, w, bias = make_inputs(1, MAMBA2_D, sum(lengths), "channels_last", grad=True)
    h0 = torch.randn(len(lengths), MAMBA2_D, K - 1, device=DEVICE, dtype=x.dtype, requires_grad=True)
    gy = torch.randn(x.shape, device=DEVICE, dtype=x.dtype)
    gf = torch.randn(len(lengths), MAMBA2_D, K - 1, device=DEVICE, dtype=x.dtype)
    n_bytes = x.numel() * x.element_size()

    def fwd():
        return kconv.causal_conv1d(x, w, bias, "silu", cu_seqlens=cu, initial_states=h0, return_final_states=True)

    def fwd_bwd():
        out, fin = fwd()
        torch.autograd.grad([out, fin], [x, w, bias, h0], [gy, gf])

    with torch.no_grad():
        fwd_ms = median_ms(fwd)
    entry = {"sequences": len(lengths), "l": sum(lengths), "d": MAMBA2_D, "layout": "channels_last",
             "fwd_ms": fwd_ms, "fwd_bwd_ms": median_ms(fwd_bwd),
             "fwd_copy_ms": 2 * n_bytes / bw_copy * 1e3, "fwd_bwd_copy_ms": 5 * n_bytes / bw_copy * 1e3}
    results["packed"] = entry


def time_update(results):
    rows = []
    for b in UPDATE_BATCHES:
        x = torch.randn(b, MAMBA2_D, device=DEVICE, dtype=torch.bfloat16)
        state = torch.randn(b, MAMBA2_D, K, device=DEVICE, dtype=torch.bfloat16)  # HF: s = k
        w = torch.randn(MAMBA2_D, K, device=DEVICE, dtype=torch.bfloat16)
        bias = torch.randn(MAMBA2_D, device=DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            want, want_state = reference.causal_conv1d_update(x[..., None], state, w, bias, "silu")
            buf = state.clone()
            got, _ = kconv.causal_conv1d_update(x, buf, w, bias, "silu", out_state=buf)
            entry = {"b": b, "d": MAMBA2_D, "out_err": rel_err(got, want[..., 0]),
                     "state_exact": bool(torch.equal(buf, want_state))}
            entry["eager_ms"] = median_ms(lambda: kconv.causal_conv1d_update(x, buf, w, bias, "silu", out_state=buf))
            if DEVICE == "cuda":  # decode runs under CUDA graphs: time the replay too
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    kconv.causal_conv1d_update(x, buf, w, bias, "silu", out_state=buf)
                entry["graph_replay_ms"] = median_ms(graph.replay)
            if peer is not None:
                try:
                    entry["peer_eager_ms"] = median_ms(lambda: peer.causal_conv1d_update(x, buf, w, bias, "silu"))
                except Exception as e:  # noqa: BLE001
                    entry["peer_error"] = f"{type(e).__name__}: {e}"
        rows.append(entry)
    results["update"] = rows


# (block_d, block_l, group, num_warps, channels_last). Tokens-contiguous tiles keep
# block_d = 1 and channels-last tiles block_d = 8 * 32 * num_warps (bf16) so that the group
# axis stays in registers whatever the Triton version (see the kernel module's docstring).
SWEEP = {
    "tokens_contiguous": [
        kconv.TileConfig(1, 2048, 8, 4, False), kconv.TileConfig(1, 1024, 8, 4, False),
        kconv.TileConfig(1, 1024, 8, 2, False), kconv.TileConfig(1, 2048, 8, 8, False),
        kconv.TileConfig(1, 512, 8, 1, False), kconv.TileConfig(1, 1024, 16, 2, False),
    ],
    "channels_last": [
        kconv.TileConfig(1024, 4, 4, 4, True), kconv.TileConfig(512, 4, 4, 2, True),
        kconv.TileConfig(256, 4, 4, 1, True), kconv.TileConfig(1024, 8, 8, 4, True),
        kconv.TileConfig(2048, 4, 4, 8, True),
    ],
}


def sweep(results):
    rows = []
    b, d, l = SHAPES[0]
    for layout, configs in SWEEP.items():
        x, w, bias = make_inputs(b, d, l, layout)
        gy = torch.randn(x.shape, device=DEVICE, dtype=x.dtype)
        want = kconv.conv_forward(x, w, bias, "silu", None, None, False)[0]
        for cfg in configs:
            row = {"layout": layout, **cfg.__dict__}
            try:
                out = kconv.conv_forward(x, w, bias, "silu", None, None, False, config=cfg)[0]
                row["ok"] = bool(torch.equal(out, want))
                row["fwd_ms"] = median_ms(lambda: kconv.conv_forward(x, w, bias, "silu", None, None, False, config=cfg))
                row["bwd_ms"] = median_ms(lambda: kconv.conv_backward(x, w, bias, "silu", None, None, gy, None, config=cfg))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is data too
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
    results["sweep_b8_d5120_l2048"] = rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON path (default $OUT/bench_causal_conv1d.json)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweep")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU interpreter in seconds (no sweep): checks the script, measures nothing")
    args = parser.parse_args()
    args.no_sweep = args.no_sweep or args.smoke
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    started = time.time()
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__, "triton": triton.__version__,
               "peer": PEER_NOTE, "width": K, "dtype": "bfloat16", "activation": "silu"}
    bad = check_full_size(results)
    probe = SHAPES[0][0] * SHAPES[0][1] * SHAPES[0][2] * 2
    bw_copy = copy_bandwidth(probe)
    results["copy_TBps"] = bw_copy / 1e12
    time_conv(results, bw_copy)
    time_packed(results, bw_copy)
    time_update(results)
    if not args.no_sweep:
        sweep(results)
    results["seconds"] = time.time() - started

    path = args.out or os.path.join(os.environ.get("OUT", "."), "bench_causal_conv1d.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
    rows = results["conv"]
    bench_common.bar_chart(os.path.splitext(path)[0] + ".png", f"causal conv1d, {results['device']}",
                           [f"{r['b']}x{r['d']}x{r['l']} {r['layout'][:8]}" for r in rows],
                           {"ours fwd": [r["fwd_ms"] for r in rows], "peer fwd": [r.get("peer_fwd_ms") for r in rows],
                            "ours fwd+bwd": [r["fwd_bwd_ms"] for r in rows],
                            "peer fwd+bwd": [r.get("peer_fwd_bwd_ms") for r in rows]}, "ms (median)", log=True)

    print(f"\n{results['device']}  torch {results['torch']}  triton {results['triton']}  copy {results['copy_TBps']:.2f} TB/s")
    print(PEER_NOTE)
    print("correctness (max rel err vs reference, bf16):",
          "; ".join(f"{k}: " + ", ".join(f"{n} {v:.1e}" for n, v in e.items()) for k, e in results["correctness"].items()))
    if bad:
        print("CORRECTNESS FAILURES:", ", ".join(bad))
    if "sweep_b8_d5120_l2048" in results:
        print("\nsweep B=8 D=5120 L=2048 (block_d, block_l, group, warps): fwd / bwd-only ms")
        for r in results["sweep_b8_d5120_l2048"]:
            cfg = f"{r['layout'][:6]} ({r['block_d']},{r['block_l']},{r['group']},{r['num_warps']})"
            print(f"  {cfg:28s} " + (f"{r['fwd_ms']:.4f} / {r['bwd_ms']:.4f}  equal={r['ok']}" if "fwd_ms" in r else r["error"]))
    print(f"\n{'shape':22s} {'layout':10s} {'fwd ms':>8s} {'copy%':>6s} {'peer':>8s} {'peer/ours':>9s} "
          f"{'f+b ms':>8s} {'copy%':>6s} {'peer':>8s} {'peer/ours':>9s}")
    for r in results["conv"]:
        pf, pb = r.get("peer_fwd_ms"), r.get("peer_fwd_bwd_ms")
        print(f"{r['b']}x{r['d']}x{r['l']:<12d} {r['layout'][:10]:10s} {r['fwd_ms']:8.4f} "
              f"{100 * r['fwd_copy_ms'] / r['fwd_ms']:5.0f}% {pf or float('nan'):8.4f} "
              f"{(pf / r['fwd_ms']) if pf else float('nan'):9.2f} {r['fwd_bwd_ms']:8.4f} "
              f"{100 * r['fwd_bwd_copy_ms'] / r['fwd_bwd_ms']:5.0f}% {pb or float('nan'):8.4f} "
              f"{(pb / r['fwd_bwd_ms']) if pb else float('nan'):9.2f}")
    p = results["packed"]
    print(f"packed {p['sequences']} seqs, L={p['l']}, D={p['d']} (init+final states): fwd {p['fwd_ms']:.4f} ms "
          f"({100 * p['fwd_copy_ms'] / p['fwd_ms']:.0f}% of copy), fwd+bwd {p['fwd_bwd_ms']:.4f} ms "
          f"({100 * p['fwd_bwd_copy_ms'] / p['fwd_bwd_ms']:.0f}%)")
    for u in results["update"]:
        print(f"update b={u['b']:<3d} d={u['d']}: eager {u['eager_ms'] * 1e3:.1f} us, graph replay "
              f"{u.get('graph_replay_ms', float('nan')) * 1e3:.1f} us, peer eager {u.get('peer_eager_ms', float('nan')) * 1e3:.1f} us, "
              f"err {u['out_err']:.1e}, state exact {u['state_exact']}")
    print(f"total {results['seconds']:.0f} s")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
