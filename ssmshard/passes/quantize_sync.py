"""The ``quantize_sync`` pass: run chosen all-reduce sync points as quantized all-reduces.

Runs after ``communicate`` (it reads ``program.sync_points``). Each chosen sync point's
``ssmshard.all_reduce`` node becomes ``ssmshard.quantized_all_reduce`` (block-scaled int8 or
fp8-e4m3, two-shot; ``ssmshard.comm.quantized``, docs/quantized_sync.md) with the same input,
group, placement and tags; its ``SyncPoint.action`` becomes ``"quantized"`` and its node tags
and report row say so and name the format.

Options (``Plan(quantize_syncs=..., quantize_min_bytes=..., quantize_block=...)`` builds them):

* ``syncs``: ``"int8"`` or ``"fp8"`` (the same as ``{"*": format}``), or ``{glob: format}``
  over sync point names (``"layers.*.out_proj"``); where several globs match a name the last
  wins, and a format of ``None`` keeps that sync point exact.
* ``min_bytes``: calls whose message (the partial sum's bytes) is smaller run the exact
  all-reduce. The op decides per call, not this pass per program: one forward graph serves
  one token and a long prompt alike (symbolic shapes), and decode's messages are small, so
  decode syncs stay exact by default.
* ``block``: values per scale (32, 64 or 128).

What a glob selects: the all-reduce sync points it matches, except statistics. A glob with
wildcards passes over all-gathers (they concatenate, they do not sum) and statistic syncs
(``gate_norm``: one sum of squares per token and group, feeding a reciprocal square root;
block scaling rounds a token's small sum far off, while the message is too small to gain);
an exact name may select a statistic sync.

Errors (``PlanError``, before any collective runs): an unknown format or block; a glob of the
dict form that selects no sync point (the names are listed); an exact name of an all-gather;
and a reduce-scatter (sequence parallelism) matched by any glob, which would need a quantized
reduce-scatter: it would otherwise stay exact although it was asked to be quantized.
"""

from __future__ import annotations

import fnmatch

import torch

from ..comm.quantized import check_format
from ..plan import PlanError
from .manager import register

ssm = torch.ops.ssmshard
EXACT = None  # a format that keeps a sync point exact, in the dict form


def normalize_choice(syncs, block: int = 64, min_bytes: int = 0) -> dict:
    """``syncs`` as ``{glob: format or None}``; PlanError on an unknown format, block or threshold."""
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise PlanError(f"quantize_min_bytes must be a non-negative number of bytes, not {min_bytes!r}")
    choice = {"*": syncs} if isinstance(syncs, str) else syncs
    if not isinstance(choice, dict) or not all(isinstance(k, str) for k in choice):
        raise PlanError(f"quantize_syncs must be 'int8', 'fp8' or a dict {{glob over sync point names: format}}, "
                        f"not {syncs!r}")
    for glob, fmt in choice.items():
        try:
            if fmt is not EXACT:
                check_format(fmt, block)
        except ValueError as exc:
            raise PlanError(f"quantize_syncs[{glob!r}]: {exc}") from None
    return dict(choice)


def choose(sync_points, syncs, block: int = 64, where: str = "program") -> dict[str, str]:
    """``{sync point name: format}`` of the sync points ``syncs`` quantizes (module docstring)."""
    choice = normalize_choice(syncs, block)
    implicit = isinstance(syncs, str)
    label = (lambda glob: f"quantize_syncs={syncs!r}") if implicit else (lambda glob: f"quantize_syncs[{glob!r}]")
    chosen: dict[str, str] = {}
    for glob, fmt in choice.items():
        exact_name = not any(c in glob for c in "*?[")
        matched = [p for p in sync_points if fnmatch.fnmatchcase(p.name, glob) and p.action != "dropped"]
        selected = [p for p in matched if fmt is EXACT or _selectable(p, exact_name, label(glob))]
        if not selected and not implicit:
            passed = f" (it matches only {_listed([f'{p.name} ({_kind(p)})' for p in matched])})" if matched else ""
            raise PlanError(f"{label(glob)} selects no all-reduce sync point of this {where}{passed}; its sync "
                            f"points are {_listed([p.name for p in sync_points])}")
        for point in selected:
            if fmt is EXACT:
                chosen.pop(point.name, None)
            else:
                chosen[point.name] = fmt
    return chosen


STATISTIC_ROLES = ("gate_norm",)


def _kind(point) -> str:
    return "a statistic" if point.kind == "all_reduce" and point.role in STATISTIC_ROLES else f"an {point.kind}"


def _selectable(point, exact_name: bool, label: str) -> bool:
    """Whether a glob that matches ``point`` quantizes it; PlanError where it cannot and must."""
    if point.kind == "all_gather":
        if exact_name:
            raise PlanError(f"{label} selects sync point {point.name!r}, which is an all_gather: it concatenates "
                            "shards, it does not sum partials; leave it out")
        return False
    if point.kind != "all_reduce":
        raise PlanError(f"{label} selects sync point {point.name!r}, which is a {point.kind} (sequence "
                        "parallelism), and only all-reduce sync points can be quantized: use "
                        f"Plan(sequence_parallel=False) to quantize it, or map {point.name!r} to None")
    return exact_name or point.role not in STATISTIC_ROLES


def _listed(names, limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return (shown + f", ... ({len(names)} in all)") if len(names) > limit else (shown or "none")


@register("quantize_sync")
def quantize_sync(program, ctx):
    """Retarget the chosen all-reduce sync points to the quantized all-reduce."""
    options = ctx.options
    block, min_bytes = options.get("block", 64), options.get("min_bytes", 0)
    normalize_choice(options["syncs"], block, min_bytes)
    chosen = choose(program.sync_points, options["syncs"], block, where=f"{program.mode} program")
    nodes = {node.name: node for node in program.graph.nodes}
    for point in program.sync_points:
        fmt = chosen.get(point.name)
        if fmt is None:
            continue
        node = nodes[point.node]
        if node.target is not ssm.all_reduce.default:
            raise PlanError(f"sync point {point.name!r} is no longer an all_reduce node ({node.target}); "
                            "run quantize_sync right after communicate")
        value, group = node.args
        node.target = ssm.quantized_all_reduce.default
        node.args = (value, group, fmt, block, min_bytes, point.name)
        point.action = "quantized"
        node.meta["ssmshard"].update(sync_action="quantized", quantized=fmt)
    for row in getattr(program, "collectives", []):
        if row.get("name") in chosen:
            row.update(action="quantized", quantized=chosen[row["name"]])
    program.quantized_syncs = chosen
    return program
