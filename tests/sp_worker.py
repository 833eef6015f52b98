"""Worker for tests/test_sequence_parallel.py: each rank runs every family with
``Plan(tp=N)`` and ``Plan(tp=N, sequence_parallel=True)`` and records logits errors against HF
eager, gradient differences between the two plans, and residual-stream activation bytes."""

import json

import torch
import torch.fx

import ssmshard
from ssmshard.placement import SeqShard
from ssmshard.testing import joint_rel_err, rel_err

from conftest import small_model


class _ResidualBytes(torch.fx.Interpreter):
    """Runs a program's graph and adds up the bytes of every residual add's output."""

    def __init__(self, gm):
        super().__init__(gm)
        self.bytes = 0
        self.seq_sharded = 0

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and n.meta.get("ssmshard", {}).get("role") == "residual_add":
            self.bytes += out.numel() * out.element_size()
            self.seq_sharded += isinstance(n.meta.get("placement"), SeqShard)
        return out


def residual_bytes(dm, ids):
    program = dm.program
    interpreter = _ResidualBytes(program.graph_module)
    with torch.no_grad():
        interpreter.run(*program.weight_args(), ids)
    return interpreter.bytes, interpreter.seq_sharded


def logits_errors(dm, model, lengths, gen):
    """Relative error of ``dm``'s logits against HF eager's on a random batch of 2 at each length."""
    errors = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (2, length), generator=gen)
        with torch.no_grad():
            errors.append(rel_err(dm(ids), model(ids).logits))
    return errors


def sequence_parallel_results(rank, world, cases, lengths, seed, out_path):
    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        tp = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
        sp = ssmshard.parallelize(model, ssmshard.Plan(tp=world, sequence_parallel=True))
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        errors = logits_errors(sp, model, lengths, gen)
        # Gradients: the same loss through both plans; every rank's local gradients must agree.
        ids = torch.randint(0, vocab, (2, lengths[-1]), generator=gen)
        weights = torch.randn(2, lengths[-1], vocab, generator=gen)
        for dm in (tp, sp):
            (dm(ids) * weights).sum().backward()
            dm.sync_replicated_grads()
        grad_err = joint_rel_err((sp.local_weight(fqn).grad, tp.local_weight(fqn).grad)
                                 for fqn, spec in tp.program.param_specs.items() if spec.kind == "parameter")
        even = torch.randint(0, vocab, (2, 4 * world), generator=gen)
        tp_bytes, _ = residual_bytes(tp, even)
        sp_bytes, sharded_adds = residual_bytes(sp, even)
        results.append({"family": family, "overrides": overrides, "logits_err": max(errors),
                        "grad_err": grad_err, "tp_residual_bytes": tp_bytes, "sp_residual_bytes": sp_bytes,
                        "sharded_adds": sharded_adds,
                        "sync_kinds": sorted({p.kind for p in sp.program.sync_points})})
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
