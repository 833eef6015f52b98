"""Compiled rank programs on one GPU: forward time against its roofline floor and decode TPOT
against the weight-read floor, eager (``Plan(tp=1)``) beside compiled (``Plan(tp=1, compile=True)``),
and what compiling costs.

    PYTHONPATH=$PWD python benchmarks/compile_gpu.py --out $OUT --budget-s 500 --models mamba-2.8b
    PYTHONPATH=$PWD python benchmarks/compile_gpu.py --smoke --out DIR      # CPU, tiny configs, fp32
    python benchmarks/compile_gpu.py --summary DIR                          # summary.md from DIR's rows

Random bf16 weights (``generate_gpu.build_random_model``), one model at a time, both variants
built from the same model object.

Glossary:
  b, l          batch and sequence length of a forward; decode runs a 128-token prompt.
  forward_ms    median of ``--repeats`` calls of ``dm(ids)`` under ``torch.no_grad`` after one
                warm-up (the compiled variant's warm-ups compile: ``compile_s``).
  matmul floor  2 x (parameters of every linear layer but the embedding) x b x l FLOPs at the
                dense bf16 matmul rate measured in the same run (an 8192^3 ``torch.mm``, median of
                10), plus the scan's minimum bytes (below) at the measured copy bandwidth: a lower
                bound on the forward.
  scan bytes    per SSM layer, what the scan must read and write at the model's dtype: Mamba-1
                u, delta, z in and y out (4 x b x l x d_inner), Mamba-2 x, z in and y out (3 x)
                plus dt (b x l x heads); B and C are left out (small).
  roofline      floor_ms / forward_ms (1.0 = at the floor).
  TPOT          (median ``generate(n)`` - median ``generate(1)``) / (n - 1), CUDA-graph decode
                (``decode_gpu.ttft_and_tpot``); floor: ``decode_gpu.floor_row``.
  compile_s     seconds of the calls that compiled (``program.compilations``: tracing, Inductor,
                the first run), per program; cold (empty Inductor cache) unless a previous model
                of the same shapes filled it.
  logits_rel_err  |compiled - eager| / |eager| of the first forward's logits (bf16).
"""

from __future__ import annotations

import bench_common  # noqa: F401  (first: --smoke sets TRITON_INTERPRET before any kernel import)

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.families import BY_NAME, family_of
from ssmshard.testing import rel_err

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import GPU_MODELS, PAD, floor_row, free_memory, prompt_ids, seconds_of, ttft_and_tpot  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth, synchronize  # noqa: E402

SMOKE_MODELS = {f"tiny-{name}": (lambda name=name: BY_NAME[name].make_config()) for name in ("mamba", "mamba2")}
VARIANTS = {"eager": False, "compiled": True}


def matmul_flops_per_s(device, n=8192, repeats=10):
    """Dense bf16 matmul rate of this device (FLOP/s): the median of ``repeats`` n^3 products."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    times = [seconds_of(lambda: torch.mm(a, b), device) for _ in range(repeats)]
    return 2 * n ** 3 / statistics.median(times)


def linear_params(model):
    """Parameters of every linear layer but the input embedding (the lm_head counts)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def scan_bytes(model, batch, length):
    """Minimum bytes the scans of one forward read and write (see the glossary)."""
    config, size = model.config, next(model.parameters()).element_size()
    family = family_of(model).name
    d_inner = getattr(config, "intermediate_size", None) or config.expand * config.hidden_size
    layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Mixer"))
    if family in ("mamba", "falcon_mamba"):
        per_layer = 4 * batch * length * d_inner * size
    elif family in ("mamba2", "zamba2"):
        per_layer = 3 * batch * length * d_inner * size + batch * length * config.num_heads * size
    else:
        return 0
    return layers * per_layer


class Rows:
    def __init__(self, out):
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "rows.jsonl")

    def write(self, kind, **row):
        row = {"kind": kind, **row}
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def forward_rows(rows, name, model, dm, variant, shapes, repeats, rates, eager_logits, device, seed):
    flops_rate, bandwidth = rates
    for batch, length in shapes:
        ids = prompt_ids(model.config.vocab_size, batch, length, device, seed)
        try:
            with torch.no_grad():
                first_s = seconds_of(lambda: dm(ids), device)
                times = [seconds_of(lambda: dm(ids), device) for _ in range(repeats)]
                logits_err = None
                if (batch, length) == shapes[0]:
                    logits = dm(ids)[:, -8:].float()
                    if variant == "eager":
                        eager_logits[name] = logits
                    elif name in eager_logits:
                        logits_err = rel_err(logits, eager_logits[name])
                    del logits
        except torch.cuda.OutOfMemoryError as error:
            rows.write("oom", model=name, variant=variant, batch=batch, length=length, error=str(error)[:200])
            free_memory(device)
            continue
        ms = 1e3 * statistics.median(times)
        matmul_ms = 1e3 * 2 * linear_params(model) * batch * length / flops_rate
        scan_ms = 1e3 * scan_bytes(model, batch, length) / bandwidth
        rows.write("forward", model=name, variant=variant, batch=batch, length=length, forward_ms=ms,
                   first_call_s=first_s, floor_ms=matmul_ms + scan_ms, matmul_floor_ms=matmul_ms,
                   scan_floor_ms=scan_ms, roofline=(matmul_ms + scan_ms) / ms, logits_rel_err=logits_err)
        free_memory(device)


def decode_rows(rows, name, model, dm, variant, batches, new_tokens, repeats, bandwidth, device, seed):
    attention = family_of(model).has_attention
    for batch in batches:
        ids = prompt_ids(model.config.vocab_size, batch, 128, device, seed)
        options = dict(pad_token_id=PAD, **({"static_kv": 128 + new_tokens} if attention else {}))
        try:
            times = ttft_and_tpot(lambda n: dm.generate(ids, max_new_tokens=n, **options), new_tokens, repeats,
                                  device)
        except torch.cuda.OutOfMemoryError as error:
            rows.write("oom", model=name, variant=variant, batch=batch, error=str(error)[:200])
            free_memory(device)
            continue
        floor = floor_row(model, dm, ids, new_tokens, bandwidth)
        rows.write("tpot", model=name, variant=variant, batch=batch, **times, **floor,
                   cuda_graph=dm.decode_graph(batch) is not None,
                   tpot_over_floor=times["tpot_ms"] / floor["floor_ms"] if floor["floor_ms"] else None)


def compile_row(rows, name, variant, dm, parallelize_s):
    prefill, decode = dm.generation_programs()
    programs = {"forward": dm.program, "prefill": prefill, "decode": decode}
    rows.write("start", model=name, variant=variant, parallelize_s=parallelize_s,
               compile_s={k: [round(c["seconds"], 2) for c in p.compilations] for k, p in programs.items()})


def run_model(rows, args, name, make_config, run, rates, deadline):
    device = run["device"]
    model = build_random_model(make_config(), device, run["dtype"], args.seed)
    eager_logits = {}
    for variant, compiled in VARIANTS.items():
        if time.monotonic() > deadline:
            rows.write("skipped", model=name, variant=variant, reason="time budget")
            continue
        started = time.perf_counter()
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False, compile=compiled))
        parallelize_s = time.perf_counter() - started
        forward_rows(rows, name, model, dm, variant, run["shapes"], run["repeats"], rates, eager_logits, device,
                     args.seed)
        if time.monotonic() < deadline:
            decode_rows(rows, name, model, dm, variant, run["batches"], run["new_tokens"], run["repeats"], rates[1],
                        device, args.seed)
        compile_row(rows, name, variant, dm, parallelize_s)
        dm.release_cuda_graphs()
        del dm
        free_memory(device)
    del model
    free_memory(device)


def summary(folder):
    rows = [json.loads(line) for line in open(os.path.join(folder, "rows.jsonl"))]
    env = next(r for r in rows if r["kind"] == "environment")
    lines = [f"Device: {env['device']}; torch {env['torch']}; matmul {env['matmul_tflops']:.0f} TFLOP/s, "
             f"copy {env['copy_gb_s'] / 1e3:.2f} TB/s (measured in the run)", "",
             "| model | b x l | eager ms | compiled ms | compiled / eager | floor ms | eager roofline | "
             "compiled roofline |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    fwd = {(r["model"], r["batch"], r["length"], r["variant"]): r for r in rows if r["kind"] == "forward"}
    for (model, b, l, variant), r in sorted(fwd.items()):
        if variant != "eager" or (model, b, l, "compiled") not in fwd:
            continue
        c = fwd[(model, b, l, "compiled")]
        lines.append(f"| {model} | {b} x {l} | {r['forward_ms']:.1f} | {c['forward_ms']:.1f} | "
                     f"{c['forward_ms'] / r['forward_ms']:.2f} | {r['floor_ms']:.1f} | {r['roofline']:.2f} | "
                     f"{c['roofline']:.2f} |")
    lines += ["", "| model | batch | eager TPOT ms | compiled TPOT ms | floor ms | eager / floor | compiled / floor |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    tpot = {(r["model"], r["batch"], r["variant"]): r for r in rows if r["kind"] == "tpot"}
    for (model, b, variant), r in sorted(tpot.items()):
        if variant != "eager" or (model, b, "compiled") not in tpot:
            continue
        c = tpot[(model, b, "compiled")]
        lines.append(f"| {model} | {b} | {r['tpot_ms']:.2f} | {c['tpot_ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['tpot_over_floor']:.2f} | {c['tpot_over_floor']:.2f} |")
    lines += ["", "Compile seconds per program (each call that compiled):", ""]
    lines += [f"- {r['model']} {r['variant']}: parallelize {r['parallelize_s']:.1f} s; {r['compile_s']}"
              for r in rows if r["kind"] == "start" and r["variant"] == "compiled"]
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b"])
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--summary", metavar="DIR")
    args = parser.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return
    deadline = time.monotonic() + args.budget_s
    if args.smoke:
        run = dict(models=SMOKE_MODELS, shapes=[(2, 32)], batches=[1, 2], new_tokens=4, repeats=1,
                   dtype=torch.float32, device=torch.device("cpu"))
        models = list(SMOKE_MODELS)
    else:
        run = dict(models=GPU_MODELS, shapes=[(8, 2048), (1, 16384)], batches=[1, 16, 64], new_tokens=32,
                   repeats=args.repeats, dtype=torch.bfloat16, device=torch.device("cuda", 0))
        models = args.models
        torch.cuda.set_device(run["device"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if run["device"].type == "cuda" else "gloo", rank=0, world_size=1)
    device = run["device"]
    rates = ((matmul_flops_per_s(device, n=256 if args.smoke else 8192)),
             copy_bandwidth(device, gib=1.0 if device.type == "cuda" else 1 / 64))
    rows = Rows(args.out)
    rows.write("environment", argv=sys.argv, device=torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", torch=torch.__version__, matmul_tflops=rates[0] / 1e12, copy_gb_s=rates[1] / 1e9,
               date=datetime.date.today().isoformat(), smoke=args.smoke)
    for name in models:
        run_model(rows, args, name, run["models"][name], run, rates, deadline)
    rows.write("done")
    summary(args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
