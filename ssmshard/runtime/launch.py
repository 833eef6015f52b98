"""Start N local processes with an initialised process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        # N ranks share this machine's cores: more intra-op threads than cores per rank makes
        # small ops spin against each other (a decode step went from 4 ms to 70 ms here).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn reports the traceback
    dist.destroy_process_group()
    # Leave without running C++ static destructors: after a backward pass, a worker thread
    # can still be joinable there and abort the process ("terminate called without an active
    # exception", seen here about one run in ten), turning a finished rank into a failure.
    multiprocessing.util._exit_function()  # what a normal exit runs for a child: releases its semaphores
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, nprocs: int, *args, backend: str | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes; re-raise the first failure."""
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo")
    mp.spawn(_worker, args=(nprocs, _free_port(), backend, fn, args), nprocs=nprocs, join=True)
