"""A low-latency all-reduce for small messages: torch symmetric memory's one-shot kernel.

Decode's all-reduces move a few KB (one token's hidden vector per sequence). NCCL's ring costs
a fixed latency per call that dwarfs the bytes; a one-shot all-reduce over peer memory has every
rank copy its operand into a buffer every peer can read (allocated once, exchanged once at
start-up), then read all N buffers over NVLink and sum them. One kernel, no proxy thread, and it
can be captured in a CUDA graph.

Only the peer-to-peer kernels are used: NVLink multicast (``multimem``) stays off, as the lent
machines require (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0``).

Every rank sums the N operands in the same rank order, so every rank gets the same bits; they
can differ from NCCL's (a ring sums in another order) by the rounding of the dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import ProcessGroupBackend, _named_failures, backends_by_device

# The one-shot kernel reads N peer buffers per element, so its cost grows with the message.
# benchmarks/results/allreduce: at tp=2 on H200s it beat NCCL (inside a CUDA graph) at every
# size up to 1 MiB, and the two-shot kernel overtook it from 256 KiB; decode's messages are KiBs.
DEFAULT_MAX_BYTES = 256 * 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SymmetricMemoryError(RuntimeError):
    """The low-latency all-reduce cannot run on this group or device (the message says why)."""


def check_supported(process_group) -> None:
    """Raise :class:`SymmetricMemoryError` unless ``process_group`` is an NCCL group of CUDA ranks
    on one host whose torch has symmetric memory. Called before any collective runs."""
    if not torch.cuda.is_available():
        raise SymmetricMemoryError("Plan(allreduce='symm_mem') needs CUDA GPUs; use allreduce='nccl' (the default)")
    if backends_by_device(process_group).get("cuda") != "nccl":
        raise SymmetricMemoryError("Plan(allreduce='symm_mem') needs an NCCL process group "
                                   f"(got {dist.get_backend_config(process_group)!r}); use allreduce='nccl'")
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        raise SymmetricMemoryError(f"this torch ({torch.__version__}) has no symm_mem.one_shot_all_reduce_copy; "
                                   "use allreduce='nccl'")


class SymmetricMemoryBackend(ProcessGroupBackend):
    """A ProcessGroupBackend whose all-reduce of a CUDA tensor of at most ``max_bytes`` runs the
    one-shot peer-memory kernel; larger messages, other dtypes and the other collectives use NCCL.

    The buffer (``max_bytes`` per rank) is allocated and exchanged here, once, by every rank of
    the group together: construct it on every rank at the same point (``parallelize`` does).
    """

    def __init__(self, process_group, max_bytes: int = DEFAULT_MAX_BYTES):
        check_supported(process_group)
        super().__init__(process_group)
        from torch.distributed import _symmetric_memory as symm_mem

        self.max_bytes = int(max_bytes)
        self.group_name = process_group.group_name
        device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank exchanges handles
        self.calls = {"symm_mem": 0, "nccl": 0}  # which path each all-reduce took (tests, reports)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the one-shot kernel (decided from its size and dtype only,
        so every rank decides the same). The kernel moves whole 4-byte words: an odd count of
        2-byte values goes to NCCL."""
        size = x.numel() * x.element_size()
        return x.is_cuda and x.dtype in _DTYPES and size <= self.max_bytes and size % 4 == 0

    @_named_failures
    def all_reduce(self, x):
        if not self.takes(x):
            self.calls["nccl"] += 1
            return ProcessGroupBackend.all_reduce(self, x)
        self.calls["symm_mem"] += 1
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x.contiguous(), "sum", self.group_name)
