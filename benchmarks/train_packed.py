"""Training throughput on variable-length sequences: packed vs padded vs one sequence at a time.

    python benchmarks/train_packed.py --models mamba mamba2 --out DIR     # one GPU (H200)
    python benchmarks/train_packed.py --smoke --out DIR                   # tiny models, CPU, 1 step

Every step trains on the same fixed set of sequences (seeded log-uniform integer lengths in
[--min-len, --max-len], as many as fit in --tokens-per-step tokens, random token ids) and takes
one AdamW step; gradients are accumulated over the micro-batches of the step, and the loss is
the sum of next-token cross-entropies over real tokens divided by the step's number of targets,
so all three modes compute the same function of the same tokens:

* packed:  sequences, in drawing order, laid end to end into rows of at most --pack-len tokens
           (no padding but the filler), run by the packed forward program (``capture(model, packed=True)``);
* padded:  sequences sorted by length (longest first; --padded-order random for drawing order,
           both for two padded modes, "padded" sorted and "padded_random"),
           grouped into micro-batches with rows x longest <= --pack-len tokens, right-padded
           (pads predict nothing and, the model being causal, change no real token's output),
           run by the ordinary forward program;
* one:     each sequence alone (batch 1) through the ordinary forward program.

Every mode rounds its rows up to --pad-to-multiple-of tokens (default 16 on the GPU), as a
padding collator's ``pad_to_multiple_of`` does: packed rows get a filler sequence at the end
(``ssmshard.pack(..., pad_to_multiple_of=)``), padded and one-at-a-time rows right padding. Rows
of arbitrary length put cuBLAS on its unaligned GEMM kernels and the scans on scalar loads: on
one H200 the Mamba-1 packed step took 2,873 ms with --pad-to-multiple-of 1 and 2,175 ms with 16
(``benchmarks/results/train_packed/``).

On CUDA both programs get the ``swap_kernels`` pass (Triton scan and conv kernels, forward and
backward) and everything is bfloat16: weights, gradients and AdamW's moments (no fp32 master
copy, no autocast), the same in all three modes, so the ratios compare like with like. The
cross-entropy is computed from fp32 logits. --smoke runs tiny configs in fp32 on the CPU with
the torch reference ops (no swap).

Before any timing the step loss of the initial weights is computed in every mode (no
gradients); packed must equal one-at-a-time and padded within --loss-rtol (relative; default
2e-2 in bf16, 1e-5 in fp32). Then per mode: fresh weights (same seed) and a fresh optimizer,
--warmup steps (Triton compilation and autotuning happen there) and --steps timed steps
(CUDA events around the whole step, synchronised), median reported. Tokens/s counts real
tokens only (pads excluded). JSON (and a bar plot when matplotlib imports) is written to --out
after every mode, so a run cut short keeps what it measured; the exit status is 1 if a loss
check failed.

Dimension letters: S sequences of a step, L a sequence's length, T tokens of a packed row,
b rows of a padded micro-batch, P padded length, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmshard  # noqa: E402
from ssmshard.passes import run_pipeline  # noqa: E402
from ssmshard.testing import randomize_weights  # noqa: E402

MODES = ("packed", "padded", "one")


def mode_names(padded_order: str) -> tuple[str, ...]:
    """The modes a run times: with --padded-order both, a second padded mode in drawing order."""
    return ("packed", "padded", "padded_random", "one") if padded_order == "both" else MODES
IGNORE = -100  # cross_entropy's ignore_index: no target at this position


# ------------------------------------------------------------------------------ models


def full_size_config(name: str):
    """Mamba-1.4B / Mamba2-1.3B shapes (state-spaces checkpoints: tied embeddings, vocab 50280)."""
    from transformers import Mamba2Config, MambaConfig

    if name == "mamba":
        return MambaConfig(vocab_size=50280, hidden_size=2048, num_hidden_layers=48, state_size=16, expand=2,
                           conv_kernel=4, tie_word_embeddings=True, use_cache=False)
    if name == "mamba2":
        # num_heads * head_dim == expand * hidden_size = 4096
        return Mamba2Config(vocab_size=50280, hidden_size=2048, num_hidden_layers=48, state_size=128, expand=2,
                            head_dim=64, num_heads=64, n_groups=1, chunk_size=256, conv_kernel=4,
                            tie_word_embeddings=True, use_cache=False)
    raise ValueError(f"unknown model {name!r}: choose mamba or mamba2")


def build_model(name: str, smoke: bool, device, dtype, seed: int):
    """Random O(1)-effect weights drawn on ``device`` (``testing.randomize_weights``)."""
    if smoke:
        model = ssmshard.build_small_model(name).to(device, dtype)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(full_size_config(name), dtype=dtype)
        model = model.to_empty(device=device)
        model.tie_weights()  # to_empty gives the tied lm_head its own tensor; tie it back
    return randomize_weights(model, seed=seed).train()


def build_programs(model, swap: bool):
    """(packed program, ordinary forward program), with the Triton kernels swapped in if ``swap``."""
    programs = [ssmshard.capture(model, packed=True), ssmshard.capture(model)]
    if swap:
        programs = [run_pipeline(p, [("swap_kernels", {"kernels": "triton"})]) for p in programs]
    return programs


def kernel_summary(program) -> list[str]:
    report = getattr(program, "kernel_report", None)
    if report is None:
        return ["reference (no swap_kernels pass)"]
    counts = {}
    for row in report:
        key = f"{row['op']}: {row['kernel'] or 'reference (' + str(row['why']) + ')'}"
        counts[key] = counts.get(key, 0) + 1
    return [f"{key} x{n}" for key, n in sorted(counts.items())]


# ------------------------------------------------------------------------------ data


def draw_lengths(tokens: int, lo: int, hi: int, seed: int) -> list[int]:
    """Log-uniform integer lengths in [lo, hi], drawn until the next would pass ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while True:
        u = torch.rand((), generator=gen).item()
        length = min(hi, max(lo, int(math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo))))))
        if sum(lengths) + length > tokens:
            break
        lengths.append(length)
    if not lengths:
        raise ValueError(f"--tokens-per-step {tokens} is smaller than one sequence of the mix ({lo}..{hi})")
    return lengths


def draw_sequences(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """(L,) targets of one sequence: the next token, and nothing after the last one."""
    return torch.cat([ids[1:], ids.new_full((1,), IGNORE)])


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (1, T) packed, (b, P) padded or (1, L) alone
    targets: torch.Tensor  # same shape; IGNORE where nothing is predicted (sequence ends, pads)
    cu_seqlens: torch.Tensor | None  # (S_row + 1,) int32, packed rows only
    real_tokens: int

    def to(self, device) -> "MicroBatch":
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        return MicroBatch(self.input_ids.to(device), self.targets.to(device), cu, self.real_tokens)


def _fill_in_order(sequences, fits) -> list[list]:
    """Sequences in order into groups; a group closes when ``fits(group, next)`` says no (a
    sequence too large on its own still gets a group)."""
    groups, current = [], []
    for seq in sequences:
        if current and not fits(current, seq):
            groups.append(current)
            current = []
        current.append(seq)
    groups.append(current)
    return groups


def round_up(tokens: int, multiple: int) -> int:
    return -(-tokens // multiple) * multiple


def packed_micro_batches(sequences, pack_len: int, multiple: int = 1, pad_id: int = 0) -> list[MicroBatch]:
    """Sequences in order, each row filled until the next sequence would pass ``pack_len``
    (counting the filler that rounds the row up to ``multiple`` tokens, ``ssmshard.pack``)."""
    rows = _fill_in_order(
        sequences, lambda row, seq: round_up(sum(s.numel() for s in row) + seq.numel(), multiple) <= pack_len)
    batches = []
    for row in rows:
        packed = ssmshard.pack(row, pad_to_multiple_of=multiple, pad_id=pad_id)
        targets = torch.cat([next_token_targets(s) for s in row]
                            + [torch.full((packed.padding,), IGNORE, dtype=torch.long)])[None]  # (T,) -> (1, T)
        batches.append(MicroBatch(packed.input_ids, targets, packed.cu_seqlens, sum(s.numel() for s in row)))
    return batches


def padded_micro_batches(sequences, pack_len: int, order: str, pad_id: int, multiple: int = 1) -> list[MicroBatch]:
    """Groups whose rows x longest length (rounded up to ``multiple``) stay within ``pack_len``
    tokens, right-padded."""
    if order == "sorted":
        sequences = sorted(sequences, key=lambda s: -s.numel())
    groups = _fill_in_order(sequences, lambda group, seq: (len(group) + 1) * round_up(
        max([s.numel() for s in group] + [seq.numel()]), multiple) <= pack_len)
    return [_right_padded(group, round_up(max(s.numel() for s in group), multiple), pad_id) for group in groups]


def one_at_a_time_micro_batches(sequences, multiple: int = 1, pad_id: int = 0) -> list[MicroBatch]:
    """Each sequence alone, right-padded to ``multiple`` tokens."""
    return [_right_padded([s], round_up(s.numel(), multiple), pad_id) for s in sequences]


def _right_padded(group, length: int, pad_id: int) -> MicroBatch:
    """One row per sequence of ``group``, right-padded to ``length`` tokens."""
    ids = torch.full((len(group), length), pad_id, dtype=torch.long)  # (b, P)
    targets = torch.full((len(group), length), IGNORE, dtype=torch.long)
    for row, seq in enumerate(group):
        ids[row, :seq.numel()] = seq
        targets[row, :seq.numel()] = next_token_targets(seq)
    return MicroBatch(ids, targets, None, sum(s.numel() for s in group))


# ------------------------------------------------------------------------------ the step


def step_loss_part(program, batch: MicroBatch, n_targets: int) -> torch.Tensor:
    """This micro-batch's share of the step loss: summed token cross-entropy / step targets."""
    if batch.cu_seqlens is not None:
        logits = program(batch.input_ids, cu_seqlens=batch.cu_seqlens)  # (1, T, V)
    else:
        logits = program(batch.input_ids)  # (b, P, V)
    token_losses = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(),  # (b*P, V)
                                   ignore_index=IGNORE, reduction="sum")
    return token_losses / n_targets


def train_step(program, batches, n_targets, optimizer) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=batches[0].input_ids.device)
    for batch in batches:
        loss = step_loss_part(program, batch, n_targets)
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total


class StepTimer:
    """Seconds of one call: CUDA events around it on the GPU (synchronised), wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn):
        if not self.cuda:
            start = time.perf_counter()
            result = fn()
            return result, time.perf_counter() - start
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
        return result, start.elapsed_time(end) / 1e3


def peak_memory_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


# ------------------------------------------------------------------------------ one model


def bench_model(name: str, args, device, dtype, report: dict, write) -> bool:
    """Check and time the three modes of one model; returns whether the loss check passed."""
    started = time.perf_counter()
    model = build_model(name, args.smoke, device, dtype, args.seed)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    packed_program, forward_program = build_programs(model, swap=torch.device(device).type == "cuda")
    capture_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    lengths = draw_lengths(args.tokens_per_step, args.min_len, args.max_len, args.seed)
    if max(lengths) > args.pack_len:
        raise ValueError(f"--pack-len {args.pack_len} is shorter than the longest sequence ({max(lengths)})")
    sequences = draw_sequences(lengths, vocab, args.seed)
    pad_id = model.config.pad_token_id or 0
    modes = mode_names(args.padded_order)
    batches = {
        "packed": packed_micro_batches(sequences, args.pack_len, args.pad_to_multiple_of, pad_id),
        "padded": padded_micro_batches(sequences, args.pack_len,
                                       "sorted" if args.padded_order == "both" else args.padded_order, pad_id,
                                       args.pad_to_multiple_of),
        "one": one_at_a_time_micro_batches(sequences, args.pad_to_multiple_of, pad_id),
    }
    if "padded_random" in modes:
        batches["padded_random"] = padded_micro_batches(sequences, args.pack_len, "random", pad_id,
                                                        args.pad_to_multiple_of)
    batches = {mode: [b.to(device) for b in bs] for mode, bs in batches.items()}
    program_of = {mode: packed_program if mode == "packed" else forward_program for mode in modes}
    real_tokens = sum(lengths)
    n_targets = real_tokens - len(lengths)
    entry = {
        "model": name, "config": model.config.to_dict(), "params": params, "dtype": str(dtype).replace("torch.", ""),
        "precision": "weights, grads and AdamW moments in " + str(dtype).replace("torch.", "")
                     + "; no fp32 master, no autocast; cross-entropy on fp32 logits",
        "tokens_per_step": real_tokens, "sequences": len(lengths), "lengths": lengths,
        "pack_len": args.pack_len, "padded_order": args.padded_order, "capture_s": capture_s,
        "kernels": {"packed": kernel_summary(packed_program), "forward": kernel_summary(forward_program)},
        "modes": {},
    }
    report["models"][name] = entry
    print(f"[{name}] {params / 1e9:.2f}B params, {len(lengths)} sequences, {real_tokens} tokens/step "
          f"({min(lengths)}..{max(lengths)}), capture {capture_s:.1f}s", flush=True)
    for label, summary in entry["kernels"].items():
        print(f"[{name}] {label} program kernels: {'; '.join(summary)}", flush=True)

    # The loss check, before any optimizer step: the same weights in every mode.
    with torch.no_grad():
        losses = {mode: float(sum(step_loss_part(program_of[mode], b, n_targets) for b in batches[mode]))
                  for mode in modes}
    errors = {mode: abs(losses[mode] - losses["packed"]) / abs(losses["one"]) for mode in modes if mode != "packed"}
    passed = all(err <= args.loss_rtol for err in errors.values())
    entry["loss_check"] = {"losses": losses, "rel_diff_vs_packed": errors, "rtol": args.loss_rtol, "passed": passed}
    print(f"[{name}] step loss of the initial weights: " + ", ".join(f"{m} {v:.6f}" for m, v in losses.items())
          + "; " + ", ".join(f"|packed - {m}| / one = {e:.2e}" for m, e in errors.items()) + " "
          f"(rtol {args.loss_rtol:g}): {'ok' if passed else 'FAILED'}", flush=True)
    write()

    timer = StepTimer(device)
    for mode in modes:
        randomize_weights(model, seed=args.seed)  # every mode starts from the same weights
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        times, step_losses = [], []
        for _ in range(args.warmup + args.steps):
            loss, seconds = timer(lambda: train_step(program_of[mode], batches[mode], n_targets, optimizer))
            times.append(seconds)
            step_losses.append(float(loss))
        measured = times[args.warmup:]
        median = statistics.median(measured)
        padded_tokens = sum(b.input_ids.numel() for b in batches[mode])
        entry["modes"][mode] = {
            "micro_batches": len(batches[mode]), "tokens_run_incl_pads": padded_tokens,
            "pad_fraction": 1 - real_tokens / padded_tokens, "median_step_s": median,
            "measured_step_s": measured, "warmup_step_s": times[:args.warmup],
            "tokens_per_s": real_tokens / median, "peak_mem_gib": peak_memory_gib(device),
            "step_losses": step_losses, "wall_s": time.perf_counter() - t0,
        }
        row = entry["modes"][mode]
        peak = f", peak {row['peak_mem_gib']:.1f} GiB" if row["peak_mem_gib"] is not None else ""
        print(f"[{name}] {mode:<6} {len(batches[mode]):>3} micro-batches, pads {row['pad_fraction']:.1%}: "
              f"median step {median * 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s{peak} "
              f"(warm-up {sum(times[:args.warmup]):.1f}s)", flush=True)
        del optimizer
        model.zero_grad(set_to_none=True)
        write()
    modes = entry["modes"]
    entry["packed_vs_one"] = modes["packed"]["tokens_per_s"] / modes["one"]["tokens_per_s"]
    entry["packed_vs_padded"] = modes["packed"]["tokens_per_s"] / modes["padded"]["tokens_per_s"]
    if "padded_random" in modes:
        entry["packed_vs_padded_random"] = modes["packed"]["tokens_per_s"] / modes["padded_random"]["tokens_per_s"]
    entry["wall_s"] = time.perf_counter() - started
    print(f"[{name}] packed / one-at-a-time {entry['packed_vs_one']:.2f}x (target 3x), packed / padded "
          f"{entry['packed_vs_padded']:.2f}x (target 1.5x)"
          + (f", packed / padded in drawing order {entry['packed_vs_padded_random']:.2f}x"
             if "packed_vs_padded_random" in entry else "") + f"; {entry['wall_s']:.0f}s", flush=True)
    write()
    del packed_program, forward_program, model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return passed


# ------------------------------------------------------------------------------ output


def write_plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot written (the JSON has every figure)", flush=True)
        return
    modes = mode_names(report["args"]["padded_order"])
    names = [n for n, e in report["models"].items() if len(e["modes"]) == len(modes)]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(2.5 + 2.5 * len(names), 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [report["models"][n]["modes"][mode]["tokens_per_s"] / 1e3 for n in names]
        bars = ax.bar([k + (i - (len(modes) - 1) / 2) * width for k in range(len(names))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(names)), [
        f"{n} ({report['models'][n]['params'] / 1e9:.2f}B)\npacked / one {report['models'][n]['packed_vs_one']:.2f}x, "
        f"/ padded {report['models'][n]['packed_vs_padded']:.2f}x"
        + (f"\n/ padded_random {report['models'][n]['packed_vs_padded_random']:.2f}x"
           if "packed_vs_padded_random" in report["models"][n] else "") for n in names])
    ax.set_ylabel("training tokens/s (thousands, real tokens)")
    ax.set_title(f"fwd + bwd + AdamW, {report['device']}, lengths {report['args']['min_len']}.."
                 f"{report['args']['max_len']} log-uniform", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mamba", "mamba2"], choices=["mamba", "mamba2"])
    parser.add_argument("--smoke", action="store_true", help="tiny configs, CPU, fp32, reference ops, 1 step")
    parser.add_argument("--tokens-per-step", type=int, default=None, help="token budget of a step (32768; smoke 64)")
    parser.add_argument("--pack-len", type=int, default=None, help="tokens per packed row / padded micro-batch "
                                                                   "(8192; smoke 32)")
    parser.add_argument("--min-len", type=int, default=None, help="shortest sequence (64; smoke 3)")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence (4096; smoke 24)")
    parser.add_argument("--padded-order", choices=["sorted", "random", "both"], default="sorted",
                        help="padded micro-batches from length-sorted sequences (least padding), in drawing order, "
                             "or both (two padded modes)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=None,
                        help="round every row up to a multiple of this many tokens, in every mode (packed: a "
                             "filler sequence at the row's end; padded and one: right padding), as a padding "
                             "collator's pad_to_multiple_of does (16; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (1; smoke 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode (3; smoke 1)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--loss-rtol", type=float, default=None, help="loss check tolerance (bf16 2e-2; fp32 1e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/train_packed"))
    args = parser.parse_args(argv)
    defaults = dict(pad_to_multiple_of=(1, 16), tokens_per_step=(64, 32768), pack_len=(32, 8192), min_len=(3, 64), max_len=(24, 4096),
                    warmup=(0, 1), steps=(1, 3), loss_rtol=(1e-5, 2e-2))
    for key, (smoke, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.pad_to_multiple_of < 1 or args.pack_len % args.pad_to_multiple_of:
        parser.error(f"--pad-to-multiple-of must be >= 1 and divide --pack-len ({args.pack_len})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full-size benchmark needs a CUDA GPU; use --smoke to run the tiny CPU version")
        device, dtype = torch.device("cuda"), torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "train_packed.json")
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "args": vars(args), "models": {},
    }
    if device.type == "cuda":
        import triton
        import transformers

        report.update(triton=triton.__version__, transformers=transformers.__version__,
                      ssd_autotune=os.environ.get("SSMSHARD_SSD_AUTOTUNE", "1"))

    def write():
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)

    started = time.perf_counter()
    threads = torch.get_num_threads()
    if args.smoke:
        # Tiny ops gain nothing from intra-op threads and lose a lot on a busy machine.
        torch.set_num_threads(1)
    try:
        passed = [bench_model(name, args, device, dtype, report, write) for name in args.models]
    finally:
        torch.set_num_threads(threads)
    report["total_wall_s"] = time.perf_counter() - started
    write_plot(report, os.path.join(args.out, "train_packed.png"))
    report["loss_checks_passed"] = all(passed)
    write()
    print(f"wrote {json_path}; total {report['total_wall_s']:.0f}s", flush=True)
    if not report["loss_checks_passed"]:
        print("LOSS CHECK FAILED: packed, padded and one-at-a-time losses differ beyond --loss-rtol", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["loss_checks_passed"] else 1)
