"""CPU benchmark: how long ``ssmshard.parallelize`` and the first ``generate`` take, and where.

    python benchmarks/startup.py [--families mamba zamba2 llama] [--layers64] [--chunked] [--profile FILE]

Runs in one process with a gloo world of 1 (tp=1). For each family it builds the small test
model (``build_small_model``, as tests/conftest.py does), then times ``parallelize``, the
generation programs (prefill and decode, captured and sharded on first use), and a generate
with them ready (3 left-padded prompts, 20 new tokens). Under each it prints the time spent
in torch.export (capture) and in the verifier's fake-tensor propagation; the rest is the passes
themselves, weight slicing and Python. ``--layers64``: also a 64-layer Mamba of the small width
(capture and pass cost grow with the node count, not the width). ``--chunked``: also the first
chunked-prefill generate (it captures the chunk program). ``--profile FILE``: cProfile to FILE.
``SSMSHARD_FULL_PROPAGATION=1`` makes the verifier propagate every node after every
shape-changing pass (how it worked before it recomputed only changed nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import socket
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import ssmshard
from ssmshard import capture as capture_module
from ssmshard.families import build_small_model
from ssmshard.passes import manager
from ssmshard.testing import randomize_weights

SPENT = defaultdict(float)


def _timed(owner, name, bucket):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[bucket] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def instrument():
    _timed(torch.export, "export", "capture (torch.export)")
    _timed(manager, "propagate_fake_values", "verify (fake propagation)")


def build(family: str, layers: int | None):
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    return randomize_weights(build_small_model(family, **overrides), seed=1).eval()


def measure(family: str, layers: int | None, chunked: bool):
    model = build(family, layers)
    prompts = torch.randint(3, model.config.vocab_size, (3, 6))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0
    mask[2, :4] = 0  # left padding
    rows = []

    def timed(what, run):
        SPENT.clear()
        started = time.perf_counter()
        result = run()
        rows.append((what, time.perf_counter() - started))
        rows.extend((f"  {k}", v) for k, v in SPENT.items())
        return result

    dm = timed("parallelize", lambda: ssmshard.parallelize(model, ssmshard.Plan(tp=1)))
    timed("generation programs", dm.generation_programs)
    timed("generate (programs ready)",
          lambda: dm.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False))
    if chunked:
        timed("first chunked generate", lambda: dm.generate(prompts, attention_mask=mask, max_new_tokens=20,
                                                            do_sample=False, prefill_chunk_size=4))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=["mamba", "zamba2", "llama"])
    parser.add_argument("--layers64", action="store_true", help="also a 64-layer small-width Mamba")
    parser.add_argument("--chunked", action="store_true", help="also time the first chunked-prefill generate")
    parser.add_argument("--profile", help="write a cProfile of everything to this file")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    instrument()
    runs = [(f, None) for f in args.families] + ([("mamba", 64)] if args.layers64 else [])
    profiler = cProfile.Profile() if args.profile else None
    with profiler or contextlib.nullcontext():
        for family, layers in runs:
            rows = measure(family, layers, args.chunked)
            print(f"{family}{f' ({layers} layers)' if layers else ''}:")
            for name, seconds in rows:
                print(f"  {name:<45} {seconds:7.2f} s")
    if profiler:
        profiler.dump_stats(args.profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
