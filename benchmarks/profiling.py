"""torch.profiler helpers shared by the benchmark scripts."""

from __future__ import annotations

import torch


def kernel_table(prof) -> list[dict]:
    """CUDA kernels by name: calls and device time (ms), largest first."""
    rows = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.self_device_time_total <= 0:
            continue  # CPU-side ops; the kernels they launched are rows of their own
        rows[event.key] = {"kernel": event.key, "calls": event.count, "ms": event.self_device_time_total / 1e3}
    if not rows:  # a profiler build that files kernels under their CPU ops: take those
        rows = {e.key: {"kernel": e.key, "calls": e.count, "ms": e.self_device_time_total / 1e3}
                for e in prof.key_averages() if e.self_device_time_total > 0}
    table = sorted(rows.values(), key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in table) or 1.0
    for r in table:
        r["share"] = r["ms"] / total
    return table


def profile_kernels(fn, calls: int = 5) -> list[dict]:
    """The kernel table of ``calls`` calls of ``fn`` (after one unprofiled warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = kernel_table(prof)
    for row in table:
        row["ms_per_call"] = row["ms"] / calls
    return table


def summary(table: list[dict], top: int = 5) -> str:
    """The ``top`` kernels of a ``profile_kernels`` table on one line."""
    return "; ".join(f"{k['kernel'][:40]} {k['ms_per_call']:.3f} ms" for k in table[:top])
