"""Host-side integer helpers for kernel launches.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
functions, and every host call of one goes through Triton's constexpr unwrapping. On an H200
host that cost the Mamba-1 scan's forward+backward 49-79 us per call in all (timed per host
section; docs/kernels.md), for arithmetic worth a few hundred nanoseconds.
"""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n, for n >= 1 (every size it is asked about)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
