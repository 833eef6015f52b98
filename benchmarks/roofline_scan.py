"""Roofline of the Mamba-1 parallel scan kernels at the measured benchmark shapes: what bounds
them, from their sm_90 machine code and the bytes they must move, against the measured times.

    PYTHONPATH=/path/to/triton-3.6 python benchmarks/roofline_scan.py \\
        [--measured benchmarks/results/kernels/bench_selective_scan_parallel_bwd.json]

No GPU needed: the kernels are compiled offline (use the triton version of the GPU run, 3.6.0
on the H200 image) and their SASS read. For each kernel's hot loop (the forward's whole-tile
loop, the backward's pass A and pass B over whole tiles) it counts warp instructions per
iteration by class. With the benchmark's grid that gives the warp instructions a call issues;
the floors below divide them by what an H200 can issue:
- issue: 4 warp instructions per clock per SM (one per SM sub-partition);
- MUFU (exp2, rcp, ...): 16 lanes per clock per SM, i.e. 0.5 warp instructions per clock;
- SHFL: 32 lanes per clock per SM, i.e. 1 warp instruction per clock;
- bytes: the tensors a call must read and write, over the device copy rate measured in the
  same run as the times (``copy_roofline_GBps``).
SM count and clock are the H200's published figures (132 SMs, 1.98 GHz boost), not
measurements. Registers per thread come from ``cuobjdump --dump-resource-usage``; with one warp
per program they cap the resident warps per SM at 65536 / (32 * registers).

Dimension letters: b batch, d channels, l tokens, n state size, T tokens per tile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402

from compile_scan_alignment import KERNELS, compile_kernel  # noqa: E402

SMS, CLOCK_HZ = 132, 1.98e9  # H200 published figures
ISSUE, MUFU, SHFL = 4.0, 0.5, 1.0  # warp instructions per clock per SM
N, T, FWD_BLOCK_D, BWD_BLOCK_D, CHUNK = 16, 4, 32, 8, 64  # the GPU default ScanConfig


def loops(sass: str) -> list[list[str]]:
    """Bodies of the innermost loops in ``sass`` (a label and a later branch back to it), in
    code order."""
    lines = sass.split("\n")
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.fullmatch(r"\w+:", ln.strip())}
    spans = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA (\w+);", ln)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    innermost = [(a, b) for a, b in spans if not any(a < c and e < b for c, e in spans)]
    # (b - a > 8: not the one-instruction trap loop Triton ends a kernel with)
    return [lines[a + 1:b + 1] for a, b in sorted(innermost) if b - a > 8]


def mix(body: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for ln in body:
        m = re.search(r"\t(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def registers(cubin: bytes) -> int:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


# ptxas register caps tried by ``--register-caps`` (None: uncapped).
REGISTER_CAPS = (None, 232, 192, 168, 152, 128)


def register_caps() -> list[dict]:
    """Per kernel (the forward as training launches it, storing checkpoints) and cap: registers,
    spill loads (LDL) in the whole kernel and in its hot loops, and the hot loops' sizes."""
    rows = []
    for label, (fn, constants) in KERNELS.items():
        if label.startswith("forward"):
            constants = {**constants, "STORE_CKPT": True}
        for cap in REGISTER_CAPS:
            cubin = compile_kernel(fn, constants, set(), 90, maxnreg=cap).asm["cubin"]
            sass = get_sass(cubin)
            body = loops(sass)
            hot = [body[0]] if label.startswith("forward") else [body[0], body[-1]]  # see main()
            row = {"kernel": label.split()[0], "maxnreg": cap, "registers": registers(cubin),
                   "spill_loads": sass.count("LDL"), "spill_loads_in_hot_loops": [mix(b)["LDL"] for b in hot],
                   "hot_loop_instructions": [sum(mix(b).values()) for b in hot]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def floors_ms(warp_iters: float, ops: collections.Counter) -> dict:
    per_sm_clock = SMS * CLOCK_HZ / 1e3  # SM clocks per ms
    return {"issue": warp_iters * sum(ops.values()) / (ISSUE * per_sm_clock),
            "mufu": warp_iters * ops["MUFU"] / (MUFU * per_sm_clock),
            "shfl": warp_iters * ops["SHFL"] / (SHFL * per_sm_clock)}


def shape_of(label: str) -> tuple[int, int, int]:
    b, d, l = (int(re.search(key + r"=(\d+)", label).group(1)) for key in ("B", "d", "L"))
    return b, d, l


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default="benchmarks/results/kernels/bench_selective_scan_parallel_bwd.json")
    parser.add_argument("--out", default=None, help="write the report as JSON here too")
    parser.add_argument("--register-caps", action="store_true",
                        help="only compile each kernel under REGISTER_CAPS and print registers, spills and loop sizes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.register_caps:
        rows = register_caps()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"triton": triton.__version__, "arch": "sm_90", "caps": rows}, f, indent=1)
        return
    measured = json.load(open(args.measured))
    copy_Bps = measured["copy_roofline_GBps"] * 1e9

    code = {}
    for label, (fn, constants) in KERNELS.items():
        kernel = compile_kernel(fn, constants, set(), 90)
        code[label.split()[0]] = (loops(get_sass(kernel.asm["cubin"])), registers(kernel.asm["cubin"]))
    (fwd_loops, fwd_regs), (bwd_loops, bwd_regs) = code["forward"], code["backward"]
    # Forward: two tile loops (whole tiles, then the partial one): the first is the hot one.
    # Backward: pass A (whole, partial) then pass B (partial, whole): its hot loops are the first
    # and the last.
    hot = {"fwd": mix(fwd_loops[0]), "bwd_pass_a": mix(bwd_loops[0]), "bwd_pass_b": mix(bwd_loops[-1])}
    report = {"triton": triton.__version__, "sms": SMS, "clock_hz": CLOCK_HZ, "measured": args.measured,
              "registers": {"fwd": fwd_regs, "bwd": bwd_regs},
              "loops": {k: {"warp_instructions": sum(v.values()), **dict(v.most_common(8))} for k, v in hot.items()},
              "shapes": []}
    print(f"triton {triton.__version__}, sm_90 SASS; H200 at {SMS} SMs x {CLOCK_HZ / 1e9:.2f} GHz (published); "
          f"copy {copy_Bps / 1e12:.2f} TB/s (measured)")
    for k, v in hot.items():
        elems = (FWD_BLOCK_D if k == "fwd" else BWD_BLOCK_D) * T * N / 32
        print(f"  {k:11s} {sum(v.values()):5d} warp instr / tile = {sum(v.values()) / elems:5.1f} per (channel, token, "
              f"state) per lane; {dict(v.most_common(6))}")
    print(f"  registers: fwd {fwd_regs}, bwd {bwd_regs} -> at most {65536 // (32 * fwd_regs)} / "
          f"{65536 // (32 * bwd_regs)} resident warps per SM")
    for row in measured["scan"]:
        if "ours_fwd_ms" not in row or not row["shape"].startswith("B="):
            continue
        b, d, l = shape_of(row["shape"])
        fwd = floors_ms(b * d / FWD_BLOCK_D * l / T, hot["fwd"])
        bwd_iters = b * d / BWD_BLOCK_D * l / T
        bwd = {key: floors_ms(bwd_iters * (CHUNK / T - 1) / (CHUNK / T), hot["bwd_pass_a"])[key]
               + floors_ms(bwd_iters, hot["bwd_pass_b"])[key] for key in fwd}
        tokens = b * d * l
        fwd_bytes = tokens * 2 * 4 + b * l * N * 2 * 4  # u, delta, z read, y written (bf16); B, C fp32
        # backward: u, delta, z, dy read, du, ddelta, dz written (bf16), B, C read, and the dB / dC
        # partials (fp32, one row per BWD_BLOCK_D channels) written and read back by their sum
        partial_bytes = 2 * b * (d / BWD_BLOCK_D) * N * l * 4 * 2
        bwd_bytes = tokens * 2 * 7 + b * l * N * 2 * 4 + partial_bytes
        entry = {"shape": row["shape"], "ours_fwd_ms": row["ours_fwd_ms"], "ours_bwd_ms": row["ours_fwd_bwd_ms"] - row["ours_fwd_ms"],
                 "peer_fwd_ms": row.get("mamba_fwd_ms"), "peer_fwd_bwd_ms": row.get("mamba_fwd_bwd_ms"),
                 "fwd_floor_ms": {**fwd, "bytes": fwd_bytes / copy_Bps * 1e3},
                 "bwd_floor_ms": {**bwd, "bytes": bwd_bytes / copy_Bps * 1e3}}
        report["shapes"].append(entry)
        for part in ("fwd", "bwd"):
            fl = entry[f"{part}_floor_ms"]
            got = entry[f"ours_{part}_ms"]
            print(f"{row['shape']:24s} {part}: measured {got:6.3f} ms; floors issue {fl['issue']:.3f}, "
                  f"MUFU {fl['mufu']:.3f}, SHFL {fl['shfl']:.3f}, bytes {fl['bytes']:.3f} ms; "
                  f"issue floor / measured {fl['issue'] / got:.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
