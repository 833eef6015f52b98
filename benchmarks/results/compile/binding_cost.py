"""Host time of binding a program to a module's weights (``DistributedModule._bound``), which
every forward, prefill and generate call pays: the parameters, and the no-grad views. A tiny
Mamba and Mamba-2 of 64 layers on the CPU (the host cost depends on the number of weights, not
their size), one process, mean of 200 binds after a warm-up.

    PYTHONPATH=$PWD:tests python benchmarks/results/compile/binding_cost.py
"""
import os
import time

import torch.distributed as dist

import ssmshard
from conftest import build_small_model


def mean_ms(fn, repeats=200):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29584")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for family in ("mamba", "mamba2"):
        dm = ssmshard.parallelize(build_small_model(family, num_hidden_layers=64), ssmshard.Plan(tp=1))
        program = dm.prefill_program()
        parameters = mean_ms(lambda: dm._bound(program))
        views = mean_ms(lambda: dm._bound(program, without_grad=True))
        print(f"{family}: {len(program.param_specs)} weights, bind the parameters {parameters:.3f} ms, "
              f"the no-grad views {views:.3f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
