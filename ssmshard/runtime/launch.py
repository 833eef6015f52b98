"""Start N local processes with an initialised process group (gloo on CPU, NCCL on GPU).

No run hangs silently:

* every process group gets a timeout (``launch(timeout=...)``, else the environment variable
  ``SSMSHARD_TIMEOUT`` in seconds, else 300 s for gloo and 600 s for NCCL); a rank waiting
  longer than that in a collective raises, naming itself and the collective;
* a rank that finishes leaves its process group at once, so a rank still waiting for it in a
  collective it skipped fails within about a second (gloo: "connection closed by peer");
* the first rank to fail (an exception, a non-zero exit or a signal) stops every other rank,
  and ``launch`` raises :class:`LaunchError` with that rank's traceback;
* SIGINT or SIGTERM to the launching process stops every rank (SIGTERM, then SIGKILL after
  a few seconds), and a rank whose launcher dies without stopping it (SIGKILL) ends itself.

Ranks are forked from a server process that has imported torch, transformers and ssmshard
(multiprocessing's "forkserver"), so a launch does not pay for those imports once per rank.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

TIMEOUT_ENV = "SSMSHARD_TIMEOUT"
DEFAULT_TIMEOUT_S = {"gloo": 300.0, "nccl": 600.0}
BACKENDS = ("gloo", "nccl")
STOP_GRACE_S = 3.0  # after SIGTERM, how long a rank may take to exit before SIGKILL
# What the fork server imports once, instead of each rank importing it anew as a spawned
# interpreter would: 3-4 s of every 2-rank launch on a 2-core machine before a rank ran a
# line of ``fn``. None of these touches CUDA at import, so the server never initialises it
# (a process forked after that could not use the GPU); each rank does.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "transformers", "ssmshard")


class LaunchError(RuntimeError):
    """A rank failed; the others were stopped. ``rank``: the first rank that failed."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def collective_timeout(timeout=None, backend: str = "gloo") -> float:
    """Seconds a collective may wait: ``timeout``, else ``$SSMSHARD_TIMEOUT``, else the backend's default."""
    source = "timeout"
    if timeout is None and os.environ.get(TIMEOUT_ENV):
        timeout, source = os.environ[TIMEOUT_ENV], TIMEOUT_ENV
    if timeout is None:
        return DEFAULT_TIMEOUT_S[backend]
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(timeout, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    return seconds


def _validate(fn, nprocs, args, backend) -> tuple[str, bytes]:
    """The backend and the pickled ``(fn, args)``; a clear error for anything that would fail
    (or hang) after spawning."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int (the number of ranks), got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(rank, world_size, *args), got {type(fn).__name__}")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"fn {getattr(fn, '__qualname__', fn)!r} is defined in an interactive interpreter; ranks "
                         "start as new processes that cannot see it: define it in a module (a .py file)")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"fn and its arguments are sent to each rank by pickling, which failed ({exc}); use a "
                        "function defined at module level (not a lambda or nested function) and picklable "
                        "arguments") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= nprocs else "gloo"
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None to choose), got {backend!r}")
    elif backend == "nccl" and gpus < nprocs:
        raise ValueError(f"backend='nccl' needs one CUDA device per rank: nprocs={nprocs} but {gpus} visible; "
                         "use backend='gloo' or fewer ranks")
    return backend, payload


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the fork server) dies; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_context():
    """The multiprocessing context ranks start from (see ``FORKSERVER_PRELOAD``); where the
    platform has no fork server (Windows), each rank is a spawned interpreter."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


def _die_with_launcher(link) -> None:
    """SIGKILL this rank once the launcher's end of ``link`` closes: the launcher exited, even
    by SIGKILL, without stopping its ranks. A rank's parent is the fork server, which outlives
    a launcher while ranks run, so ``_die_with_parent`` alone would leave them orphaned."""

    def watch():
        try:
            link.recv()  # the launcher never sends: this returns only by EOF
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ssmshard-launcher-watch", daemon=True).start()


def _worker(rank, world, port, backend, timeout, payload, error_file, environment, link):
    _die_with_parent()
    _die_with_launcher(link)
    # A forked rank inherits the fork server's environment, fixed when the server started;
    # a rank sees the launcher's environment at this launch, as a spawned one would.
    os.environ.clear()
    os.environ.update(environment)
    # Ctrl-C reaches every process of the terminal's group: the launcher alone handles it
    # and stops the ranks, so the user sees one message instead of one traceback per rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    status = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            # N ranks share this machine's cores: more intra-op threads than cores per rank makes
            # small ops spin against each other (a decode step went from 4 ms to 70 ms here).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        fn, args = pickle.loads(payload)
        fn(rank, world, *args)
    except SystemExit as exc:  # fn may end its rank with sys.exit(code)
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException as exc:  # noqa: BLE001  (reported to the launcher, which stops the other ranks)
        lines = str(exc).strip().splitlines()
        summary = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        with open(error_file, "w") as f:
            json.dump({"summary": summary, "traceback": traceback.format_exc()}, f)
        status = 1
    finally:
        # Leave the group now, without a barrier: a rank still waiting for this one in a
        # collective this one never called fails at once instead of at the timeout.
        if dist.is_initialized():
            if backend == "nccl":
                # A CUDA graph still holding NCCL kernels (a DistributedModule kept alive by the
                # function or by a reference cycle) would make the teardown wait forever.
                from .cuda_graph import release_cuda_graphs

                release_cuda_graphs()
            dist.destroy_process_group()
    # Leave without running C++ static destructors: after a backward pass, a worker thread
    # can still be joinable there and abort the process ("terminate called without an active
    # exception", seen here about one run in ten), turning a finished rank into a failure.
    multiprocessing.util._exit_function()  # what a normal exit runs for a child: releases its semaphores
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class _Stopped(BaseException):
    """SIGTERM reached the launcher."""


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


def _stop(processes) -> None:
    """SIGTERM every live rank, then SIGKILL those still alive after ``STOP_GRACE_S``."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _failure(rank, process, error_file, world) -> LaunchError:
    """The error naming the first rank that failed: its exception first, then its traceback."""
    trace = ""
    if os.path.exists(error_file):
        with open(error_file) as f:
            error = json.load(f)
        cause, trace = error["summary"], error["traceback"].rstrip()
    elif process.exitcode < 0:
        name = signal.Signals(-process.exitcode).name
        cause = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        cause = f"exited with code {process.exitcode}"
    stopped = "; the other ranks were stopped" if world > 1 else ""
    message = f"rank {rank} of {world} failed{stopped}: {cause}"
    return LaunchError(f"{message}\n\nrank {rank}'s traceback:\n{trace}" if trace else message, rank)


def _wait(processes, error_files) -> None:
    """Until every rank exits 0; at the first failure, stop the others and raise."""
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank = running.pop(sentinel)
            process = processes[rank]
            process.join()
            if process.exitcode != 0:
                _stop(processes)
                raise _failure(rank, process, error_files[rank], len(processes))


def launch(fn, nprocs: int, *args, backend: str | None = None, timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` new processes, each in one process group.

    ``backend``: ``"gloo"`` or ``"nccl"`` (default: NCCL when there is a GPU per rank, else gloo;
    NCCL carries CUDA tensors only, so a model on the CPU of a GPU machine needs ``"gloo"``).
    ``timeout``: seconds a collective may wait for the other ranks before it raises (default:
    ``$SSMSHARD_TIMEOUT``, else 300 s for gloo, 600 s for NCCL). Arguments are checked before
    anything starts. If a rank fails, the others are stopped and :class:`LaunchError` is raised
    with the failing rank's traceback; SIGINT or SIGTERM to this process stops every rank.
    """
    backend, payload = _validate(fn, nprocs, args, backend)
    timeout = collective_timeout(timeout, backend)
    context = _rank_context()
    handle_sigterm = (threading.current_thread() is threading.main_thread()
                      and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if handle_sigterm:
        signal.signal(signal.SIGTERM, _raise_stopped)
    processes = []
    # Held open by this process alone while the ranks run (see _die_with_launcher).
    rank_end, launcher_end = context.Pipe(duplex=False)
    try:
        with tempfile.TemporaryDirectory(prefix="ssmshard-launch-") as tmp:
            error_files = [os.path.join(tmp, f"rank{rank}.err") for rank in range(nprocs)]
            port = free_port()
            for rank in range(nprocs):
                process = context.Process(target=_worker, args=(rank, nprocs, port, backend, timeout, payload,
                                                                error_files[rank], dict(os.environ), rank_end),
                                              name=f"ssmshard-rank{rank}")
                process.start()
                processes.append(process)
            rank_end.close()  # each rank holds its own copy now
            _wait(processes, error_files)
    except BaseException as exc:
        _stop(processes)
        if isinstance(exc, _Stopped):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM's default action would have
        raise
    finally:
        rank_end.close()
        launcher_end.close()
        if handle_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
