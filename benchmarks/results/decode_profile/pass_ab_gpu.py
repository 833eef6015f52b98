"""What one optimisation pass brings to a decode step: the graphed step's device time with and
without it, timed alternately on one GPU in one process.

    PYTHONPATH=$PWD python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT --models mamba-2.8b --skip fuse_dt_proj
    PYTHONPATH=$PWD python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT --models mamba-2.8b --skip fuse_dt_proj decode_gemv
    PYTHONPATH=$PWD python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT --models llama-3-8b --skip fuse_rotary+fold_cache_positions
    PYTHONPATH=$PWD python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT --models mamba-2.8b --env SSMSHARD_GEMV_ROWS=1
    PYTHONPATH=$PWD python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT --models mamba2-2.7b --state-dtypes bfloat16

Variants: the full plan (``all passes``) and, per ``--skip`` argument, ``Plan(skip_passes=[name])``
(``a+b``: ``skip_passes=[a, b]``), per ``--add`` argument ``Plan(add_passes=[name])`` (an opt-in pass),
each a ``parallelize`` of the same random bf16 model (``decode_gpu.GPU_MODELS``), and per
``--env KEY=VALUE`` the full plan (with the ``--add`` passes) with that environment variable set while its graph is captured
(kernel choices read at capture time, such as ``SSMSHARD_GEMV_ROWS``), and per ``--state-dtypes``
argument the full plan with ``Plan(ssm_state_dtype=...)`` (other numerics: its tokens may differ).
Per batch each
variant generates a few greedy tokens from the same prompt (which captures its decode graph;
the tokens must agree across variants, else the row says so), then rounds of ``--replays``
replays of each variant's CUDA graph alternate (``dm.decode_graph(b).graph.replay()``: one
decode step on the state the prompt left, the host's per-token work excluded), each round timed
by CUDA events. Step time: the median over rounds. This is the step's device time and its gaps
between kernels; decode_gpu.py's TPOT adds the host loop around it.

Rows go to ``OUT/pass_ab.jsonl``; the table is printed. GPU only (it times CUDA graphs), so it
sits with the results it produced rather than among the benchmarks with a CPU smoke mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import ssmshard
from ssmshard.families import family_of
from ssmshard.plan import OPT_IN_PASSES, OPTIONAL_PASSES, STATE_DTYPES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from bench_common import init_single_process_group  # noqa: E402
from decode_gpu import GPU_MODELS, PAD, free_memory, prompt_ids  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402


def step_ms(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def compare(model, variants, batch, args):
    ids = prompt_ids(model.config.vocab_size, batch, args.prompt, torch.device("cuda"), args.seed)
    tokens, graphs = {}, {}
    # Attention families graph their decode over static key/value buffers (as decode_gpu.py runs them).
    options = dict(static_kv=args.prompt + args.new_tokens) if family_of(model).has_attention else {}
    for name, (dm, env) in variants.items():
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            tokens[name] = dm.generate(ids, max_new_tokens=args.new_tokens, pad_token_id=PAD, **options)
            graphs[name] = dm.decode_graph(batch)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if graphs[name] is None:
            raise SystemExit(f"{name}: batch {batch} decoded without a CUDA graph")
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, graphed in graphs.items():
            times[name].append(step_ms(graphed.graph, args.replays))
    baseline = next(iter(tokens.values()))
    return {name: dict(step_ms=statistics.median(t), rounds_ms=t, same_tokens=torch.equal(tokens[name], baseline))
            for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b"], choices=sorted(GPU_MODELS))
    parser.add_argument("--skip", nargs="*", default=[], metavar="PASS[+PASS...]",
                        help="one variant per argument, without that pass (or those joined by +)")
    parser.add_argument("--add", nargs="*", default=[], metavar="PASS",
                        help="one variant per argument, with that opt-in pass (Plan(add_passes=[PASS]))")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="one variant per setting: the full plan, captured with KEY=VALUE in the environment")
    parser.add_argument("--state-dtypes", nargs="*", default=[], choices=sorted(set(STATE_DTYPES) - {"float32"}),
                        help="also the full plan with the SSM states in this dtype (Plan(ssm_state_dtype=...))")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    unknown = [name for names in args.skip for name in names.split("+") if name not in OPTIONAL_PASSES]
    if unknown:
        parser.error(f"--skip: unknown passes {unknown}; choose from {', '.join(OPTIONAL_PASSES)}")
    if any(name not in OPT_IN_PASSES for name in args.add):
        parser.error(f"--add: choose from {', '.join(OPT_IN_PASSES)}")
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    init_single_process_group(torch.device("cuda"))
    with open(os.path.join(args.out, "pass_ab.jsonl"), "a") as rows:
        for model_name in args.models:
            model = build_random_model(GPU_MODELS[model_name](), torch.device("cuda"), torch.bfloat16, seed=args.seed)
            variants = {"all passes": (ssmshard.parallelize(model, ssmshard.Plan(tp=1)), {})}
            variants.update({f"without {names}": (ssmshard.parallelize(model, ssmshard.Plan(tp=1, skip_passes=names.split("+"))), {})
                             for names in args.skip})
            variants.update({f"with {name}": (ssmshard.parallelize(model, ssmshard.Plan(tp=1, add_passes=[name])), {})
                             for name in args.add})
            variants.update({f"ssm_state_dtype={dtype}": (ssmshard.parallelize(model, ssmshard.Plan(
                tp=1, add_passes=args.add, ssm_state_dtype=dtype)), {}) for dtype in args.state_dtypes})
            for setting in args.env:
                key, _, value = setting.partition("=")
                variants[setting] = (ssmshard.parallelize(model, ssmshard.Plan(tp=1, add_passes=args.add)), {key: value})
            for batch in args.batches:
                results = compare(model, variants, batch, args)
                base = results["all passes"]["step_ms"]
                for name, result in results.items():
                    row = dict(model=model_name, batch=batch, variant=name, device=device, replays=args.replays,
                               rounds=args.rounds, **result, over_all_passes=result["step_ms"] / base)
                    rows.write(json.dumps(row) + "\n")
                    rows.flush()
                    print(f"{model_name:12s} b{batch:<4d} {name:28s} {result['step_ms']:8.4f} ms/step "
                          f"x{row['over_all_passes']:.3f} same tokens: {result['same_tokens']}", flush=True)
            del variants, model
            free_memory(torch.device("cuda"))


if __name__ == "__main__":
    main()
