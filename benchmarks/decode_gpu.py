"""Single-GPU decode: TPOT against the weight-read floor and beside Hugging Face ``generate``;
batch-1 TTFT of a long prompt; the time ``ssmshard.parallelize`` and the first generation take.

    PYTHONPATH=$PWD python benchmarks/decode_gpu.py --out $OUT --budget-s 420               # one GPU
    PYTHONPATH=$PWD python benchmarks/decode_gpu.py --out $OUT --models llama-3-8b --budget-s 420
    PYTHONPATH=$PWD python benchmarks/decode_gpu.py --smoke --out DIR      # CPU, tiny configs, fp32
    python benchmarks/decode_gpu.py --plot DIR                             # plots + table from DIR's rows

Models: Mamba-2.8B, Mamba2-2.7B, Zamba2-2.7B and Llama-3-8B-sized configs with random bf16
weights drawn on the GPU (``generate_gpu.build_random_model``); the Hugging Face baselines run
the very model object ssmshard was built from. EOS is unset, so every run generates exactly
``--new-tokens``.

Variants (``variant`` in each row):
  ssmshard            ``dm.generate``: the decode step replayed as a CUDA graph (on a GPU), attention
                      families over static key/value buffers of a fixed length (``static_kv=l+n``,
                      so the graph of a batch size is captured once and replayed by every run).
  hf                  Hugging Face ``model.generate`` greedy (dynamic cache); ``hf_path`` says whether
                      the mamba-ssm / causal-conv1d kernels were importable and ran.
  hf_static_compiled  Llama only: ``generate(cache_implementation="static")``, which Hugging Face
                      compiles with ``torch.compile`` on CUDA (``dynamo_graphs`` counts the graphs
                      compiled during its warm-up; 0 means it ran uncompiled).

Glossary:
  b, l, n       batch (requests), prompt length, new tokens per run.
  TTFT          median time of ``generate(max_new_tokens=1)`` (prefill and the first token).
  TPOT          (median time of ``generate(max_new_tokens=n)`` - median of ``generate(n // 4)``)
                / (n - n // 4), the two timed alternately (``ttft_and_tpot`` says why not TTFT):
                one decode step with the host's per-token work; every timed run follows one
                untimed warm-up and a device synchronize, and ends with one.
  copy bandwidth  bytes read + written per second by a device-to-device copy of 1 GiB (median of
                5), measured once per run (``static_kv_decode_gpu.copy_bandwidth``).
  weight-read floor  bytes one decode step must read / copy bandwidth: every weight once (the
                input embedding table counts b rows, unless tied to the output head), the
                recurrent states (conv and SSM, from the prefill's own state tensors) and the
                keys/values of the mean context of the timed steps (l + n / 2 positions). State
                writes are not counted, and a weight shared by several layers (Zamba2's shared
                blocks) counts once: a lower bound.
  timed_runs    TTFT rows time fewer than --repeats runs where the budget would not hold them
                at the warm-up's pace (at least one).
  skip_passes   the optimisation passes the ssmshard rows' plan left out (``--skip-passes``), if any.
  ssm_state_dtype  the dtype the ssmshard rows' plan held SSM states in (``--ssm-state-dtype``), if
                not HF's float32; the floor then counts the states in that dtype.
  forward       median time of ``dm(ids)``, the whole-sequence forward of the same prompt (the
                TTFT a prefill could reach).
  time to start ``parallelize_s`` (of which ``parallelize_capture_s`` in ``capture`` and
                ``parallelize_passes_s`` in ``shard_program``: the passes and the kernel swap;
                the rest is the plan's layout and the local weights), ``generation_programs_s``
                (prefill and decode captured and sharded; attention families: ``prefill_program_s``,
                as their graphed generate needs no decode program of the growing cache),
                ``static_decode_s`` (the static-K/V decode program, attention families),
                ``lazy_forward`` (``--lazy-forward``: ``parallelize`` laid the weights out from the
                prefill program, which ``parallelize_s`` then includes, and captured no forward),
                ``programs_loaded`` / ``programs_stored`` (``--program-cache DIR``: the generation
                programs this process read from the program cache, and those it built and wrote),
                ``all_capture_s`` / ``all_passes_s`` (capture
                and passes over all of these), and ``first_generate_s`` / ``steady_generate_s``
                of a 2-token batch-1 generation (the difference is the first use's cost: the
                decode graph's capture, kernel compilation and autotuning).

Rows go to ``OUT/rows_rank0.jsonl`` (one JSON object a line, flushed) as soon as each is
measured, so a run cut off by its time limit keeps every finished row. ``--budget-s`` skips what
would end after it (estimated from the longest step of the same kind so far) and records the
skip. Order per model: start, ssmshard TPOT by batch, ssmshard TTFT, HF TPOT by batch, HF TTFT,
then the compiled static-cache baseline (Llama). ``--variants`` runs some of them;
``--batches`` with no sizes leaves out the TPOT rows (TTFT of ``--long-prompt`` only).
"""

from __future__ import annotations

import bench_common  # first: --smoke sets TRITON_INTERPRET before any kernel import
from bench_common import time_spent_in

import argparse
import datetime
import gc
import glob
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.families import BY_NAME, family_of
from ssmshard.plan import STATE_DTYPES
from ssmshard.runtime import distributed as distributed_module
from ssmshard.runtime.static_kv import KV_KINDS, KV_POSITIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_gpu import (Clock, Recorder, build_random_model, hf_kernel_path, llama3_8b_config,  # noqa: E402
                          mamba2_2p7b_config, zamba2_2p7b_config)
from static_kv_decode_gpu import copy_bandwidth, synchronize  # noqa: E402
from tp_gpu import mamba_2p8b_config  # noqa: E402

GPU_MODELS = {"mamba-2.8b": mamba_2p8b_config, "mamba2-2.7b": mamba2_2p7b_config,
              "zamba2-2.7b": zamba2_2p7b_config, "llama-3-8b": llama3_8b_config}
SMOKE_MODELS = {f"tiny-{name}": (lambda name=name: BY_NAME[name].make_config())
                for name in ("mamba", "mamba2", "zamba2", "llama")}
PAD = 0
VARIANTS = ("ssmshard", "hf", "hf_static_compiled")
# First guesses (seconds) of each kind of step, until one has been measured.
DEFAULT_COST_S = {"build": 60, "start": 90, "tpot": 30, "ttft": 30, "hf_tpot": 40, "hf_ttft": 60,
                  "hf_static_compiled": 150}


# ---------------------------------------------------------------------------------- settings
def settings(args):
    """What this run measures: the models, sizes, dtype and device."""
    if args.smoke:
        return dict(models=SMOKE_MODELS, batches=[1, 4], prompt=16, new_tokens=4, long_prompt=48, repeats=1,
                    dtype=torch.float32, device=torch.device("cpu"))
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU")
    return dict(models=GPU_MODELS, batches=args.batches, prompt=args.prompt, new_tokens=args.new_tokens,
                long_prompt=args.long_prompt, repeats=args.repeats, dtype=torch.bfloat16,
                device=torch.device("cuda", 0))


def prompt_ids(vocab, batch, length, device, seed):
    """A random prompt without pad ids (ids >= 1), the same for every variant."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 7919 + length)
    return torch.randint(1, vocab, (batch, length), generator=gen).to(device)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- timing
def seconds_of(fn, device):
    """Wall time of one call of ``fn``, between two device synchronizations."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def ttft_and_tpot(generate, new_tokens, repeats, device):
    """TTFT (seconds): median of ``generate(1)``. TPOT: the slope of generate's time in the number
    of tokens, ``(T(new_tokens) - T(short)) / (new_tokens - short)`` with ``short = new_tokens // 4``
    (at least 2), medians of calls made alternately. Both calls pay the prompt's prefill and the
    decode loop's per-call setup, so neither enters TPOT; a difference with ``generate(1)``, which
    runs no decode step, would fold their run-to-run variation (tens of ms at batch 1 on an H200)
    into the per-token figure. The longer run goes first: a graph, a compiled step or a static
    cache sized for it is then reused by the shorter ones."""
    short = max(2, new_tokens // 4)
    if new_tokens <= short:
        raise ValueError(f"TPOT needs at least 3 new tokens, got {new_tokens}")
    warm_up_s = seconds_of(lambda: generate(new_tokens), device)
    seconds_of(lambda: generate(short), device)
    seconds_of(lambda: generate(1), device)
    first = statistics.median(seconds_of(lambda: generate(1), device) for _ in range(repeats))
    shorts, longs = [], []
    for _ in range(repeats):
        shorts.append(seconds_of(lambda: generate(short), device))
        longs.append(seconds_of(lambda: generate(new_tokens), device))
    part, whole = statistics.median(shorts), statistics.median(longs)
    return {"ttft_ms": 1e3 * first, "tpot_ms": 1e3 * (whole - part) / (new_tokens - short),
            "generate_ms": 1e3 * whole, "short_tokens": short, "generate_short_ms": 1e3 * part,
            "tpot_method": "slope", "warm_up_s": warm_up_s}


def median_ms(fn, repeats, device, seconds_left=float("inf")):
    """(median time of ``fn`` in ms after one warm-up call, timed calls): as many of ``repeats``
    calls as ``seconds_left`` holds at the warm-up's pace, at least one (a 4K prefill through
    Hugging Face's torch fallback can take many seconds)."""
    warm_up_s = seconds_of(fn, device)
    calls = max(1, min(repeats, int(seconds_left // max(warm_up_s, 1e-9))))
    return 1e3 * statistics.median(seconds_of(fn, device) for _ in range(calls)), calls


# ---------------------------------------------------------------------------------- bytes
def weight_read_bytes(model, batch):
    """Bytes of the weights one decode step reads: all of them once, except an input embedding
    table not tied to the output head, of which only the ``batch`` looked-up rows are read."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared (tied) tensors once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
        total += batch * embedding.shape[1] * embedding.element_size()
    return total


def state_bytes(dm, ids):
    """(recurrent-state bytes, key/value bytes per position) of a batch, from prefill's states."""
    prefill_program = dm.prefill_program()
    _, states = dm.prefill(ids)
    recurrent = kv_per_position = 0
    for tensor, spec in zip(states, prefill_program.state_specs):
        if spec.kind in KV_KINDS:
            if tensor.numel():  # hybrids hold empty key/value tensors for their SSM layers
                kv_per_position += tensor.numel() * tensor.element_size() // tensor.shape[KV_POSITIONS]
        else:
            recurrent += tensor.numel() * tensor.element_size()
    return recurrent, kv_per_position


def floor_row(model, dm, ids, new_tokens, bandwidth):
    """The weight-read floor of one decode step of ``ids``' batch (see the glossary)."""
    batch, prompt = ids.shape
    weights = weight_read_bytes(model, batch)
    recurrent, kv_per_position = state_bytes(dm, ids)
    kv = kv_per_position * (prompt + new_tokens / 2)
    total = weights + recurrent + kv
    return {"weight_bytes": weights, "recurrent_state_bytes": recurrent, "kv_bytes": kv, "step_bytes": total,
            "floor_ms": 1e3 * total / bandwidth if bandwidth else None}


# ---------------------------------------------------------------------------------- runner
class DecodeBench:
    """One run: the models one after another, each step skipped when the budget says so."""

    def __init__(self, args, run, rec, clock, bandwidth):
        self.args, self.run, self.rec, self.clock, self.bandwidth = args, run, rec, clock, bandwidth
        self.device = run["device"]

    def allowed(self, kind, **where):
        """Whether a step of ``kind`` fits the budget; records the skip when it does not."""
        if self.clock.allows(kind, DEFAULT_COST_S[kind]):
            return True
        self.rec.skipped(kind, "time budget", **where)
        return False

    def seconds_left(self):
        return self.args.budget_s - self.clock.elapsed()

    def timed_step(self, kind, fn):
        """``fn()``, its duration remembered as the estimate of the next step of ``kind``."""
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.clock.took(kind, time.perf_counter() - started)

    def run_model(self, name, make_config):
        if not self.allowed("build", model=name):
            return
        config = make_config()
        model = self.timed_step("build", lambda: build_random_model(config, self.device, self.run["dtype"],
                                                                    self.args.seed))
        attention = family_of(model).has_attention
        try:
            ours = "ssmshard" in self.args.variants
            dm = self.start(name, model) if ours and self.allowed("start", model=name) else None
            if dm is not None:
                for batch in self.run["batches"]:
                    self.ours_tpot(name, model, dm, batch, attention)
                self.ours_ttft(name, dm, attention)
                del dm
                free_memory(self.device)
            self.hf_rows(name, model)
        except torch.cuda.OutOfMemoryError as error:
            self.rec.write("oom", model=name, error=str(error).splitlines()[0])
        del model
        free_memory(self.device)

    # ------------------------------------------------------------------ time to start
    def start(self, name, model):
        """``parallelize`` and what the first generation adds, timed part by part (glossary)."""
        def build():
            row = {}
            with time_spent_in(distributed_module, ("capture", "shard_program")) as inside:
                started = time.perf_counter()
                dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, skip_passes=self.args.skip_passes,
                                                               ssm_state_dtype=self.args.ssm_state_dtype),
                                          lazy_forward=self.args.lazy_forward, program_cache=self.args.program_cache)
                synchronize(self.device)
                row["parallelize_s"] = time.perf_counter() - started
                row.update(parallelize_capture_s=inside["capture"], parallelize_passes_s=inside["shard_program"])
                if family_of(model).has_attention:  # what a graphed generate builds
                    row["prefill_program_s"] = seconds_of(dm.prefill_program, self.device)
                    row["static_decode_s"] = seconds_of(dm.static_decode_program, self.device)
                else:
                    row["generation_programs_s"] = seconds_of(dm.generation_programs, self.device)
                row.update(all_capture_s=inside["capture"], all_passes_s=inside["shard_program"])
            ids = prompt_ids(model.config.vocab_size, 1, self.run["prompt"], self.device, self.args.seed)
            options = self.ours_options(ids, 2, family_of(model).has_attention)
            row["first_generate_s"] = seconds_of(lambda: dm.generate(ids, **options), self.device)
            row["steady_generate_s"] = seconds_of(lambda: dm.generate(ids, **options), self.device)
            return dm, row
        dm, row = self.timed_step("start", build)
        params = sum(p.numel() for p in model.parameters())
        # The prefill program names the same kernels, and a lazy forward's module has built no other.
        self.rec.write("start", model=name, params=params, layers=model.config.num_hidden_layers, **row,
                       lazy_forward=self.args.lazy_forward,
                       **({} if dm.program_cache is None else
                          {"programs_loaded": sorted(dm.program_cache.loaded),
                           "programs_stored": sorted(dm.program_cache.stored)}),
                       kernels=sorted({f"{r['op']}: {r['kernel'] or 'reference'}"
                                       for r in getattr(dm.prefill_program(), "kernel_report", [])}))
        return dm

    # ------------------------------------------------------------------ ssmshard
    def ours_options(self, ids, new_tokens, attention):
        """``dm.generate`` arguments: static buffers of one length for every run of this prompt."""
        options = dict(max_new_tokens=new_tokens, pad_token_id=PAD)
        if attention:
            options["static_kv"] = ids.shape[1] + self.run["new_tokens"]
        return options

    def ours_tpot(self, name, model, dm, batch, attention):
        where = dict(model=name, variant="ssmshard", batch=batch, prompt=self.run["prompt"])
        if self.args.skip_passes:
            where["skip_passes"] = self.args.skip_passes
        if self.args.ssm_state_dtype:
            where["ssm_state_dtype"] = self.args.ssm_state_dtype
        if not self.allowed("tpot", **where):
            return
        ids = prompt_ids(model.config.vocab_size, batch, self.run["prompt"], self.device, self.args.seed)

        def generate(n):
            return dm.generate(ids, **dict(self.ours_options(ids, n, attention), max_new_tokens=n))
        times = self.timed_step("tpot", lambda: ttft_and_tpot(generate, self.run["new_tokens"],
                                                                self.run["repeats"], self.device))
        floor = floor_row(model, dm, ids, self.run["new_tokens"], self.bandwidth)
        self.rec.write("tpot", **where, new_tokens=self.run["new_tokens"], repeats=self.run["repeats"], **times,
                       **floor, cuda_graph=dm.decode_graph(batch) is not None,
                       tpot_over_floor=times["tpot_ms"] / floor["floor_ms"] if floor["floor_ms"] else None)

    def ours_ttft(self, name, dm, attention):
        length = self.run["long_prompt"]
        where = dict(model=name, variant="ssmshard", batch=1, prompt=length)
        if not self.allowed("ttft", **where):
            return
        ids = prompt_ids(dm.program.vocab_size, 1, length, self.device, self.args.seed)

        def measure():
            options = self.ours_options(ids, 1, attention)
            ttft, calls = median_ms(lambda: dm.generate(ids, **options), self.run["repeats"], self.device,
                                    self.seconds_left())
            forward_ms, forward_calls = median_ms(lambda: forward(dm, ids), self.run["repeats"], self.device,
                                                  self.seconds_left())
            return {"ttft_ms": ttft, "timed_runs": calls, "forward_ms": forward_ms, "forward_timed_runs": forward_calls}
        row = self.timed_step("ttft", measure)
        self.rec.write("ttft", **where, **row, ttft_over_forward=row["ttft_ms"] / row["forward_ms"])

    # ------------------------------------------------------------------ Hugging Face
    def hf_rows(self, name, model):
        path = hf_kernel_path(model, self.device)
        self.rec.write("hf_path", model=name, **path)
        if "hf" in self.args.variants:
            for batch in self.run["batches"]:
                self.hf_tpot(name, model, batch, "hf", {}, path)
            self.hf_ttft(name, model, path)
        if family_of(model).name == "llama" and "hf_static_compiled" in self.args.variants:
            for batch in self.run["batches"]:
                self.hf_tpot(name, model, batch, "hf_static_compiled", {"cache_implementation": "static"}, path)

    def hf_tpot(self, name, model, batch, variant, extra, path):
        kind = "hf_tpot" if variant == "hf" else variant
        where = dict(model=name, variant=variant, batch=batch, prompt=self.run["prompt"])
        if not self.allowed(kind, **where):
            return
        ids = prompt_ids(model.config.vocab_size, batch, self.run["prompt"], self.device, self.args.seed)

        def generate(n):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=PAD, **extra)
        compiled_before = dynamo_graphs()
        times = self.timed_step(kind, lambda: ttft_and_tpot(generate, self.run["new_tokens"], self.run["repeats"],
                                                            self.device))
        self.rec.write("tpot", **where, new_tokens=self.run["new_tokens"], repeats=self.run["repeats"], **times,
                       dynamo_graphs=dynamo_graphs() - compiled_before, hf_kernels_ran=path["fast_kernels_ran"],
                       hf_importable=path["importable"])

    def hf_ttft(self, name, model, path):
        length = self.run["long_prompt"]
        where = dict(model=name, variant="hf", batch=1, prompt=length)
        if not self.allowed("hf_ttft", **where):
            return
        ids = prompt_ids(model.config.vocab_size, 1, length, self.device, self.args.seed)

        def generate():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                  pad_token_id=PAD)
        ttft, calls = self.timed_step("hf_ttft", lambda: median_ms(generate, self.run["repeats"], self.device,
                                                                   self.seconds_left()))
        self.rec.write("ttft", **where, ttft_ms=ttft, timed_runs=calls, hf_kernels_ran=path["fast_kernels_ran"],
                       hf_importable=path["importable"])


@torch.no_grad()
def forward(dm, ids):
    return dm(ids)




def dynamo_graphs():
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------------------------- plots
VARIANT_STYLE = {"ssmshard": "C0", "hf": "C1", "hf_static_compiled": "C2"}


def read_rows(folder):
    rows = []
    # rows_rank0.jsonl, or several runs' rows beside each other (rows_<what>.jsonl)
    for path in sorted(glob.glob(os.path.join(folder, "rows*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def plot(folder):
    """One figure per model (TPOT against batch, a line per variant, the floor dashed) and a
    markdown table of every TPOT and TTFT row, both into ``folder``."""
    rows = read_rows(folder)
    tpot = [r for r in rows if r["kind"] == "tpot"]
    for model in sorted({r["model"] for r in tpot}):
        plot_model(folder, model, [r for r in tpot if r["model"] == model])
    table = summary_table(rows)
    with open(os.path.join(folder, "decode_summary.md"), "w") as f:
        f.write(table)
    print(table)


def plot_model(folder, model, rows):
    path = os.path.join(folder, f"decode_tpot_{model}.png")
    plt = bench_common.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in sorted({r["variant"] for r in rows}):
        # Log axes: a non-positive TPOT (noise of a smoke run) has no point.
        points = sorted((r["batch"], r["tpot_ms"]) for r in rows if r["variant"] == variant and r["tpot_ms"] > 0)
        if points:
            ax.plot(*zip(*points), marker="o", color=VARIANT_STYLE.get(variant), label=variant)
    floor = sorted((r["batch"], r["floor_ms"]) for r in rows if r.get("floor_ms"))
    if floor:
        ax.plot(*zip(*floor), linestyle="--", color="k", label="weight-read floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"{model}: decode time per output token", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def summary_table(rows):
    lines = [f"Device: {env.get('device')}; copy bandwidth {env.get('copy_gb_s', 0) / 1e3:.2f} TB/s; "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}; models {', '.join(env.get('models', []))}"
             for env in (r for r in rows if r["kind"] == "environment")]
    lines += ["",
             "| model | batch | ssmshard TPOT ms | floor ms | ssmshard / floor | HF TPOT ms | HF static+compile ms |",
             "|---|---|---|---|---|---|---|"]
    tpot = {(r["model"], r["variant"], r["batch"]): r for r in rows if r["kind"] == "tpot"}
    for model, batch in sorted({(m, b) for m, _, b in tpot}, key=lambda mb: (mb[0], mb[1])):
        ours, hf, hfc = (tpot.get((model, v, batch), {}) for v in ("ssmshard", "hf", "hf_static_compiled"))
        lines.append(f"| {model} | {batch} | {fmt(ours.get('tpot_ms'))} | {fmt(ours.get('floor_ms'))} | "
                     f"{fmt(ours.get('tpot_over_floor'))} | {fmt(hf.get('tpot_ms'))} | {fmt(hfc.get('tpot_ms'))} |")
    lines += ["", "| model | prompt | ssmshard TTFT ms | ssmshard forward ms | HF TTFT ms |", "|---|---|---|---|---|"]
    ttft = {(r["model"], r["variant"]): r for r in rows if r["kind"] == "ttft"}
    for model in sorted({m for m, _ in ttft}):
        ours, hf = ttft.get((model, "ssmshard"), {}), ttft.get((model, "hf"), {})
        lines.append(f"| {model} | {ours.get('prompt', hf.get('prompt'))} | {fmt(ours.get('ttft_ms'))} | "
                     f"{fmt(ours.get('forward_ms'))} | {fmt(hf.get('ttft_ms'))} |")
    lines += ["", "| model | parallelize s | generation (attention: prefill) programs s | static decode s | "
              "all captures s | all passes s | first generate s | steady generate s |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "start"):
        programs = r.get("generation_programs_s", r.get("prefill_program_s"))
        lines.append(f"| {r['model']} | {fmt(r['parallelize_s'])} | {fmt(programs)} | "
                     f"{fmt(r.get('static_decode_s'))} | {fmt(r['all_capture_s'])} | {fmt(r['all_passes_s'])} | "
                     f"{fmt(r['first_generate_s'])} | {fmt(r['steady_generate_s'])} |")
    lines += [""] + [f"HF path of {r['model']}: {r['path']}; importable: {r['importable']}"
                     for r in rows if r["kind"] == "hf_path"]
    skipped = [r for r in rows if r["kind"] == "skipped"]
    if skipped:
        lines += ["", f"Skipped for time: {len(skipped)} steps ("
                  + ", ".join(f"{r.get('model')} {r['what']} b={r.get('batch', '-')}" for r in skipped) + ")"]
    return "\n".join(lines) + "\n"


def fmt(value):
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------- main
def environment(args, run, bandwidth):
    import transformers

    device = run["device"]
    return {"argv": sys.argv, "smoke": args.smoke,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(run["dtype"]),
            "models": list(run["models"]), "batches": run["batches"], "prompt": run["prompt"],
            "new_tokens": run["new_tokens"], "long_prompt": run["long_prompt"], "repeats": run["repeats"],
            "copy_gb_s": bandwidth / 1e9 if bandwidth else None, "budget_s": args.budget_s, "seed": args.seed,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for rows_rank0.jsonl")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny configs: checks the whole flow")
    parser.add_argument("--budget-s", type=float, default=420, help="skip what would end after this (seconds)")
    parser.add_argument("--models", nargs="+", help="a subset of the models")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256],
                        help="batch sizes of the TPOT runs (none: only TTFT and time to start)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which of the variants above to run")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length of the TPOT runs")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per TPOT run")
    parser.add_argument("--long-prompt", type=int, default=4096, help="prompt length of the TTFT runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7, help="of the random weights and prompts")
    parser.add_argument("--skip-passes", nargs="*", default=[], metavar="PASS",
                        help="optimisation passes ssmshard's plan leaves out (Plan(skip_passes=...)), to measure one")
    parser.add_argument("--ssm-state-dtype", choices=sorted(STATE_DTYPES),
                        help="the dtype ssmshard's plan holds SSM states in (Plan(ssm_state_dtype=...)); default HF's")
    parser.add_argument("--lazy-forward", action="store_true",
                        help="parallelize(..., lazy_forward=True): weights laid out from the prefill program, "
                             "no forward program captured before the first forward call")
    parser.add_argument("--program-cache", metavar="DIR",
                        help="parallelize(..., program_cache=DIR): generation programs loaded from DIR where a "
                             "previous process stored them (the start rows' programs_loaded / programs_stored)")
    parser.add_argument("--plot", metavar="DIR", help="plots and a summary table from DIR's rows")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        plot(args.plot)
        return
    if not args.out:
        raise SystemExit("--out DIR is required (or --plot DIR)")
    clock = Clock(args.budget_s)
    run = settings(args)
    if args.models:
        unknown = sorted(set(args.models) - set(run["models"]))
        if unknown:
            raise SystemExit(f"unknown models {unknown}; choose from {list(run['models'])}")
        run["models"] = {m: run["models"][m] for m in args.models}
    if run["device"].type == "cuda":
        torch.cuda.set_device(run["device"])
    bench_common.init_single_process_group(run["device"])
    # A smoke run copies a small buffer: the flow is checked, the figure means nothing.
    bandwidth = copy_bandwidth(run["device"], gib=1.0 if run["device"].type == "cuda" else 1 / 64)
    rec = Recorder(args.out, 0, clock)
    rec.write("environment", **environment(args, run, bandwidth))
    bench = DecodeBench(args, run, rec, clock, bandwidth)
    for name, make_config in run["models"].items():
        bench.run_model(name, make_config)
    rec.write("done", budget_s=args.budget_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
