"""``check_placements``: are the placements a sharded program carries consistent with its ops?

After ``communicate`` every edge must agree: each op reads its inputs in the placements it
recorded as needed (``input_placements``), each collective turns exactly the placement it
consumes into the one it produces, and every tensor-valued node carries a placement. A pass
that rewires a sharded graph (sync-point drop, quantized syncs) can run this to prove it kept
the data flow consistent.
"""

from __future__ import annotations

import torch

from ...placement import Partial, Replicate, SeqShard, Shard, same_data
from .context import is_tensor, placement_of

ssm = torch.ops.ssmshard


def _collective_contract(node):
    """(what it consumes, what it produces) as predicates, or None for a non-collective."""
    both = {
        ssm.all_reduce.default: (Partial, Replicate),
        ssm.reduce_scatter.default: (Partial, SeqShard),
        ssm.split.default: (Replicate, SeqShard),
        ssm.all_gather.default: ((Shard, SeqShard), Replicate),
        ssm.all_gather_partial_grad.default: ((Shard, SeqShard), Replicate),
        ssm.tp_copy.default: (Replicate, Replicate),
    }
    return both.get(node.target)


def check_placements(program) -> list[str]:
    """Every inconsistency found, as readable lines (empty: consistent)."""
    problems = []
    for node in program.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        if node.op == "call_function" and is_tensor(node) and "placement" not in node.meta:
            problems.append(f"{node.name} ({node.target}) has no placement")
            continue
        contract = _collective_contract(node)
        if contract is not None:
            source, produced = placement_of(node.args[0]), node.meta["placement"]
            if not isinstance(source, contract[0]) or not isinstance(produced, contract[1]):
                problems.append(f"{node.name}: {node.target} turns {source} into {produced}")
            continue
        needed = node.meta.get("input_placements", {})
        for arg in node.all_input_nodes:
            if not is_tensor(arg) or arg.name not in needed:
                continue
            have, want = placement_of(arg), needed[arg.name]
            if not same_data(have, want):
                problems.append(f"{node.name} reads {arg.name} as {want} but it is {have}")
    return problems
