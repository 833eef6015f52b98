"""The decode step of every rank of a ``SimulatedMesh`` on one GPU, as ONE CUDA graph.

The ranks of a SimulatedMesh are threads of one process and their collectives are sums of the
ranks' tensors in memory (``comm/simulated.py``). A graph per rank cannot work: a simulated
all-reduce reads tensors the other ranks' kernels write, and nothing would order one rank's
graph against another's. So every rank records into one graph instead:

1. each rank warms its step up on the mesh's one capture stream (Triton compilation, the
   allocator's blocks), as ``torch.cuda.graph`` requires;
2. rank 0 begins the capture on that stream, and every rank thread runs its step on it. A
   stream records kernels in the order they are launched, whichever thread launches them, and
   the collectives' rendezvous makes that order a valid one: a sum is launched only after every
   rank has launched the kernels that write its parts;
3. once every rank's step is in, rank 0 ends the capture.

A replay then runs every rank's step. The ranks meet before it (each has copied its token,
positions and states into its own buffers, on the stream all the rank threads share) and after
it (no rank reads its logits before the replay is launched); rank 0 launches it.

The capture is "relaxed": a "global" capture forbids other threads the CUDA calls the rank
threads make while rank 0 captures. Each rank's buffers are its own, as in
:class:`~ssmshard.runtime.cuda_graph.GraphedDecode`; only the graph is shared. What this checks
is the ranks' sharded decode programs replayed from a graph with the values of an N-process
run; the NCCL kernels of a real tensor-parallel graph need one GPU per rank.
"""

from __future__ import annotations

import threading

import torch

from ..comm.groups import backend_of
from .cuda_graph import _CAPTURED, GraphedDecode, warm_up


class JointDecodeGraph:
    """One CUDA graph holding the decode step of each rank of a mesh (module docstring); the
    rank threads of process group ``group`` call it through their :class:`RankOfJointGraph`."""

    def __init__(self, group: str):
        self.group = group
        self.graph = None
        self.stream = None
        self._lock = threading.Lock()

    def _meet(self, label: str) -> None:
        backend_of(self.group).barrier(f"joint decode graph: {label}")

    def record(self, rank: int, run, record_step) -> None:
        """Every rank calls this with its step ``run``; ``record_step(run)`` runs it under the
        capture (and copies its new states into its buffers). Returns once the graph is captured."""
        with self._lock:
            if self.stream is None:
                self.stream = torch.cuda.Stream()
        # Warm-up on the one stream too: a simulated collective reads the other ranks' tensors,
        # and only one stream orders their kernels.
        warm_up(run, self.stream)
        self._meet("warmed up")
        if rank == 0:
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.stream):
                self.graph.capture_begin(capture_error_mode="relaxed")
        try:
            self._meet("capture begun")
            with torch.cuda.stream(self.stream):
                record_step(run)
            self._meet("every rank's step recorded")
        except BaseException:
            if rank == 0:
                self._abandon_capture()
            raise
        if rank == 0:
            with torch.cuda.stream(self.stream):
                self.graph.capture_end()
        self._meet("captured")
        torch.cuda.current_stream().wait_stream(self.stream)

    def _abandon_capture(self) -> None:
        """End a capture a rank's failure interrupted, so the stream and the allocator leave
        capture mode; the graph is not kept."""
        try:
            with torch.cuda.stream(self.stream):
                self.graph.capture_end()
        except RuntimeError:
            pass  # an invalidated capture raises as it ends; it has ended all the same
        self.graph = None

    def replay(self, rank: int) -> None:
        """One replay of every rank's step, once every rank has written its inputs."""
        self._meet("inputs written")
        if rank == 0:
            self.graph.replay()
        self._meet("replayed")

    def release(self) -> None:
        with self._lock:
            if self.graph is not None:
                self.graph.reset()
            self.graph = None


class RankOfJointGraph(GraphedDecode):
    """One rank's decode step replayed from a :class:`JointDecodeGraph`: this rank's buffers and
    interface as ``GraphedDecode``'s, the graph (``.graph``) shared with the other ranks."""

    def __init__(self, program, static_length, joint: JointDecodeGraph, rank: int):
        super().__init__(program, static_length)
        self.joint = joint
        self.rank = rank

    def _record(self, run):
        _CAPTURED.add(self)
        self.joint.record(self.rank, run, self._run_and_keep)
        self.graph = self.joint.graph

    def _replay(self):
        self.joint.replay(self.rank)

    def release(self) -> None:
        self.joint.release()
        self.graph = None
        super().release()


class JointGraphs:
    """The joint graphs of a mesh: a rank's k-th request for a decode graph gets its part of the
    mesh's k-th joint graph. The ranks run the same ``generate`` calls, so they ask for a new
    graph at the same points and in the same order."""

    def __init__(self, world: int, group: str):
        self.world = world
        self.group = group
        self._requests = [0] * world
        self._open: dict[int, tuple[JointDecodeGraph, set]] = {}  # k -> (graph, ranks yet to take it)
        self._lock = threading.Lock()

    def for_rank(self, rank: int, program, static_length=None) -> RankOfJointGraph:
        with self._lock:
            index = self._requests[rank]
            self._requests[rank] += 1
            if index not in self._open:
                self._open[index] = (JointDecodeGraph(self.group), set(range(self.world)))
            joint, waiting = self._open[index]
            waiting.discard(rank)
            if not waiting:
                del self._open[index]
        return RankOfJointGraph(program, static_length, joint, rank)
