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


def sharded_programs(program, model, plan) -> list:
    """Every rank's program of ``plan`` on the meta device: no process group, no weights.

    ``program`` is copied for each rank (the ``shard`` pass rewrites the graph in place), and
    the copy's tags are copied too, since a graph copy shares its nodes' meta dicts.
    """
    from ..passes import run_pipeline
    from ..passes.shard import sharding_steps

    placements = plan.layout(program, model)  # PlanError before any work
    programs = []
    for rank in range(plan.tp):
        local = copy.deepcopy(program)
        for node in local.graph.nodes:
            if "ssmshard" in node.meta:
                node.meta["ssmshard"] = dict(node.meta["ssmshard"])
        options = {"placements": placements, "rank": rank, "tp": plan.tp, "group": "inspect", "training": False}
        programs.append(run_pipeline(local, sharding_steps(options)))
    return programs


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
