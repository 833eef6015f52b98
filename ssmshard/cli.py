"""The ``ssmshard`` command line: ``ssmshard inspect MODEL`` and ``ssmshard demo``.

``inspect`` captures a model built on the meta device (no weights are allocated, so a
config of any size works) and prints what the program holds. ``demo`` checks, on a tiny
randomly initialised model, that the captured programs compute what Hugging Face eager does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

DEMO_TOLERANCE = 1e-5
PLACEMENT_NOTATION = """placements (docs/design.md): R every rank holds the whole value; R~ the same, but its
gradient is a per-rank partial sum; P every rank holds a summand; S(d:n/k,...) dimension d is a
concatenation of segments, a segment of n elements cut into k equal pieces of which each rank
holds one; n/k@s: s consecutive ranks hold the same piece. Example: S(0:128/4,32/2@2) on 4 ranks
holds rows 32r..32r+31 of the first segment and piece r//2 (16 rows) of the second."""


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
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model} is a directory without a config.json")
        return AutoConfig.from_pretrained(model)
    if os.path.isfile(model):
        return AutoConfig.from_pretrained(model)  # a path to a config .json file
    raise ValueError(f"{model!r} is neither a family name ({', '.join(BY_NAME)}), "
                     "a config.json file, nor a checkpoint directory")


def cmd_inspect(args) -> int:
    import ssmshard

    try:
        from .families import model_class_for

        config = load_config(args.model)
        cls = model_class_for(config)
        with torch.device("meta"):  # shapes only: no memory for weights, any size works
            model = cls(config).eval()
        started = time.perf_counter()
        program = ssmshard.capture(model, mode=args.mode)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    print(program.summary())
    if args.graph:
        print(program.print_readable(print_output=False))
    if args.blocks:
        print("block graph edges (call site, block kind):")
        for src, dst in program.block_graph().edges():
            print(f"  {src[0]} [{src[1]}] -> {dst[0]} [{dst[1]}]")
    print(f"captured {type(model).__name__} ({args.mode}) in {seconds:.2f}s; "
          f"shapes served: {program.describe_ranges() or 'static'}")
    if args.html:
        from .views import sharded_programs, write_html

        try:  # every rank's program, before the report below shards `program` in place
            write_html(args.html, sharded_programs(program, model, ssmshard.Plan(tp=args.tp))
                       if args.tp > 1 else [program])
        except ssmshard.PlanError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.html}")
    if args.tp > 1:
        return _inspect_sharding(program, model, args.tp, args.rank)
    return 0


def _inspect_sharding(program, model, tp, rank) -> int:
    """Plan, shard and report one rank's program on meta: no process group, no weights."""
    import ssmshard
    from .passes import run_pipeline
    from .passes.shard import sharding_steps

    plan = ssmshard.Plan(tp=tp)
    try:
        placements = plan.layout(program, model)
    except ssmshard.PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(plan.explain(program, model))
    options = {"placements": placements, "rank": rank, "tp": tp, "group": "inspect", "training": False}
    sharded = run_pipeline(program, sharding_steps(options))
    print(sharded.report())
    return 0


def _print_history(program) -> None:
    print(f"pass history of the {program.mode} program:")
    for record in program.history:
        if record.get("skipped"):
            print(f"  {record['pass']:<12} skipped")
            continue
        diff = ", ".join(f"{op} {n:+d}" for op, n in record["op_diff"].items()) or "no op-count change"
        print(f"  {record['pass']:<12} {record['seconds'] * 1e3:7.1f} ms  {diff}")


def cmd_demo(args) -> int:
    import ssmshard
    from .reference_decode import hf_incremental_logits, program_incremental_logits
    from .testing import randomize_weights, rel_err

    model = ssmshard.build_small_model(args.family)
    randomize_weights(model, seed=0)
    vocab = model.config.vocab_size
    print(f"demo: {type(model).__name__} (small default config, random weights), "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")

    programs = {}
    for mode in ("forward", "prefill", "decode"):
        started = time.perf_counter()
        programs[mode] = ssmshard.capture(model, mode=mode)
        print(f"captured {mode:<8} {programs[mode].node_count():5d} ops in {time.perf_counter() - started:.2f}s")
    print(programs["forward"].summary())
    _print_history(programs["forward"])

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        ids = torch.randint(0, vocab, (2, 24), generator=gen)
        forward_err = rel_err(programs["forward"](ids), model(ids).logits)
        prompt = torch.randint(0, vocab, (2, 16), generator=gen)
        next_tokens = torch.randint(0, vocab, (2, args.tokens), generator=gen)
        expected = hf_incremental_logits(model, prompt, next_tokens)
        got = program_incremental_logits(programs["prefill"], programs["decode"], prompt, next_tokens)
    decode_err = max(rel_err(a, b) for a, b in zip(got, expected))
    # A shape outside a graph's ranges (e.g. a prefill shorter than the conv kernel) adds a sibling.
    print("graphs in each shape-bucket cache: " +
          ", ".join(f"{mode} {1 + len(p.siblings)}" for mode, p in programs.items()))
    print(f"forward (batch 2, seq 24) vs HF eager:                 max rel err {forward_err:.1e}")
    print(f"prefill (16 tokens) + {args.tokens} decode steps vs HF with cache: max rel err {decode_err:.1e}")

    tp_err = float("nan")
    if args.nproc > 1:
        plan = ssmshard.Plan(tp=args.nproc)
        print(f"\ntensor parallelism over {args.nproc} CPU ranks (gloo): {plan}")
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "tp.json")
            ssmshard.launch(_demo_rank, args.nproc, args.family, result_path)
            with open(result_path) as f:
                tp_err = json.load(f)["err"]
    ok = all(e <= DEMO_TOLERANCE for e in (forward_err, decode_err)) and not tp_err > DEMO_TOLERANCE
    status = "demo OK" if ok else "demo FAILED"
    print(f"{status}: forward rel err {forward_err:.1e}, decode rel err {decode_err:.1e}, "
          f"tp={args.nproc} logits rel err {tp_err:.1e} (tolerance {DEMO_TOLERANCE:.0e})")
    return 0 if ok else 1


def _demo_rank(rank, world, family, result_path):
    """One rank of the demo: shard the model, run it, compare with the unsharded HF model."""
    import ssmshard
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
        print(dm.program.report())
        print(f"capture + shard + collectives passes: {shard_seconds:.2f}s")
        print(f"tp={world} forward (batch 4, seq 64) vs unsharded HF eager: max rel err {err:.1e}; "
              f"{ids.numel() / seconds:,.0f} tokens/s on CPU")
        with open(result_path, "w") as f:
            json.dump({"err": err}, f)


def build_parser() -> argparse.ArgumentParser:
    from .families import BY_NAME

    parser = argparse.ArgumentParser(prog="ssmshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="capture a model on the meta device and print its program",
                       epilog=PLACEMENT_NOTATION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=f"a family name ({', '.join(BY_NAME)}), a config.json, or a checkpoint directory")
    p.add_argument("--mode", choices=("forward", "prefill", "decode", "chunk"), default="forward")
    p.add_argument("--graph", action="store_true", help="also print the full graph")
    p.add_argument("--blocks", action="store_true", help="also print the block graph's edges")
    p.add_argument("--tp", type=int, default=1, help="also plan and shard for this many ranks and report")
    p.add_argument("--rank", type=int, default=0, help="the rank whose sharded program --tp reports")
    p.add_argument("--html", metavar="PATH", help="also write every rank's program as one self-contained HTML "
                   "page (blocks per layer, collectives, weight placements on hover, a rank selector)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="capture a tiny model and check its programs against HF eager")
    p.add_argument("--family", choices=sorted(BY_NAME), default="mamba2")
    p.add_argument("--tokens", type=int, default=8, help="decode steps after the 16-token prefill")
    p.add_argument("--nproc", type=int, default=2, help="tensor-parallel CPU ranks (1: skip)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_transformers()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
