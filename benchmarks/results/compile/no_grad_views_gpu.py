"""Eager forward under ``torch.no_grad`` with the weights bound as views that do not require grad
(what ``DistributedModule.forward`` does there) against the parameters themselves (what it did
before), one GPU, random bf16 weights, tp 1, ``Plan(tp=1, training=False)``. With the parameters,
ATen's matmul copies Mamba-1's transposed ``out_proj`` input and ``dt_proj`` output into rows
(``eager_copies_probe.py``). Median of 5 forwards (CUDA events) each way, in alternation, and the
largest logits difference between them; two rounds, the lower median of each way reported. One
JSON row per model and shape on stdout.

``--ttft-lengths``: the same for batch-1 time to first token, ``generate(max_new_tokens=1)``,
whose prefill reads the views too (``DistributedModule._reading_weights_without_grad``), with
the forward of the same prompt beside it (the TTFT target is within 1.2x of it) and whether
the two ways give the same token.

    PYTHONPATH=$PWD python benchmarks/results/compile/no_grad_views_gpu.py --models mamba-2.8b mamba2-2.7b
    PYTHONPATH=$PWD python benchmarks/results/compile/no_grad_views_gpu.py --models mamba-2.8b mamba2-2.7b \
        --shapes --ttft-lengths 4096 32768
"""
import contextlib
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
import ssmshard  # noqa: E402
from decode_gpu import GPU_MODELS  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402
from ssmshard.testing import rel_err  # noqa: E402


def timed(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def ttft_row(dm, name, length, vocab_size):
    """Batch-1 TTFT of a ``length``-token prompt with the prefill reading the no-grad views
    (``generate`` as it is) and the parameters (the views switched off), and the forward."""
    ids = torch.randint(0, vocab_size, (1, length), device="cuda")

    def first_token():
        return dm.generate(ids, max_new_tokens=1, do_sample=False)

    def with_parameters():
        dm._reading_weights_without_grad = lambda *programs: contextlib.nullcontext()
        try:
            return first_token()
        finally:
            del dm._reading_weights_without_grad

    def forward():
        with torch.no_grad():
            return dm(ids)

    first_token(), with_parameters(), forward()  # warm-up: programs built, kernels compiled
    views, params, forwards = [], [], []
    for _ in range(2):
        views.append(timed(first_token))
        params.append(timed(with_parameters))
        forwards.append(timed(forward))
    views_ms = min(t for t, _ in views)
    return dict(model=name, batch=1, length=length, what="ttft", device=torch.cuda.get_device_name(),
                torch=torch.__version__, views_ms=round(views_ms, 2),
                parameters_ms=round(min(t for t, _ in params), 2),
                forward_ms=round(min(t for t, _ in forwards), 2),
                ttft_over_forward=round(views_ms / min(t for t, _ in forwards), 3),
                same_token=bool(torch.equal(views[-1][1], params[-1][1])))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mamba-2.8b"])
    parser.add_argument("--shapes", nargs="*", default=["8x2048", "1x16384"])
    parser.add_argument("--ttft-lengths", nargs="*", type=int, default=[])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for name in args.models:
        config = GPU_MODELS[name]()
        model = build_random_model(config, "cuda", torch.bfloat16)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False))

        def with_parameters(ids):
            dm._bound(dm.program)  # the parameters, requiring grad
            return dm.program(ids)

        for shape in args.shapes:
            batch, length = map(int, shape.split("x"))
            ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
            with torch.no_grad():
                dm(ids), with_parameters(ids)  # warm-up: kernels compiled, autotuned
                views, params = [], []
                for _ in range(2):
                    views.append(timed(lambda: dm(ids)))
                    params.append(timed(lambda: with_parameters(ids)))
            row = dict(model=name, batch=batch, length=length, device=torch.cuda.get_device_name(),
                       torch=torch.__version__,
                       views_ms=round(min(t for t, _ in views), 2), parameters_ms=round(min(t for t, _ in params), 2),
                       logits_rel_diff=rel_err(views[-1][1].float(), params[-1][1].float()))
            print(json.dumps(row), flush=True)
        for length in args.ttft_lengths:
            print(json.dumps(ttft_row(dm, name, length, config.vocab_size)), flush=True)
        del dm, model
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
