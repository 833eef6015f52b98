"""``ssmshard inspect MODEL --tp N --html out.html``: the sharded program as one HTML page.

The page is one self-contained file (its script, style and data are inline; it loads nothing
from the network): per rank, the program's blocks row by row (one row per decoder layer),
each collective marked with its kind and bytes per token, each weight's placement, local
shape and held index ranges on hover, and a rank selector. It renders whatever
``program_data`` extracts from the nodes' tags, so passes that tag their nodes appear without
changes here.
"""

from __future__ import annotations

import copy
import html
import json
from importlib import resources

from .program_data import program_data

_ASSETS = resources.files(__package__)


def sharded_programs(program, model, plan, *, prefill=None) -> list:
    """Every rank's program of ``plan`` on the meta device: no process group, no weights.

    Built as the runtime builds them (``runtime.pipeline.shard_program``), from a copy of
    ``program`` per rank (the passes rewrite the graph in place; the copy's tags are copied
    too, since a graph copy shares its nodes' meta dicts). Decode and chunk programs need the
    unsharded ``prefill`` program (each rank's states are placed as its prefill returns them).
    """
    from ..runtime.pipeline import shard_program

    placements = plan.layout(program, model)  # PlanError before any work
    programs = []
    for rank in range(plan.tp):
        rank_prefill = None
        if prefill is not None:
            rank_prefill = shard_program(_copy(prefill), model, plan, rank=rank, group="inspect")
        programs.append(shard_program(_copy(program), model, plan, rank=rank, group="inspect",
                                      placements=placements, prefill=rank_prefill))
    return programs


def _copy(program):
    local = copy.deepcopy(program)
    for node in local.graph.nodes:
        for key in ("ssmshard", "localize"):
            if key in node.meta:
                node.meta[key] = copy.copy(node.meta[key])
    return local


def render_html(programs, *, title: str | None = None) -> str:
    """The page for ``programs``: one per rank, in rank order (one unsharded program works too)."""
    ranks = [program_data(p) for p in programs]
    first = ranks[0]
    title = title or f"{first['family']} {first['mode']} program, tp={first['tp']}"
    # "</" inside a <script> element would end it early; JSON allows "<\/".
    data = json.dumps({"title": title, "ranks": ranks}, separators=(",", ":")).replace("</", "<\\/")
    page = (_ASSETS / "page.html").read_text(encoding="utf-8")
    return (page.replace("{{title}}", html.escape(title))
                .replace("{{style}}", (_ASSETS / "page.css").read_text(encoding="utf-8"))
                .replace("{{script}}", (_ASSETS / "page.js").read_text(encoding="utf-8"))
                .replace("{{data}}", data))


def write_html(path, programs, *, title: str | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(programs, title=title))
