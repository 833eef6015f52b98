"""``parallelize(model, plan)``: this rank's executable module of a tensor-parallel model."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..capture import capture
from ..packing import PackedBatch
from ..collectives import all_reduce, register_group
from ..passes import run_pipeline
from ..placement import Shard, local_slice
from ..plan import Plan, PlanError

_group_ids = itertools.count()


class DistributedModule(torch.nn.Module):
    """One rank's part of the model: local weight shards (as parameters) and the local program.

    ``forward(input_ids)`` returns the full logits on every rank and is differentiable: each
    local parameter's ``.grad`` is this rank's slice of the unsharded model's gradient.
    Built with ``parallelize(..., packed=True)`` it also runs packed batches: ``forward`` of a
    :class:`~ssmshard.packing.PackedBatch` (or ``input_ids`` (1, T) with ``cu_seqlens=``)
    returns (1, T, vocab) logits, every sequence computed on its own.
    """

    def __init__(self, program, weights: dict[str, torch.Tensor], plan: Plan, rank: int,
                 packed_program=None):
        super().__init__()
        self.program = program
        self.packed_program = packed_program  # sharded like ``program``, over the same local weights
        self.plan = plan
        self.rank = rank
        self._names = {}
        for index, (fqn, tensor) in enumerate(weights.items()):
            name = f"w{index}"
            self._names[fqn] = name
            if program.param_specs[fqn].kind == "parameter":
                self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad))
            else:
                self.register_buffer(name, tensor, persistent=False)
        local = {fqn: getattr(self, name) for fqn, name in self._names.items()}
        program.bind(local)
        if packed_program is not None:
            missing = sorted(set(packed_program.param_specs) - set(local))
            if missing:
                raise RuntimeError(f"the packed program reads weights the forward program does not: {missing[:3]}")
            packed_program.bind(local)

    def local_weight(self, fqn: str) -> torch.Tensor:
        return getattr(self, self._names[fqn])

    @torch.no_grad()
    def sync_replicated_grads(self) -> None:
        """Sum the gradients of weight rows that several ranks share (call after backward).

        Mamba-2's B/C rows when n_groups < tp, and key/value heads when n_kv_heads < tp, are
        held by tp / pieces ranks each: each rank's gradient for them is a partial sum over its
        own heads (the shard pass deliberately puts no ``tp_copy`` on them, so the gradient
        reaching the shared input is not counted once per rank). Each such segment is placed at
        its chunk's offset in a zero buffer of the full segment and all-reduced, so ranks
        holding the same chunk add up and nothing else mixes in.
        """
        group = self.program.shard["group"]
        for fqn, name in self._names.items():
            placement = self.program.param_specs[fqn].placement
            param = getattr(self, name)
            if not isinstance(placement, Shard) or param.grad is None:
                continue
            start = 0
            for seg in placement.segments:
                if seg.pieces < self.plan.tp:
                    local = param.grad.narrow(placement.dim, start, seg.local)
                    shape = list(local.shape)
                    shape[placement.dim] = seg.size
                    full = local.new_zeros(shape)
                    full.narrow(placement.dim, seg.offset(self.rank), seg.local).copy_(local)
                    full = all_reduce(full, group)
                    local.copy_(full.narrow(placement.dim, seg.offset(self.rank), seg.local))
                start += seg.local

    def forward(self, input_ids, *, cu_seqlens=None, position_ids=None):
        program = self.program
        if isinstance(input_ids, PackedBatch) or cu_seqlens is not None:
            if self.packed_program is None:
                raise ValueError("this DistributedModule was built without packing and would run packed "
                                 "sequences as one: use ssmshard.parallelize(model, plan, packed=True)")
            program = self.packed_program
        # Re-bind so parameters replaced by .to()/load_state_dict are the ones used.
        program.weights = {fqn: getattr(self, name) for fqn, name in self._names.items()}
        return program(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids)


def parallelize(model, plan: Plan, *, group=None, device_mesh=None, packed: bool = False) -> DistributedModule:
    """Shard ``model`` for this process's rank of ``group`` (default: the world).

    The plan is validated against the model before any collective call: an impossible split
    raises :class:`~ssmshard.plan.PlanError` in every process at once. ``packed=True`` also
    captures and shards the packed forward program, so ``forward`` accepts packed batches.
    """
    program = capture(model, mode="forward")
    # Captured before any process-group work too: a model packing cannot serve fails here.
    packed_program = capture(model, mode="forward", packed=True) if packed else None
    placements = plan.layout(program, model)  # PlanError here, before any process-group work
    if device_mesh is not None:
        group = device_mesh.get_group()
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs an initialised process group: run under torchrun or "
                           "ssmshard.launch (or call torch.distributed.init_process_group)")
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.tp:
        raise PlanError(f"Plan(tp={plan.tp}) but the process group has {world} ranks; set tp={world}")
    name = f"ssmshard_tp{next(_group_ids)}"
    register_group(name, group)
    options = {"placements": placements, "rank": rank, "tp": plan.tp, "group": name, "training": plan.training}
    program = run_pipeline(program, [("shard", options), "collectives"])
    if packed_program is not None:
        # The same placements: both programs read one set of local weights.
        packed_program = run_pipeline(packed_program, [("shard", dict(options)), "collectives"])
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    weights = {}
    for fqn, spec in program.param_specs.items():
        full = named.get(fqn, program.constants.get(fqn))
        placement = placements.get(fqn)
        local = local_slice(full.detach(), placement, rank) if isinstance(placement, Shard) else full.detach()
        weights[fqn] = local.clone().requires_grad_(spec.kind == "parameter" and full.requires_grad)
    return DistributedModule(program, weights, plan, rank, packed_program)
