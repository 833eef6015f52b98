"""CPU benchmark: how long ``ssmshard.capture`` takes on meta-device models, by depth and mode.

Capture runs torch.export over the whole model, so its cost grows with the layer count; on
the meta device no weight is allocated, so a 64-layer Mamba-2.8B-width model captures in a
process of well under 2 GB (asserted in tests/test_capture.py). Wall time is measured here,
not in the tests, because on a shared CI machine it is not a correctness property.

    python benchmarks/bench_capture.py [--layers 8 16 32 64] [--repeats 3] [--out FILE]
    python benchmarks/bench_capture.py --smoke --out FILE     # 2 layers, one capture each: checks the script

Each (family, mode, layers) point is the median of ``--repeats`` captures, each in a fresh
process (export caches nothing across processes, and a fresh process is what a user pays).
Writes JSON to --out (default benchmarks/results/capture/capture_cpu.json), a plot beside it (.png,
with matplotlib), and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

# Mamba-2.8B and Mamba2-2.7B widths; the depth is the swept variable.
CONFIGS = {
    "mamba": "MambaConfig(vocab_size=50280, hidden_size=2560, num_hidden_layers={layers}, state_size=16)",
    "mamba2": ("Mamba2Config(vocab_size=50280, hidden_size=2560, num_hidden_layers={layers}, state_size=128,"
               " num_heads=80, head_dim=64, n_groups=1)"),
}

ONE_CAPTURE = """
import resource, time, torch, ssmshard
from transformers import MambaConfig, Mamba2Config
from ssmshard.families import build_meta_model
model = build_meta_model({config})
started = time.perf_counter()
ssmshard.capture(model, mode={mode!r})
print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def time_capture(family: str, mode: str, layers: int) -> tuple[float, float]:
    script = ONE_CAPTURE.format(config=CONFIGS[family].format(layers=layers), mode=mode)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"capture of {family} {mode} {layers} layers failed:\n{out.stderr[-3000:]}")
    seconds, peak_gb = (float(x) for x in out.stdout.split()[-2:])
    return seconds, peak_gb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--modes", nargs="+", default=["forward"], choices=["forward", "decode", "prefill"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "capture", "capture_cpu.json"))
    parser.add_argument("--smoke", action="store_true", help="2 layers, one capture per point: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.repeats = [2], 1

    import torch
    import transformers
    from tqdm import tqdm

    points = [(f, m, n) for f in args.families for m in args.modes for n in args.layers]
    rows = []
    for family, mode, layers in tqdm(points, desc="captures", unit="point"):
        runs = [time_capture(family, mode, layers) for _ in range(args.repeats)]
        rows.append({"family": family, "mode": mode, "layers": layers,
                     "seconds_median": statistics.median(s for s, _ in runs),
                     "seconds_all": [round(s, 3) for s, _ in runs],
                     "peak_rss_gb_max": max(g for _, g in runs)})
    result = {"machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__},
              "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'family':8} {'mode':8} {'layers':>6} {'median s':>9} {'s/layer':>8} {'peak GB':>8}")
    for r in rows:
        print(f"{r['family']:8} {r['mode']:8} {r['layers']:6d} {r['seconds_median']:9.2f} "
              f"{r['seconds_median'] / r['layers']:8.3f} {r['peak_rss_gb_max']:8.2f}")
    print(f"wrote {args.out}")
    points = sorted({r["layers"] for r in rows})
    series = {f"{f} {m}": [next((r["seconds_median"] for r in rows if (r["family"], r["mode"], r["layers"]) == (f, m, n)),
                                None) for n in points] for f in args.families for m in args.modes}
    bench_common.bar_chart(os.path.splitext(args.out)[0] + ".png", "capture on the meta device, median seconds",
                           [f"{n} layers" for n in points], series, "seconds")


if __name__ == "__main__":
    main()
