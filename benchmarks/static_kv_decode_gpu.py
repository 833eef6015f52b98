"""TPOT of attention models' decode: growing cache (eager) against static key/value buffers (eager
and one CUDA-graph replay per step), tp = 1, random bf16 weights.

    PYTHONPATH=$PWD python3 benchmarks/static_kv_decode_gpu.py --out $OUT            # one GPU
    PYTHONPATH=$PWD python3 benchmarks/static_kv_decode_gpu.py --layers 8 --out $OUT # shallower copies
    PYTHONPATH=$PWD python benchmarks/static_kv_decode_gpu.py --smoke --out DIR      # CPU, tiny configs

TPOT = (median time of ``dm.generate(max_new_tokens=n)`` - median time of ``max_new_tokens=1``)
/ (n - 1), each timed run after a device synchronize; EOS is unset so every run generates n
tokens. The weight-read floor of a step is the bytes of the weights over the device-to-device
copy bandwidth measured in the same run (bytes read and written). ``--layers`` keeps the first N
decoder layers of each config (TPOT scales with depth; the header of the JSON says which depth
ran). Rows go to ``OUT/static_kv_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.families import BY_NAME

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402 (sibling module)
from generate_gpu import build_random_model, keep_layers, llama3_8b_config, zamba2_2p7b_config  # noqa: E402 (sibling script)

GPU_MODELS = {"zamba2-2.7b": zamba2_2p7b_config, "llama-3-8b": llama3_8b_config}
SMOKE_MODELS = {f"tiny-{name}": (lambda name=name: BY_NAME[name].make_config()) for name in ("zamba2", "llama")}
# generate() arguments of each decode variant.
VARIANTS = {"dynamic_eager": dict(cuda_graph=False, static_kv=False),
            "static_eager": dict(cuda_graph=False, static_kv=True),
            "static_graphed": dict(cuda_graph=True, static_kv=True)}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, gib=1.0, repeats=5):
    """Bytes read and written per second by a device-to-device copy of ``gib`` GiB (median)."""
    n = int(gib * 2 ** 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def median_seconds(fn, device, repeats):
    fn()  # warm-up: captures programs and graphs
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_model(name, config, args, device, dtype, bandwidth):
    keep_layers(config, args.layers)
    model = build_random_model(config, device, dtype) if device.type == "cuda" else \
        BY_NAME[name.removeprefix("tiny-")].model_class()(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every run generates max_new_tokens
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1, config.vocab_size, (batch, args.prompt), generator=gen).to(device)
        row = {"model": name, "layers": config.num_hidden_layers, "batch": batch, "prompt": args.prompt,
               "new_tokens": args.new_tokens, "weight_bytes": weight_bytes,
               "weight_read_floor_ms": 1e3 * weight_bytes / bandwidth if bandwidth else None}
        for variant, options in VARIANTS.items():
            if variant == "static_graphed" and device.type != "cuda":
                continue

            def run(n):
                return lambda: dm.generate(ids, max_new_tokens=n, pad_token_id=0, **options)

            first = median_seconds(run(1), device, args.repeats)
            whole = median_seconds(run(args.new_tokens), device, args.repeats)
            row[f"{variant}_tpot_ms"] = 1e3 * (whole - first) / (args.new_tokens - 1)
            row[f"{variant}_ttft_ms"] = 1e3 * first
        print(json.dumps(row), flush=True)
        rows.append(row)
    del dm, model
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", help="default: every model of the suite")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (0: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (fp32, gloo)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    suite = SMOKE_MODELS if args.smoke else GPU_MODELS
    bench_common.init_single_process_group(device)
    bandwidth = None if args.smoke else copy_bandwidth(device)
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "copy_bytes_per_s": bandwidth, "dtype": str(dtype)}
    rows = []
    for name in args.models or list(suite):
        rows += run_model(name, suite[name](), args, device, dtype, bandwidth)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "static_kv_decode.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
