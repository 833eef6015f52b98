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


def _read_one_element_arrays_as_indices() -> None:
    """Let the interpreter use a kernel's runtime integer argument as an index (``range(n)``).

    The interpreter holds such an argument as a one-element 1-d NumPy array and makes it an
    index with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"; deprecated since NumPy 1.25). Triton 3.6 (torch 2.11's) does
    that; newer Triton squeezes the array first, which this applies to older ones too: it wraps
    the interpreter's per-launch patching of ``triton.language.tensor`` and replaces the one
    attribute, through the same scope, so that it is undone when the launch ends.
    """
    try:
        from triton.runtime import interpreter as triton_interpreter
    except ImportError:  # no Triton: nothing runs under the interpreter
        return
    patch = getattr(triton_interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "reads_one_element_arrays", False):
        return

    def index(tensor) -> int:
        return int(tensor.handle.data.squeeze())

    def patch_lang_tensor(tensor, scope):  # Triton 3.6 to 3.9: (tensor, the launch's patch scope)
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    patch_lang_tensor.reads_one_element_arrays = True
    triton_interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _read_one_element_arrays_as_indices()
