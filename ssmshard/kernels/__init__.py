"""Kernels behind the ``torch.ops.ssmshard`` ops.

``reference`` holds pure-torch, vectorised implementations: they define the
semantics of every op and serve as the CPU / fallback path.

Triton kernels (forward and backward, packed sequences via ``cu_seqlens``), imported
explicitly (they need Triton, and TRITON_INTERPRET=1 set first to run on CPU); the
``swap_kernels`` pass wires them into programs:

* ``selective_scan`` (with ``selective_scan_fwd``, ``selective_scan_fwd_parallel``,
  ``selective_scan_bwd``, ``scan_common``):
  the Mamba-1 scan; ``state_update``: the decode step (Mamba-1 and Mamba-2 layouts);
* ``ssd_scan`` (with ``ssd_scan_fwd``, ``ssd_scan_bwd``, ``ssd_triton_common``): Mamba-2 SSD;
* ``causal_conv1d``: the depthwise causal conv and its decode update.
* ``rms_norm``: RMSNorm, with the residual add before it, and Mamba-2's gated norm (forward).
* ``gemv``: the skinny matmul of a decode step's linear layers (``ssmshard.decode_linear``), and of
  several sharing one input in one launch (``ssmshard.decode_linear_group``).
"""

# Every kernel module imports this package first: the interpreter's fixes apply before any launch.
from . import interpreter  # noqa: E402,F401
