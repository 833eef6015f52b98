"""Multi-GPU generation benchmark: throughput, TTFT, TPOT, peak memory, longest prompt.

    PYTHONPATH=$PWD python3 -m torch.distributed.run --standalone --nproc_per_node 4 \\
        benchmarks/generate_gpu.py --suite quick --out $OUT --budget-s 480
    python benchmarks/generate_gpu.py --plot DIR          # afterwards, on a CPU: summary + plots
    torchrun --standalone --nproc_per_node 2 benchmarks/generate_gpu.py --smoke --out DIR   # CPU, gloo

One launcher, every configuration inside it. Layouts: tp = 1 (rank 0), tp = 2 (ranks 0, 1), tp = 4
(all) over ``dist.new_group`` groups, and data parallel dp = 2, 4: independent tp = 1 replicas,
each taking batch / dp of the requests (throughput = all generated tokens / the slowest
replica's time). Ranks outside a configuration wait at a barrier of a CPU (gloo) group; every
go / skip decision is taken by the first rank of the team that runs it and broadcast, so ranks
never disagree about what runs next.

Measures (random bf16 weights drawn on the GPU from a meta-device model, the same seed
everywhere, so the Hugging Face baseline runs the very weights ours does):
  TTFT = median time of ``generate(max_new_tokens=1)``; TPOT = (median time of
  ``generate(max_new_tokens=n)`` - TTFT) / (n - 1); each timed run starts after a barrier of the
  team and a device synchronize, and a repeat's time is the slowest rank's. Throughput =
  batch * n / median generate time (generated tokens per second, prefill included).
  Peak memory: ``max_memory_allocated`` per rank over the warm-up and timed runs.
  Longest prompt: batch 1, prefill + one decode step, on a coarse grid, with and without
  chunked prefill; ``torch.cuda.OutOfMemoryError`` is caught and memory freed, and a size the
  kernels refuse up front (``ValueError``, e.g. 32-bit indexing) counts as not fitting. At tp > 1 a
  length is not tried when the peak memory extrapolated from the last two lengths exceeds 92% of
  the GPU: an OOM on one rank only would leave its peers waiting in a collective.
  Compute / collective split: torch.profiler over one prefill and 3 decode steps (the captured
  programs called as generate calls them), kernels whose name contains "nccl" counted as
  collective, on rank 0 (NCCL time includes waiting for a slower peer, so each profiled region
  starts after a barrier).

Rows go to ``OUT/rows_rank{R}.jsonl`` as soon as each is measured (flushed), so a run cut off by
its time limit still leaves every finished row; ``--budget-s`` skips what would not finish in
time and records what it skipped.

Glossary: b batch (requests), l prompt length, n new tokens, tp ranks of one model copy,
dp model copies (replicas).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.families import BY_NAME, build_meta_model
from ssmshard.program import unpadded_mask_and_positions
from ssmshard.runtime.checkpoint import recompute_buffer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_gpu import _init_on_gpu, mamba_2p8b_config  # noqa: E402  (a sibling script, not a package)

K = 1024


# ---------------------------------------------------------------------------------- models
def falcon_mamba_7b_config():
    from transformers import FalconMambaConfig

    return FalconMambaConfig(vocab_size=65024, hidden_size=4096, state_size=16, num_hidden_layers=64, expand=2,
                             conv_kernel=4, time_step_rank=256, mixer_rms_eps=1e-6, use_cache=True)


def mamba2_2p7b_config():
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=50288, hidden_size=2560, state_size=128, num_hidden_layers=64, expand=2,
                        num_heads=80, head_dim=64, n_groups=1, conv_kernel=4, chunk_size=256,
                        tie_word_embeddings=True)


def zamba2_2p7b_config():
    from transformers import Zamba2Config

    # The config class's default layer pattern is Zamba2-2.7B's (54 layers, 9 hybrid).
    return Zamba2Config(vocab_size=32000, hidden_size=2560, num_hidden_layers=54, mamba_d_state=64,
                        mamba_expand=2, n_mamba_heads=80, mamba_ngroups=1, num_attention_heads=32,
                        num_key_value_heads=32, intermediate_size=10240, num_mem_blocks=2,
                        use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False,
                        max_position_embeddings=131072)


def llama3_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       tie_word_embeddings=False)


def llama2_7b_config():
    """A Llama-7B-sized decoder (Llama-2-7B's shape: full multi-head attention, 32K vocabulary)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                       tie_word_embeddings=False)


def keep_layers(config, layers: int | None):
    """``config`` cut to its first ``layers`` layers (all when None), a hybrid's layer pattern too."""
    if layers:
        config.num_hidden_layers = min(config.num_hidden_layers, layers)
        if getattr(config, "layers_block_type", None) is not None:
            config.layers_block_type = config.layers_block_type[:config.num_hidden_layers]
        if getattr(config, "hybrid_layer_ids", None) is not None:
            config.hybrid_layer_ids = [i for i in config.hybrid_layer_ids if i < config.num_hidden_layers]
    return config


GPU_MODELS = {"mamba-2.8b": mamba_2p8b_config, "falcon-mamba-7b": falcon_mamba_7b_config,
              "mamba2-2.7b": mamba2_2p7b_config, "zamba2-2.7b": zamba2_2p7b_config,
              "llama-3-8b": llama3_8b_config}
SMOKE_MODELS = {f"tiny-{name}": (lambda name=name: BY_NAME[name].make_config()) for name in ("mamba", "zamba2")}


def build_random_model(config, device, dtype, seed=0):
    """The HF model of ``config`` with random weights drawn on ``device``: built on the meta device
    and materialised there (``to_empty``), never as a full CPU fp32 copy. Buffers (rotary
    ``inv_freq``) are computed from the config as ``from_pretrained`` does.

    The generation config has no EOS token: every benchmark times fixed-length greedy runs, and a
    random model emits the EOS id now and then. Not ``min_new_tokens``, which forces the EOS logit
    to -inf and so changes the greedy ids whenever EOS is the argmax."""
    model = build_meta_model(config, dtype=dtype)
    buffers = {name: recompute_buffer(model, name) for name, _ in model.named_buffers()}
    model.to_empty(device=device)
    model.generation_config.eos_token_id = None
    _init_on_gpu(model, seed=seed, device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    return model.eval()


# ---------------------------------------------------------------------------------- suites
@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int

    @property
    def name(self):
        return f"tp{self.tp}" if self.dp == 1 else f"dp{self.dp}"

    @property
    def ranks(self):
        return list(range(self.tp * self.dp))


@dataclass
class Suite:
    models: dict
    layouts: list
    batches: list
    prompts: list
    new_tokens: int
    repeats: int
    hf_cells: list  # (b, l) of the Hugging Face baseline
    profile_cells: list  # (b, l) profiled at every tp > 1
    longest_grid: list
    chunk: int  # prefill chunk of the longest-prompt search
    max_cell_tokens: int  # b * l above this is skipped (recorded)
    dtype: torch.dtype


def make_suite(args) -> Suite:
    layouts = [Layout(1, 1), Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(1, 4)]
    if args.smoke:
        return Suite(SMOKE_MODELS, layouts, [1, 4], [16, 40], 6, 2, [(1, 16)], [(1, 16)], [64, 256], 32,
                     1 << 20, torch.float32)
    if args.suite == "quick":
        return Suite({m: GPU_MODELS[m] for m in ("mamba-2.8b", "mamba2-2.7b")}, layouts, [1, 16], [1 * K, 4 * K], 128, 3,
                     [(1, 1 * K)], [(1, 1 * K), (16, 1 * K)], [16 * K, 32 * K, 64 * K, 128 * K], 4096,
                     1 << 20, torch.bfloat16)
    return Suite(dict(GPU_MODELS), layouts, [1, 4, 16, 64], [1 * K, 4 * K, 16 * K, 32 * K], 128, 3,
                 [(1, 1 * K), (16, 1 * K)], [(1, 4 * K), (16, 4 * K)], [16 * K, 32 * K, 64 * K, 128 * K], 4096,
                 512 * K, torch.bfloat16)


# ---------------------------------------------------------------------------------- plumbing
class Recorder:
    """Each rank appends the rows it measured to its own JSONL file, flushed row by row."""

    def __init__(self, out, rank, clock):
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, f"rows_rank{rank}.jsonl")
        self.file = open(self.path, "a")
        self.clock = clock
        self.rank = rank

    def write(self, kind, **row):
        row = {"kind": kind, **row, "rank": self.rank, "elapsed_s": round(self.clock.elapsed(), 2)}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        brief = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
        print(f"[rank {self.rank}] {json.dumps(brief)}", flush=True)

    def skipped(self, what, reason, **where):
        self.write("skipped", what=what, reason=reason, **where)


class Clock:
    def __init__(self, budget_s):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.longest = {}  # kind of step -> longest duration seen (the estimate of the next one)

    def elapsed(self):
        return time.perf_counter() - self.start

    def allows(self, kind, default_s):
        return self.elapsed() + self.longest.get(kind, default_s) < self.budget_s

    def took(self, kind, seconds):
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


class Team:
    """The ranks that run one configuration: a CPU group for barriers and agreement (the
    tensor-parallel groups themselves are NCCL on GPUs)."""

    def __init__(self, ranks, control):
        self.ranks = list(ranks)
        self.group = control  # None for a team of one
        self.leader = self.ranks[0]

    @property
    def member(self):
        return dist.get_rank() in self.ranks

    @property
    def leads(self):
        return dist.get_rank() == self.leader

    def barrier(self):
        if self.group is not None:
            dist.barrier(group=self.group)

    def decide(self, value):
        """The leader's ``value`` on every member."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def gather(self, obj):
        if self.group is None:
            return [obj]
        out = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out


class Groups:
    """Every process group the suite needs, created up front in the same order on every rank
    (``new_group`` is collective over the world)."""

    def __init__(self, world, timeout_s):
        self.world = world
        self.compute, self.control = {}, {}
        self.timeout = datetime.timedelta(seconds=timeout_s)
        ctl_timeout = datetime.timedelta(hours=1)  # idle ranks wait here for whole configurations
        self.control[tuple(range(world))] = dist.new_group(list(range(world)), backend="gloo", timeout=ctl_timeout)
        for size in sorted({1, 2, 4, world}):
            if size > world:
                continue
            for start in range(0, world - size + 1, size):
                ranks = tuple(range(start, start + size))
                self.compute[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
                if size > 1 and ranks not in self.control:
                    self.control[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=ctl_timeout)

    def team(self, ranks):
        ranks = tuple(ranks)
        return Team(ranks, None if len(ranks) == 1 else self.control[ranks])

    def team_sizes(self):
        return sorted({len(ranks) for ranks in self.compute if ranks[0] == 0})

    def everyone(self):
        return self.team(range(self.world))

    def replica_group(self, tp):
        """This rank's tensor-parallel group of ``tp`` consecutive ranks."""
        rank = dist.get_rank()
        start = rank - rank % tp
        return self.compute[tuple(range(start, start + tp))]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def allocated_gib(device):
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(error):
    return isinstance(error, torch.cuda.OutOfMemoryError)


def prompt_ids(vocab, batch, length, seed):
    """The same random prompt on every rank for a (b, l) cell; no pad tokens (ids >= 1)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 7919 + length)
    return torch.randint(1, vocab, (batch, length), generator=gen)


def ids_digest(ids):
    return hashlib.sha1(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def generate_options():
    """Which of the lead's new ``generate`` options this checkout has (by signature)."""
    from ssmshard.runtime import generate as generate_module

    names = set(inspect.signature(ssmshard.DistributedModule.generate).parameters)
    names |= set(inspect.signature(generate_module.generate).parameters)
    return {"prefill_chunk_size": "prefill_chunk_size" in names, "cuda_graph": "cuda_graph" in names}


def timed(team, device, fn):
    team.barrier()
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def slowest(per_rank):
    """Per repeat, the slowest rank's time (lists of equal length, one per rank)."""
    return [max(times) for times in zip(*per_rank)]


# ---------------------------------------------------------------------------------- runner
class Bench:
    def __init__(self, args, suite, groups, rec, clock, device):
        self.args, self.suite, self.groups, self.rec, self.clock, self.device = args, suite, groups, rec, clock, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.options = generate_options()
        self.gen_kwargs = {}
        if args.cuda_graph != "default":
            if not self.options["cuda_graph"]:
                raise SystemExit(f"--cuda-graph {args.cuda_graph} asked for, but generate() has no cuda_graph "
                                 "option in this checkout; leave --cuda-graph default")
            self.gen_kwargs["cuda_graph"] = {"auto": "auto", "on": True, "off": False}[args.cuda_graph]
        self.layouts = [lay for lay in suite.layouts if len(lay.ranks) <= self.world]

    def everyone_decides(self, kind, default_s, what, **where):
        team = self.groups.everyone()
        go = team.decide(self.clock.allows(kind, default_s) if team.leads else None)
        if not go and team.leads:
            self.rec.skipped(what, "time budget", **where)
        return go

    # ------------------------------------------------------------------ one model, every layout
    def run_model(self, name, make_config):
        config = make_config()
        vocab = config.vocab_size
        replica_layouts = [lay for lay in self.layouts if lay.tp == 1]
        tp_layouts = [lay for lay in self.layouts if lay.tp > 1]
        # With 4+ ranks, the tp = 1 longest-prompt search (rank 2) and the HF baseline (rank 3) run
        # beside the tp = 2 measurement on ranks 0, 1: other GPUs, so they cost no time.
        beside_tp2 = self.world >= 4 and any(lay.tp == 2 for lay in tp_layouts)
        needed = max([len(lay.ranks) for lay in replica_layouts] + [3 if beside_tp2 else 1])
        replica_ranks = min(size for size in self.groups.team_sizes() if size >= needed)  # a team with a group

        dm = None
        if self.everyone_decides("build", 90, "build", model=name, tp=1):
            dm = self.build(name, config, tp=1, ranks=range(replica_ranks)) if self.rank < replica_ranks else None
            for lay in replica_layouts:
                self.cells(name, vocab, lay, dm)
            if not beside_tp2:
                self.longest_prompt(name, vocab, self.groups.team([0]), dm, tp=1)
            if self.rank != 2 or not beside_tp2:
                dm = self.drop(dm)
        self.groups.everyone().barrier()

        for lay in tp_layouts:
            if self.everyone_decides("build", 90, "build", model=name, tp=lay.tp):
                if lay.tp == 2 and beside_tp2 and self.rank == 2:
                    if dm is not None:  # None: the replica build was skipped for time
                        self.longest_prompt(name, vocab, self.groups.team([2]), dm, tp=1, budget_local=True)
                    dm = self.drop(dm)
                elif lay.tp == 2 and beside_tp2 and self.rank == 3:
                    self.hf_baseline(name, config, budget_local=True)
                elif self.rank in lay.ranks:
                    tp_dm = self.build(name, config, tp=lay.tp, ranks=lay.ranks)
                    self.cells(name, vocab, lay, tp_dm)
                    self.profile(name, vocab, lay, tp_dm)
                    self.longest_prompt(name, vocab, self.groups.team(lay.ranks), tp_dm, tp=lay.tp)
                    self.drop(tp_dm)
            elif lay.tp == 2 and beside_tp2 and self.rank == 2:
                dm = self.drop(dm)
            self.groups.everyone().barrier()
        if dm is not None:  # no tp = 2 phase ran: the replica kept for it is not needed
            dm = self.drop(dm)
        if not beside_tp2 and self.rank == 0:
            self.hf_baseline(name, config, budget_local=True)
        self.groups.everyone().barrier()

    def drop(self, dm):
        del dm
        free_memory(self.device)
        return None

    def build(self, name, config, *, tp, ranks):
        started = time.perf_counter()
        model = build_random_model(config, self.device, self.suite.dtype, self.args.seed)
        params = sum(p.numel() for p in model.parameters())
        # Generation only: no forward program (lazy_forward), prefill and decode captured while the
        # model holds real values.
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=tp, training=False), group=self.groups.replica_group(tp),
                                  lazy_forward=True)
        dm.generation_programs()
        # The full copy is not needed any more: later shape-bucket captures run on meta shapes.
        model.to_empty(device="meta")
        free_memory(self.device)
        seconds = time.perf_counter() - started
        self.clock.took("build", seconds)
        team = self.groups.team(ranks)
        weights = team.gather(allocated_gib(self.device))
        if team.leads:
            kernels = sorted({f"{r['op']}: {r['kernel'] or 'reference'}"
                              for r in getattr(dm.prefill_program(), "kernel_report", [])})
            self.rec.write("build", model=name, tp=tp, ranks=list(ranks), params=params, setup_s=seconds,
                           weights_gib_per_rank=weights, kernels=kernels or "reference (no swap_kernels pass)")
        return dm

    # ------------------------------------------------------------------ throughput, TTFT, TPOT
    def cells(self, name, vocab, lay, dm):
        team = self.groups.team(lay.ranks)
        if not team.member:
            return
        replica = self.rank // lay.tp
        for batch in self.suite.batches:
            for length in self.suite.prompts:
                where = dict(model=name, layout=lay.name, tp=lay.tp, dp=lay.dp, batch=batch, prompt=length)
                if batch % lay.dp:
                    if team.leads:
                        self.rec.skipped("cell", f"batch {batch} does not split over dp={lay.dp}", **where)
                    continue
                if batch * length > self.suite.max_cell_tokens:
                    if team.leads:
                        self.rec.skipped("cell", f"b*l over --max-cell-tokens {self.suite.max_cell_tokens}", **where)
                    continue
                if not team.decide(self.clock.allows("cell", 30) if team.leads else None):
                    if team.leads:
                        self.rec.skipped("cell", "time budget", **where)
                    continue
                local = batch // lay.dp
                ids = prompt_ids(vocab, batch, length, self.args.seed)[replica * local:(replica + 1) * local].to(self.device)
                started = time.perf_counter()
                result = self.measure(dm, ids, team)
                self.clock.took("cell", time.perf_counter() - started)
                results = team.gather(result)
                if team.leads:
                    self.write_cell(where, results)

    def measure(self, dm, ids, team):
        n, repeats = self.suite.new_tokens, self.suite.repeats
        generate = lambda tokens: dm.generate(ids, max_new_tokens=tokens, **self.gen_kwargs)  # noqa: E731
        programs = dm.generation_programs()
        try:
            reset_peak(self.device)
            generate(min(3, n))  # warm-up: kernels compiled and tuned, decode step graphed where it is
            captured = [len(p.siblings) for p in programs]
            ttft = [timed(team, self.device, lambda: generate(1))[0] for _ in range(repeats)]
            full = []
            for _ in range(repeats):
                seconds, out = timed(team, self.device, lambda: generate(n))
                full.append(seconds)
            # A shape-bucket capture inside the timed runs would be timed as generation.
            recaptured = [len(p.siblings) for p in programs] != captured
            return {"ttft": ttft, "full": full, "peak_gib": peak_gib(self.device), "recaptured_while_timed": recaptured,
                    "new_ids": out[:, ids.shape[1]:].cpu().tolist()}
        except torch.cuda.OutOfMemoryError as error:
            free_memory(self.device)
            return {"oom": str(error).splitlines()[0]}

    def write_cell(self, where, results):
        ooms = [r["oom"] for r in results if "oom" in r]
        if ooms:
            self.rec.write("cell_oom", **where, error=ooms[0])
            return
        n = self.suite.new_tokens
        ttft = statistics.median(slowest([r["ttft"] for r in results]))
        full = statistics.median(slowest([r["full"] for r in results]))
        new_ids = [row for r in results[::where["tp"]] for row in r["new_ids"]]  # one copy per replica
        row = dict(where, new_tokens=n, repeats=self.suite.repeats, ttft_s=ttft,
                   tpot_s=(full - ttft) / (n - 1) if n > 1 else None, generate_s=full,
                   throughput_tok_s=where["batch"] * n / full, requests_per_s=where["batch"] / full,
                   peak_gib=max(r["peak_gib"] or 0 for r in results) if self.device.type == "cuda" else None,
                   peak_gib_per_rank=[r["peak_gib"] for r in results],
                   ttft_all_s=slowest([r["ttft"] for r in results]), generate_all_s=slowest([r["full"] for r in results]),
                   new_ids_sha=ids_digest(torch.tensor(new_ids)), generate_kwargs=_jsonable(self.gen_kwargs),
                   recaptured_while_timed=any(r["recaptured_while_timed"] for r in results))
        if where["batch"] * n <= 4096:
            row["new_ids"] = new_ids
        self.rec.write("gen", **row)

    # ------------------------------------------------------------------ longest prompt
    def longest_prompt(self, name, vocab, team, dm, *, tp, budget_local=False):
        """Batch 1, prefill + one decode step, ascending lengths until one does not fit."""
        if not team.member:
            return
        total_gib = (torch.cuda.get_device_properties(self.device).total_memory / 2**30
                     if self.device.type == "cuda" else None)
        for chunk in (None, self.suite.chunk):
            where = dict(model=name, tp=tp, chunk=chunk)
            if chunk is not None and not self.options["prefill_chunk_size"]:
                if team.leads:
                    self.rec.write("longest", **where, longest_fit=None,
                                   reason="generate() has no prefill_chunk_size option in this checkout")
                continue
            kwargs = dict(self.gen_kwargs, **({"prefill_chunk_size": chunk} if chunk else {}))
            fits, peaks, verdict = [], [], None
            for length in self.suite.longest_grid:
                predicted = _extrapolate(fits, peaks, length)
                if tp > 1 and predicted is not None and total_gib is not None and predicted > 0.92 * total_gib:
                    verdict = f"{length} not tried: predicted peak {predicted:.1f} GiB > 92% of {total_gib:.0f} GiB"
                    break
                allowed = self.clock.allows("longest", 20)
                if not (allowed if budget_local else team.decide(allowed if team.leads else None)):
                    verdict = f"{length} not tried: time budget"
                    break
                ids = prompt_ids(vocab, 1, length, self.args.seed).to(self.device)
                started = time.perf_counter()
                try:
                    reset_peak(self.device)
                    seconds, _ = timed(team, self.device, lambda: dm.generate(ids, max_new_tokens=2, **kwargs))
                    status = {"ok": True, "s": seconds, "peak": peak_gib(self.device)}
                except (torch.cuda.OutOfMemoryError, ValueError) as error:
                    # ValueError: a size the kernels refuse up front (e.g. 32-bit indexing), the
                    # same on every rank of the team, so no rank is left waiting.
                    status = {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                del ids
                free_memory(self.device)
                self.clock.took("longest", time.perf_counter() - started)
                statuses = team.gather(status)
                ok = all(s["ok"] for s in statuses)
                if team.leads:
                    self.rec.write("longest_try", **where, prompt=length, fits=ok,
                                   seconds=max(s.get("s", 0) for s in statuses),
                                   peak_gib_per_rank=[s.get("peak") for s in statuses],
                                   error=next((s["error"] for s in statuses if not s["ok"]), None))
                if not ok:
                    verdict = f"{length} does not fit (OOM)"
                    break
                fits.append(length)
                peaks.append(max(s["peak"] or 0 for s in statuses))
            if team.leads:
                self.rec.write("longest", **where, longest_fit=fits[-1] if fits else None, grid=self.suite.longest_grid,
                               reason=verdict or "every length of the grid fits")

    # ------------------------------------------------------------------ compute / collective split
    def profile(self, name, vocab, lay, dm):
        team = self.groups.team(lay.ranks)
        for batch, length in self.suite.profile_cells:
            where = dict(model=name, layout=lay.name, tp=lay.tp, batch=batch, prompt=length)
            if not team.decide(self.clock.allows("profile", 20) if team.leads else None):
                if team.leads:
                    self.rec.skipped("profile", "time budget", **where)
                continue
            started = time.perf_counter()
            try:
                split = profile_split(dm, prompt_ids(vocab, batch, length, self.args.seed).to(self.device), team, self.device)
            except torch.cuda.OutOfMemoryError as error:
                free_memory(self.device)
                split = {"oom": str(error).splitlines()[0]}
            self.clock.took("profile", time.perf_counter() - started)
            if team.leads:
                self.rec.write("profile", **where, **split)

    # ------------------------------------------------------------------ Hugging Face baseline
    def hf_baseline(self, name, config, *, budget_local):
        team = self.groups.team([self.rank])
        model = None
        for batch, length in self.suite.hf_cells:
            where = dict(model=name, layout="hf", tp=1, dp=1, batch=batch, prompt=length)
            if not self.clock.allows("hf", 40):
                self.rec.skipped("hf", "time budget", **where)
                continue
            started = time.perf_counter()
            if model is None:
                model = build_random_model(config, self.device, self.suite.dtype, self.args.seed)  # ours too
                path = hf_kernel_path(model, self.device)
            ids = prompt_ids(config.vocab_size, batch, length, self.args.seed).to(self.device)
            pad = config.pad_token_id if config.pad_token_id is not None else 0

            def generate(tokens):
                with torch.no_grad():
                    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                          do_sample=False, pad_token_id=pad)
            try:
                reset_peak(self.device)
                generate(2)
                ttft = [timed(team, self.device, lambda: generate(1))[0] for _ in range(self.suite.repeats)]
                full = []
                for _ in range(self.suite.repeats):
                    seconds, out = timed(team, self.device, lambda: generate(self.suite.new_tokens))
                    full.append(seconds)
            except torch.cuda.OutOfMemoryError as error:
                free_memory(self.device)
                self.rec.write("cell_oom", **where, error=str(error).splitlines()[0])
                continue
            self.clock.took("hf", time.perf_counter() - started)
            n = self.suite.new_tokens
            t1, tn = statistics.median(ttft), statistics.median(full)
            new_ids = out[:, length:].cpu()
            row = dict(where, new_tokens=n, repeats=self.suite.repeats, ttft_s=t1, tpot_s=(tn - t1) / (n - 1),
                       generate_s=tn, throughput_tok_s=batch * n / tn, requests_per_s=batch / tn,
                       peak_gib=peak_gib(self.device), ttft_all_s=ttft, generate_all_s=full,
                       new_ids_sha=ids_digest(new_ids), hf_path=path)
            if batch * n <= 4096:
                row["new_ids"] = new_ids.tolist()
            self.rec.write("hf", **row)
        del model
        free_memory(self.device)


def _jsonable(kwargs):
    return {k: v if isinstance(v, (bool, int, str, type(None))) else str(v) for k, v in kwargs.items()}


def _extrapolate(lengths, peaks, length):
    """Peak memory at ``length`` on the line through the last two measured points."""
    if len(lengths) < 2 or peaks[-1] is None:
        return None
    slope = (peaks[-1] - peaks[-2]) / (lengths[-1] - lengths[-2])
    return peaks[-1] + slope * (length - lengths[-1])


# ---------------------------------------------------------------------------------- profiling
COLLECTIVE_MARKS = ("nccl", "gloo", "c10d::")


def kernel_times(prof, device):
    """(name, microseconds) of every device kernel (GPU), or of every top-level op (CPU)."""
    from torch.autograd import DeviceType

    if device.type == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == DeviceType.CPU and e.cpu_parent is None]


def split_times(kernels, wall_s, steps=1):
    collective = sum(us for name, us in kernels if any(m in name.lower() for m in COLLECTIVE_MARKS)) / 1e3
    total = sum(us for _, us in kernels) / 1e3
    top = {}
    for name, us in kernels:
        if any(m in name.lower() for m in COLLECTIVE_MARKS):
            top[name[:80]] = top.get(name[:80], 0) + us / 1e3
    return {"kernel_ms": total / steps, "collective_ms": collective / steps, "compute_ms": (total - collective) / steps,
            "collective_share": collective / total if total else None, "wall_ms": wall_s * 1e3 / steps,
            "collective_kernels": dict(sorted(top.items(), key=lambda kv: -kv[1])[:5])}


def profile_split(dm, ids, team, device, steps=3):
    """One prefill and ``steps`` decode steps of the captured programs, called as generate calls
    them (eager: a graphed decode step runs the same kernels), each under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    prefill, decode = dm.generation_programs()
    mask, positions = unpadded_mask_and_positions(ids, 0)
    token = torch.zeros(ids.shape[0], 1, dtype=ids.dtype, device=device)  # a fixed token: same input on every rank

    def run_prefill():
        return prefill(ids, attention_mask=mask, position_ids=positions)

    def run_decode(states):
        m, p = mask, positions[:, -1:]
        for _ in range(steps):
            m = torch.cat([m, m.new_ones(m.shape[0], 1)], dim=-1)
            p = p + 1
            _, states = decode(token, states, attention_mask=m, position_ids=p)
        return states

    with torch.no_grad():
        _, states = run_prefill()  # warm-up
        run_decode(states)
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        team.barrier()
        synchronize(device)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            _, states = run_prefill()
            synchronize(device)
            prefill_wall = time.perf_counter() - started
        prefill_split = split_times(kernel_times(prof, device), prefill_wall)
        team.barrier()
        synchronize(device)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            run_decode(states)
            synchronize(device)
            decode_wall = time.perf_counter() - started
        decode_split = split_times(kernel_times(prof, device), decode_wall, steps)
    return {"prefill": prefill_split, "decode_step": decode_split, "decode_steps_profiled": steps,
            "method": "torch.profiler on rank 0, kernels named *nccl* are collective; programs called eagerly"}


def hf_kernel_path(model, device):
    """Which path HF's forward took, from the kernels a short forward ran (not from imports)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.ones(1, 64, dtype=torch.long, device=device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with torch.no_grad(), profile(activities=activities) as prof:
        model(ids)
        synchronize(device)
    marks = ("selective_scan", "causal_conv1d", "chunk_scan", "chunk_state", "state_passing", "ssd")
    names = sorted({e.name[:60] for e in prof.events() if any(m in e.name.lower() for m in marks)})
    importable = {m: importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d", "kernels")}
    return {"fast_kernels_ran": bool(names), "kernel_names": names[:8], "importable": importable,
            "path": "mamba-ssm / causal-conv1d kernels" if names else "torch fallback (no mamba-ssm kernel ran)"}


# ---------------------------------------------------------------------------------- main
def environment(args, suite, device, options):
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"argv": sys.argv, "suite": "smoke" if args.smoke else args.suite, "world": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
            "dtype": str(suite.dtype), "models": list(suite.models), "batches": suite.batches,
            "prompts": suite.prompts, "new_tokens": suite.new_tokens, "repeats": suite.repeats,
            "generate_options_available": options, "budget_s": args.budget_s, "seed": args.seed,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for rows_rank*.jsonl")
    parser.add_argument("--suite", choices=["quick", "full"], default="quick")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models: tests the whole flow")
    parser.add_argument("--budget-s", type=float, default=480, help="skip what would end after this (seconds)")
    parser.add_argument("--models", nargs="+", help="a subset of the suite's models")
    parser.add_argument("--seed", type=int, default=7, help="of the random weights and prompts")
    parser.add_argument("--longest-grid", type=int, nargs="+", default=None,
                        help="prompt lengths (tokens) of the longest-prompt search, instead of the suite's")
    parser.add_argument("--cuda-graph", choices=["default", "auto", "on", "off"], default="default",
                        help="pass generate(cuda_graph=...); default: the library's own default")
    parser.add_argument("--collective-timeout-s", type=float, default=300,
                        help="NCCL timeout: a hung collective ends the run instead of eating the budget")
    parser.add_argument("--plot", metavar="DIR", help="summary.json and plots from DIR's rows (CPU, no launcher)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        from generate_plots import plot

        plot(args.plot)
        return
    if not args.out:
        raise SystemExit("--out DIR is required (or --plot DIR)")
    clock = Clock(args.budget_s)
    if args.smoke:
        device = torch.device("cpu")
        backend = "gloo"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on a CPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    suite = make_suite(args)
    if args.longest_grid:
        suite.longest_grid = sorted(args.longest_grid)
    if args.models:
        unknown = sorted(set(args.models) - set(suite.models))
        if unknown:
            raise SystemExit(f"unknown models {unknown}; this suite has {list(suite.models)}")
        suite.models = {m: suite.models[m] for m in args.models}
    groups = Groups(dist.get_world_size(), args.collective_timeout_s)
    rec = Recorder(args.out, dist.get_rank(), clock)
    bench = Bench(args, suite, groups, rec, clock, device)
    if dist.get_rank() == 0:
        rec.write("environment", **environment(args, suite, device, bench.options))
        for lay in suite.layouts:
            if len(lay.ranks) > dist.get_world_size():
                rec.skipped("layout", f"needs {len(lay.ranks)} ranks, the run has {dist.get_world_size()}",
                            layout=lay.name)
    groups.everyone().barrier()
    for name, make_config in suite.models.items():
        bench.run_model(name, make_config)
    if dist.get_rank() == 0:
        rec.write("done", budget_s=args.budget_s)
    groups.everyone().barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
