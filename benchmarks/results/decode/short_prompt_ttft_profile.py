"""Where batch-1 time to first token goes at a short prompt (one GPU).

    PYTHONPATH=$PWD python benchmarks/results/decode/short_prompt_ttft_profile.py [--models mamba-2.8b ...]

For each model (random bf16 weights, tp 1): ``dm.generate(max_new_tokens=1)`` and ``dm.prefill``
at prompts of 128 and 4096 tokens, medians of 5 after a warm-up, and one profiled prefill at 128
tokens: the host's wall time beside the summed device time of its kernels and the number of
kernels launched. Prints one JSON line per measurement.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import bench_common  # noqa: E402
import decode_gpu  # noqa: E402
import ssmshard  # noqa: E402


def median_ms(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b", "mamba2-2.7b"])
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    bench_common.init_single_process_group(device)
    for name in args.models:
        model = decode_gpu.build_random_model(decode_gpu.GPU_MODELS[name](), device, torch.bfloat16, 7)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
        prefill_program, _ = dm.generation_programs()
        for length in (128, 4096):
            ids = decode_gpu.prompt_ids(model.config.vocab_size, 1, length, device, 7)
            row = {"model": name, "prompt": length,
                   "generate_1_ms": median_ms(lambda: dm.generate(ids, max_new_tokens=1, pad_token_id=0)),
                   "prefill_ms": median_ms(lambda: dm.prefill(ids))}
            print(json.dumps(row), flush=True)
        ids = decode_gpu.prompt_ids(model.config.vocab_size, 1, 128, device, 7)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            start = time.perf_counter()
            dm.prefill(ids)
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - start)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_ms = sum(e.device_time for e in kernels) / 1e3
        print(json.dumps({"model": name, "prompt": 128, "profiled_prefill_wall_ms": wall,
                          "kernel_ms": device_ms, "kernels": len(kernels),
                          "graph_nodes": prefill_program.node_count()}), flush=True)
        del dm, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
