"""Peak activation memory per rank and forward time of TP, TP + sequence parallelism and TSP.

    python benchmarks/tsp_memory.py --ranks 4 --model mamba2-2.7b --seq 16384 131072 --out DIR  # GPUs (NCCL)
    python benchmarks/tsp_memory.py --smoke --out DIR     # CPU, gloo, a tiny model: checks the script

For each plan (``Plan(tp=D)``, ``Plan(tp=D, sequence_parallel=True)``, ``Plan(tsp=D)`` and
``Plan(tsp=D, tsp_logits="local")``, which returns each rank's own tokens' logits) and each
sequence length, one forward pass (no grad) on batch 1: on CUDA the peak of
``torch.cuda.max_memory_allocated`` above the weights, on the CPU the peak bytes of live
activations of the program's graph (``ssmshard.testing.peak_activation_bytes``); and the median
forward seconds. Writes ``tsp_memory.json`` and ``tsp_memory.png`` (matplotlib) to DIR.

Models (``--model``, random bf16 weights drawn on the GPU, ``--layers`` to keep the first N):
Mamba-2.8B-, Mamba2-2.7B-, Zamba2-2.7B- and Llama-7B-sized configs (``generate_gpu.py``'s, and
Llama-2-7B's shape for the last). ``--smoke`` runs the small test config of the same family,
whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import generate_gpu  # noqa: E402  (a sibling script: the GPU-sized configs)
import torch  # noqa: E402

import ssmshard  # noqa: E402
from ssmshard.families import build_small_model  # noqa: E402
from ssmshard.testing import peak_activation_bytes, randomize_weights  # noqa: E402

PLANS = {"tp": lambda d: ssmshard.Plan(tp=d, training=False),
         "tp+sp": lambda d: ssmshard.Plan(tp=d, sequence_parallel=True, training=False),
         "tsp": lambda d: ssmshard.Plan(tsp=d, training=False),
         "tsp-local": lambda d: ssmshard.Plan(tsp=d, tsp_logits="local", training=False)}

# --model -> (GPU-sized config, the family whose small test config --smoke runs)
MODELS = {"mamba-2.8b": (generate_gpu.mamba_2p8b_config, "mamba"),
          "mamba2-2.7b": (generate_gpu.mamba2_2p7b_config, "mamba2"),
          "zamba2-2.7b": (generate_gpu.zamba2_2p7b_config, "zamba2"),
          "llama-7b": (generate_gpu.llama2_7b_config, "llama")}


def _model(name, layers, device):
    make_config, family = MODELS[name]
    if bench_common.SMOKE:
        return randomize_weights(build_small_model(family), seed=1)
    config = generate_gpu.keep_layers(make_config(), layers)
    return generate_gpu.build_random_model(config, device, torch.bfloat16, seed=1)


def _timed(fn, device) -> float:
    if device == "cpu":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


@torch.no_grad()
def rank_main(rank, world, model_name, layers, lengths, repeats, out):
    device = "cpu" if bench_common.SMOKE else f"cuda:{torch.cuda.current_device()}"
    model = _model(model_name, layers, device)
    rows = []
    for plan_name, make_plan in PLANS.items():
        dm = ssmshard.parallelize(model, make_plan(world))
        for seq in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
            if device == "cpu":
                peak = peak_activation_bytes(dm.program.for_shapes([ids]), ids)
            else:
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                dm(ids)
                peak = torch.cuda.max_memory_allocated() - base
            times = [_timed(lambda: dm(ids), device) for _ in range(repeats)]
            rows.append({"plan": plan_name, "ranks": world, "seq": seq, "batch": 1, "rank": rank,
                         "peak_activation_bytes": peak, "forward_s": statistics.median(times)})
        del dm
    every_rank = [None] * world
    torch.distributed.all_gather_object(every_rank, rows)
    if rank == 0:
        result = {"model": model_name, "layers": model.config.num_hidden_layers, "ranks": world,
                  "device": "cpu (gloo)" if device == "cpu" else torch.cuda.get_device_name(),
                  "smoke": bench_common.SMOKE,
                  "rows": [row for rank_rows in every_rank for row in rank_rows]}
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tsp_memory.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result["rows"][:len(rows)], indent=1))


def plot(out):
    with open(os.path.join(out, "tsp_memory.json")) as f:
        result = json.load(f)
    rows = [r for r in result["rows"] if r["rank"] == 0]
    lengths = sorted({r["seq"] for r in rows})
    series = {plan: [next((r["peak_activation_bytes"] / 2**20 for r in rows if r["plan"] == plan and r["seq"] == s),
                          None) for s in lengths] for plan in PLANS}
    bench_common.bar_chart(os.path.join(out, "tsp_memory.png"),
                           f"{result['model']}: peak activation MiB per rank, {result['ranks']} ranks, "
                           f"{result['device']}", [f"seq {s}" for s in lengths], series, "MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="mamba2-2.7b")
    parser.add_argument("--layers", type=int, default=None, help="keep the model's first N layers (default: all)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tsp_memory"))
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, a tiny model: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.seq, args.repeats = 2, [32, 64], 1
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on GPUs, or pass --smoke to check the script on the CPU")
    ssmshard.launch(rank_main, args.ranks, args.model, args.layers, args.seq, args.repeats, args.out,
                    backend="gloo" if args.smoke else None)
    plot(args.out)


if __name__ == "__main__":
    main()
