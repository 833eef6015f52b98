"""One SSD forward of ours and of mamba_ssm's, ready for Nsight Compute, plus device times.

Builds bench_ssd_scan.py's inputs for one shape, runs both forwards until autotuning has
settled, prints each one's kernels with their device time per call (torch.profiler), then
runs each forward once between cudaProfilerStart/Stop. Under

    ncu --profile-from-start off --clock-control none --set full -o REPORT \\
        python benchmarks/ncu_ssd_forward.py --batch 8 --length 2048

only those two forwards are profiled (the autotuner's trial launches are not). Without ncu
the script is a quick device-time A/B of the forward kernels. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_ssd_scan import CHUNK, chosen_configs, make_inputs  # noqa: E402
from profiling import profile_kernels, summary  # noqa: E402


def peer_best_configs():
    """The configs mamba_ssm's autotuned SSD forward kernels settled on (name -> str)."""
    from mamba_ssm.ops.triton import ssd_bmm, ssd_chunk_scan, ssd_chunk_state, ssd_state_passing

    found = {}
    for module in (ssd_chunk_scan, ssd_chunk_state, ssd_state_passing, ssd_bmm):
        for name in dir(module):
            best = getattr(getattr(module, name), "best_config", None)
            if name.startswith("_") and name.endswith("_fwd_kernel") and best is not None:
                found[name] = str(best)
    return found


def output_config_timings():
    """The autotuner's median per chunk-output config at the last tuned key (config -> ms)."""
    from ssmshard.kernels import ssd_scan_fwd

    timings = getattr(ssd_scan_fwd.chunk_output.tuned, "configs_timings", None) or {}
    return {str(config): float(ms[0] if isinstance(ms, (list, tuple)) else ms) for config, ms in timings.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--no-mamba", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    from ssmshard.kernels.ssd_scan import ssd_scan

    torch.manual_seed(0)
    inp = make_inputs(args.batch, args.length, False, "cuda")
    forwards = {"ours": lambda: ssd_scan(**inp, chunk_size=CHUNK, dt_softplus=True)}
    if not args.no_mamba:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        forwards["mamba"] = lambda: mamba_chunk_scan_combined(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], CHUNK, D=inp["D"], dt_bias=inp["dt_bias"],
            dt_softplus=True)
    report = {"device": torch.cuda.get_device_name(), "batch": args.batch, "length": args.length}
    with torch.no_grad():
        for name, fn in forwards.items():
            for _ in range(3):  # autotune, then settle
                fn()
            table = profile_kernels(fn)
            report[name] = {"kernels": table, "ms_per_call": sum(r["ms_per_call"] for r in table)}
            print(f"{name}: {report[name]['ms_per_call']:.3f} ms device time; {summary(table)}", flush=True)
        report["ours_configs"] = {k: v for k, v in chosen_configs().items() if k.startswith("chunk_")}
        print("ours configs:", report["ours_configs"], flush=True)
        report["ours_output_config_ms"] = output_config_timings()
        for config, ms in report["ours_output_config_ms"].items():
            print(f"  chunk output {config}: {ms:.4f} ms (autotuner)", flush=True)
        if "mamba" in forwards:
            report["mamba_configs"] = peer_best_configs()
            print("mamba configs:", report["mamba_configs"], flush=True)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for fn in forwards.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
