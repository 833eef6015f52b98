"""Communication for sharded programs: named groups, their backends, and collective ops.

* :mod:`.groups`: a group name resolves to a backend (a ``torch.distributed`` ProcessGroup, or
  a :class:`SimulatedGroup`); :func:`rank_of` / :func:`world_of` answer for either.
* :mod:`.simulated`: all ranks as threads of one process (:func:`run_simulated`).
* :mod:`.ops`: the ``torch.ops.ssmshard`` collectives with fake kernels and autograd; its
  docstring tables every op's forward, backward and gradient convention.
* :mod:`.weights` / :mod:`.ring`: under ``Plan(tsp=D)``, a whole weight all-gathered from the
  shards where an op reads it, or a linear layer computed from the shards passed around the ranks.
* :mod:`.quantized`: the block-scaled int8 / fp8 two-shot all-reduce, its error bound and a
  recorder of bytes sent and errors per sync point.
"""

from .groups import (CollectiveBackend, CollectiveError, ProcessGroupBackend, backend_of, declare_group_size, rank_of,
                     register_group, registered, resolve_group, unregister_group, world_of)
from .ops import (all_gather, all_gather_partial_grad, all_reduce, all_to_all, broadcast, padded_chunk,
                  reduce, reduce_scatter, shift, split, tp_copy)
from .quantized import error_bound, quantized_all_reduce, record_quantized_syncs
from .simulated import SimulatedGroup, SimulatedGroupError, run_simulated

__all__ = ["CollectiveBackend", "CollectiveError", "ProcessGroupBackend", "SimulatedGroup", "SimulatedGroupError", "all_gather",
           "all_gather_partial_grad", "all_reduce", "all_to_all", "backend_of", "broadcast", "declare_group_size",
           "error_bound", "padded_chunk", "quantized_all_reduce", "rank_of", "record_quantized_syncs", "reduce",
           "reduce_scatter", "register_group", "registered", "resolve_group", "run_simulated", "shift", "split",
           "tp_copy", "unregister_group", "world_of"]
