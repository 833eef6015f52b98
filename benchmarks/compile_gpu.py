"""Compiled rank programs on one GPU: forward time against its roofline floor and decode TPOT
against the weight-read floor, eager (``Plan(tp=1)``) beside compiled (``Plan(tp=1, compile=True)``),
and what compiling costs.

    PYTHONPATH=$PWD python benchmarks/compile_gpu.py --out $OUT --budget-s 500 --models mamba-2.8b
    PYTHONPATH=$PWD python benchmarks/compile_gpu.py --out $OUT --profile   # + where the forward's time goes
    PYTHONPATH=$PWD python benchmarks/compile_gpu.py --out $OUT --forward-only --profile --models mamba2-2.7b
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
  TPOT          (median ``generate(n)`` - median ``generate(n // 4)``) / (n - n // 4), CUDA-graph
                decode (``decode_gpu.ttft_and_tpot``); floor: ``decode_gpu.floor_row``.
  compile_s     seconds of the calls that compiled (``program.compilations``: tracing, Inductor,
                the first run), per program; cold (empty Inductor cache) unless a previous model
                of the same shapes filled it.
  logits_rel_err  |compiled - eager| / |eager| of the first forward's logits (bf16).
  profile       (``--profile``) device time of one forward at the first shape by kernel and by
                category (``FORWARD_CATEGORIES``: matmul, scan, conv, norm, Inductor's fused glue,
                copies, other) beside the matmul and scan floors: where the forward's time over
                its floor goes. On the CPU (``--smoke``) the categories are of aten ops, nested
                ones counted in each, so only the plumbing means anything there.
"""

from __future__ import annotations

import bench_common  # first: --smoke sets TRITON_INTERPRET before any kernel import

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
from decode_profile import MATMUL_KERNELS, category, kernel_times  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth, synchronize  # noqa: E402

SMOKE_MODELS = {f"tiny-{name}": (lambda name=name: BY_NAME[name].make_config()) for name in ("mamba", "mamba2")}
VARIANTS = {"eager": False, "compiled": True}
# Kernel-name needles per category, first match wins (ssmshard's Triton kernels by their function
# names; Inductor names its kernels triton_poi / triton_red / triton_per_fused_...).
FORWARD_CATEGORIES = (("matmul", MATMUL_KERNELS + ("triton_tem", "aten::mm", "aten::addmm", "aten::bmm")),
                      ("scan", ("scan_fwd", "segment_carry", "ssd_", "chunk_table", "_final_states",
                                "selective_scan")),
                      ("conv", ("_conv_", "conv1d")),
                      ("norm", ("rms_norm",)),
                      ("fused glue (Inductor)", ("triton_",)),
                      ("copies", ("copy", "memcpy")))


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


def forward_profile(fn, device) -> dict:
    """One call of ``fn`` profiled: device ms by category and the 15 largest kernels."""
    times = kernel_times(fn, device)
    by_category = {}
    for kernel, (_, us) in times.items():
        label = category(kernel, FORWARD_CATEGORIES)
        by_category[label] = by_category.get(label, 0.0) + us / 1e3
    top = sorted(times.items(), key=lambda item: -item[1][1])[:15]
    return {"device_ms": sum(us for _, us in times.values()) / 1e3, "by_category_ms": by_category,
            "kernels": [{"kernel": k[:160], "category": category(k, FORWARD_CATEGORIES), "calls": calls,
                         "ms": us / 1e3} for k, (calls, us) in top]}


def forward_rows(rows, name, model, dm, variant, shapes, repeats, rates, eager_logits, device, seed, profile=False):
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
        if profile and (batch, length) == shapes[0]:
            with torch.no_grad():
                found = forward_profile(lambda: dm(ids), device)
            rows.write("forward_profile", model=name, variant=variant, batch=batch, length=length, forward_ms=ms,
                       matmul_floor_ms=matmul_ms, scan_floor_ms=scan_ms, **found)
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
                     args.seed, profile=args.profile)
        if time.monotonic() < deadline and not args.forward_only:
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
    lines += profile_table(rows)
    lines += ["", "Compile seconds per program (each call that compiled):", ""]
    lines += [f"- {r['model']} {r['variant']}: parallelize {r['parallelize_s']:.1f} s; {r['compile_s']}"
              for r in rows if r["kind"] == "start" and r["variant"] == "compiled"]
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def profile_table(rows) -> list[str]:
    """Markdown lines: each profiled forward's device ms by category, eager beside compiled, with
    the floor of the categories that have one."""
    found = {(r["model"], r["batch"], r["length"], r["variant"]): r for r in rows if r["kind"] == "forward_profile"}
    lines = []
    for (model, b, l) in sorted({key[:3] for key in found}):
        eager, compiled = found.get((model, b, l, "eager")), found.get((model, b, l, "compiled"))
        any_row = eager or compiled
        floors = {"matmul": any_row["matmul_floor_ms"], "scan": any_row["scan_floor_ms"]}
        labels = [label for label, _ in FORWARD_CATEGORIES] + ["other"]
        lines += ["", f"Device ms of one forward by kernel category, {model} {b} x {l}:", "",
                  "| category | eager ms | compiled ms | floor ms |", "|---|---:|---:|---:|"]
        for label in labels + ["all kernels"]:
            cells = []
            for r in (eager, compiled):
                value = None if r is None else (r["device_ms"] if label == "all kernels"
                                                 else r["by_category_ms"].get(label, 0.0))
                cells.append("-" if value is None else f"{value:.1f}")
            floor = sum(floors.values()) if label == "all kernels" else floors.get(label)
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | {'' if floor is None else f'{floor:.1f}'} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b"])
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--summary", metavar="DIR")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one forward per variant by kernel category (glossary: profile)")
    parser.add_argument("--forward-only", action="store_true", help="skip the decode rows")
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
    bench_common.init_single_process_group(run["device"])
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
