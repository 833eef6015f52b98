"""Tensor-parallel sharding of a captured program, as three passes run per rank.

``propagate`` (placements on every node, by op rules registered per category in ``rules/``
and a swappable reduce ``policy``) -> ``localize`` (local sizes, rank-dependent constants)
-> ``communicate`` (the collectives the placements demand, named as sync points).
``Plan.pipeline`` builds the list with the plan's options; see docs/design.md.

The placements stay on the graph (``node.meta["placement"]``) for later passes and reports.
"""

from .check import check_placements
from .communicate import Collectives, SyncPoint, bytes_per_token, token_symbols
from .context import ShardingError, ShardOptions
from .policy import MegatronPolicy, ReducePolicy, SequenceParallelPolicy
from .propagate import output_placements
from . import localize  # noqa: F401  (registers the pass)

SHARDING_PASSES = ("propagate", "localize", "communicate")


def sharding_steps(options: dict) -> list:
    """The three passes with their shared options, as ``run_pipeline`` steps."""
    return [(name, options) for name in SHARDING_PASSES]


__all__ = ["check_placements", "Collectives", "MegatronPolicy", "ReducePolicy", "SHARDING_PASSES", "SequenceParallelPolicy",
           "ShardOptions", "ShardingError", "SyncPoint", "bytes_per_token", "output_placements", "sharding_steps", "token_symbols"]
