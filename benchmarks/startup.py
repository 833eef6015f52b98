"""CPU benchmark: how long ``ssmshard.parallelize`` and the first ``generate`` take, and where.

    python benchmarks/startup.py [--families mamba zamba2 llama] [--layers64] [--chunked] [--profile FILE]

Runs in one process with a gloo world of 1 (tp=1). For each family it builds the small test
model (``build_small_model``, as tests/conftest.py does), then times ``parallelize`` and the
first ``generate`` (3 left-padded prompts, 20 new tokens), and prints the time spent in
torch.export (capture), in the passes themselves, in the verifier's fake-tensor propagation,
and in the generation itself. ``--layers64``: also a 64-layer Mamba of small width (capture and
pass cost grow with the node count, not the width). ``--repeat``: parallelize the same model a
second time (what the in-process program cache serves). ``--profile FILE``: cProfile to FILE.
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


def measure(family: str, layers: int | None, chunked: bool, repeat: bool):
    model = build(family, layers)
    prompts = torch.randint(3, model.config.vocab_size, (3, 6))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0
    mask[2, :4] = 0  # left padding
    rows = {}
    SPENT.clear()
    started = time.perf_counter()
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
    rows["parallelize"] = time.perf_counter() - started
    rows.update({f"  {k}": v for k, v in SPENT.items()})
    SPENT.clear()
    started = time.perf_counter()
    dm.generation_programs()
    rows["generation programs"] = time.perf_counter() - started
    rows.update({f"  {k}": v for k, v in SPENT.items()})
    started = time.perf_counter()
    dm.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False)
    rows["generate (programs ready)"] = time.perf_counter() - started
    if chunked:
        SPENT.clear()
        started = time.perf_counter()
        dm.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False, prefill_chunk_size=4)
        rows["first chunked generate"] = time.perf_counter() - started
        rows.update({f"  {k}": v for k, v in SPENT.items()})
    if repeat:
        SPENT.clear()
        started = time.perf_counter()
        again = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
        again.generation_programs()
        rows["second parallelize + generation programs"] = time.perf_counter() - started
        rows.update({f"  {k}": v for k, v in SPENT.items()})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=["mamba", "zamba2", "llama"])
    parser.add_argument("--layers64", action="store_true", help="also a 64-layer small-width Mamba")
    parser.add_argument("--chunked", action="store_true", help="also time the first chunked-prefill generate")
    parser.add_argument("--repeat", action="store_true", help="also time a second parallelize of the same model")
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
            rows = measure(family, layers, args.chunked, args.repeat)
            print(f"{family}{f' ({layers} layers)' if layers else ''}:")
            for name, seconds in rows.items():
                print(f"  {name:<45} {seconds:7.2f} s")
    if profiler:
        profiler.dump_stats(args.profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
