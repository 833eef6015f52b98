"""How a batch-1 Mamba-1 forward should split its row: segment count x forward tile x register
cap, timed from CUDA graphs beside mamba-ssm's selective_scan_fn on the same inputs.

    python benchmarks/sweep_scan_split.py [--out FILE] [--lengths 2048 4096 ...]

Why: at B=1 (d=5120) the row is cut into G segments so that enough programs run; each
program is one warp, so how many are resident per SM is set by the tile's registers (or the
block limit of 32), and G * d / BLOCK_D programs fill a whole number of waves only for some G.
The segment pass and the output pass are timed together, as ``selective_scan`` runs them.
Every config's y is checked against the default's (max relative difference, fp32 output).

Writes JSON (default $OUT/sweep_scan_split.json) and prints one line per config.
``--plot JSON`` draws an earlier run's JSON (forward time against segment count, one line per
tile and cap, the peer and the default marked) to a PNG beside it, without a GPU.
Dimension letters: b batch, d channels, l tokens, n state size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_selective_scan import D_MODEL, N_STATE, ORDER, graph_time, make_inputs, mamba_ssm_scan, rel_err  # noqa: E402
from ssmshard.kernels.selective_scan import ScanConfig, _segments, default_config, selective_scan  # noqa: E402

# (channels per tile, register cap): the three tiles, and caps that let the 16-channel tile
# (128 registers uncapped: 16 warps per SM) hold 20 or 21 warps per SM.
TILES = [(8, None), (16, None), (16, 104), (16, 96), (32, None)]
SEGMENTS = {2048: [4, 5, 6, 7, 8, 11, 16], 4096: [6, 7, 8, 10, 11, 13, 16, 22],
            8192: [11, 13, 16, 22, 26, 32], 16384: [16, 22, 26, 32, 43, 64]}


def fwd_bwd_times(inputs, cfg) -> dict:
    """Forward+backward medians, eager (``do_bench``) and replayed from a CUDA graph."""
    leaves = [a.detach().requires_grad_(True) for a in inputs]
    dy = torch.randn_like(inputs[0])

    def step():
        torch.autograd.grad(selective_scan(*leaves, True, config=cfg), leaves, dy)

    return {"eager_ms": triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"),
            "graph_ms": graph_time(step)}


def plot(path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as fh:
        results = json.load(fh)
    rows = results["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for block_d, cap in TILES:
            points = sorted((c["segments"], c["graph_ms"]) for c in row["configs"]
                            if c["block_d"] == block_d and c["maxnreg"] == cap)
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=f"{block_d} ch" + (f", cap {cap}" if cap else ""))
        if row.get("peer_graph_ms"):
            ax.axhline(row["peer_graph_ms"], color="k", ls="--", lw=1, label="mamba-ssm")
        ax.axhline(row["default_graph_ms"], color="grey", ls=":", lw=1, label="default")
        ax.set(title=f"B=1 d={D_MODEL} L={row['l']}", xlabel="segments", ylabel="forward, CUDA graph (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Mamba-1 forward at batch 1: row split ({results['device']})", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--lengths", type=int, nargs="*", default=sorted(SEGMENTS))
    parser.add_argument("--no-mamba", action="store_true")
    parser.add_argument("--fwd-bwd-segments", type=int, nargs="*", default=[],
                        help="also time forward+backward (eager and from a CUDA graph) at the default's tile with "
                             "these nominal segment counts and the default's")
    parser.add_argument("--plot", metavar="JSON", default=None, help="draw an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.plot:
        print(f"wrote {plot(args.plot)}")
        return
    out = args.out or os.path.join(os.environ.get("OUT", "."), "sweep_scan_split.json")
    device = torch.device("cuda")
    peer = None if args.no_mamba else mamba_ssm_scan()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "sms": torch.cuda.get_device_properties(device).multi_processor_count, "rows": []}
    t0 = time.time()
    for l in args.lengths:
        x = make_inputs(1, D_MODEL, l, N_STATE, device)
        inputs = [x[k] for k in ORDER]
        base = default_config(1, D_MODEL, l, device)
        row = {"l": l, "default": base.__dict__, "configs": []}
        with torch.no_grad():
            y_want = selective_scan(*inputs, True, out_dtype=torch.float32, config=base)
            if peer is not None:
                row["peer_graph_ms"] = graph_time(lambda: peer(*inputs, delta_softplus=True))
        row["default_graph_ms"] = graph_time(lambda: selective_scan(*inputs, True, config=base))
        print(f"L={l}: default (G={base.segments}, bd{base.par_block_d}) {row['default_graph_ms']:.4f} ms, "
              f"peer {row.get('peer_graph_ms')} ms", flush=True)
        seen = set()
        for block_d, cap in TILES:
            for nominal in SEGMENTS[l]:
                cfg = ScanConfig(**{**base.__dict__, "par_block_d": block_d, "par_maxnreg": cap, "segments": nominal})
                segments = _segments(l, cfg)[0]
                if (block_d, cap, segments) in seen:
                    continue
                seen.add((block_d, cap, segments))
                with torch.no_grad():
                    diff = rel_err(selective_scan(*inputs, True, out_dtype=torch.float32, config=cfg), y_want)
                ms = graph_time(lambda: selective_scan(*inputs, True, config=cfg))
                row["configs"].append({"block_d": block_d, "maxnreg": cap, "segments": segments, "graph_ms": ms,
                                       "max_rel_diff": diff})
                print(f"    bd{block_d:<2} cap {str(cap):>4} G={segments:<3} {ms:.4f} ms  diff {diff:.1e}", flush=True)
        for nominal in sorted({base.segments, *args.fwd_bwd_segments}):
            cfg = ScanConfig(**{**base.__dict__, "segments": nominal})
            row.setdefault("fwd_bwd", []).append(dict(segments=_segments(l, cfg)[0], **fwd_bwd_times(inputs, cfg)))
            print(f"    fwd+bwd bd{cfg.par_block_d} G={_segments(l, cfg)[0]}: {row['fwd_bwd'][-1]}", flush=True)
        results["rows"].append(row)
        del x, inputs, y_want
    results["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
