"""Worker functions for the multi-process (gloo) tensor-parallel tests.

Every rank builds the same model, shards it, and compares with Hugging Face eager run in the
same process. Rank 0 writes the measured errors to a JSON file the test reads.
"""

import json

import torch

import ssmshard
from ssmshard.passes.shard import ReducePolicy, check_placements
from ssmshard.placement import Partial, Replicate, Shard, local_slice
from ssmshard.testing import joint_rel_err, rel_err

from conftest import small_model


class ReduceScatterThenGather(ReducePolicy):
    """A test-supplied reduce policy: every partial sum reduced by reduce_scatter along its last
    dim followed by all_gather (padded when the dim does not divide), not all_reduce."""

    def lower(self, comm, value, have, want, consumer):
        if isinstance(have, Partial) and isinstance(want, Replicate):
            last = value.meta["val"].dim() - 1
            scattered = comm.reduce_scatter(value, last)
            return comm.gather(scattered, last, consumer, partial_grad=want.partial_grad,
                               length=value.meta["val"].shape[last])
        return comm.standard(value, have, want, consumer)


def forward_errors(rank, world, cases, seed, out_path):
    results = []
    for family, overrides, plan_kwargs in cases:
        model = small_model(family, **overrides)
        if plan_kwargs.get("policy") == "reduce_scatter_then_gather":
            plan_kwargs = {**plan_kwargs, "policy": ReduceScatterThenGather}
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, **plan_kwargs))
        gen = torch.Generator().manual_seed(seed)
        errors = []
        for batch, seq in ((1, 1), (3, 7), (2, 33)):
            ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
            with torch.no_grad():
                errors.append(rel_err(dm(ids), model(ids).logits))
        placed = [n for n in dm.program.graph.nodes if n.op == "call_function"]
        results.append({"family": family, "overrides": overrides, "plan": str(plan_kwargs), "err": max(errors),
                        "collectives": len(dm.program.collectives),
                        "collective_kinds": sorted({p.kind for p in dm.program.sync_points}),
                        "unplaced": [n.name for n in placed if "placement" not in n.meta],
                        "placement_problems": check_placements(dm.program)})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def gradient_errors(rank, world, cases, seed, out_path):
    """Each rank's gradients against the unsharded program's (1e-5) and against HF eager (1e-4).

    The unsharded captured program runs the same ops as the shards, so any difference from it
    is the sharding. HF eager differs by float32 rounding of another scan algorithm (its
    per-token loop), which reaches ~1e-5 on A_log-like gradients: that is checked separately.
    """
    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
        unsharded = ssmshard.capture(model)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=gen)
        # Always include rank 1's first vocabulary row: a padding_idx left global on a
        # vocab-sharded embedding drops exactly that row's gradient (Zamba pads with id 0).
        ids[0, 0] = model.config.vocab_size // world
        weights = torch.randn(2, 13, model.config.vocab_size, generator=gen)
        model.zero_grad(set_to_none=True)
        (model(ids).logits * weights).sum().backward()
        hf_grads = {k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}
        reference = {k: v.detach().clone().requires_grad_(True) for k, v in unsharded.weights.items()}
        unsharded.weights = reference
        (unsharded(ids) * weights).sum().backward()
        logits = dm(ids)
        (logits * weights).sum().backward()
        dm.sync_replicated_grads()
        # One relative error for the whole gradient (joint_rel_err says why), and per parameter
        # for the report.
        vs_unsharded, vs_hf, per_param = [], [], {}
        for fqn, spec in dm.program.param_specs.items():
            if spec.kind != "parameter":
                continue
            grad = dm.local_weight(fqn).grad
            if grad is None:
                raise AssertionError(f"{family}: no gradient reached {fqn} on rank {rank}")
            expected, from_hf = reference[fqn].grad, hf_grads[fqn]
            if isinstance(spec.placement, Shard):
                expected = local_slice(expected, spec.placement, rank)
                from_hf = local_slice(from_hf, spec.placement, rank)
            vs_unsharded.append((grad, expected))
            vs_hf.append((grad, from_hf))
            per_param[fqn] = rel_err(grad, expected)
        worst = max(per_param, key=per_param.get)
        results.append({"family": family, "overrides": overrides, "err": joint_rel_err(vs_unsharded),
                        "err_vs_hf": joint_rel_err(vs_hf),
                        "worst_param": worst, "worst_param_err": per_param[worst],
                        "logits_err": rel_err(logits, model(ids).logits)})
        model.zero_grad(set_to_none=True)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)



def packed_errors(rank, world, cases_path, out_path):
    """Packed batches through ``parallelize(..., packed=True)`` against the unsharded packed
    program's logits and gradients, which the test computed and saved to ``cases_path``
    (family -> PackedBatch fields, loss weights, logits, gradients). Checks the PackedBatch and
    keyword forms of ``forward``, each rank's gradient slices (over the whole gradient vector,
    as in gradient_errors), and that a module built without packing refuses the batch."""
    results = []
    for family, case in torch.load(cases_path).items():
        model = small_model(family)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), packed=True)
        batch = ssmshard.PackedBatch(case["input_ids"], case["cu_seqlens"], case["position_ids"])
        logits = dm(batch)
        (logits * case["loss_weights"]).sum().backward()
        dm.sync_replicated_grads()
        grad_pairs = []
        for fqn, spec in dm.packed_program.param_specs.items():
            if spec.kind != "parameter":
                continue
            grad, want = dm.local_weight(fqn).grad, case["grads"][fqn]
            if isinstance(spec.placement, Shard):
                want = local_slice(want, spec.placement, rank)
            grad_pairs.append((grad, want))
        with torch.no_grad():
            by_kwargs = dm(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)
        local = {k: dm.local_weight(k) for k in dm.program.param_specs}
        unpacked_only = ssmshard.DistributedModule(dm.program, local, dm.plan, rank)
        try:
            unpacked_only(batch)
            refused = False
        except ValueError as exc:
            refused = "packed=True" in str(exc)
        results.append({"family": family, "rank": rank, "logits_err": rel_err(logits, case["logits"]),
                        "kwargs_logits_err": rel_err(by_kwargs, case["logits"]), "grad_err": joint_rel_err(grad_pairs),
                        "collectives": len(dm.packed_program.collectives),
                        "refused_unpacked_module": refused})
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([r for rank_results in gathered for r in rank_results], f)
