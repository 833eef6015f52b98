"""What the benchmark scripts share: the CPU smoke mode, timing there, and plots.

Import this module before torch, triton or ssmshard.kernels: with ``--smoke`` on the command
line it sets ``TRITON_INTERPRET=1``, which Triton reads when a kernel module is imported, so
the kernels run on Triton's CPU interpreter at tiny sizes (the script is checked, nothing is
measured). Plots need matplotlib (``pip install 'ssmshard[bench]'``); without it a script
writes its JSON and says that it drew no plot.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import contextmanager

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def cpu_median_ms(fn, repeats: int = 1) -> float:
    """Wall-clock median of ``repeats`` calls, in ms (smoke runs: the figure means nothing)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def init_single_process_group(device) -> None:
    """A one-rank process group for a benchmark's ssmshard programs (NCCL on CUDA, else gloo),
    with a timeout, on a free port unless MASTER_PORT is set: runs side by side on one host
    (one per GPU) do not clash over a fixed port."""
    import datetime

    import torch.distributed as dist

    from ssmshard.runtime.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))


def pyplot(path: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (saying so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'ssmshard[bench]'): no plot {path}")
        return None
    return plt


def bar_chart(path: str, title: str, groups: list[str], series: dict[str, list], ylabel: str,
              log: bool = False) -> str | None:
    """Grouped bars: one group per label of ``groups``, one bar per series (None: no bar)."""
    plt = pyplot(path)
    if plt is None:
        return None
    series = {name: values for name, values in series.items() if any(v is not None for v in values)}
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 2), 4))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


@contextmanager
def time_spent_in(module, names):
    """Seconds spent in each function ``names`` of ``module`` (as the module calls them) while
    the block runs: ``{name: seconds}``, filled as calls return."""
    originals = {name: getattr(module, name) for name in names}
    spent = dict.fromkeys(names, 0.0)

    def timed(name, fn):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started
        return call
    for name, fn in originals.items():
        setattr(module, name, timed(name, fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
