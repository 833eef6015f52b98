"""Where one training step's GPU time goes: torch.profiler over one step of train_packed.py.

    python benchmarks/profile_train_step.py --models mamba mamba2 --modes packed padded --out DIR

Same models, sequences, micro-batches and step as ``train_packed.py`` (bf16, Triton kernels
swapped in). Per (model, mode): one warm-up step (compilation), then one profiled step. Writes
``profile_<model>_<mode>.json``: the step's wall time, the summed time of every CUDA kernel, and
the kernels grouped by name (calls, total ms, share of the kernel time), largest first; the top
rows are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_packed as tp  # noqa: E402
from profiling import kernel_table  # noqa: E402


def profile_mode(name: str, mode: str, args, device) -> dict:
    model = tp.build_model(name, False, device, torch.bfloat16, args.seed)
    packed_program, forward_program = tp.build_programs(model, swap=True)
    lengths = tp.draw_lengths(args.tokens_per_step, args.min_len, args.max_len, args.seed)
    sequences = tp.draw_sequences(lengths, model.config.vocab_size, args.seed)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = {"packed": lambda: tp.packed_micro_batches(sequences, args.pack_len),
               "padded": lambda: tp.padded_micro_batches(sequences, args.pack_len, "sorted", pad),
               "one": lambda: tp.one_at_a_time_micro_batches(sequences)}[mode]()
    batches = [b.to(device) for b in batches]
    program = packed_program if mode == "packed" else forward_program
    n_targets = sum(int((b.targets != tp.IGNORE).sum()) for b in batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tp.train_step(program, batches, n_targets, optimizer)  # warm-up: Triton compiles here
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tp.train_step(program, batches, n_targets, optimizer)
        torch.cuda.synchronize()
        step_s = time.perf_counter() - start
    table = kernel_table(prof)
    result = {"model": name, "mode": mode, "micro_batches": len(batches), "tokens": sum(lengths),
              "step_ms_profiled": step_s * 1e3, "kernel_ms": sum(r["ms"] for r in table), "kernels": table[:60],
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    print(f"[{name} {mode}] {len(batches)} micro-batches, step {step_s * 1e3:.1f} ms (profiled), "
          f"kernels {result['kernel_ms']:.1f} ms", flush=True)
    for r in table[:args.top]:
        print(f"  {r['ms']:9.2f} ms {r['share']:6.1%} {r['calls']:6d}x  {r['kernel'][:110]}", flush=True)
    del model, packed_program, forward_program, optimizer
    torch.cuda.empty_cache()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mamba", "mamba2"], choices=["mamba", "mamba2"])
    parser.add_argument("--modes", nargs="+", default=["packed"], choices=list(tp.MODES))
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--pack-len", type=int, default=8192)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=25, help="kernels printed per step")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/train_packed"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_train_step.py needs a CUDA GPU (it profiles the Triton kernels)")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    for name in args.models:
        for mode in args.modes:
            result = profile_mode(name, mode, args, device)
            with open(os.path.join(args.out, f"profile_{name}_{mode}.json"), "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
