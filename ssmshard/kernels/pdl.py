"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A batch-1 decode step is a chain of dependent kernels, most of them small (norms, the conv and
state updates) between the projections' GEMVs; on an H200 each kernel boundary inside the CUDA
graph cost 1-3 us whatever the kernel moved (benchmarks/results/decode_profile/). With PDL
(Hopper and later) a kernel is launched while the one before it still runs: it may do work that
does not depend on its predecessor (a GEMV loads its first weight tile), then waits in
``gdc_wait`` until the predecessor has finished and its writes are visible. Every kernel here
also calls ``gdc_launch_dependents`` at its start, so the next one can be launched as soon as all
of its own programs are running. In a probe of 64 layers of [norm -> GEMV -> norm -> GEMV] in a
CUDA graph on an H200 this took 30.1 us to 25.7 us per layer (benchmarks/results/pdl/).

The rules that keep it exact, followed by every kernel that takes ``PDL``: nothing written by an
earlier kernel is read, and nothing is written, before ``gdc_wait``; before it a kernel reads only
weights, which no kernel of the step writes. ``gdc_wait`` waits for the kernel just before, which
itself waited for its own predecessor, so every earlier kernel of the stream has finished too.
Kernels launched without PDL (PyTorch's) wait for everything before them as usual.

``SSMSHARD_PDL=0`` turns it off. It is off on CPUs (the interpreter) and GPUs before sm_90.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "SSMSHARD_PDL"


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL (module docstring)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The ``PDL`` constexpr and launch option for a kernel launch on ``device``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def start_dependents_then_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
