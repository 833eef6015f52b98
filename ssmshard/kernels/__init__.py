"""Kernels behind the ``torch.ops.ssmshard`` ops.

``reference`` holds pure-torch, vectorised implementations: they define the
semantics of every op and serve as the CPU / fallback path.
"""
