"""Scaling with GPUs of one host: TPOT, TTFT and prefill throughput of TP against one GPU per copy,
with NCCL, the low-latency all-reduce, SPD and quantized syncs, all measured in one run.
    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 benchmarks/scaling_gpu.py --layers 16 --out $OUT
    python benchmarks/scaling_gpu.py --plot DIR                      # afterwards, CPU: table and plot
    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 benchmarks/scaling_gpu.py --smoke --out DIR  # CPU, gloo
Variants (every rank of the launcher takes part in each; N = ranks, T = each power of two from 2
to N that divides N, so a 4-rank launcher measures tp 1, 2 and 4 side by side):
    tp1          one full copy per GPU (data parallel, N copies): the baseline every ratio divides
    tpT          Plan(tp=T), NCCL all-reduces; N / T copies, one per group of T consecutive ranks
    tpT_symm     Plan(tp=T, allreduce=low_latency): one-shot peer-memory all-reduce for small messages
    tpT_symm_spd the same with SPD: out_proj syncs of the last layers dropped (see ``spd_drop_set``)
    tpT_int8 / tpT_fp8   Plan(tp=T, quantize_syncs=fmt): messages of at least 1 MiB quantized
    tpT_sp       Plan(tp=T, sequence_parallel=True): prefill throughput only (generation programs
                 are plain TP under it, so their figures would be tpT's)
Measured per variant (random bf16 weights, the same seed on every rank, median of --repeats):
TPOT = (time of generate(n) - time of generate(1)) / (n - 1) at batch 1 and 16 (the decode step is
a CUDA-graph replay where the program allows it); TTFT = time of generate(1) at batch 1 and the
long prompt; prefill throughput = batch x prompt tokens / time of one forward. Times are the
slowest rank's. For tpT the throughput of the host is N / T times one copy's (independent copies).
``--profile`` adds, per variant, the device time of one prefill forward by kernel category
(matmul, scan, conv, norm, all-reduce, other) beside its wall time: the gap is idle GPU time.
Glossary: N ranks, T ranks per copy, L layers kept, b batch, l prompt tokens, n new tokens.
"""
from __future__ import annotations

import argparse
import collections
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
from decode_profile import MATMUL_KERNELS, category, kernel_times  # noqa: E402
from generate_gpu import (GPU_MODELS, build_random_model, keep_layers, peak_gib, prompt_ids, reset_peak,  # noqa: E402
                          synchronize)

# SPD's drop fraction: the sensitivity analysis on the trained small Mamba at tp 2 chose 7 of its
# 15 candidate out_proj sync points under a 1% perplexity budget (benchmarks/results/spd_accuracy/);
# the large configs drop the same fraction, last layers first (later layers were the insensitive
# ones there; layer 0 was extremely sensitive and is never dropped).
SPD_DROP_FRACTION = 7 / 15


def spd_drop_set(layers: int) -> list[str]:
    count = round(SPD_DROP_FRACTION * layers)
    return [f"layers.{i}.out_proj" for i in range(max(1, layers - count), layers)]


def tp_degrees(world: int) -> list[int]:
    """The tensor-parallel degrees a launcher of ``world`` ranks measures: 1 and the powers of two
    up to ``world`` that divide it."""
    return [t for t in (1 << k for k in range(world.bit_length())) if world % t == 0]


def variants(world: int, layers: int, smoke: bool) -> dict[str, ssmshard.Plan]:
    low_latency = "nccl" if smoke else "symm_mem"  # symmetric memory needs CUDA: smoke checks the rest
    plans = {"tp1": ssmshard.Plan(tp=1, training=False)}
    for t in tp_degrees(world)[1:]:
        plans.update({f"tp{t}": ssmshard.Plan(tp=t, training=False),
                      f"tp{t}_symm": ssmshard.Plan(tp=t, training=False, allreduce=low_latency),
                      f"tp{t}_symm_spd": ssmshard.Plan(tp=t, training=False, allreduce=low_latency,
                                                       drop_syncs=spd_drop_set(layers)),
                      f"tp{t}_int8": ssmshard.Plan(tp=t, training=False, quantize_syncs="int8"),
                      f"tp{t}_fp8": ssmshard.Plan(tp=t, training=False, quantize_syncs="fp8"),
                      f"tp{t}_sp": ssmshard.Plan(tp=t, training=False, sequence_parallel=True)})
    return plans


@dataclasses.dataclass
class Ranks:
    """This process's place in the launcher: its device, and the groups the timings use."""
    device: torch.device
    rank: int
    world: int
    cpu_group: object  # gloo: the slowest rank's time and the budget, off the GPUs' streams
    copy_groups: dict  # T -> this rank's group of T consecutive ranks (None for T = N: the world)


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


def graph_step_ms(dm, batch: int, ranks: Ranks, replays: int = 20) -> float | None:
    """Milliseconds per replay of the decode step's CUDA graph alone, back to back: the GPU's
    share of TPOT (the rest is the host's work between steps). None when the step was not graphed."""
    graphed = dm.decode_graph(batch)  # the graph generate() just used, kept per batch size
    if graphed is None:
        return None
    dist.barrier()
    synchronize(ranks.device)
    start = time.perf_counter()
    for _ in range(replays):  # every rank of a copy replays together: the graph holds its collectives
        graphed.graph.replay()
    synchronize(ranks.device)
    local = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ranks.cpu_group)
    return 1e3 * local.item() / replays


def measure(dm, vocab, args, ranks: Ranks, decode: bool = True) -> dict:
    device = ranks.device
    row = {}
    for batch in args.decode_batch if decode else ():
        ids = prompt_ids(vocab, batch, args.decode_prompt, args.seed).to(device)
        first = timed(ranks, lambda: dm.generate(ids, max_new_tokens=1), args.repeats)
        full = timed(ranks, lambda: dm.generate(ids, max_new_tokens=args.new_tokens), args.repeats)
        row[f"tpot_ms_b{batch}"] = 1e3 * (full - first) / (args.new_tokens - 1)
        row[f"graph_step_ms_b{batch}"] = graph_step_ms(dm, batch, ranks)
    if decode:
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
    dm = ssmshard.parallelize(model, plan, group=ranks.copy_groups[plan.tp])
    dm.generation_programs()
    setup_s = time.perf_counter() - started
    model.to_empty(device="meta")
    row = {"variant": name, "tp": plan.tp, "copies": world // plan.tp, "setup_s": setup_s,
           "syncs_dropped": len(plan.drop_syncs),
           **measure(dm, config.vocab_size, args, ranks, decode=not plan.sequence_parallel)}
    if args.profile:
        row["prefill_profile"] = prefill_profile(dm, config.vocab_size, args, ranks)
    del dm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row["prefill_tok_s_host"] = row["prefill_tok_s"] * row["copies"]
    return row


def copy_groups(rank: int, world: int) -> dict:
    """T -> the group of T consecutive ranks this rank belongs to (None for the whole world)."""
    mine = {}
    for t in tp_degrees(world):
        if t == world:
            mine[t] = None
            continue
        for first in range(0, world, t):  # every rank must take part in every new_group call
            group = dist.new_group(list(range(first, first + t)))
            if first <= rank < first + t:
                mine[t] = group
    return mine


PREFILL_CATEGORIES = (("all-reduce", ("nccl", "all_reduce", "allreduce", "quantize")),
                      ("matmul", MATMUL_KERNELS),
                      ("scan", ("scan", "ssd", "chunk", "segment_carry", "_final_states")),
                      ("conv", ("conv",)),
                      ("norm", ("rms_norm", "norm")))


def prefill_profile(dm, vocab, args, ranks: Ranks) -> dict:
    """Device ms of one prefill forward by kernel category, and its wall ms, on this rank (rank 0's
    is what is stored). All-reduce time includes waiting for the slower ranks."""
    batch = prompt_ids(vocab, args.prefill_batch, args.prompt, args.seed).to(ranks.device)
    dist.barrier()
    with torch.no_grad():
        started = time.perf_counter()
        times = kernel_times(lambda: dm(batch), ranks.device)
        wall_ms = 1e3 * (time.perf_counter() - started)
    by_category = collections.Counter()
    other = []
    for name, (calls, us) in times.items():
        label = category(name, PREFILL_CATEGORIES)
        by_category[label] += us / 1e3
        if label == "other":
            other.append({"kernel": name[:120], "calls": calls, "ms": us / 1e3})
    return {"wall_ms": wall_ms, "kernel_ms": sum(by_category.values()), **dict(by_category),
            "largest_other": sorted(other, key=lambda k: -k["ms"])[:12]}  # what "other" is


def main_ranks(args):
    backend = "gloo" if args.smoke else "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ranks = Ranks(device, rank, world,
                  cpu_group=dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s)),
                  copy_groups=copy_groups(rank, world))
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
    nan = float("nan")
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        base = next((r for r in mine if r["variant"] == "tp1"), {})
        lines.append(f"{model} ({mine[0]['layers']} layers, {mine[0]['ranks']} x {mine[0]['device']})")
        lines.append(f"{'variant':14} {'TPOT b1 ms':>11} {'graph b1 ms':>12} {'TPOT b16 ms':>12} {'graph b16 ms':>13} "
                     f"{'TTFT ms':>8} {'prefill tok/s':>14} {'x tp1 (b1 TPOT)':>16} {'x tp1 (prefill)':>16} "
                     f"{'tokens = tp1':>13}")
        for r in mine:
            get = lambda row, key: nan if row.get(key) is None else row[key]  # noqa: E731 (sp rows: prefill only)
            same = (sum(a == b for a, b in zip(r["new_ids_b1"], base["new_ids_b1"])) / len(base["new_ids_b1"])
                    if base and "new_ids_b1" in r else nan)
            lines.append(f"{r['variant']:14} {get(r, 'tpot_ms_b1'):11.3f} {get(r, 'graph_step_ms_b1'):12.3f} "
                         f"{get(r, 'tpot_ms_b16'):12.3f} {get(r, 'graph_step_ms_b16'):13.3f} {get(r, 'ttft_ms'):8.1f} "
                         f"{r['prefill_tok_s']:14,.0f} {get(base, 'tpot_ms_b1') / get(r, 'tpot_ms_b1'):16.2f} "
                         f"{r['prefill_tok_s'] / get(base, 'prefill_tok_s'):16.2f} "
                         f"{same:13.0%}")
        profiled = [r for r in mine if "prefill_profile" in r]
        if profiled:
            names = [c for c, _ in PREFILL_CATEGORIES] + ["other"]
            lines.append(f"one prefill forward on rank 0, ms: {'variant':14} {'wall':>8} {'kernels':>8} "
                         + " ".join(f"{c:>10}" for c in names))
            for r in profiled:
                p = r["prefill_profile"]
                lines.append(f"{'':34}{r['variant']:14} {p['wall_ms']:8.1f} {p['kernel_ms']:8.1f} "
                             + " ".join(f"{p.get(c, 0.0):10.1f}" for c in names))
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
        nan = float("nan")  # sequence-parallel rows measure prefill only
        axes[0].plot(names, [r.get("tpot_ms_b1", nan) for r in mine], "o-", label=f"{model} b1")
        if "tpot_ms_b16" in mine[0]:
            axes[0].plot(names, [r.get("tpot_ms_b16", nan) for r in mine], "s--", label=f"{model} b16")
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
    parser.add_argument("--profile", action="store_true", help="kernel time of one prefill by category")
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
