"""Where the host's time goes in a batch-1 prefill of a short prompt: ``cProfile`` over
``dm.prefill`` of a 128-token prompt (the device work there is a few ms; the rest is the
host running the graph), one GPU, random bf16 weights, tp 1. Prints the wall time per prefill
(median of 5) without and with the profiler, then the functions with the most own time and the
most cumulative time, totalled over the profiled prefills (the warm-up's one included).

    PYTHONPATH=$PWD python benchmarks/results/decode/prefill_host_profile.py --models mamba2-2.7b mamba-2.8b
"""
import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
sys.path.insert(0, os.path.dirname(__file__))
import bench_common  # noqa: E402
import decode_gpu  # noqa: E402
import ssmshard  # noqa: E402
from short_prompt_ttft_profile import median_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mamba2-2.7b"])
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    bench_common.init_single_process_group(device)
    for name in args.models:
        model = decode_gpu.build_random_model(decode_gpu.GPU_MODELS[name](), device, torch.bfloat16, 7)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False))
        ids = decode_gpu.prompt_ids(model.config.vocab_size, 1, args.length, device, 7)
        prefill = lambda: dm.prefill(ids)  # noqa: E731
        plain = median_ms(prefill)
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = median_ms(prefill)
        profiler.disable()
        print(f"== {name}: prefill of {args.length} tokens, median of 5: {plain:.1f} ms "
              f"({profiled:.1f} ms under cProfile; the totals below are over 6 prefills)", flush=True)
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(args.top)
            print(f"-- by {order}")
            print(text.getvalue().split("ncalls", 1)[-1].join(("ncalls", "")), flush=True)
        del dm, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
