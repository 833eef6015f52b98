"""The ``ssmshard`` command line: ``inspect MODEL``, ``sensitivity MODEL``, ``programs FOLDER``, ``demo``.

``inspect`` captures a model built on the meta device (no weights are allocated, so a
config of any size works) and prints what the program holds. ``demo`` checks, on a tiny
randomly initialised model, that the captured programs compute what Hugging Face eager does.
``sensitivity`` measures, on calibration tokens, what dropping each sync point (SPD) costs in
perplexity at a tensor-parallel size, on a simulated mesh in this process (docs/spd.md).
``programs`` lists a program cache folder and prunes what this installation can no longer load.

A user error (a bad argument, an unknown model, an impossible plan, a combination the
sharding rules do not support) prints one line ``error: ...`` and exits with status 2
(``-v`` adds the traceback). Progress goes to stderr through the ``ssmshard`` logger:
``-q`` keeps warnings only, ``-v`` adds debug messages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import time
import traceback

import torch

DEMO_TOLERANCE = 1e-5  # largest relative error the demo accepts (float32)
PLACEMENT_NOTATION = """placements (docs/design.md): R every rank holds the whole value; R~ the same, but its
gradient is a per-rank partial sum; P every rank holds a summand; S(d:n/k,...) dimension d is a
concatenation of segments, a segment of n elements cut into k equal pieces of which each rank
holds one; n/k@s: s consecutive ranks hold the same piece; S(d:seq) the sequence dim cut into
tp equal chunks (padded). Example: S(0:128/4,32/2@2) on 4 ranks holds rows 32r..32r+31 of the
first segment and piece r//2 (16 rows) of the second."""


class UserError(Exception):
    """Something the user can fix: printed as one ``error:`` line, exit status 2."""


def _quiet_transformers() -> None:
    # HF logs a "falling back to the reference implementation" notice per missing CUDA kernel;
    # capture swaps those kernels for ssmshard ops anyway.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def load_config(model: str):
    """A family name (its small default config), a config.json path, or a checkpoint directory."""
    from transformers import AutoConfig

    from .families import BY_NAME

    if model in BY_NAME:
        return BY_NAME[model].make_config()
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise UserError(f"{model} is a directory without a config.json")
    if not os.path.exists(model):
        raise UserError(f"{model!r} is neither a family name ({', '.join(BY_NAME)}), "
                        "a config.json file, nor a checkpoint directory")
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read a model config from {model}: {exc}") from exc


def _meta_model(name: str):
    from .families import model_class_for

    config = load_config(name)
    try:
        cls = model_class_for(config)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        with torch.device("meta"):  # shapes only: no memory for weights, any size works
            return cls(config).eval()
    except ValueError as exc:  # HF's own check of the config (sizes that do not divide, ...)
        raise UserError(f"{cls.__name__} rejects the config of {name}: {exc}") from exc


def cmd_inspect(args) -> int:
    import ssmshard
    from .capture import STATEFUL_MODES

    if not 0 <= args.rank < args.tp:
        raise UserError(f"--rank {args.rank} is not a rank of --tp {args.tp} (ranks 0 to {args.tp - 1})")
    model = _meta_model(args.model)
    # Decode and chunk programs take the states prefill returns, sharded as prefill shards them.
    prefill = ssmshard.capture(model, mode="prefill") if args.mode in STATEFUL_MODES and args.tp > 1 else None
    program = ssmshard.capture(model, mode=args.mode)
    plan = ssmshard.Plan(tp=args.tp) if args.tp > 1 else None
    if plan is not None:
        for p in (prefill, program):
            if p is not None:
                plan.layout(p, model)  # an impossible plan is an error before anything is printed

    print(program.summary())
    if args.graph:
        print(program.print_readable(print_output=False))
    if args.blocks:
        print("block graph edges (call site, block kind):")
        for src, dst in program.block_graph().edges():
            print(f"  {src[0]} [{src[1]}] -> {dst[0]} [{dst[1]}]")
    print(f"{program.mode} program serves shapes: {program.describe_ranges() or 'static'}")
    if args.html:
        from .views import sharded_programs, write_html

        # Every rank's program, from copies: the report below shards ``program`` in place.
        write_html(args.html, sharded_programs(program, model, plan, prefill=prefill) if plan else [program])
        print(f"wrote {args.html}")
    if plan is not None:
        print(plan.explain(program, model, syncs=False))  # the report below lists them
        program = _shard_for_report(program, prefill, model, plan, args.rank)
        print(program.report(activations=args.placements))
    return 0


def _shard_for_report(program, prefill, model, plan, rank):
    """Rank ``rank``'s program as the runtime builds it, on meta: no process group, no weights."""
    from .runtime.pipeline import shard_program

    if prefill is not None:
        prefill = shard_program(prefill, model, plan, rank=rank, group="inspect")
    return shard_program(program, model, plan, rank=rank, group="inspect", prefill=prefill)


def cmd_demo(args) -> int:
    import ssmshard
    from .reference_decode import hf_incremental_logits, program_incremental_logits
    from .testing import randomize_weights, rel_err

    model = ssmshard.build_small_model(args.family)
    randomize_weights(model, seed=0)
    vocab = model.config.vocab_size
    print(f"demo: {type(model).__name__} (small default config, random weights), "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")

    programs = {mode: ssmshard.capture(model, mode=mode) for mode in ("forward", "prefill", "decode")}
    print(programs["forward"].summary())

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        ids = torch.randint(0, vocab, (2, 24), generator=gen)
        forward_err = rel_err(programs["forward"](ids), model(ids).logits)
        prompt = torch.randint(0, vocab, (2, 16), generator=gen)
        next_tokens = torch.randint(0, vocab, (2, args.tokens), generator=gen)
        expected = hf_incremental_logits(model, prompt, next_tokens)
        got = program_incremental_logits(programs["prefill"], programs["decode"], prompt, next_tokens)
    decode_err = max(rel_err(a, b) for a, b in zip(got, expected))
    print(f"forward (batch 2, seq 24) vs HF eager: max rel err {_within(forward_err)}")
    print(f"prefill (16 tokens) + {args.tokens} decode steps vs HF with its cache: max rel err {_within(decode_err)}")

    errors = [forward_err, decode_err]
    if args.nproc > 1:
        print(f"\ntensor parallelism over {args.nproc} CPU processes (gloo): {ssmshard.Plan(tp=args.nproc)}")
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "tp.json")
            ssmshard.launch(_demo_rank, args.nproc, args.family, result_path, backend="gloo")
            with open(result_path) as f:
                errors.append(json.load(f)["err"])
    ok = all(e <= DEMO_TOLERANCE for e in errors)
    print("demo OK" if ok else f"demo FAILED: an error above exceeds the tolerance {DEMO_TOLERANCE:.0e}")
    return 0 if ok else 1


def _within(err: float) -> str:
    return f"{err:.1e} (tolerance {DEMO_TOLERANCE:.0e}{'' if err <= DEMO_TOLERANCE else ': EXCEEDED'})"


def _demo_rank(rank, world, family, result_path):
    """One rank of the demo: shard the model, run it, compare with the unsharded HF model."""
    import ssmshard
    from .inspect import sharding_report
    from .testing import randomize_weights, rel_err

    _quiet_transformers()
    model = randomize_weights(ssmshard.build_small_model(family), seed=0)
    started = time.perf_counter()
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
    shard_seconds = time.perf_counter() - started
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = dm(ids)  # warm-up, and the value we check
        repeats, started = 5, time.perf_counter()
        for _ in range(repeats):
            dm(ids)
        seconds = (time.perf_counter() - started) / repeats
        err = rel_err(logits, model(ids).logits)
    if rank == 0:
        specs = dm.program.param_specs.values()
        split = sum(1 for s in specs if type(s.placement).__name__ == "Shard")
        print(f"captured and sharded in {shard_seconds:.1f}s; rank 0 holds {split} of {len(specs)} weights split, "
              f"the rest whole (`ssmshard inspect {family} --tp {world}` lists them)")
        print(sharding_report(dm.program, weights=False))
        print(f"tp={world} forward (batch 4, seq 64) vs unsharded HF eager: max rel err {_within(err)}; "
              f"{ids.numel() / seconds:,.0f} tokens/s on CPU")
        with open(result_path, "w") as f:
            json.dump({"err": err}, f)


# ----------------------------------------------------------------------------- arguments
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors (unknown option, bad value) are user errors
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a rank (0, 1, ...), got {text!r}")
    return value


def _version() -> str:
    from . import __version__

    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers"))
    return f"ssmshard {__version__} ({versions})"


def _load_model(name: str):
    """A family name (its small model, random weights) or a checkpoint directory (its weights)."""
    from .families import BY_NAME, build_small_model, model_class_for

    if name in BY_NAME:
        return build_small_model(name)
    config = load_config(name)
    if not os.path.isdir(name):
        raise UserError(f"sensitivity needs weights: {name} is not a checkpoint directory")
    try:
        return model_class_for(config).from_pretrained(name).eval()
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the checkpoint {name}: {exc}") from exc


def _calibration_ids(path: str, model_name: str) -> torch.Tensor:
    if not os.path.isfile(path):
        raise UserError(f"calibration file {path} does not exist")
    if path.endswith(".pt"):
        ids = torch.load(path)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            raise UserError(f"{path} must hold a 1-D tensor of token ids")
        return ids.long()
    with open(path) as f:
        text = f.read()
    words = text.split()
    if words and all(w.isdigit() for w in words):
        return torch.tensor([int(w) for w in words])
    if not os.path.isdir(model_name):
        raise UserError(f"{path} is text, and {model_name} is not a checkpoint directory with a tokenizer: give "
                        "token ids (.pt or whitespace-separated integers)")
    from transformers import AutoTokenizer

    return torch.tensor(AutoTokenizer.from_pretrained(model_name)(text)["input_ids"])


def cmd_sensitivity(args) -> int:
    from .plan import Plan
    from .sensitivity import sensitivity

    model = _load_model(args.model)
    ids = _calibration_ids(args.calibration, args.model)
    vocab = model.config.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise UserError(f"calibration ids must lie in [0, {vocab}); found {int(ids.min())}..{int(ids.max())}")
    try:
        report = sensitivity(model, Plan(tp=args.tp, allow_approximate=args.allow_approximate), ids,
                             window=args.window, batch_size=args.batch_size, max_windows=args.max_windows,
                             thresholds=(args.isb, args.esb), progress=not args.quiet)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(report.table())
    choice = report.choose(budget=args.budget)
    print(f"chosen within {args.budget:.2%}: drop_syncs={choice.drop_syncs} (measured perplexity "
          f"{choice.measured.perplexity:.4f}, increase {choice.measured.increase:.2%})")
    if args.json:
        report.save(args.json)
    if args.plot and not report.plot(args.plot):
        print(f"no plot written to {args.plot}: matplotlib is not installed (pip install 'ssmshard[bench]')",
              file=sys.stderr)
    return 0


def cmd_programs(args) -> int:
    from .runtime.program_cache_entries import describe, entries, summary, unloadable_here

    if not os.path.isdir(args.folder):
        raise UserError(f"{args.folder} is not a folder (the one given to parallelize(program_cache=...) "
                        "or $SSMSHARD_PROGRAM_CACHE)")
    found = entries(args.folder)
    gpus = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else set()
    rows, stale = [], []
    for entry in found:
        row, mismatch = summary(entry), unloadable_here(entry)
        here = "no: " + describe(mismatch) if mismatch else "yes"
        if not mismatch and row["gpu"] is not None and row["gpu"] not in gpus:
            here = f"on {row['gpu']} only"
        rows.append((row["kind"], "" if row["rank"] is None else str(row["rank"]), row["model"], row["plan"],
                     f"{row['megabytes']:.1f}", time.strftime("%Y-%m-%d %H:%M", time.localtime(row["stored"])), here))
        if mismatch:
            stale.append(entry)
    total = sum(entry.bytes for entry in found) / 1e6
    print(f"{args.folder}: {len(found)} programs, {total:.1f} MB; {len(stale)} stored by other code "
          f"(another ssmshard, Python, torch, transformers or model source), which this installation cannot load")
    if rows:
        header = ("kind", "rank", "model", "plan", "MB", "stored", "loadable here")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        for r in [header] + rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    if args.prune:
        for entry in stale:
            for path in entry.files:
                path.unlink(missing_ok=True)
        print(f"pruned {len(stale)} programs ({sum(e.bytes for e in stale) / 1e6:.1f} MB) stored by other code")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .capture import MODES
    from .families import BY_NAME

    parser = _Parser(prog="ssmshard", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    output = _Parser(add_help=False)
    output.add_argument("-v", "--verbose", action="store_true", help="debug messages, tracebacks of errors")
    output.add_argument("-q", "--quiet", action="store_true", help="no progress messages, warnings only")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", parents=[output], help="capture a model on the meta device and print its program",
                       description="Capture MODEL on the meta device and print its program; with --tp, the plan "
                                   "and one rank's placements, local shapes and collectives (bytes per token are "
                                   "each rank's operand).",
                       epilog=PLACEMENT_NOTATION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=f"a family name ({', '.join(BY_NAME)}), a config.json, or a checkpoint directory")
    p.add_argument("--mode", choices=MODES, default="forward")
    p.add_argument("--graph", action="store_true", help="also print the full graph")
    p.add_argument("--blocks", action="store_true", help="also print the block graph's edges")
    p.add_argument("--tp", type=_positive_int, default=1, help="also plan and shard for this many ranks and report")
    p.add_argument("--rank", type=_rank, default=0, help="the rank whose sharded program --tp reports (default 0)")
    p.add_argument("--placements", action="store_true",
                   help="with --tp, also print every op's placement and local shape (activations too)")
    p.add_argument("--html", metavar="PATH", help="also write every rank's sharded program as one self-contained "
                                                   "HTML page (blocks per layer, collectives, placements on hover)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("sensitivity", parents=[output], help="perplexity cost of dropping each sync point (SPD)",
                       description="Run MODEL at --tp ranks simulated in this process with each sync point dropped "
                                   "in turn and cumulatively from the last layers back; print perplexity, KL and "
                                   "class (ISB/SB/ESB) per sync point and the drop set chosen within --budget.")
    p.add_argument("model", help="a checkpoint directory (weights and config), or a family name (a tiny random model)")
    p.add_argument("--tp", type=_positive_int, required=True, help="tensor-parallel ranks to simulate")
    p.add_argument("--calibration", required=True, metavar="FILE",
                   help="token ids: a .pt 1-D tensor, or a text file of whitespace-separated integers; any other "
                        "text is tokenized with the checkpoint's tokenizer")
    p.add_argument("--window", type=_positive_int, default=128, help="tokens per scored window")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-windows", type=_positive_int, default=None, help="score only the first windows")
    p.add_argument("--isb", type=float, default=0.01, help="largest perplexity increase of an insensitive block")
    p.add_argument("--esb", type=float, default=0.05, help="above this, extremely sensitive")
    p.add_argument("--budget", type=float, default=0.01, help="perplexity increase the chosen drop set may cost")
    p.add_argument("--allow-approximate", action="store_true", help="also try the x_proj sync points (unrepaired)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the sensitivity plot as PNG (needs matplotlib)")
    p.set_defaults(func=cmd_sensitivity)

    p = sub.add_parser("programs", parents=[output], help="list a program cache folder; --prune what no longer loads",
                       description="List the generation programs stored in FOLDER (parallelize(program_cache=FOLDER) "
                                   "or $SSMSHARD_PROGRAM_CACHE): kind, rank, model, plan fields that differ from "
                                   "Plan(), size, time, and whether this installation can load each; an entry "
                                   "stored by other code (ssmshard sources, Python, torch, transformers, the "
                                   "model's source files) can never be found again.")
    p.add_argument("folder")
    p.add_argument("--prune", action="store_true",
                   help="delete the entries stored by other code (entries for another GPU are kept)")
    p.set_defaults(func=cmd_programs)

    p = sub.add_parser("demo", parents=[output], help="capture a tiny model and check its programs against HF eager")
    p.add_argument("--family", choices=sorted(BY_NAME), default="mamba2")
    p.add_argument("--tokens", type=_positive_int, default=8, help="decode steps after the 16-token prefill")
    p.add_argument("--nproc", type=_positive_int, default=2, help="tensor-parallel CPU processes (1: skip)")
    p.set_defaults(func=cmd_demo)
    return parser


class _Format(logging.Formatter):
    def format(self, record):
        message = super().format(record)
        return message if record.levelno == logging.INFO else f"{record.levelname.lower()}: {message}"


def _log_to_stderr(verbose: bool, quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Format())
    logger = logging.getLogger("ssmshard")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)


def main(argv=None) -> int:
    from .passes.shard import ShardingError
    from .plan import PlanError

    verbose = False
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        _log_to_stderr(args.verbose, args.quiet)
        _quiet_transformers()
        return args.func(args)
    except (UserError, PlanError, ShardingError) as exc:
        if verbose:
            traceback.print_exc()
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
