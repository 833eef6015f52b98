"""Summary and plots of a ``generate_gpu.py`` run, from its ``rows_rank*.jsonl`` (CPU, no launcher).

    python benchmarks/generate_gpu.py --plot DIR

Writes DIR/summary.json (speed-ups against tp = 1 and where they fall short of the seed's
ratios, the Hugging Face comparison, whether tp > 1 generated the ids tp = 1 did, the longest
prompts, the compute / collective splits, what was skipped) and, with matplotlib,
DIR/throughput_vs_gpus.png and DIR/latency_vs_prompt.png.
"""

from __future__ import annotations

import glob
import json
import os

# The throughput ratios against one GPU that the tensor-parallel SSM paper reports (2 and 4 GPUs).
SEED_RATIOS = {2: (1.6, 2.1), 4: (2.6, 4.0)}


def load_rows(folder):
    paths = sorted(glob.glob(os.path.join(folder, "rows_rank*.jsonl")))
    if not paths:
        raise SystemExit(f"no rows_rank*.jsonl in {folder}: is it the --out folder of generate_gpu.py?")
    rows = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    return rows


def summarize(folder):
    rows = load_rows(folder)
    gen = [r for r in rows if r["kind"] == "gen"]
    by_cell = {}
    for r in gen:
        by_cell.setdefault((r["model"], r["batch"], r["prompt"]), {})[r["layout"]] = r
    hf = {(r["model"], r["batch"], r["prompt"]): r for r in rows if r["kind"] == "hf"}
    scaling, short, same_ids = [], [], []
    for (model, batch, prompt), layouts in sorted(by_cell.items()):
        base = layouts.get("tp1")
        if base is None:
            continue
        for name, r in sorted(layouts.items()):
            if name == "tp1":
                continue
            gpus = r["tp"] * r["dp"]
            entry = {"model": model, "batch": batch, "prompt": prompt, "layout": name, "gpus": gpus,
                     "throughput_x": r["throughput_tok_s"] / base["throughput_tok_s"],
                     "ttft_x": base["ttft_s"] / r["ttft_s"],
                     "tpot_x": base["tpot_s"] / r["tpot_s"] if base.get("tpot_s") and r.get("tpot_s") else None}
            scaling.append(entry)
            if r["dp"] == 1 and gpus in SEED_RATIOS and entry["throughput_x"] < SEED_RATIOS[gpus][0]:
                short.append({**entry, "seed_ratio": SEED_RATIOS[gpus]})
            if r["dp"] == 1:
                same_ids.append({"model": model, "batch": batch, "prompt": prompt, "layout": name,
                                 "same_ids_as_tp1": r["new_ids_sha"] == base["new_ids_sha"]})
    versus_hf = []
    for key, h in sorted(hf.items()):
        ours = by_cell.get(key, {}).get("tp1")
        if ours is None:
            continue
        versus_hf.append({"model": key[0], "batch": key[1], "prompt": key[2], "hf_path": h.get("hf_path", {}).get("path"),
                          "throughput_x": ours["throughput_tok_s"] / h["throughput_tok_s"],
                          "ttft_x": h["ttft_s"] / ours["ttft_s"], "tpot_x": h["tpot_s"] / ours["tpot_s"],
                          "same_ids_as_hf": ours["new_ids_sha"] == h["new_ids_sha"]})
    summary = {
        "environment": next((r for r in rows if r["kind"] == "environment"), None),
        "finished": any(r["kind"] == "done" for r in rows),
        "cells": [{k: r.get(k) for k in ("model", "layout", "batch", "prompt", "ttft_s", "tpot_s", "throughput_tok_s",
                                         "peak_gib")} for r in gen],
        "scaling_vs_tp1": scaling, "short_of_seed_ratios": short, "greedy_ids_vs_tp1": same_ids,
        "versus_hf": versus_hf,
        "longest_prompt": [{k: r.get(k) for k in ("model", "tp", "chunk", "longest_fit", "reason")}
                           for r in rows if r["kind"] == "longest"],
        "profiles": [r for r in rows if r["kind"] == "profile"],
        "ooms": [r for r in rows if r["kind"] == "cell_oom"],
        "skipped": [r for r in rows if r["kind"] == "skipped"],
    }
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary, rows


def print_tables(summary):
    print("| model | layout | b | l | TTFT ms | TPOT ms | tokens/s | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for c in sorted(summary["cells"], key=lambda c: (c["model"], c["batch"], c["prompt"], c["layout"])):
        tpot = f"{c['tpot_s'] * 1e3:.2f}" if c["tpot_s"] is not None else "-"
        peak = f"{c['peak_gib']:.1f}" if c["peak_gib"] is not None else "-"
        print(f"| {c['model']} | {c['layout']} | {c['batch']} | {c['prompt']} | {c['ttft_s'] * 1e3:.1f} | {tpot} "
              f"| {c['throughput_tok_s']:,.0f} | {peak} |")
    for s in summary["short_of_seed_ratios"]:
        print(f"short of seed: {s['model']} {s['layout']} b={s['batch']} l={s['prompt']}: "
              f"{s['throughput_x']:.2f}x (seed {s['seed_ratio'][0]}-{s['seed_ratio'][1]}x)")
    for v in summary["versus_hf"]:
        print(f"vs HF ({v['hf_path']}): {v['model']} b={v['batch']} l={v['prompt']}: throughput {v['throughput_x']:.2f}x, "
              f"TTFT {v['ttft_x']:.2f}x, TPOT {v['tpot_x']:.2f}x, same ids {v['same_ids_as_hf']}")
    for lp in summary["longest_prompt"]:
        print(f"longest prompt: {lp['model']} tp={lp['tp']} chunk={lp['chunk']}: {lp['longest_fit']} ({lp['reason']})")
    for p in summary["profiles"]:
        if "oom" in p:
            continue
        for part in ("prefill", "decode_step"):
            s = p[part]
            print(f"split {p['model']} {p['layout']} b={p['batch']} l={p['prompt']} {part}: kernels {s['kernel_ms']:.2f} ms, "
                  f"collective {s['collective_ms']:.2f} ms ({(s['collective_share'] or 0) * 100:.0f}%), wall {s['wall_ms']:.2f} ms")
    print(f"skipped: {len(summary['skipped'])}, OOM cells: {len(summary['ooms'])}, finished: {summary['finished']}")


def plot(folder):
    summary, rows = summarize(folder)
    print_tables(summary)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"summary.json written to {folder}; the plots need matplotlib: pip install matplotlib "
                         "(or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = [r for r in rows if r["kind"] == "gen"]
    models = sorted({r["model"] for r in gen})
    if not models:
        raise SystemExit(f"summary.json written to {folder}; no generation rows to plot")

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        cells = sorted({(r["batch"], r["prompt"]) for r in gen if r["model"] == model})
        for i, (batch, prompt) in enumerate(cells):
            color = f"C{i % 10}"
            pick = {r["layout"]: r for r in gen if (r["model"], r["batch"], r["prompt"]) == (model, batch, prompt)}
            for kind, style in (("tp", "-o"), ("dp", "--s")):
                points = [(1, pick["tp1"]["throughput_tok_s"])] if "tp1" in pick else []
                points += [(g, pick[f"{kind}{g}"]["throughput_tok_s"]) for g in (2, 4, 8) if f"{kind}{g}" in pick]
                if len(points) > 1 or kind == "tp":
                    ax.plot(*zip(*points), style, color=color, label=f"{kind} b={batch} l={prompt}")
        ax.set(title=model, xlabel="GPUs", ylabel="generated tokens / s", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4], ["1", "2", "4"])
        ax.minorticks_off()
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "throughput_vs_gpus.png"), dpi=120)

    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        series = sorted({(r["layout"], r["batch"]) for r in gen if r["model"] == model})
        for i, (layout, batch) in enumerate(series):
            points = sorted((r["prompt"], r["ttft_s"], r["tpot_s"]) for r in gen
                            if (r["model"], r["layout"], r["batch"]) == (model, layout, batch))
            prompts = [p for p, _, _ in points]
            axes[0][col].plot(prompts, [t * 1e3 for _, t, _ in points], "-o", color=f"C{i % 10}",
                              label=f"{layout} b={batch}")
            axes[1][col].plot(prompts, [(t or 0) * 1e3 for _, _, t in points], "-o", color=f"C{i % 10}",
                              label=f"{layout} b={batch}")
        axes[0][col].set(title=f"{model}: TTFT", xlabel="prompt tokens", ylabel="ms", yscale="log")
        axes[1][col].set(title=f"{model}: TPOT", xlabel="prompt tokens", ylabel="ms per token")
        prompts = sorted({r["prompt"] for r in gen if r["model"] == model})
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(prompts, [f"{p // 1024}K" if p >= 1024 else str(p) for p in prompts])
            ax.minorticks_off()
        axes[0][col].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "latency_vs_prompt.png"), dpi=120)
    print(f"wrote {folder}/summary.json, throughput_vs_gpus.png, latency_vs_prompt.png")
