"""The pass pipeline that turns a captured program into one rank's program.

``parallelize`` (every program of a DistributedModule) and ``ssmshard inspect --tp`` both build
it here, so what the command line reports is what the runtime runs.
"""

from __future__ import annotations

import logging
import time

from ..capture import STATEFUL_MODES
from ..passes import run_pipeline
from ..passes.manager import regenerate_code
from ..passes.shard import ShardingError
from ..placement import same_data

log = logging.getLogger(__name__)


def shard_program(program, model, plan, *, rank: int, group: str, kernels: str = "reference",
                  placements=None, prefill=None, sequence_sharded: bool = False):
    """``program`` rewritten into rank ``rank``'s program of ``plan`` (a :class:`~ssmshard.Plan`).

    The passes are ``plan.pipeline(...)``'s: the sharding passes (``propagate``, ``localize``,
    ``communicate``, with weights placed by ``plan.layout``, or ``placements`` when the caller
    computed them already, and the plan's reduce policy for this program's mode), then the
    plan's sync-point passes, then ``swap_kernels`` when ``kernels == "triton"``. ``group``: the
    name the collectives use (``register_group``).

    Decode and chunk programs take the states as prefill returns them: pass this rank's
    sharded ``prefill`` program; the result is checked to return every state as it takes it,
    so the state cache never crosses ranks. ``sequence_sharded``: a prefill program of a TSP plan
    as the ``tsp`` pass makes it (``Plan.pipeline``).
    """
    if placements is None:
        placements = plan.layout(program, model)
    states = input_placements = None
    if program.mode in STATEFUL_MODES:
        if prefill is None:
            raise ValueError(f"a {program.mode} program takes the states prefill returns: pass the sharded "
                             "prefill program as prefill=")
        states = prefill.shard["outputs"][1:]
        # After input_ids, attention_mask and position_ids come the states, in prefill's order.
        input_placements = {3 + i: p for i, p in enumerate(states)}
    steps = plan.pipeline(program.mode, placements=placements, rank=rank, group=group, kernels=kernels,
                          input_placements=input_placements, sequence_sharded=sequence_sharded)
    what = f"rank {rank} of tp={plan.tp}, {program.mode} program"
    log.info("%s: running %s", what, ", ".join(step if isinstance(step, str) else step[0] for step in steps))
    # One step at a time, so the log can say what each pass took, its verification included.
    times, shared = [], {}
    for step in steps:
        started = time.perf_counter()
        program = run_pipeline(program, [step], shared=shared, recompile=False)
        times.append(f"{program.history[-1]['pass']} {time.perf_counter() - started:.1f}s")
    regenerate_code(program)  # once, not after every pass that changed the graph
    log.info("%s: %s", what, ", ".join(times))
    if plan.head_permutations and program.shard is not None:  # applied to the weights on their way to the rank; recorded for reports
        program.shard["head_permutations"] = sorted(plan.head_permutations)
    program.compile = plan.compile
    if states is not None:
        for i, (given, back) in enumerate(zip(states, program.shard["outputs"][1:])):
            if not same_data(given, back):
                raise ShardingError(f"{program.mode} returns state {i} ({program.state_specs[i]}) as {back} "
                                    f"but takes it as {given}")
    return program

