"""Where one decode step's time goes: per-kernel device time of a graphed decode step, by kernel
and by category, beside the step's wall time (TPOT) and its weight-read floor.

    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 benchmarks/decode_profile.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/decode_profile.py --out $OUT              # one GPU: tp1 only
    PYTHONPATH=$PWD python benchmarks/decode_profile.py --smoke --out DIR       # CPU, tiny Mamba, fp32
    python benchmarks/decode_profile.py --plot DIR                              # the plot from DIR's JSON

Variants: ``tp1`` (every rank decodes its own copy), ``tp1_unoptimised`` (the same with
``Plan(skip_passes=OPTIONAL_PASSES)``: what the optimisation passes bring), ``tp1_opt_in`` (with the
opt-in passes, ``Plan(add_passes=OPT_IN_PASSES)``; only when named in ``--variants``), and with 2 or more processes ``tpN`` (NCCL
all-reduces) and ``tpN_symm`` (``Plan(allreduce="symm_mem")``: one-shot peer-memory all-reduce).
Model: ``--model`` (a decode_gpu.py config: Mamba-2.8B by default, Mamba2-2.7B, Zamba2-2.7B,
Llama-3-8B) with ``--layers`` of its layers, random bf16 weights; ``--variants`` picks variants.

Glossary:
  step kernels   (profile of ``generate(n)`` - profile of ``generate(1)``) / (n - 1), by kernel
                 name: the kernels one decode step runs, with calls and device microseconds.
  device us      the sum of a step's kernel times; TPOT - device us is time the GPU idles
                 between kernels (launch gaps inside the CUDA graph, host work between steps).
  categories     matmul (cuBLAS / nvjet GEMM and GEMV kernels and their split-K reductions),
                 all-reduce (NCCL, one-shot), copies (copy and memcpy kernels), SSM step (the
                 state and conv update kernels), attention (SDPA / flash kernels), other
                 (norms, casts, elementwise, argmax).
  floor          weight bytes (the embedding table counts its looked-up rows) + recurrent state
                 bytes, over the copy bandwidth measured in the same run (decode_gpu.py's floor).
"""

from __future__ import annotations

import bench_common  # first: --smoke sets TRITON_INTERPRET before any kernel import

import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.families import BY_NAME
from ssmshard.plan import OPT_IN_PASSES, OPTIONAL_PASSES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import GPU_MODELS, floor_row  # noqa: E402
from generate_gpu import build_random_model, keep_layers  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth, synchronize  # noqa: E402

MATMUL_KERNELS = ("nvjet", "gemv", "gemm", "splitkreduce", "cutlass", "sm90_xmma")
CATEGORIES = (("all-reduce", ("nccl", "all_reduce", "allreduce")),
              ("matmul", MATMUL_KERNELS),
              ("copies", ("copy", "memcpy")),
              ("SSM step", ("_state_update", "_conv_update")),
              ("attention", ("flash", "fmha", "attention", "sdpa")))


def category(kernel: str, categories=CATEGORIES) -> str:
    name = kernel.lower()
    for label, needles in categories:
        if any(n in name for n in needles):
            return label
    return "other"


def kernel_times(fn, device) -> dict[str, list]:
    """Kernel name -> [calls, device microseconds] over one call of ``fn`` (CPU ops on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
        fn()
        synchronize(device)
    wanted = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    times = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == wanted and (on_cuda or event.name.startswith("aten::")):
            times[event.name][0] += 1
            times[event.name][1] += event.time_range.elapsed_us()
    return times


def step_kernels(generate, new_tokens: int, device) -> list[dict]:
    """The kernels of one decode step: generate(n) minus generate(1), per step (glossary).
    Both run once first: Triton's autotuner times its candidates on a kernel's first call (its
    benchmark runs and cache-clearing fills would otherwise count as the step's kernels)."""
    generate(new_tokens)
    generate(1)
    long, short = kernel_times(lambda: generate(new_tokens), device), kernel_times(lambda: generate(1), device)
    steps = new_tokens - 1
    rows = []
    for name in set(long) | set(short):
        calls = (long[name][0] - short[name][0]) / steps
        us = (long[name][1] - short[name][1]) / steps
        if calls > 0.01 or us > 0.1:
            rows.append({"kernel": name[:200], "category": category(name), "calls": round(calls, 2),
                         "us": round(us, 3), "us_each": round(us / calls, 3) if calls > 0 else None})
    return sorted(rows, key=lambda r: -r["us"])


def tpot_ms(generate, new_tokens: int, repeats: int, device) -> float:
    def median_s(n):
        generate(n)
        times = []
        for _ in range(repeats):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            generate(n)
            synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    return 1e3 * (median_s(new_tokens) - median_s(1)) / (new_tokens - 1)


def variants(world: int, smoke: bool, only=None) -> dict:
    plans = {"tp1": ssmshard.Plan(tp=1, training=False),
             "tp1_unoptimised": ssmshard.Plan(tp=1, training=False, skip_passes=list(OPTIONAL_PASSES)),
             "tp1_opt_in": ssmshard.Plan(tp=1, training=False, add_passes=list(OPT_IN_PASSES))}
    if world > 1:
        plans[f"tp{world}"] = ssmshard.Plan(tp=world, training=False)
        if not smoke:
            plans[f"tp{world}_symm"] = ssmshard.Plan(tp=world, training=False, allreduce="symm_mem")
    # tp1_opt_in only when named: not part of the default set
    return {name: plan for name, plan in plans.items() if (name in only if only else name != "tp1_opt_in")}


def run(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if not args.smoke else torch.device("cpu")
    solo = [dist.new_group([r]) for r in range(world)]
    config = BY_NAME["mamba"].make_config() if args.smoke else GPU_MODELS[args.model]()
    config = keep_layers(config, args.layers)  # a hybrid's layer pattern too
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    results = {}
    for name, plan in variants(world, args.smoke, args.variants).items():
        model = build_random_model(config, device, torch.float32 if args.smoke else torch.bfloat16, args.seed)
        started = time.perf_counter()
        dm = ssmshard.parallelize(model, plan, group=solo[rank] if plan.tp == 1 else None)
        dm.generation_programs()
        row = {"tp": plan.tp, "allreduce": plan.allreduce, "skipped_passes": plan.skip_passes, "setup_s": time.perf_counter() - started, "batches": {}}
        for batch in args.batches:
            ids = torch.randint(1, config.vocab_size, (batch, args.prompt), device=device,
                                generator=torch.Generator(device).manual_seed(args.seed))

            def generate(n):
                return dm.generate(ids, max_new_tokens=n, pad_token_id=0)
            kernels = step_kernels(generate, args.new_tokens, device)
            by_category = collections.Counter()
            for k in kernels:
                by_category[k["category"]] += k["us"]
            cell = {"tpot_ms": tpot_ms(generate, args.new_tokens, args.repeats, device),
                    "device_us": sum(k["us"] for k in kernels), "kernels_per_step": sum(k["calls"] for k in kernels),
                    "by_category_us": dict(by_category), "kernels": kernels}
            if bandwidth:
                cell.update(floor_row(model, dm, ids, args.new_tokens, bandwidth))
            row["batches"][str(batch)] = cell
            if rank == 0:
                print(f"{name} b{batch}: TPOT {cell['tpot_ms']:.3f} ms, kernels {cell['device_us']:.0f} us "
                      f"({cell['kernels_per_step']:.0f} per step) " +
                      ", ".join(f"{c} {us:.0f}" for c, us in by_category.most_common()), flush=True)
        results[name] = row
        del dm, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            "copy_bandwidth_bytes_per_s": bandwidth, "model": "tiny-mamba" if args.smoke else args.model,
            "layers": config.num_hidden_layers, "world": world,
            "prompt": args.prompt, "new_tokens": args.new_tokens, "results": results}


def plot(folder: str) -> None:
    from bench_common import pyplot

    with open(os.path.join(folder, "decode_profile.json")) as f:
        data = json.load(f)
    plt = pyplot(os.path.join(folder, "decode_profile.png"))
    if plt is None:
        return
    labels, cells = [], []
    for name, row in data["results"].items():
        for batch, cell in row["batches"].items():
            labels.append(f"{name}\nb{batch}")
            cells.append(cell)
    order = ["matmul", "SSM step", "attention", "copies", "other", "all-reduce"]
    fig, ax = plt.subplots(figsize=(1.6 * len(cells) + 2, 4.5))
    bottom = [0.0] * len(cells)
    for label in order:
        values = [c["by_category_us"].get(label, 0.0) / 1e3 for c in cells]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    idle = [max(c["tpot_ms"] - b, 0.0) for c, b in zip(cells, bottom)]
    ax.bar(labels, idle, bottom=bottom, label="idle (TPOT - kernels)", color="lightgrey")
    floors = [c.get("floor_ms") for c in cells]
    if all(f is not None for f in floors):
        ax.scatter(labels, floors, marker="_", s=600, color="black", label="weight-read floor", zorder=3)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"One decode step, {data['layers']}-layer {data.get('model', 'mamba-2.8b')} config, {data['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "decode_profile.png"), dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for decode_profile.json (and the plot)")
    parser.add_argument("--plot", metavar="DIR", help="only draw the plot from DIR/decode_profile.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny Mamba, fp32: checks the script")
    parser.add_argument("--model", choices=sorted(GPU_MODELS), default="mamba-2.8b")
    parser.add_argument("--variants", nargs="+", help="only these variants (tp1, tp1_unoptimised, tp1_opt_in, tpN, tpN_symm)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.new_tokens, args.repeats = [1], 4, 1
    if not args.plot and not args.out:
        parser.error("--out is required (or --plot DIR)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo" if args.smoke else "nccl")
        else:  # one process: a world of one
            bench_common.init_single_process_group(torch.device("cpu" if args.smoke else "cuda"))
    if not args.smoke:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    data = run(args)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_profile.json"), "w") as f:
            json.dump(data, f, indent=1)
        plot(args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
