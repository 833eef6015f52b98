"""``SimulatedMesh``: every rank of a tensor-parallel plan in one process (CPU or one GPU).

Each rank is a :class:`~ssmshard.runtime.distributed.DistributedModule` built exactly as
``parallelize`` builds it in its own process (the same capture, ``plan.layout``, rank
pipeline and weight slices); the collectives run in memory through a
:class:`~ssmshard.comm.simulated.SimulatedGroup` (one thread per rank, sums in rank order), so
the values are those of an N-process run (up to the order in which a backend adds more than
two parts: the mesh adds them in rank order, gloo and NCCL in orders of their own). It is what
sync-point calibration (``ssmshard.sensitivity``) runs on: one machine evaluates a tp=8 plan
with dropped or quantized sync points.

    mesh = SimulatedMesh(model, Plan(tp=8, drop_syncs=["layers.*.o_proj"]))
    logits = mesh(ids)                               # rank 0's logits (every rank has them)
    tokens = mesh.generate(ids, max_new_tokens=8)
    grads = mesh.run(lambda dm: ...)                 # any per-rank function, backward included

Backward through simulated collectives works on CPU tensors only, inside ``run`` (the rank
threads own the collectives; see comm/simulated.py). On a GPU, ``generate`` replays the decode
steps of all ranks from one CUDA graph (``runtime/joint_graph.py``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading

import torch

from ..capture import capture
from ..comm.simulated import DEFAULT_TIMEOUT_S, run_simulated
from .distributed import DistributedModule, local_weights
from .joint_graph import JointGraphs
from .pipeline import shard_program

_mesh_ids = itertools.count()


class CapturedOnce:
    """The generation programs of a mesh's model, each captured once for all its ranks: every
    call returns a fresh copy of the one capture of those options, for a rank to shard (the
    ranks of a process group each capture the same program; here they share one export)."""

    def __init__(self):
        self._programs = {}
        self._lock = threading.Lock()  # rank threads may build a program on first use

    def __call__(self, model, **options):
        key = tuple(sorted(options.items()))
        with self._lock:
            if key not in self._programs:
                self._programs[key] = capture(model, **options)
            return copy_for_a_rank(self._programs[key])


def copy_for_a_rank(program):
    """A deep copy of a captured ``program`` for one rank to shard. The copy reads the model's
    weights until the rank binds its own slices: they are shared, not copied (no pass writes them)."""
    shared = {id(t): t for t in (program.weights or {}).values()}
    return copy.deepcopy(program, memo=shared)


class SimulatedMesh:
    """All ``plan.tp`` ranks of ``model`` under ``plan``, run as threads of this process."""

    def __init__(self, model, plan, *, timeout: float = DEFAULT_TIMEOUT_S, program=None):
        """``program``: ``model``'s captured forward program, to reuse across meshes (calibration
        builds one mesh per candidate plan); each rank shards its own copy."""
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("SimulatedMesh needs the model's weights; this model is on the meta device")
        self.plan = plan
        self.model = model
        self.timeout = timeout
        self.group = f"ssmshard_simulated{next(_mesh_ids)}"
        plan.check_model(model)  # PlanError here, before any rank runs
        program = capture(model, mode="forward") if program is None else program
        captures = CapturedOnce()
        placements = plan.layout(program, model)  # likewise
        permutations = plan.weight_permutations(program, model)  # likewise; the model is not changed
        kernels = plan.kernel_choice(next(model.parameters()).device)
        self._joint_graphs = JointGraphs(plan.tp, self.group)
        self.ranks: list[DistributedModule] = []
        for rank in range(plan.tp):
            options = {"rank": rank, "group": self.group, "kernels": kernels}
            local = shard_program(copy_for_a_rank(program), model, plan, placements=placements, **options)
            weights = local_weights(local, placements, model, rank, permutations)
            self.ranks.append(DistributedModule(local, weights, plan, rank, model=model, shard_options=options,
                                                captures=captures,
                                                decode_graphs=functools.partial(self._joint_graphs.for_rank, rank)))

    @property
    def program(self):
        """Rank 0's forward program (its ``sync_points`` and ``report()``)."""
        return self.ranks[0].program

    def run(self, fn, *args) -> list:
        """``fn(rank_module, *args)`` on every rank at once; the ranks' results in rank order.
        Grad mode is the caller's."""
        grad = torch.is_grad_enabled()

        def rank_main(rank, world):
            with torch.set_grad_enabled(grad):
                return fn(self.ranks[rank], *args)

        return run_simulated(rank_main, self.plan.tp, group=self.group, timeout=self.timeout)

    def __call__(self, input_ids, **kwargs):
        """The logits every rank returns (rank 0's)."""
        return self.run(lambda dm: dm(input_ids, **kwargs))[0]

    def prefill(self, input_ids, attention_mask=None, **kwargs):
        self._generation_programs(kwargs.get("chunk_size"), input_ids)
        return self.run(lambda dm: dm.prefill(input_ids, attention_mask, **kwargs))

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Rank 0's output of ``DistributedModule.generate`` (every rank returns the same ids).

        On a GPU the decode step of every rank is replayed from one CUDA graph
        (``runtime/joint_graph.py``), where ``cuda_graph`` asks for one as in ``DistributedModule.generate``."""
        self._generation_programs(kwargs.get("prefill_chunk_size"), input_ids)
        if self._may_decode_static_kv(kwargs.get("static_kv", "auto"), kwargs.get("cuda_graph", "auto")):
            for dm in self.ranks:  # captured here for the same reason as the other programs
                dm.static_decode_program()
        return self.run(lambda dm: dm.generate(input_ids, attention_mask, **kwargs))[0]

    def release_cuda_graphs(self) -> None:
        """Free the ranks' decode graph (the next graphed ``generate`` captures it again)."""
        for dm in self.ranks:
            dm.release_cuda_graphs()

    def _may_decode_static_kv(self, static_kv, cuda_graph="auto") -> bool:
        """Whether ``generate(static_kv=...)`` may decode over static key/value buffers: asked
        for, or ``"auto"`` with the weights on CUDA and the step graphed
        (``DistributedModule._static_kv_length`` decides and checks the rest)."""
        from ..families import family_of

        if static_kv is False or not family_of(self.model).has_attention:
            return False
        return static_kv != "auto" or (next(self.model.parameters()).is_cuda and cuda_graph is not False)

    def _generation_programs(self, chunk_size, input_ids):
        """Capture and shard each rank's generation programs here, one rank after another (export
        is not thread-safe), before the rank threads run them."""
        for dm in self.ranks:
            dm.generation_programs()
            if chunk_size is not None and input_ids.shape[1] > chunk_size:
                dm.chunk_program()
