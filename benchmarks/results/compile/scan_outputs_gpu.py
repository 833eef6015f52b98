"""Eager forward and batch-1 TTFT of a Mamba-1 model with the ``scan_outputs`` pass (the scan
writes bf16 y, the one-tensor cat and the cast after it gone, and skips the final state the
forward does not read) against the same plan with the pass skipped, one GPU, random bf16
weights, tp 1, ``Plan(tp=1, training=False)``, under ``torch.no_grad``. Both modules built from
the same model in one process; median of 5 calls (CUDA events) each way, in alternation, two
rounds, the lower median of each way reported, and whether the logits (tokens, for TTFT) are the
same bits. The floor is compile_gpu.py's (matmul rate and copy bandwidth measured in this run).
``--profile``: device time of one forward by kernel category and the 15 largest kernels, both
ways, at every shape.

    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_gpu.py --profile --ttft-lengths 4096 32768

``--skip`` names the passes the compared module leaves out (the two modules are otherwise the
same plan); ``--baseline-scan-forward parallel`` runs the compared module's Mamba-1 scans on the
parallel forward kernel instead of the default pick (how "auto" was measured against it):

    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_gpu.py --skip --baseline-scan-forward parallel --profile --ttft-lengths 4096 32768
"""
import dataclasses
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
import ssmshard  # noqa: E402
from compile_gpu import forward_profile, linear_params, matmul_flops_per_s, scan_bytes  # noqa: E402
from decode_gpu import GPU_MODELS  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402
from ssmshard.kernels import selective_scan as scan_module  # noqa: E402
from ssmshard.testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from no_grad_views_gpu import timed  # noqa: E402  (median ms of CUDA-event timed calls, the last output)


def alternate(ways: dict, rounds=2):
    """{way: (lower median ms over the rounds, the last output)}."""
    for fn in ways.values():
        fn()  # warm-up: programs built, kernels compiled and tuned
    results = {way: [] for way in ways}
    for _ in range(rounds):
        for way, fn in ways.items():
            results[way].append(timed(fn))
    return {way: (min(t for t, _ in runs), runs[-1][1]) for way, runs in results.items()}


def with_scan_forward(fn, variant):
    """``fn`` run with every default scan config's forward variant set to ``variant``."""
    if variant is None:
        return fn

    def run():
        picked = scan_module._cached_config
        scan_module._cached_config = lambda *a: dataclasses.replace(picked(*a), fwd_variant=variant)
        try:
            return fn()
        finally:
            scan_module._cached_config = picked
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mamba-2.8b")
    parser.add_argument("--shapes", nargs="*", default=["8x2048", "1x16384"])
    parser.add_argument("--ttft-lengths", nargs="*", type=int, default=[])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip", nargs="*", default=["scan_outputs"],
                        help="the passes the module compared against leaves out")
    parser.add_argument("--baseline-scan-forward", choices=["parallel", "sequential"],
                        help="the scan forward kernel the module compared against runs")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29557")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda")
    flops, bandwidth = matmul_flops_per_s(device), copy_bandwidth(device)
    common = dict(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__,
                  matmul_tflops=round(flops / 1e12, 1), copy_tb_s=round(bandwidth / 1e12, 3))
    config = GPU_MODELS[args.model]()
    model = build_random_model(config, "cuda", torch.bfloat16)
    modules = {"pass": ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False)),
               "skipped": ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False,
                                                                    skip_passes=args.skip))}
    common["skipped_passes"] = args.skip
    common["baseline_scan_forward"] = args.baseline_scan_forward
    baseline = lambda way, fn: with_scan_forward(fn, args.baseline_scan_forward) if way == "skipped" else fn  # noqa: E731
    print(json.dumps({**common, "what": "scans given a dtype", "scans": len(modules["pass"].program.scan_output_report),
                      "token_major_projections": len(getattr(modules["pass"].program, "token_major_report", []))}),
          flush=True)
    for shape in args.shapes:
        batch, length = map(int, shape.split("x"))
        ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
        floor_ms = 1e3 * (2 * linear_params(model) * batch * length / flops + scan_bytes(model, batch, length) / bandwidth)
        with torch.no_grad():
            found = alternate({way: baseline(way, lambda dm=dm: dm(ids)) for way, dm in modules.items()})
            row = {**common, "what": "forward", "batch": batch, "length": length, "floor_ms": round(floor_ms, 2)}
            for way, (ms, _) in found.items():
                row[f"{way}_ms"] = round(ms, 2)
                row[f"{way}_roofline"] = round(floor_ms / ms, 3)
            row["same_logits"] = bool(torch.equal(found["pass"][1], found["skipped"][1]))
            row["logits_rel_diff"] = rel_err(found["pass"][1].float(), found["skipped"][1].float())
            print(json.dumps(row), flush=True)
            del found
            if args.profile:
                for way, dm in modules.items():
                    print(json.dumps({**common, "what": "forward_profile", "way": way, "batch": batch,
                                      "length": length, **forward_profile(baseline(way, lambda dm=dm: dm(ids)), device)}),
                          flush=True)
        torch.cuda.empty_cache()
    for length in args.ttft_lengths:
        ids = torch.randint(0, config.vocab_size, (1, length), device="cuda")
        ways = {way: baseline(way, lambda dm=dm: dm.generate(ids, max_new_tokens=1, do_sample=False))
                for way, dm in modules.items()}
        with torch.no_grad():
            forwards = {way: baseline(way, lambda dm=dm: dm(ids)) for way, dm in modules.items()}
            found = alternate({**ways, **{f"forward_{way}": fn for way, fn in forwards.items()}})
        row = {**common, "what": "ttft", "batch": 1, "length": length}
        for way, (ms, _) in found.items():
            row[f"{way}_ms"] = round(ms, 2)
        row["same_token"] = bool(torch.equal(found["pass"][1], found["skipped"][1]))
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
