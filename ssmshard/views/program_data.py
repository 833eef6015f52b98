"""A rank's program as plain data (JSON-ready) for views: blocks per layer, weights, collectives.

Everything here is read from what the passes leave on the graph, not from a list of known
passes, so that a later pass shows up in every view as soon as it tags its nodes:

* a node's ``meta["ssmshard"]`` tags: the five every node carries (module, call_site, layer,
  block, role) place it in a block; any other tag (``sync_id``, or what a sync-point pass adds)
  is listed with the node and summarised on its block;
* a node tagged with ``sync`` is a collective: its kind is the tag's value, its cost the
  ``bytes_per_token`` tag;
* a node's ``meta["placement"]``, when a pass records one, is shown with the node;
* a weight's placement is its ``ParamSpec.placement`` (set by the ``shard`` pass).

A block is the set of nodes sharing (layer, call-site root, block kind): the rows of
``program.summary()``.
"""

from __future__ import annotations

from ..inspect import _site_root
from ..placement import Shard, local_ranges, local_shape
from ..program import op_name

# Tags every node carries (passes/manager.REQUIRED_TAGS) and the collective accounting tags:
# shown in their own places, not among a node's extra tags.
_PLACED_TAGS = {"module", "call_site", "layer", "block", "role", "sync", "bytes_per_token"}


def _tags(node) -> dict:
    return node.meta.get("ssmshard") or {}


def _text(value) -> str:
    return value if isinstance(value, str) else str(value)


def _block_key(tags) -> tuple:
    return (tags.get("layer"), _site_root(tags), tags.get("block") or "?")


def _held(placement, rank: int) -> str:
    """Which global index ranges this rank holds, e.g. ``dim 0: 0:64, 128:192``."""
    if not isinstance(placement, Shard):
        return "all of it" if placement is not None else "unsharded program"
    ranges = ", ".join(f"{start}:{start + length}" for start, length in local_ranges(placement, rank))
    return f"dim {placement.dim}: {ranges}"


def _weight_users(program) -> dict:
    """Weight FQN -> the block keys of the nodes that read it (graph order, no repeats)."""
    fqn_of = {spec.name: spec.target for spec in program.inputs if spec.kind != "user"}
    users = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in fqn_of:
            keys = []
            for user in node.users:
                key = _block_key(_tags(user))
                if user.op == "call_function" and key not in keys:
                    keys.append(key)
            users[fqn_of[node.name]] = keys
    return users


def _short_name(fqn: str, site: str) -> str:
    """``fqn`` relative to the block's call site; a shared block's weights are stored under one
    of the layers that call it, so layer numbers may differ (``layers.3...`` in ``layers.1``)."""
    site_parts, parts = site.split("."), fqn.split(".")
    same = len(parts) > len(site_parts) and all(
        a == b or (a.isdigit() and b.isdigit()) for a, b in zip(site_parts, parts))
    return ".".join(parts[len(site_parts):]) if same else fqn


def _weight_row(spec, rank: int, site: str) -> dict:
    placement = spec.placement
    shape = local_shape(spec.shape, placement) if placement is not None else spec.shape
    return {"name": _short_name(spec.fqn, site), "fqn": spec.fqn,
            "placement": "-" if placement is None else str(placement), "shape": list(spec.shape),
            "local_shape": list(shape), "held": _held(placement, rank),
            "dtype": _text(spec.dtype).replace("torch.", "")}


def _node_row(node) -> dict:
    tags = _tags(node)
    row = {"name": node.name, "op": op_name(node), "role": tags.get("role", ""),
           "extra": {k: _text(v) for k, v in tags.items() if k not in _PLACED_TAGS}}
    if node.meta.get("placement") is not None:
        row["placement"] = _text(node.meta["placement"])
    if "sync" in tags:
        val = node.args[0].meta.get("val") if node.args and hasattr(node.args[0], "meta") else None
        row.update(sync=_text(tags["sync"]), bytes_per_token=tags.get("bytes_per_token"),
                   dtype=_text(val.dtype).replace("torch.", "") if val is not None else "")
    return row


def program_data(program) -> dict:
    """One rank's program: rows of blocks (before the layers, one per layer, after them)."""
    shard = getattr(program, "shard", None) or {}
    rank, tp = shard.get("rank", 0), shard.get("tp", 1)
    blocks: dict[tuple, dict] = {}
    layered_seen = False
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        tags = _tags(node)
        key = _block_key(tags)
        layered_seen = layered_seen or key[0] is not None
        block = blocks.get(key)
        if block is None:
            position = "layer" if key[0] is not None else ("after" if layered_seen else "before")
            block = blocks[key] = {"layer": key[0], "site": key[1], "kind": key[2], "position": position,
                                   "roles": [], "nodes": [], "collectives": [], "weights": [], "tags": {}}
        row = _node_row(node)
        block["nodes"].append(row)
        if row["role"] and row["role"] != "body" and row["role"] not in block["roles"]:
            block["roles"].append(row["role"])
        if "sync" in row:
            block["collectives"].append(row)
        for name, value in row["extra"].items():
            values = block["tags"].setdefault(name, [])
            if value not in values:
                values.append(value)
    for fqn, keys in _weight_users(program).items():
        for key in keys:
            if key in blocks:
                blocks[key]["weights"].append(_weight_row(program.param_specs[fqn], rank, key[1]))
    return {"rank": rank, "tp": tp, "family": program.family, "mode": program.mode,
            "rows": _rows(list(blocks.values())),
            "collectives": sum(len(b["collectives"]) for b in blocks.values()),
            "bytes_per_token": sum(c["bytes_per_token"] or 0 for b in blocks.values() for c in b["collectives"])}


def _rows(blocks: list[dict]) -> list[dict]:
    """Blocks grouped into display rows, in graph order within each row."""
    rows: dict[tuple, dict] = {}
    for block in blocks:
        if block["position"] == "layer":
            key, label = (1, block["layer"]), f"layer {block['layer']}"
        else:
            key = (0, 0) if block["position"] == "before" else (2, 0)
            label = "before the layers" if block["position"] == "before" else "after the layers"
        rows.setdefault(key, {"label": label, "layer": block["layer"], "blocks": []})["blocks"].append(block)
    return [rows[k] for k in sorted(rows)]
