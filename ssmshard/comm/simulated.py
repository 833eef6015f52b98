"""All ranks of a group in one process: each rank is a Python thread (torch ops release the GIL).

Every collective is a rendezvous of the N rank threads: each deposits its tensor, waits until
all have (the first meeting), computes its own result from all deposits, and waits again (the
second meeting) so no deposit is reused while a rank still reads it. Results are those of a
real process group, each rank's result a fresh tensor; sums are taken in rank order (a real
backend may add more than two parts in another order, which can change the last bit).

A simulated group never hangs. A meeting waits at most ``timeout`` seconds; a rank that raises
(anywhere in its function), returns while others wait in a collective, or calls a different
collective than the others fails the group, and every rank waiting or arriving later raises
:class:`SimulatedGroupError` at once, naming the collective it was in and the cause.

Limits: the default torch RNG is shared by all threads (draw from explicit generators);
grad mode is per thread (every rank starts with it on). Autograd runs the backward of CUDA
tensors on one engine thread per device rather than on the rank's thread, so a backward through
simulated collectives on a GPU raises (the thread is not one of the group's ranks); CPU
backward runs on the calling thread and works.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor

from .groups import CollectiveBackend, registered

DEFAULT_TIMEOUT_S = 300.0


class SimulatedGroupError(RuntimeError):
    """A simulated collective could not complete (another rank failed, timed out or diverged)."""


def _sum_in_rank_order(parts):
    total = parts[0].clone(memory_format=torch.contiguous_format)
    for part in parts[1:]:
        total.add_(part)
    return total


class SimulatedGroup(CollectiveBackend):
    """An in-memory group of ``world`` ranks, each a thread bound with :meth:`bind`."""

    def __init__(self, world: int, *, timeout: float = DEFAULT_TIMEOUT_S):
        if world < 1:
            raise ValueError(f"a simulated group needs at least one rank, not {world}")
        self._world = world
        self.timeout = timeout
        self._local = threading.local()
        self._cond = threading.Condition()
        self._generation = 0  # meetings completed
        self._waiting: dict[int, str] = {}  # rank -> the collective it waits in, this meeting
        self._departed: set[int] = set()
        self._failure: str | None = None
        self._deposits: list = [None] * world
        self._calls = [0] * world  # collectives each rank has entered (only its own thread writes)

    def __repr__(self):
        return f"SimulatedGroup(world={self._world})"

    # ------------------------------------------------------------------ ranks
    @contextlib.contextmanager
    def bind(self, rank: int):
        """Make the calling thread rank ``rank`` of this group for the block."""
        if not 0 <= rank < self._world:
            raise ValueError(f"rank {rank} is outside {self!r}")
        previous = getattr(self._local, "rank", None)
        self._local.rank = rank
        try:
            yield
        finally:
            self._local.rank = previous

    def rank(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise SimulatedGroupError(
                f"thread {threading.current_thread().name!r} is not a rank of {self!r}: run the ranks with "
                "ssmshard.comm.run_simulated (or SimulatedGroup.bind). A backward pass of CUDA tensors runs on "
                "autograd's device thread, which no rank owns: simulate backward on the CPU")
        return rank

    def world(self) -> int:
        return self._world

    # ------------------------------------------------------------------ failures
    def abort(self, rank: int, exc: BaseException) -> None:
        """Rank ``rank`` failed with ``exc``: every waiting and later collective raises."""
        self._fail(f"rank {rank} raised {type(exc).__name__}: {exc}")

    def depart(self, rank: int) -> None:
        """Rank ``rank`` finished its function: nobody may wait for it any more."""
        with self._cond:
            self._departed.add(rank)
            if self._waiting:
                self._fail_locked(f"rank(s) [{rank}] returned from their function while {self._describe_waiting()} "
                                  "waited: the ranks did not call the same collectives")

    def _fail(self, reason: str) -> None:
        with self._cond:
            self._fail_locked(reason)

    def _fail_locked(self, reason: str) -> None:
        if self._failure is None:  # keep the first cause
            self._failure = reason
        self._cond.notify_all()

    def _error(self, label: str, rank: int) -> SimulatedGroupError:
        return SimulatedGroupError(f"{label} on rank {rank} of {self!r} cannot complete: {self._failure}")

    def _describe_waiting(self) -> str:
        return ", ".join(f"{label} (rank {r})" for r, label in sorted(self._waiting.items()))

    # ------------------------------------------------------------------ rendezvous
    def _meet(self, rank: int, label: str, same_label: bool = False) -> None:
        """Return once all ranks have reached this meeting; raise if that cannot happen (or,
        with ``same_label``, if the ranks met under different labels)."""
        with self._cond:
            if self._failure is None and self._departed:
                self._fail_locked(f"rank(s) {sorted(self._departed)} returned from their function before this "
                                  "collective: the ranks did not call the same collectives")
            if self._failure is not None:
                raise self._error(label, rank)
            generation = self._generation
            self._waiting[rank] = label
            if len(self._waiting) == self._world:
                if same_label and len(set(self._waiting.values())) > 1:
                    self._fail_locked(f"the ranks met at different points: {self._describe_waiting()}")
                    raise self._error(label, rank)
                self._waiting.clear()
                self._generation += 1
                self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._generation != generation or self._failure is not None, self.timeout)
            if self._generation != generation:
                return  # released, even if a failure came after
            if self._failure is None:
                missing = sorted(set(range(self._world)) - set(self._waiting))
                self._fail_locked(f"timed out after {self.timeout:g} s: rank(s) {missing} never arrived while "
                                  f"{self._describe_waiting()} waited")
            raise self._error(label, rank)

    def barrier(self, label: str = "barrier") -> None:
        """Return once every rank has called ``barrier`` with the same ``label``; different labels,
        a failure or a timeout of the group raise here as in a collective."""
        rank = self.rank()
        try:
            self._meet(rank, label, same_label=True)
        except SimulatedGroupError:
            raise
        except BaseException as exc:  # e.g. KeyboardInterrupt while waiting: release the others
            self.abort(rank, exc)
            raise

    def _exchange(self, what: str, x: Tensor, combine):
        """Deposit ``x``, meet, return ``combine(deposits, rank)``, meet again."""
        rank = self.rank()
        label = f"{what} (this rank's collective #{self._calls[rank]})"
        self._calls[rank] += 1
        self._deposits[rank] = (what, x)
        try:
            self._meet(rank, label)
            deposits = list(self._deposits)  # complete now; nobody replaces one before the second meeting
            self._check_same(deposits, label, rank)
            result = combine([tensor for _, tensor in deposits], rank)
            self._meet(rank, label + ", reading the others' tensors")
        except SimulatedGroupError:
            raise
        except BaseException as exc:  # this rank's own failure: release the others
            self.abort(rank, exc)
            raise
        # Only after a complete exchange: on failure another rank may still be reading (the
        # failed group keeps its deposits until it is dropped).
        self._deposits[rank] = None
        return result

    def _check_same(self, deposits, label: str, rank: int) -> None:
        seen = [(what, tuple(t.shape), t.dtype, t.device) for what, t in deposits]
        if any(s != seen[0] for s in seen):
            calls = "; ".join(f"rank {r}: {what} of {list(shape)} {dtype} on {device}"
                              for r, (what, shape, dtype, device) in enumerate(seen))
            self._fail(f"the ranks called different collectives or shapes ({calls})")
            raise self._error(label, rank)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x):
        return self._exchange("all_reduce", x, lambda parts, rank: _sum_in_rank_order(parts))

    def all_gather_stacked(self, x):
        return self._exchange("all_gather", x, lambda parts, rank: torch.stack(parts))

    def reduce_scatter_stacked(self, stacked):
        return self._exchange("reduce_scatter", stacked,
                              lambda parts, rank: _sum_in_rank_order([p[rank] for p in parts]))

    def all_to_all_stacked(self, stacked):
        return self._exchange("all_to_all", stacked, lambda parts, rank: torch.stack([p[rank] for p in parts]))

    def broadcast(self, x, src):
        return self._exchange(f"broadcast(src={src})", x,
                              lambda parts, rank: parts[src].clone(memory_format=torch.contiguous_format))

    def reduce(self, x, dst):
        return self._exchange(f"reduce(dst={dst})", x, lambda parts, rank: (
            _sum_in_rank_order(parts) if rank == dst else torch.zeros_like(x, memory_format=torch.contiguous_format)))

    def shift(self, x, offset):
        return self._exchange(f"shift(offset={offset})", x, lambda parts, rank: parts[(rank - offset) % self._world]
                              .clone(memory_format=torch.contiguous_format))


def run_simulated(fn, world: int, *args, group: str = "world", timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(rank, world, *args)`` on every rank of a fresh :class:`SimulatedGroup` registered
    as ``group`` (what ``group`` named before is restored afterwards), one thread per rank.

    Returns the ranks' results in rank order. If any rank raises, the others' collectives raise
    too and the first failure is re-raised here, with the other ranks' errors as notes.
    """
    sim = SimulatedGroup(world, timeout=timeout)
    results = [None] * world
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def rank_main(rank):
        with sim.bind(rank):
            try:
                results[rank] = fn(rank, world, *args)
            except BaseException as exc:
                with lock:
                    failures.append((rank, exc))  # before abort: the cause is recorded first
                sim.abort(rank, exc)
                return
            sim.depart(rank)

    with registered(group, sim):
        threads = [threading.Thread(target=rank_main, args=(rank,), name=f"simulated-rank-{rank}", daemon=True)
                   for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        first_rank, first = failures[0]
        first.add_note(f"(raised by simulated rank {first_rank} of {world})")
        for rank, exc in failures[1:]:
            first.add_note(f"simulated rank {rank}: {type(exc).__name__}: {exc}")
        raise first
    return results
