"""Human views of a Program: the per-layer summary table and the block-level graph."""

from __future__ import annotations

import collections

import networkx as nx
import torch

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


def sharding_report(program, *, weights: bool = True, activations: bool = False) -> str:
    """Weights: placement and local shape; sync points: kind, place, dtype, bytes per token and
    what sync-point passes made of them (kept, dropped, quantized); with ``activations``, every
    op's placement and local shape.

    Bytes per token are each rank's operand (``passes/shard/communicate.py``); ``weights=False``
    leaves out the weight table.
    """
    from .placement import local_shape

    shard = getattr(program, "shard", None)
    if shard is None:
        return "not sharded (run the sharding passes, e.g. through ssmshard.parallelize)"
    lines = [f"rank {shard['rank']} of tp={shard['tp']} ({shard.get('policy', 'MegatronPolicy')})"]
    if program.compile:
        compiled = program.compilations
        lines.append(f"compiled (Plan(compile=True)): {len(compiled)} compilations so far, "
                     f"{sum(c['seconds'] for c in compiled):.1f}s"
                     + "".join(f"; {c['shapes'][:1]} {c['seconds']:.1f}s" for c in compiled))
    if weights:
        lines.append(f"{'weight':<58} {'placement':<36} local shape")
        for fqn, spec in program.param_specs.items():
            placement = spec.placement
            shape = local_shape(spec.shape, placement) if placement is not None else spec.shape
            lines.append(f"{fqn:<58} {str(placement):<36} {tuple(shape)}")
    points = program.sync_points
    kept = [p for p in points if p.action != "dropped"]
    lines.append(f"{len(points)} sync points, {_bytes(_total(kept))} bytes per token in all "
                 f"(each rank's operand){_actions(points)}:")
    lines.append(_totals(points))
    permuted = set(shard.get("head_permutations", ()))  # sync points whose block's heads the plan re-orders
    for i, p in enumerate(points):
        layer = "-" if p.layer is None else p.layer
        notes = ([] if p.action == "kept" else [p.action]) + (["heads permuted"] if p.name in permuted else [])
        lines.append(f"  #{i:<3} {p.kind:<14} layer {layer:<3} {p.block:<9} after {p.role:<10} "
                     f"{p.dtype:<8} {_bytes(p.bytes_per_token):>7} B/token  {p.name}"
                     + (f"  [{', '.join(notes)}]" if notes else ""))
    if activations:
        program.require_values("the report of every op's local shape")
        lines.append(f"{'node':<40} {'op':<28} {'layer':>5} {'block':<9} {'role':<12} {'placement':<24} local shape")
        for node in program.graph.nodes:
            if node.op != "call_function" or "placement" not in node.meta:
                continue
            tags = node.meta.get("ssmshard", {})
            layer = "-" if tags.get("layer") is None else tags["layer"]
            val = node.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
            placement = node.meta["placement"]
            shown = ",".join(map(str, placement)) if isinstance(placement, tuple) else str(placement)
            lines.append(f"{node.name:<40} {op_name(node):<28} {layer:>5} {tags.get('block', ''):<9} "
                         f"{tags.get('role', ''):<12} {shown:<24} {shape}")
    return "\n".join(lines)


def _totals(points) -> str:
    """Bytes per token each action leaves on the wire, and per decode step (one token a sequence)."""
    by_action = {a: _total([p for p in points if p.action == a]) for a in ("kept", "quantized", "dropped")}
    sent = _total([p for p in points if p.action != "dropped"])
    return (f"  per token: {_bytes(by_action['kept'])} B kept, {_bytes(by_action['quantized'])} B quantized "
            f"(its operand, before quantization), {_bytes(by_action['dropped'])} B "
            f"dropped; a decode step of batch b syncs b x {_bytes(sent)} B in {sum(p.action != 'dropped' for p in points)}"
            " collectives")


def _total(points):
    sizes = [p.bytes_per_token for p in points]
    return float("nan") if None in sizes else sum(sizes)


def _actions(points) -> str:
    counts = collections.Counter(p.action for p in points)
    return "" if set(counts) <= {"kept"} else " (" + ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) + ")"


def _bytes(count) -> str:
    return "unknown" if count is None or count != count else f"{count:,}"
