"""Human views of a Program: the per-layer summary table and the block-level graph."""

from __future__ import annotations

import collections

import networkx as nx

from .program import op_name


def _tags(node):
    return node.meta.get("ssmshard") or {}


def summary_table(program) -> str:
    """One row per (layer, block): the roles present and the op count."""
    rows: dict[tuple, dict] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        t = _tags(node)
        key = (t.get("layer"), t.get("block"), t.get("call_site", "").split(".")[0:3] and _site_root(t))
        row = rows.setdefault(key, {"roles": collections.Counter(), "ops": collections.Counter()})
        row["roles"][t.get("role")] += 1
        row["ops"][op_name(node)] += 1
    lines = [f"{program.family} {program.mode} program: {program.node_count()} ops, "
             f"{len(program.param_specs)} weights, {len(program.state_specs)} state tensors",
             f"{'layer':>5}  {'block':<9}  {'ops':>5}  {'call site':<34}  roles"]
    order = sorted(rows, key=lambda k: (-1 if k[0] is None else k[0], str(k[2]), str(k[1])))
    for layer, block, site in order:
        row = rows[(layer, block, site)]
        roles = ", ".join(r for r in sorted(row["roles"]) if r != "body")
        lines.append(f"{'-' if layer is None else layer:>5}  {block:<9}  {sum(row['ops'].values()):>5}  "
                     f"{site:<34}  {roles}")
    return "\n".join(lines)


def _site_root(tags) -> str:
    """The call site of the block a node belongs to (the module one level below the layer)."""
    site = tags.get("call_site", "")
    parts = site.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 3])
    return ".".join(parts[:2]) if site else "(model)"


def block_graph(program) -> nx.DiGraph:
    """Nodes are (call-site block root, block kind); edges follow data flow between blocks."""
    g = nx.DiGraph()

    def key(node):
        t = _tags(node)
        return (_site_root(t), t.get("block"))

    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        k = key(node)
        if k not in g:
            t = _tags(node)
            g.add_node(k, block=t.get("block"), layer=t.get("layer"), ops=0)
        g.nodes[k]["ops"] += 1
        for arg in node.all_input_nodes:
            if arg.op == "call_function":
                src = key(arg)
                if src != k:
                    g.add_edge(src, k)
    return g


def sharding_report(program, *, weights: bool = True) -> str:
    """Weights: placement and local shape; collectives: place, dtype and bytes per token.

    Bytes per token are each rank's operand (``passes/collectives.py``); ``weights=False``
    leaves out the weight table.
    """
    from .passes.collectives import total_bytes_per_token
    from .placement import local_shape

    shard = getattr(program, "shard", None)
    if shard is None:
        return "not sharded (run the shard pass, e.g. through ssmshard.parallelize)"
    lines = [f"rank {shard['rank']} of tp={shard['tp']}"]
    if weights:
        lines.append(f"{'weight':<58} {'placement':<36} local shape")
        for fqn, spec in program.param_specs.items():
            placement = spec.placement
            shape = local_shape(spec.shape, placement) if placement is not None else spec.shape
            lines.append(f"{fqn:<58} {str(placement):<36} {tuple(shape)}")
    rows = getattr(program, "collectives", [])
    lines.append(f"{len(rows)} collectives, {_bytes(total_bytes_per_token(rows))} bytes per token in all "
                 "(each rank's operand):")
    for r in rows:
        layer = "-" if r["layer"] is None else r["layer"]
        lines.append(f"  #{r['id']:<3} {r['op']:<10} layer {layer:<3} {r['block']:<9} after {r['role']:<10} "
                     f"{r['dtype']:<8} {_bytes(r['bytes_per_token']):>7} B/token")
    return "\n".join(lines)


def _bytes(count) -> str:
    return "unknown" if count is None or count != count else f"{count:,}"
