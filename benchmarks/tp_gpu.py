"""Tensor parallelism on GPUs: bf16 equality at tp = 1, 2, 4 over NCCL, and forward throughput.

    python benchmarks/tp_gpu.py equality --tp 1 2 4 --out DIR
    python benchmarks/tp_gpu.py throughput --tp 1 2 4 --batch 8 --seq 2048 --out DIR
    python benchmarks/tp_gpu.py throughput --smoke --out DIR     # CPU, gloo, tiny model: checks the script

Writes ``equality_tp<N>.json`` / ``throughput_tp<N>.json`` to DIR and a plot of what is there
(``equality.png``, ``throughput.png``; matplotlib). ``--smoke`` runs tp 1 and 2 on CPU processes
(gloo) with a tiny model in seconds; its figures mean nothing.

equality: for each family's small test config (random O(1)-effect weights), the logits of the
tp-rank DistributedModule in bf16 against HF eager in fp32 on the CPU, next to the error of our
own unsharded program (tp = 1) in bf16 and of HF eager in bf16. Sharding only reorders sums,
so the tolerance is relative to tp = 1's bf16 error: tp = N passes when its error is at most
twice that (bf16 has 8 mantissa bits; a reordered sum moves each rounding, not the scale).

throughput: a Mamba-2.8B-sized config (64 layers, hidden 2560, vocab 50280, N = 16) with random
bf16 weights, forward only, median of CUDA-event timings; the scans are whatever the program's
ops dispatch to (named in the output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import torch  # noqa: E402

import ssmshard  # noqa: E402
from ssmshard.families import build_small_model  # noqa: E402
from ssmshard.testing import randomize_weights, rel_err  # noqa: E402

FAMILIES = [("mamba", {}), ("falcon_mamba", {}), ("mamba2", {}), ("mamba2", {"n_groups": 1}), ("zamba", {}),
            ("zamba2", {}), ("llama", {}), ("llama", {"num_key_value_heads": 1})]
if bench_common.SMOKE:
    FAMILIES = [("mamba2", {})]
DEVICE = "cpu" if bench_common.SMOKE else "cuda"


def _device_name() -> str:
    return "cpu (gloo)" if DEVICE == "cpu" else torch.cuda.get_device_name()


def _timed(fn) -> float:
    """Seconds of one call: CUDA events on the GPU, the wall clock on the CPU (smoke runs)."""
    if DEVICE == "cpu":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _write(out, name, rows):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(rows, f, indent=1)


def equality_rank(rank, world, out):
    rows = []
    for family, overrides in FAMILIES:
        model = randomize_weights(build_small_model(family, **overrides), seed=1)
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(0, model.config.vocab_size, (4, 96), generator=gen)
        with torch.no_grad():
            reference = model(ids).logits  # fp32, CPU
            model = model.to(DEVICE, torch.bfloat16)
            hf_bf16 = model(ids.to(DEVICE)).logits.float().cpu()
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
        with torch.no_grad():
            ours = dm(ids.to(DEVICE)).float().cpu()
        rows.append({"family": family, "overrides": overrides, "tp": world, "device": _device_name(),
                     "err_vs_fp32": rel_err(ours, reference), "hf_bf16_err_vs_fp32": rel_err(hf_bf16, reference),
                     "collectives": len(dm.program.collectives)})
    if rank == 0:
        _write(out, f"equality_tp{world}.json", rows)
        for r in rows:
            print(f"tp={world} {r['family']:<13} {str(r['overrides']):<28} ours bf16 {r['err_vs_fp32']:.2e}  "
                  f"HF bf16 {r['hf_bf16_err_vs_fp32']:.2e}", flush=True)


def mamba_2p8b_config():
    from transformers import MambaConfig

    if bench_common.SMOKE:
        return MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                           conv_kernel=4, time_step_rank=8, use_cache=True)
    return MambaConfig(vocab_size=50280, hidden_size=2560, state_size=16, num_hidden_layers=64, expand=2,
                       conv_kernel=4, time_step_rank=160, use_cache=True)


@torch.no_grad()
def _init_on_gpu(model, seed=0, device="cuda"):
    """O(1)-effect random weights drawn on ``device`` (same on every rank: same seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            param.copy_(torch.log(torch.arange(1, param.shape[-1] + 1, device=device)).expand_as(param))
        elif name.endswith("dt_proj.bias"):
            dt = torch.exp(torch.empty(param.shape, device=device).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
            param.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif leaf == "D" or "norm" in name:
            param.fill_(1.0)
        elif param.dim() >= 2:
            std = 1.0 if "embed" in name else 1.0 / math.sqrt(param.shape[-1])
            param.normal_(0.0, std, generator=gen)
        else:
            param.zero_()


def throughput_rank(rank, world, batch, seq, repeats, out):
    from transformers import AutoModelForCausalLM

    config = mamba_2p8b_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device=DEVICE)
    _init_on_gpu(model, device=DEVICE)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, training=False))
    setup = time.perf_counter() - started
    del model
    gen = torch.Generator(DEVICE).manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE, generator=gen)
    times = []
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for i in range(repeats + 2):  # two warm-up runs, then the timed ones
            torch.distributed.barrier()
            seconds = _timed(lambda: dm(ids))
            if i >= 2:
                times.append(seconds)
    median = statistics.median(times)
    kernels = sorted({f"{r['op']}: {r['kernel'] or 'reference'}" for r in getattr(dm.program, "kernel_report", [])})
    row = {"config": "mamba-2.8b-sized", "params": params, "tp": world, "batch": batch, "seq": seq,
           "dtype": "bfloat16", "median_s": median, "all_s": times, "tokens_per_s": batch * seq / median,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None, "setup_s": setup,
           "kernels": kernels or "reference (no swap_kernels pass)", "device": _device_name(), "torch": torch.__version__}
    if rank == 0:
        _write(out, f"throughput_tp{world}.json", row)
        print(f"tp={world} batch {batch} x seq {seq}: {median * 1e3:.1f} ms median of {repeats}, "
              f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_mem_gib'] or 0:.1f} GiB/GPU, setup {setup:.0f}s",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["equality", "throughput"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tp_gpu"))
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tp 1 and 2, a tiny model: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.tp, args.batch, args.seq, args.repeats = [1, 2], 2, 16, 1
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on GPUs, or pass --smoke to check the script on the CPU")
    for tp in args.tp:
        if not args.smoke and torch.cuda.device_count() < tp:
            print(f"skipping tp={tp}: {torch.cuda.device_count()} GPUs")
            continue
        if args.what == "equality":
            ssmshard.launch(equality_rank, tp, args.out, backend="gloo" if args.smoke else None)
        else:
            ssmshard.launch(throughput_rank, tp, args.batch, args.seq, args.repeats, args.out,
                            backend="gloo" if args.smoke else None)
    plot(args.what, args.out)


def plot(what, out):
    """A chart of every result file of this kind in ``out``."""
    rows = []
    for name in sorted(os.listdir(out)):
        if name.startswith(what + "_tp") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                rows.append(json.load(f))
    if not rows:
        return
    if what == "throughput":
        rows.sort(key=lambda r: r["tp"])
        bench_common.bar_chart(os.path.join(out, "throughput.png"),
                               f"forward tokens/s, batch {rows[0]['batch']} x {rows[0]['seq']}, {rows[0]['device']}",
                               [f"tp={r['tp']}" for r in rows], {"tokens/s": [r["tokens_per_s"] for r in rows]}, "tokens/s")
    else:
        rows.sort(key=lambda r: r[0]["tp"])
        cases = [f"{c['family']} {c['overrides'] or ''}".strip() for c in rows[0]]
        series = {f"ours tp={r[0]['tp']}": [c["err_vs_fp32"] for c in r] for r in rows}
        series["HF eager bf16"] = [c["hf_bf16_err_vs_fp32"] for c in rows[0]]
        bench_common.bar_chart(os.path.join(out, "equality.png"), f"bf16 logits vs fp32 HF eager, {rows[0][0]['device']}",
                               cases, series, "relative error", log=True)


if __name__ == "__main__":
    main()
