"""Zamba2-2.7B's batch-1 time to first token at 4K, before and after a batch-1 TPOT run (one GPU).

    PYTHONPATH=$PWD python benchmarks/results/decode/zamba2_ttft_order.py [--trace-all-layers]

``benchmarks/decode_gpu.py`` measured 80.5 ms (0.99x the forward) when TTFT ran alone and
105.5 ms (1.32x) when it followed the batch-1 TPOT run. The hypothesis this script tests: static
key/value buffers of another length replace the batch's decode graph and slow the next prefill.
(It did not hold: the kernels and their device time were the same in every order; the wall time
varied with the host, benchmarks/results/decode/README.md.) This script times ``dm.generate(max_new_tokens=1)``
call by call in that order (random bf16 weights, tp 1), ``dm.prefill`` alone, generate without
static buffers, and profiles one slow call: host wall time beside the kernels' summed device time
and the ops with the most host time. One JSON line per measurement.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import bench_common  # noqa: E402
import decode_gpu  # noqa: E402
import ssmshard  # noqa: E402

LONG, SHORT, NEW = 4096, 128, 32


def times_ms(fn, repeats):
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(round(1e3 * (time.perf_counter() - start), 2))
    return out


def profiled(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    averages = prof.key_averages()
    host = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:12]
    device = sorted(averages, key=lambda a: -a.self_device_time_total)[:8]
    return {"wall_ms": round(wall, 2), "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 2),
            "kernels": len(kernels),
            "top_host_ops": [(a.key[:60], a.count, round(a.self_cpu_time_total / 1e3, 2)) for a in host],
            "top_device_ops": [(a.key[:60], a.count, round(a.self_device_time_total / 1e3, 2)) for a in device]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace-all-layers", action="store_true", help="SSMSHARD_TRACE_ALL_LAYERS=1")
    args = parser.parse_args()
    if args.trace_all_layers:
        os.environ["SSMSHARD_TRACE_ALL_LAYERS"] = "1"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    bench_common.init_single_process_group(device)
    model = decode_gpu.build_random_model(decode_gpu.GPU_MODELS["zamba2-2.7b"](), device, torch.bfloat16, 7)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
    vocab = model.config.vocab_size
    long_ids = decode_gpu.prompt_ids(vocab, 1, LONG, device, 7)
    short_ids = decode_gpu.prompt_ids(vocab, 1, SHORT, device, 7)

    def ttft(static_kv=LONG + NEW):
        return dm.generate(long_ids, max_new_tokens=1, pad_token_id=0, static_kv=static_kv)

    def emit(**row):
        print(json.dumps({"trace_all_layers": args.trace_all_layers, **row}), flush=True)

    emit(step="ttft before any TPOT run", ms=times_ms(ttft, 6))
    emit(step="forward", ms=times_ms(lambda: dm(long_ids), 4))
    emit(step="prefill", ms=times_ms(lambda: dm.prefill(long_ids), 4))
    emit(step="ttft static_kv=False", ms=times_ms(lambda: ttft(False), 4))
    emit(step="batch-1 TPOT-run generate (static_kv 160)",
         ms=times_ms(lambda: dm.generate(short_ids, max_new_tokens=NEW, pad_token_id=0, static_kv=SHORT + NEW), 3))
    emit(step="ttft after the TPOT run", ms=times_ms(ttft, 6))
    emit(step="profile of ttft after the TPOT run", **profiled(ttft))
    emit(step="profile of prefill", **profiled(lambda: dm.prefill(long_ids)))


if __name__ == "__main__":
    main()
