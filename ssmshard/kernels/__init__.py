"""Kernels behind the ``torch.ops.ssmshard`` ops.

``reference`` holds pure-torch, vectorised implementations: they define the
semantics of every op and serve as the CPU / fallback path.
``selective_scan`` (with ``selective_scan_fwd``, ``selective_scan_bwd``, ``scan_common``) and
``state_update`` hold Triton kernels for the Mamba-1 scan and the decode step.
"""
