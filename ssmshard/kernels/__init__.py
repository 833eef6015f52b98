"""Kernels behind the ``torch.ops.ssmshard`` ops.

``reference`` holds pure-torch, vectorised implementations: they define the
semantics of every op and serve as the CPU / fallback path.

``ssd_scan`` is the Triton Mamba-2 SSD scan (forward and backward, packed sequences);
import it explicitly (it needs Triton, and TRITON_INTERPRET=1 set first to run on CPU).
"""
