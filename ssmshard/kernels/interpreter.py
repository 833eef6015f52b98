"""Triton's CPU interpreter (``TRITON_INTERPRET=1``): whether it runs the kernels, and the lock
that keeps its launches apart.

The interpreter patches ``triton.language`` while a kernel runs, so interpreted launches from
several threads (the ranks of a simulated group, ``comm.simulated``) must not overlap. On a GPU
the lock is a no-op context.
"""

from __future__ import annotations

import contextlib
import os
import threading

# Read at import, like @triton.jit does: kernels run under the CPU interpreter when set.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Reentrant: a kernel's host function may hold it around launches of its helpers.
INTERPRETER_LOCK = threading.RLock() if INTERPRET else contextlib.nullcontext()
