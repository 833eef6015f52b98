"""Where the static-K/V decode program's build goes, CPU only: a 54-layer small-width Zamba2 in
Zamba2-2.7B's layer layout (benchmarks/startup.py's), tp 1, the GPU plan's passes (the plan's
kernel choice forced to "triton", so that the decode passes a CUDA generate runs are the ones
run here).

    PYTHONPATH=$PWD python benchmarks/results/capture/static_decode_start.py [--profile FILE]

Prints:
- the seconds of `parallelize(lazy_forward=True)` (which builds the prefill program);
- the seconds of the static-K/V decode program;
- for each torch.export the static decode's capture calls, the seconds of that export with the
  capture's dynamic shapes, with static shapes (dynamic_shapes=None), then with dynamic shapes
  again (the capture itself uses the first).
"""
import argparse
import cProfile
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench_common  # noqa: E402
import startup  # noqa: E402

import ssmshard  # noqa: E402
from ssmshard.plan import Plan  # noqa: E402


def exports_timed_both_ways():
    """Wrap torch.export.export: each call also exports with static shapes and again with the
    caller's, and prints the three times."""
    export = torch.export.export

    def timed(module, args, dynamic_shapes=None, strict=False, **kw):
        times, programs = [], []
        for shapes in (dynamic_shapes, None, dynamic_shapes):
            started = time.perf_counter()
            programs.append(export(module, args, dynamic_shapes=shapes, strict=strict, **kw))
            times.append(time.perf_counter() - started)
        print(f"  export of {type(module).__name__}: dynamic {times[0]:.2f} s, static {times[1]:.2f} s, "
              f"dynamic again {times[2]:.2f} s; {len(programs[0].graph.nodes)} / {len(programs[1].graph.nodes)} nodes",
              flush=True)
        return programs[0]
    torch.export.export = timed
    return export


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="write a cProfile of the static-K/V decode program's build here")
    parser.add_argument("--exports", action="store_true", help="time each export with dynamic and static shapes")
    args = parser.parse_args()
    Plan.kernel_choice = lambda self, device: "triton"  # the GPU plan's passes, on CPU tensors
    bench_common.init_single_process_group(torch.device("cpu"))
    model = startup.build("zamba2", 54)
    started = time.perf_counter()
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1), lazy_forward=True)
    print(f"parallelize (lazy_forward=True): {time.perf_counter() - started:.2f} s", flush=True)
    if args.exports:
        exports_timed_both_ways()
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    dm.static_decode_program()
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    print(f"static-K/V decode program: {time.perf_counter() - started:.2f} s"
          f"{' (the three exports included)' if args.exports else ''}", flush=True)


if __name__ == "__main__":
    main()
