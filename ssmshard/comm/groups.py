"""Named communication groups and the backends that carry their collectives.

Graphs name a group by a string (``"ssmshard_tp0"``), never by a process-group object, so they
stay plain data and one graph serves any launcher. A name resolves to a
:class:`CollectiveBackend`:

* :class:`ProcessGroupBackend` wraps a ``torch.distributed`` ProcessGroup (gloo, NCCL), one
  rank per process;
* :class:`~ssmshard.comm.simulated.SimulatedGroup` runs every rank as a thread of one process.

Ops ask :func:`rank_of` / :func:`world_of` (never ``dist.get_rank``), which answer for either.

Every backend method is functional: it returns a new tensor and leaves its input alone. The
"stacked" methods move a tensor of shape (N, *chunk) whose row k is addressed to / from rank k;
the ops in :mod:`ssmshard.comm.ops` lay tensors out that way, so a backend knows nothing about
dims, padding or autograd. A faster all-reduce (for example torch symmetric memory's one-shot /
two-shot kernels below a message size, inside CUDA graphs) is a backend subclass that overrides
:meth:`CollectiveBackend.all_reduce` and is registered under the same name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

# Before torch 2.13 these were the only names; 2.13 renames them and deprecates the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveBackend:
    """What a named group must provide. Every rank calls the same methods in the same order."""

    def rank(self) -> int:
        raise NotImplementedError

    def world(self) -> int:
        raise NotImplementedError

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's ``x``."""
        raise NotImplementedError

    def all_gather_stacked(self, x: Tensor) -> Tensor:
        """(N, *x.shape): row k is rank k's ``x``."""
        raise NotImplementedError

    def reduce_scatter_stacked(self, stacked: Tensor) -> Tensor:
        """``stacked`` (N, *chunk): this rank gets the sum over ranks k of rank k's row ``rank``."""
        raise NotImplementedError

    def all_to_all_stacked(self, stacked: Tensor) -> Tensor:
        """``stacked`` (N, *chunk): row j goes to rank j; row k of the result came from rank k."""
        raise NotImplementedError

    def broadcast(self, x: Tensor, src: int) -> Tensor:
        """Rank ``src``'s ``x`` on every rank."""
        raise NotImplementedError

    def reduce(self, x: Tensor, dst: int) -> Tensor:
        """The sum of every rank's ``x`` on rank ``dst``; zeros on the others."""
        raise NotImplementedError

    def shift(self, x: Tensor, offset: int) -> Tensor:
        """Send ``x`` to rank (rank + offset) mod N; return what rank (rank - offset) mod N sent."""
        raise NotImplementedError

    def start_shifts(self, sends: list) -> "PendingShifts":
        """Start a :meth:`shift` of every ``(x, offset)`` in ``sends``; ``.wait()`` on the result
        returns what arrived, in order. The caller computes in between (the ring schedule of
        ``comm.ring``). This default shifts one after the other before returning (no overlap);
        a backend with non-blocking point-to-point overrides it."""
        return PendingShifts(received=[self.shift(x, offset) for x, offset in sends])


class PendingShifts:
    """Shifts under way: ``wait()`` blocks until they are done and returns the received tensors."""

    def __init__(self, received: list, works: tuple = (), on_wait=None):
        self._received, self._works, self._on_wait = received, works, on_wait

    @property
    def buffers(self) -> list:
        """The tensors the shifts receive into (allocated now, filled once :meth:`wait` returns)."""
        return self._received

    def wait(self) -> list:
        if self._on_wait is not None:
            self._on_wait(self._works)
        return self._received


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank; the message names the rank, op and group."""


def backends_by_device(pg=None) -> dict:
    """``{device type: backend name}`` of process group ``pg``: ``{'cpu': 'gloo', 'cuda': 'gloo'}``,
    ``{'cuda': 'nccl'}``, ...

    Read from torch's backend config, not ``dist.get_backend``: a group started without a backend
    (``init_process_group()``, or ``init_device_mesh`` before any group exists) reports
    ``'undefined'`` there, and on a machine with a GPU it has NCCL only, so it carries no CPU
    tensors even where the mesh was built for ``'cpu'``.
    """
    config = dist.get_backend_config(pg)
    return dict(part.split(":", 1) for part in config.split(",") if ":" in part)


def _timeout_seconds(pg) -> float | None:
    """The timeout ``pg`` was created with, where this torch exposes it (a private attribute)."""
    try:
        device = torch.device("cpu" if "cpu" in backends_by_device(pg) else "cuda")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001  (only used to word an error message)
        return None


def _named_failures(method):
    """A failed collective re-raised as one that says which rank waited in what: the cause's
    traceback shows only torch.distributed's frames, so its message is kept whole."""
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            timeout = _timeout_seconds(self.process_group)
            bound = f"the process group's timeout ({timeout:g} s)" if timeout else "the process group's timeout"
            what = method.__name__.replace("_stacked", "")
            name = getattr(self.process_group, "group_name", None) or "?"
            raise CollectiveError(
                f"rank {dist.get_rank()} waited in {what} over process group '{name}' ({self.world()} ranks) and it "
                f"failed. Another rank failed, left, or did not call this {what} (every rank must run the "
                f"same collectives in the same order); a wait is bounded by {bound} "
                f"(ssmshard.launch(timeout=...) or SSMSHARD_TIMEOUT).\n{type(exc).__name__}: {str(exc).strip()}"
            ) from None
    wrapper.__name__ = method.__name__
    return wrapper


class ProcessGroupBackend(CollectiveBackend):
    """Collectives of a ``torch.distributed`` ProcessGroup. Waits are bounded by the group's own
    timeout (``init_process_group(timeout=...)``); a failed one raises :class:`CollectiveError`."""

    def __init__(self, process_group):
        self.process_group = process_group

    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    @_named_failures
    def all_reduce(self, x):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.process_group)
        return out

    @_named_failures
    def all_gather_stacked(self, x):
        out = x.new_empty((self.world(), *x.shape))
        _all_gather_single(out.view(-1), x.contiguous().view(-1), group=self.process_group)
        return out

    @_named_failures
    def reduce_scatter_stacked(self, stacked):
        out = stacked.new_empty(stacked.shape[1:])
        _reduce_scatter_single(out.view(-1), stacked.contiguous().view(-1), group=self.process_group)
        return out

    @_named_failures
    def all_to_all_stacked(self, stacked):
        stacked = stacked.contiguous()
        out = torch.empty_like(stacked)
        dist.all_to_all_single(out, stacked, group=self.process_group)
        return out

    @_named_failures
    def broadcast(self, x, src):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.broadcast(out, group_src=src, group=self.process_group)
        return out

    @_named_failures
    def reduce(self, x, dst):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.reduce(out, group_dst=dst, group=self.process_group)
        if self.rank() != dst:
            out.zero_()  # NCCL leaves non-root buffers undefined
        return out

    @_named_failures
    def shift(self, x, offset):
        rank, world = self.rank(), self.world()
        if offset % world == 0:
            return x.clone(memory_format=torch.contiguous_format)
        received = torch.empty_like(x, memory_format=torch.contiguous_format)
        # One batch of a non-blocking send and receive: every rank posts both before waiting,
        # so the ring cannot deadlock whatever the order ranks arrive in.
        ops = [dist.P2POp(dist.isend, x.contiguous(), group=self.process_group, group_peer=(rank + offset) % world),
               dist.P2POp(dist.irecv, received, group=self.process_group, group_peer=(rank - offset) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received

    @_named_failures
    def start_shifts(self, sends):
        """One batch of non-blocking sends and receives for every shift, not waited on: on NCCL
        the transfers run on the communicator's stream while the caller's kernels run on theirs.
        Every rank posts its sends and receives in the same order, so two shifts between the same
        pair of ranks (both offsets at N = 2) match in order."""
        rank, world = self.rank(), self.world()
        ops, received = [], []
        for x, offset in sends:
            buffer = torch.empty_like(x, memory_format=torch.contiguous_format)
            ops += [dist.P2POp(dist.isend, x.contiguous(), group=self.process_group,
                               group_peer=(rank + offset) % world),
                    dist.P2POp(dist.irecv, buffer, group=self.process_group, group_peer=(rank - offset) % world)]
            received.append(buffer)
        return PendingShifts(received, tuple(dist.batch_isend_irecv(ops)), self.wait_shifts)

    @_named_failures
    def wait_shifts(self, works):
        for work in works:
            work.wait()


_GROUPS: dict[str, tuple[object, CollectiveBackend]] = {}  # name -> (what was registered, its backend)
_DECLARED_SIZES: dict[str, int] = {}


def register_group(name: str, group) -> None:
    """Let graphs reach ``group`` (a ProcessGroup or any :class:`CollectiveBackend`, e.g. a
    :class:`~ssmshard.comm.simulated.SimulatedGroup`) by ``name``."""
    backend = group if isinstance(group, CollectiveBackend) else ProcessGroupBackend(group)
    if isinstance(group, ProcessGroupBackend):
        group = group.process_group  # resolve_group answers with the ProcessGroup it wraps
    _GROUPS[name] = (group, backend)


def unregister_group(name: str) -> None:
    _GROUPS.pop(name, None)


@contextlib.contextmanager
def registered(name: str, group):
    """Register ``group`` under ``name`` for a block; restore what ``name`` meant before."""
    previous = _GROUPS.get(name)
    register_group(name, group)
    try:
        yield group
    finally:
        if previous is None:
            unregister_group(name)
        else:
            _GROUPS[name] = previous


def declare_group_size(name: str, size: int) -> None:
    """Let fake (shape) propagation know a group's size before the group exists (passes run first)."""
    _DECLARED_SIZES[name] = size


def _entry(name: str):
    if name not in _GROUPS:
        raise RuntimeError(f"communication group {name!r} is not registered: create the DistributedModule through "
                           "ssmshard.parallelize inside an initialised process group, or run the ranks with "
                           "ssmshard.comm.run_simulated")
    return _GROUPS[name]


def resolve_group(name: str):
    """What was registered under ``name`` (a ProcessGroup or a SimulatedGroup)."""
    return _entry(name)[0]


def backend_of(name: str) -> CollectiveBackend:
    return _entry(name)[1]


def rank_of(name: str) -> int:
    """This rank's index in group ``name`` (the calling thread's, for a SimulatedGroup)."""
    return backend_of(name).rank()


def world_of(name: str) -> int:
    """The number of ranks of group ``name``: the registered group's, else the declared size."""
    if name in _GROUPS:
        return _GROUPS[name][1].world()
    if name in _DECLARED_SIZES:
        return _DECLARED_SIZES[name]
    raise RuntimeError(f"the size of communication group {name!r} is unknown: register the group, or call "
                       f"ssmshard.comm.declare_group_size({name!r}, N) before propagating shapes")
