"""A user-written pass: fold every RMSNorm subgraph into one ``aten.rms_norm`` node.

torch.export records Hugging Face's RMSNorm as ~10 ATen ops (casts, dtype asserts, pow,
mean, add eps, rsqrt, two muls). A pass that wants to swap in a fused norm kernel, or a
sharding rule that wants to see "a norm", is simpler with one node per norm. The pass
selects the norms by their tags (``block == "norm"``, grouped by ``call_site``) rather than
by matching op patterns, checks that each group really is the plain RMSNorm it expects,
and skips (with a message) anything else.

The node it creates gets the tags of the node it replaces: the verifier that runs after
every pass refuses a graph with untagged nodes.

Run:  python examples/user_pass.py [family]      (default: mamba2)
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

import ssmshard
from ssmshard.program import op_name
from ssmshard.testing import randomize_weights, rel_err

# The ops HF's RMSNorm lowers to; anything else in a norm group means it is not a plain RMSNorm.
RMS_NORM_OPS = {"_assert_tensor_metadata", "to", "pow", "mean", "add", "rsqrt", "mul"}


def _external_inputs(nodes):
    """Values the group reads from outside (dtype asserts only check, so they do not count)."""
    inside = set(nodes)
    seen = []
    for node in nodes:
        if op_name(node) == "_assert_tensor_metadata":
            continue
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in seen:
                seen.append(arg)
    return seen


def _external_outputs(nodes):
    inside = set(nodes)
    return [n for n in nodes if any(user not in inside for user in n.users)]


def _without_shared_casts(nodes):
    """Drop from the group an entry cast that the rest of the graph also reads.

    RMSNorm starts with ``x.to(float32)``; on a float32 model that cast returns ``x`` itself, so
    export hands the same value to the residual stream. It stays in the graph and becomes the
    norm's input.
    """
    outputs = _external_outputs(nodes)
    shared = {n for n in outputs[:-1] if op_name(n) == "to"}
    return [n for n in nodes if n not in shared]


@ssmshard.passes.register("fuse_rms_norm")
def fuse_rms_norm(program, ctx):
    graph = program.graph
    weight_names = {i.name for i in program.inputs if i.kind != "user"}
    groups = defaultdict(list)  # call site -> its nodes, in graph order
    for node in graph.nodes:
        tags = node.meta.get("ssmshard", {})
        if node.op == "call_function" and tags.get("block") == "norm":
            groups[tags["call_site"]].append(node)

    fused = []
    for call_site, group in groups.items():
        nodes = _without_shared_casts(group)
        inputs, outputs = _external_inputs(nodes), _external_outputs(nodes)
        weights = [n for n in inputs if n.op == "placeholder" and n.name in weight_names]
        others = [n for n in inputs if n not in weights]
        eps = [n.args[1] for n in nodes if op_name(n) == "add" and isinstance(n.args[1], float)]
        if ({op_name(n) for n in nodes} - RMS_NORM_OPS or len(outputs) != 1 or len(weights) != 1
                or len(others) != 1 or len(eps) != 1):
            print(f"  fuse_rms_norm: {call_site} is not a plain RMSNorm; left as is")
            continue
        (x,), (weight,), (out,) = others, weights, outputs
        with graph.inserting_before(out):
            norm = graph.call_function(torch.ops.aten.rms_norm.default,
                                       (x, [weight.meta["val"].shape[-1]], weight, eps[0]))
        # Keep the replaced node's provenance: its tags (required) and its source location.
        norm.meta["ssmshard"] = dict(out.meta["ssmshard"])
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in out.meta:
                norm.meta[key] = out.meta[key]
        out.replace_all_uses_with(norm)
        for node in reversed(nodes):  # users before producers
            graph.erase_node(node)
        fused.append((call_site, norm))

    ctx.shared["fused_norms"] = [site for site, _ in fused]
    print(f"  fuse_rms_norm: folded {len(fused)} norms into aten.rms_norm")
    return program


def main(family: str = "mamba2") -> int:
    model = randomize_weights(ssmshard.build_small_model(family), seed=0)
    program = ssmshard.capture(model, mode="forward")
    before = program.node_count()

    program = ssmshard.passes.run_pipeline(program, ["fuse_rms_norm"])
    print(f"{program.family} forward program: {before} -> {program.node_count()} ops")
    for record in program.history:
        print(f"  pass {record['pass']:<14} op diff: {record['op_diff'] or 'none'}")
    for node in program.graph.nodes:
        if node.target is torch.ops.aten.rms_norm.default:
            print(f"  {node.name:<12} tags {node.meta['ssmshard']}")

    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = rel_err(program(ids), model(ids).logits)
    tolerance = 1e-5
    ok = err <= tolerance
    print(f"{'OK' if ok else 'FAILED'}: rewritten program vs HF eager, max rel err {err:.1e} "
          f"(tolerance {tolerance:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    sys.exit(main(*sys.argv[1:]))
