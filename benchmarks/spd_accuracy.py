"""Accuracy of sync-point drops (SPD) and quantized all-reduces on the trained small models.

For each trained checkpoint (benchmarks/train_small_models.py: llama, mamba, mamba2 and zamba2
where present) and each tensor-parallel size, on a :class:`ssmshard.SimulatedMesh` (every rank in
this process, the values of a real run):

1. ``ssmshard.sensitivity`` on the CALIBRATION split: each sync point's perplexity increase when
   dropped alone (class ISB / SB / ESB) and the last-layers-first greedy curve;
2. ``report.choose(budget)``: the largest drop set within the perplexity budget (measured on the
   calibration windows);
3. on the HELD-OUT split (never seen by a choice): the perplexity of exact TP, the chosen SPD
   set, int8 and fp8 quantized syncs (``quantize_min_bytes=0``: every all-reduce quantized) and
   SPD + int8, each with its relative change against exact TP, and the all-reduce counts of
   each program (kept / dropped / quantized).

    python benchmarks/spd_accuracy.py --models-dir DIR [--tp 2 4] [--jobs 6] [--out FILE]
    python benchmarks/spd_accuracy.py --smoke --out FILE   # tiny random models: checks the script
    python benchmarks/spd_accuracy.py --replot [--out FILE] [--include OTHER.json ...]  # table and plots again

DIR holds one ``from_pretrained`` folder per model and ``splits.safetensors`` (the calibration
and held-out token streams, benchmarks/small_corpus.py). Each (model, tp) case runs in its own
process (``--jobs`` at a time, ``--threads`` torch threads each). Writes JSON to --out (default
benchmarks/results/spd_accuracy/spd_accuracy.json), beside it ``spd_accuracy.png`` (sensitivity
per layer), ``spd_accuracy_heldout.png`` (held-out perplexity change per variant) and one
sensitivity report (JSON and PNG) per case, and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

FAMILIES = ("llama", "mamba", "mamba2", "zamba2")
SMOKE_VOCAB = 256
FLOOR = 1e-6  # the log-scale plot draws increases at or below zero here


def variant_plans(tp: int, drop_syncs: list[str]) -> dict:
    from ssmshard import Plan

    every = dict(quantize_min_bytes=0)  # every all-reduce quantized, whatever its size
    return {"tp": Plan(tp=tp),
            "spd": Plan(tp=tp, drop_syncs=list(drop_syncs)),
            "int8": Plan(tp=tp, quantize_syncs="int8", **every),
            "fp8": Plan(tp=tp, quantize_syncs="fp8", **every),
            "spd+int8": Plan(tp=tp, drop_syncs=list(drop_syncs), quantize_syncs="int8", **every)}


def all_reduce_counts(program) -> dict:
    actions = [p.action for p in program.sync_points if p.kind == "all_reduce"]
    return {a: actions.count(a) for a in ("kept", "dropped", "quantized")}


def load_case_inputs(name: str, args):
    """The model (fp32, eval) and its calibration and held-out token streams."""
    import torch

    if args.smoke:  # a tiny random model of the family and random token streams
        from small_models import build_model

        model = build_model(name, SMOKE_VOCAB, smoke=True, seed=args.seed, device="cpu").eval()
        generator = torch.Generator().manual_seed(args.seed)
        streams = {s: torch.randint(0, SMOKE_VOCAB, (args.window * 4,), generator=generator)
                   for s in ("calibration", "heldout")}
        return model, streams
    from small_corpus import load_streams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(args.models_dir, name), dtype=torch.float32).eval()
    return model, load_streams(os.path.join(args.models_dir, "splits.safetensors"))


def run_case(name: str, tp: int, args) -> dict:
    import torch

    import ssmshard
    from ssmshard import Plan, SimulatedMesh
    from ssmshard.eval import perplexity

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, streams = load_case_inputs(name, args)
    calibration = dict(window=args.window, batch_size=args.batch_size, max_windows=args.calibration_windows)
    report = ssmshard.sensitivity(model, Plan(tp=tp), streams["calibration"], greedy=args.greedy, progress=False,
                                  **calibration)
    sensitivity_s = time.perf_counter() - started
    validation = None
    if args.validate:
        # The calibration stream's next windows: disjoint from the calibration and held-out text.
        validation = streams["calibration"][args.calibration_windows * args.window:]
        if validation.numel() < args.calibration_windows * args.window:
            raise SystemExit(f"--validate needs {2 * args.calibration_windows} windows of {args.window} tokens in the "
                             "calibration stream")
    choice = report.choose(budget=args.budget, validation_ids=validation)
    stem = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"sensitivity_{name}_tp{tp}")
    report.save(stem + ".json")
    report.plot(stem + ".png")

    heldout = dict(window=args.window, batch_size=args.batch_size, max_windows=args.heldout_windows)
    eager = perplexity(lambda ids: model(ids).logits, streams["heldout"], **heldout)
    program = ssmshard.capture(model, mode="forward")
    variants, sync_points = {}, None
    for label, plan in variant_plans(tp, choice.drop_syncs).items():
        mesh = SimulatedMesh(model, plan, program=program)
        result = perplexity(mesh, streams["heldout"], **heldout)
        sync_points = len(mesh.program.sync_points) if sync_points is None else sync_points  # exact TP's
        variants[label] = {"perplexity": result.perplexity, "all_reduces": all_reduce_counts(mesh.program),
                           "drop_syncs": list(plan.drop_syncs), "quantize_syncs": plan.quantize_syncs}
    exact = variants["tp"]["perplexity"]
    for row in variants.values():
        row["relative_change"] = row["perplexity"] / exact - 1
    all_reduces = sum(variants["tp"]["all_reduces"].values())
    spd_counts = variants["spd"]["all_reduces"]
    return {"model": name, "tp": tp, "params": sum(p.numel() for p in model.parameters()),
            "sync_points": sync_points, "candidates": len(report.points),
            "all_reduces_tp": all_reduces,
            "dropped": len(choice.drop_syncs), "drop_syncs": choice.drop_syncs,
            "all_reduces_removed_fraction": (all_reduces - spd_counts["kept"] - spd_counts["quantized"]) / all_reduces,
            "calibration": {"exact_perplexity": report.exact_perplexity, "windows": report.windows,
                            "window": report.window, "chosen_perplexity": choice.measured.perplexity,
                            "chosen_increase": choice.measured.increase, "budget": args.budget},
            "validation": None if choice.validated is None else {
                "windows": args.calibration_windows, "increase": choice.validated.increase,
                "taken_back": choice.taken_back},
            "classes": report.classes(),
            "points": [{"name": p.name, "layer": p.layer, "role": p.role, "increase": p.increase, "kl": p.kl,
                        "cls": p.cls} for p in report.points],
            "heldout": {"eager_perplexity": eager.perplexity, "windows": eager.windows, "window": eager.window,
                        "variants": variants},
            "sensitivity_s": sensitivity_s, "wall_s": time.perf_counter() - started}


def plot_sensitivity(path: str, cases: list[dict]) -> None:
    """One panel per model: each sync point's calibration perplexity increase by layer, per tp."""
    plt = bench_common.pyplot(path)
    if plt is None:
        return
    models = list(dict.fromkeys(c["model"] for c in cases))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for case in (c for c in cases if c["model"] == model):
            for role in sorted({p["role"] for p in case["points"]}):
                mine = [p for p in case["points"] if p["role"] == role]
                ax.plot([-1 if p["layer"] is None else p["layer"] for p in mine],
                        [max(p["increase"], FLOOR) * 100 for p in mine], marker="o",
                        label=f"tp={case['tp']} {role}")
        ax.axhline(cases[0]["calibration"]["budget"] * 100, color="gray", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("layer (-1: embedding)")
        ax.set_ylabel(f"perplexity increase, % (<= 0 drawn at {FLOOR * 100:g})")
        ax.set_title(model, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("SPD sensitivity on the calibration split (SimulatedMesh, fp32)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def print_table(cases: list[dict]) -> None:
    labels = ["tp", "spd", "int8", "fp8", "spd+int8"]
    print(f"{'model':7} {'tp':>2} {'syncs':>5} {'cand':>4} {'drop':>4} {'AR removed':>10} "
          + " ".join(f"{label + ' ppl (chg)':>20}" for label in labels))
    for c in cases:
        v = c["heldout"]["variants"]
        cells = " ".join(f"{v[label]['perplexity']:>10.3f} ({v[label]['relative_change']:+7.2%})" for label in labels)
        print(f"{c['model']:7} {c['tp']:>2} {c['sync_points']:>5} {c['candidates']:>4} {c['dropped']:>4} "
              f"{c['all_reduces_removed_fraction']:>10.1%} {cells}")
        print("        classes: " + "; ".join(f"{k} {len(names)}: {' '.join(names) or '-'}"
                                              for k, names in c["classes"].items()))


def write_plots(out: str, results: list[dict]) -> None:
    stem = os.path.splitext(out)[0]
    plot_sensitivity(stem + ".png", results)
    labels = ["spd", "int8", "fp8", "spd+int8"]
    bench_common.bar_chart(stem + "_heldout.png", "held-out perplexity change vs exact TP (SimulatedMesh, fp32)",
                           [f"{c['model']} tp={c['tp']}" for c in results],
                           {label: [c["heldout"]["variants"][label]["relative_change"] * 100 for c in results]
                            for label in labels}, "perplexity change, %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", default=os.path.join(ROOT, "benchmarks", "results", "trained_models"))
    parser.add_argument("--models", nargs="+", default=None, choices=FAMILIES,
                        help="default: every family with a checkpoint folder in --models-dir")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--budget", type=float, default=0.01, help="perplexity budget of choose (0.01 = 1%%)")
    parser.add_argument("--window", type=int, default=128, help="tokens per scored window")
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--heldout-windows", type=int, default=64)
    parser.add_argument("--validate", action="store_true",
                        help="choose(validation_ids=...): check the chosen set on the calibration stream's next "
                             "--calibration-windows windows and take back sync points until it is within the budget")
    parser.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the last-layers-first greedy curve (--no-greedy: choose adds sync points in "
                             "one-at-a-time order only, each addition measured; about half the plans)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1, help="(model, tp) cases run at once, one process each")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per case")
    parser.add_argument("--seed", type=int, default=0, help="smoke models' weights and tokens")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spd_accuracy",
                                                      "spd_accuracy.json"))
    parser.add_argument("--smoke", action="store_true", help="a tiny random llama at tp 2: checks the script")
    parser.add_argument("--replot", action="store_true", help="print the table and draw the plots of --out again")
    parser.add_argument("--include", nargs="+", default=[], help="with --replot: also the cases of these JSON files "
                        "(other runs, e.g. other tp), in the table and the plots of --out")
    args = parser.parse_args()
    if args.replot:
        results = []
        for path in [args.out] + args.include:
            with open(path) as f:
                results += json.load(f)["cases"]
        results.sort(key=lambda c: (FAMILIES.index(c["model"]), c["tp"]))
        print_table(results)
        write_plots(args.out, results)
        return
    if args.smoke:
        args.models, args.tp = ["llama"], [2]
        args.window, args.calibration_windows, args.heldout_windows, args.batch_size = 16, 2, 2, 2
    if args.models is None:
        args.models = [m for m in FAMILIES if os.path.isdir(os.path.join(args.models_dir, m))]
        if not args.models:
            parser.error(f"no checkpoint folder of {FAMILIES} in {args.models_dir} (see --models-dir)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    import torch
    import transformers

    cases = [(m, tp) for tp in args.tp for m in args.models]  # the smaller tp first
    header = {"device": "CPU (SimulatedMesh, fp32)",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__},
              "args": vars(args)}
    results = []
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as pool:
        futures = {pool.submit(run_case, m, tp, args): (m, tp) for m, tp in cases}
        for future in concurrent.futures.as_completed(futures):
            model_name, tp = futures[future]
            results.append(future.result())
            results.sort(key=lambda c: (FAMILIES.index(c["model"]), c["tp"]))
            with open(args.out, "w") as f:  # after every case: a stopped run keeps what it finished
                json.dump(dict(header, cases=results, complete=len(results) == len(cases)), f, indent=1)
            print(f"done {model_name} tp={tp}: {len(results)}/{len(cases)}", flush=True)
    print_table(results)
    print(f"wrote {args.out}")
    write_plots(args.out, results)


if __name__ == "__main__":
    main()
