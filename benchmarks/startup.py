"""CPU benchmark: how long ``ssmshard.parallelize`` and the first ``generate`` take, and where.

    python benchmarks/startup.py [--families mamba zamba2 llama] [--layers64] [--zamba2-54] [--chunked] [--static-kv] [--profile FILE]
    python benchmarks/startup.py --verifier-nodes TP [--families ...] [--layers64]
    python benchmarks/startup.py --smoke          # mamba only: checks the script

Runs in one process with a gloo world of 1 (tp=1). For each family it builds the small test
model (``build_small_model``, as tests/conftest.py does), then times ``parallelize``, the
generation programs (prefill and decode, captured and sharded on first use), and a generate
with them ready (3 left-padded prompts, 20 new tokens). Under each it prints the time spent
in torch.export (capture) and in the verifier's fake-tensor propagation; the rest is the passes
themselves, weight slicing and Python. ``--layers64``: also a 64-layer Mamba of the small width
(capture and pass cost grow with the node count, not the width). ``--zamba2-54``: also a 54-layer
Zamba2 of the small width in Zamba2-2.7B's layout (hybrid layers at 6, 12, ..., 42, 47, 51, two
shared blocks alternating). ``SSMSHARD_TRACE_ALL_LAYERS=1``: capture traces every layer instead of
copying traced ones (how capture worked before ``layer_repeat.py``). ``--chunked``: also the first
chunked-prefill generate (it captures the chunk program). ``--lazy-forward``: ``parallelize(...,
lazy_forward=True)``, which lays the weights out from the prefill program and never captures the
forward program here. ``--static-kv``: instead of the generation programs and a generate, the
prefill program and the static-K/V decode program (what a GPU generate of an attention model
builds). ``--profile FILE``: cProfile to FILE.
``SSMSHARD_FULL_PROPAGATION=1`` makes the verifier propagate every node after every
shape-changing pass (how it worked before it recomputed only changed nodes).

``--verifier-nodes TP``: instead, the nodes the verifier's fake propagation runs and its CPU time
(``time.process_time``) while the prefill and decode programs of each model are sharded for the
last rank of TP, with ``SSMSHARD_FULL_PROPAGATION=1`` and without. Node counts do not depend on
the machine's load; CPU time less than wall time does.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import time

import torch
import torch.distributed as dist

import bench_common
from bench_common import time_spent_in

import ssmshard
from ssmshard import capture as capture_module
from ssmshard.families import build_small_model
from ssmshard.passes import manager
from ssmshard.testing import randomize_weights

# What each phase's time is spent in (module, function, label).
INSIDE = ((torch.export, "export", "capture (torch.export)"),
          (manager, "propagate_fake_values", "verify (fake propagation)"))


ZAMBA2_27B_HYBRIDS = (6, 12, 18, 24, 30, 36, 42, 47, 51)  # of its 54 layers


def build(family: str, layers: int | None):
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    if family == "zamba2" and layers == 54:
        overrides.update(num_mem_blocks=2, layers_block_type=["hybrid" if i in ZAMBA2_27B_HYBRIDS else "mamba"
                                                              for i in range(54)])
    return randomize_weights(build_small_model(family, **overrides), seed=1).eval()


def measure(family: str, layers: int | None, chunked: bool, lazy_forward: bool = False, static_kv: bool = False):
    model = build(family, layers)
    prompts = torch.randint(3, model.config.vocab_size, (3, 6))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0
    mask[2, :4] = 0  # left padding
    rows = []

    def timed(what, run):
        with contextlib.ExitStack() as stack:
            spent = [(label, stack.enter_context(time_spent_in(module, [name])), name)
                     for module, name, label in INSIDE]
            started = time.perf_counter()
            result = run()
            rows.append((what, time.perf_counter() - started))
        rows.extend((f"  {label}", inside[name]) for label, inside, name in spent if inside[name])
        return result

    dm = timed("parallelize", lambda: ssmshard.parallelize(model, ssmshard.Plan(tp=1), lazy_forward=lazy_forward))
    if static_kv:  # what a GPU generate of an attention model builds: no decode program of the growing cache
        timed("prefill program", dm.prefill_program)
        timed("static-K/V decode program", dm.static_decode_program)
        return rows
    timed("generation programs", dm.generation_programs)
    timed("generate (programs ready)",
          lambda: dm.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False))
    if chunked:
        timed("first chunked generate", lambda: dm.generate(prompts, attention_mask=mask, max_new_tokens=20,
                                                            do_sample=False, prefill_chunk_size=4))
    return rows


def verifier_nodes(family: str, layers: int | None, tp: int) -> None:
    """Print the nodes propagated and the verifier's CPU time, full and changed-only."""
    import os

    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from ssmshard.runtime.pipeline import shard_program

    counts = {"nodes": 0, "cpu": 0.0}
    run_node, propagate = FakeTensorProp.run_node, manager.propagate_fake_values

    def counting_run_node(self, node):
        counts["nodes"] += 1
        return run_node(self, node)

    def timed_propagate(*args):
        started = time.process_time()
        propagate(*args)
        counts["cpu"] += time.process_time() - started

    FakeTensorProp.run_node, manager.propagate_fake_values = counting_run_node, timed_propagate
    model, plan = build(family, layers), ssmshard.Plan(tp=tp)
    try:
        for full in ("1", "0"):
            os.environ["SSMSHARD_FULL_PROPAGATION"] = full
            counts.update(nodes=0, cpu=0.0)
            prefill = shard_program(ssmshard.capture(model, mode="prefill"), model, plan, rank=tp - 1, group="g")
            shard_program(ssmshard.capture(model, mode="decode"), model, plan, rank=tp - 1, group="g",
                          prefill=prefill)
            print(f"{family}{f' ({layers} layers)' if layers else ''} tp={tp} "
                  f"{'full' if full == '1' else 'changed-only'}: nodes propagated {counts['nodes']}, "
                  f"verifier CPU {counts['cpu']:.2f} s")
    finally:
        FakeTensorProp.run_node, manager.propagate_fake_values = run_node, propagate
        os.environ.pop("SSMSHARD_FULL_PROPAGATION", None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=["mamba", "zamba2", "llama"])
    parser.add_argument("--layers64", action="store_true", help="also a 64-layer small-width Mamba")
    parser.add_argument("--zamba2-54", action="store_true", help="also a 54-layer small-width Zamba2 (2.7B's layout)")
    parser.add_argument("--chunked", action="store_true", help="also time the first chunked-prefill generate")
    parser.add_argument("--lazy-forward", action="store_true",
                        help="parallelize(..., lazy_forward=True): weights laid out from the prefill program")
    parser.add_argument("--static-kv", action="store_true",
                        help="time the prefill and static-K/V decode programs (a GPU generate's, attention models) "
                             "instead of the generation programs and a generate")
    parser.add_argument("--profile", help="write a cProfile of everything to this file")
    parser.add_argument("--verifier-nodes", type=int, metavar="TP",
                        help="count the verifier's propagated nodes at this tp instead of timing")
    parser.add_argument("--smoke", action="store_true", help="mamba only, to check the script")
    args = parser.parse_args()
    if args.smoke:
        args.families, args.layers64 = ["mamba"], False
    bench_common.init_single_process_group(torch.device("cpu"))  # gloo: the programs run on the CPU
    runs = [(f, None) for f in args.families] + ([("mamba", 64)] if args.layers64 else []) + \
        ([("zamba2", 54)] if args.zamba2_54 else [])
    if args.verifier_nodes:
        for family, layers in runs:
            verifier_nodes(family, layers, args.verifier_nodes)
        return dist.destroy_process_group()
    profiler = cProfile.Profile() if args.profile else None
    with profiler or contextlib.nullcontext():
        for family, layers in runs:
            rows = measure(family, layers, args.chunked, args.lazy_forward, args.static_kv)
            print(f"{family}{f' ({layers} layers)' if layers else ''}:")
            for name, seconds in rows:
                print(f"  {name:<45} {seconds:7.2f} s")
    if profiler:
        profiler.dump_stats(args.profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
