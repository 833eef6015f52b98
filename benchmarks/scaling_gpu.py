"""Scaling with GPUs of one host: TPOT, TTFT and prefill throughput of TP against one GPU per copy,
with NCCL, the low-latency all-reduce, SPD and quantized syncs, all measured in one run.
    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 benchmarks/scaling_gpu.py --layers 16 --out $OUT
    python benchmarks/scaling_gpu.py --plot DIR                      # afterwards, CPU: table and plot
    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 benchmarks/scaling_gpu.py --smoke --out DIR  # CPU, gloo
Variants (every rank of the launcher takes part in each; N = ranks):
    tp1          one full copy per GPU (data parallel, N copies): the baseline every ratio divides
    tpN          Plan(tp=N), NCCL all-reduces
    tpN_symm     Plan(tp=N, allreduce=low_latency): one-shot peer-memory all-reduce for small messages
    tpN_symm_spd the same with SPD: out_proj syncs of the last layers dropped (see ``spd_drop_set``)
    tpN_int8 / tpN_fp8   Plan(tp=N, quantize_syncs=fmt): messages of at least 1 MiB quantized
Measured per variant (random bf16 weights, the same seed on every rank, median of --repeats):
TPOT = (time of generate(n) - time of generate(1)) / (n - 1) at batch 1 and 16 (the decode step is
a CUDA-graph replay where the program allows it); TTFT = time of generate(1) at batch 1 and the
long prompt; prefill throughput = batch x prompt tokens / time of one forward. Times are the
slowest rank's. For tp1 the throughput of the host is N times one copy's (N independent copies).
Glossary: N ranks, L layers kept, b batch, l prompt tokens, n new tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (before torch: --smoke sets the Triton interpreter)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ssmshard  # noqa: E402
from ssmshard.families import BY_NAME  # noqa: E402
from generate_gpu import (GPU_MODELS, build_random_model, peak_gib, prompt_ids, reset_peak,  # noqa: E402
                          synchronize)

# SPD's drop fraction: the sensitivity analysis on the trained small Mamba at tp 2 chose 7 of its
# 15 candidate out_proj sync points under a 1% perplexity budget (benchmarks/results/spd_accuracy/);
# the large configs drop the same fraction, last layers first (later layers were the insensitive
# ones there; layer 0 was extremely sensitive and is never dropped).
SPD_DROP_FRACTION = 7 / 15


def spd_drop_set(layers: int) -> list[str]:
    count = round(SPD_DROP_FRACTION * layers)
    return [f"layers.{i}.out_proj" for i in range(max(1, layers - count), layers)]


def variants(world: int, layers: int, smoke: bool) -> dict[str, ssmshard.Plan]:
    n = world
    low_latency = "nccl" if smoke else "symm_mem"  # symmetric memory needs CUDA: smoke checks the rest
    return {"tp1": ssmshard.Plan(tp=1, training=False),
            f"tp{n}": ssmshard.Plan(tp=n, training=False),
            f"tp{n}_symm": ssmshard.Plan(tp=n, training=False, allreduce=low_latency),
            f"tp{n}_symm_spd": ssmshard.Plan(tp=n, training=False, allreduce=low_latency,
                                             drop_syncs=spd_drop_set(layers)),
            f"tp{n}_int8": ssmshard.Plan(tp=n, training=False, quantize_syncs="int8"),
            f"tp{n}_fp8": ssmshard.Plan(tp=n, training=False, quantize_syncs="fp8")}


def keep_layers(config, layers: int):
    if layers:
        config.num_hidden_layers = min(config.num_hidden_layers, layers)
    return config


@dataclasses.dataclass
class Ranks:
    """This process's place in the launcher: its device, and the groups the timings use."""
    device: torch.device
    rank: int
    world: int
    cpu_group: object  # gloo: the slowest rank's time and the budget, off the GPUs' streams
    solo_groups: list  # one single-rank group per rank: each tp1 copy runs alone


def timed(ranks: Ranks, fn, repeats: int) -> float:
    """Median seconds of ``fn`` (after one warm-up), each timing ended by the slowest rank."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(ranks.device)
        start = time.perf_counter()
        fn()
        synchronize(ranks.device)
        local = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ranks.cpu_group)
        times.append(local.item())
    return statistics.median(times)


def measure(dm, vocab, args, ranks: Ranks) -> dict:
    device = ranks.device
    row = {}
    for batch in args.decode_batch:
        ids = prompt_ids(vocab, batch, args.decode_prompt, args.seed).to(device)
        first = timed(ranks, lambda: dm.generate(ids, max_new_tokens=1), args.repeats)
        full = timed(ranks, lambda: dm.generate(ids, max_new_tokens=args.new_tokens), args.repeats)
        row[f"tpot_ms_b{batch}"] = 1e3 * (full - first) / (args.new_tokens - 1)
    row["new_ids_b1"] = dm.generate(prompt_ids(vocab, 1, args.decode_prompt, args.seed).to(device),
                                    max_new_tokens=args.new_tokens)[0, args.decode_prompt:].tolist()
    long = prompt_ids(vocab, 1, args.prompt, args.seed).to(device)
    row["ttft_ms"] = 1e3 * timed(ranks, lambda: dm.generate(long, max_new_tokens=1), args.repeats)
    batch = prompt_ids(vocab, args.prefill_batch, args.prompt, args.seed).to(device)
    reset_peak(device)
    with torch.no_grad():
        seconds = timed(ranks, lambda: dm(batch), args.repeats)
    row["prefill_tok_s"] = args.prefill_batch * args.prompt / seconds
    row["prefill_peak_gib"] = peak_gib(device)
    return row


def run_variant(name, plan, config, args, ranks: Ranks) -> dict:
    device, world = ranks.device, ranks.world
    model = build_random_model(config, device, torch.float32 if args.smoke else torch.bfloat16, args.seed)
    started = time.perf_counter()
    group = ranks.solo_groups[ranks.rank] if plan.tp == 1 else None
    dm = ssmshard.parallelize(model, plan, group=group)
    dm.generation_programs()
    setup_s = time.perf_counter() - started
    model.to_empty(device="meta")
    row = {"variant": name, "tp": plan.tp, "copies": world // plan.tp, "setup_s": setup_s,
           "syncs_dropped": len(plan.drop_syncs), **measure(dm, config.vocab_size, args, ranks)}
    del dm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row["prefill_tok_s_host"] = row["prefill_tok_s"] * row["copies"]
    return row


def main_ranks(args):
    backend = "gloo" if args.smoke else "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ranks = Ranks(device, rank, world,
                  cpu_group=dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s)),
                  solo_groups=[dist.new_group([r]) for r in range(world)])  # every rank joins every new_group call
    models = {"tiny-mamba": BY_NAME["mamba"].make_config} if args.smoke else {m: GPU_MODELS[m] for m in args.models}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "scaling.jsonl")
    start = time.perf_counter()
    for model_name, make_config in models.items():
        config = keep_layers(make_config(), args.layers)
        for name, plan in variants(world, config.num_hidden_layers, args.smoke).items():
            if args.variants and name not in args.variants:
                continue
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=ranks.cpu_group)
            if elapsed.item() > args.budget_s:
                if rank == 0:
                    print(f"skipped {model_name} {name}: over --budget-s", flush=True)
                continue
            row = run_variant(name, plan, config, args, ranks)
            if rank == 0:
                row.update(model=model_name, layers=config.num_hidden_layers, ranks=world,
                           device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())) if
                           device.type == "cuda" else None, args=vars(args))
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{model_name} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                           if isinstance(v, float)), flush=True)
    dist.barrier(group=ranks.cpu_group)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ results
def table(rows) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        base = next((r for r in mine if r["variant"] == "tp1"), None)
        lines.append(f"{model} ({mine[0]['layers']} layers, {mine[0]['ranks']} x {mine[0]['device']})")
        lines.append(f"{'variant':14} {'TPOT b1 ms':>11} {'TPOT b16 ms':>12} {'TTFT ms':>8} {'prefill tok/s':>14} "
                     f"{'x tp1 (b1 TPOT)':>16} {'x tp1 (prefill)':>16} {'tokens = tp1':>13}")
        for r in mine:
            speed = (f"{base['tpot_ms_b1'] / r['tpot_ms_b1']:16.2f} {r['prefill_tok_s'] / base['prefill_tok_s']:16.2f}"
                     if base else f"{'':16} {'':16}")
            same = (sum(a == b for a, b in zip(r["new_ids_b1"], base["new_ids_b1"])) / len(base["new_ids_b1"])
                    if base else float("nan"))
            b16 = r.get("tpot_ms_b16", float("nan"))
            lines.append(f"{r['variant']:14} {r['tpot_ms_b1']:11.3f} {b16:12.3f} {r['ttft_ms']:8.1f} "
                         f"{r['prefill_tok_s']:14,.0f} {speed} {same:13.0%}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        names = [r["variant"] for r in mine]
        axes[0].plot(names, [r["tpot_ms_b1"] for r in mine], "o-", label=f"{model} b1")
        if "tpot_ms_b16" in mine[0]:
            axes[0].plot(names, [r["tpot_ms_b16"] for r in mine], "s--", label=f"{model} b16")
        axes[1].plot(names, [r["prefill_tok_s"] for r in mine], "o-", label=model)
    axes[0].set_ylabel("TPOT (ms, lower is better)")
    axes[1].set_ylabel("prefill tokens/s of one copy")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['ranks']} x {rows[0]['device']}, {rows[0]['layers']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/scaling"))
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b"], choices=list(GPU_MODELS))
    parser.add_argument("--variants", nargs="*", help="names as in the docstring (tp2 for N = 2), default all")
    parser.add_argument("--layers", type=int, default=0, help="keep the first L layers (0: all)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--prompt", type=int, default=4096, help="TTFT (batch 1) and prefill prompt length")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=420, help="start no variant after this")
    parser.add_argument("--collective-timeout-s", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny Mamba: checks the script")
    parser.add_argument("--plot", metavar="DIR", help="print the table and draw scaling.png from DIR")
    args = parser.parse_args()
    if args.plot:
        with open(os.path.join(args.plot, "scaling.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        print(table(rows))
        plot(rows, os.path.join(args.plot, "scaling.png"))
        return
    if args.smoke:
        args.decode_batch, args.decode_prompt, args.new_tokens = [1, 2], 8, 4
        args.prompt, args.prefill_batch, args.repeats = 16, 2, 1
    main_ranks(args)


if __name__ == "__main__":
    main()
