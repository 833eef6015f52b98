"""Op rules, registered by op category (the layout of ``torch.distributed.tensor._ops``).

A rule is a function ``rule(cx, node) -> placement`` called by ``propagate`` for a node with
at least one sharded or partial input. It reads its inputs' placements with
``cx.placement(arg)``, may ask for an input in another placement with
``cx.want(node, arg, placement)`` (``communicate`` then inserts the collective), may leave a
local rewrite for ``localize`` in ``node.meta["localize"]``, and returns the placement of the
output (a tuple for several outputs). A combination it cannot shard is
``context.fail(node, why)``: never a silent fallback to replication.

Categories: ``pointwise``, ``view`` (view/reshape/expand/transpose/slice/split/cat),
``linear`` (linear, matmul, embedding), ``reduction``, ``ssm`` (conv, scans, state updates,
gated norm), ``attention``, ``factory`` (allocations, in-place copies, sizes).
"""

from __future__ import annotations

from typing import Callable

RULES: dict = {}
# Ops linear in every input: a Partial input may stay Partial through them (see policy.py).
LINEAR_IN_PARTIALS: set = set()


def rule(*targets, linear: bool = False) -> Callable:
    """Register the decorated function as the rule of each op overload in ``targets``."""
    def decorator(fn):
        for target in targets:
            if target in RULES:
                raise ValueError(f"two rules for {target}: {RULES[target].__name__} and {fn.__name__}")
            RULES[target] = fn
            if linear:
                LINEAR_IN_PARTIALS.add(target)
        return fn

    return decorator


from . import attention, factory, linear, pointwise, reduction, ssm, view  # noqa: E402,F401  (register)
