"""Compiled rank programs (``Plan(compile=True)``): a program's graph run through ``torch.compile``.

The graph a rank runs is already whole (one FX graph per program, collectives included), so
Dynamo has nothing to discover: it re-traces the graph module's code, and Inductor fuses the
elementwise glue between the matmuls (casts, transposes, gating, discretisation, residual adds)
into generated kernels. The SSM kernels, the fused norms and the collectives stay single opaque
ops (``passes/kernel_ops.py``, ``comm/ops.py``): their fakes declare the layouts they return.

A program compiles on its first call; a later call with other shapes compiles once more with
those sizes symbolic (Dynamo's automatic dynamic shapes), then every length reuses it. The
CUDA-graph decode runner warms its step up before capture, so the compile happens there and the
graph replays the compiled kernels. Inductor caches what it generates on disk
(``TORCHINDUCTOR_CACHE_DIR``; by default under the system's temporary directory): a second
process compiling the same program reuses it. docs/compile.md.
"""

from __future__ import annotations

import copy
import logging
import operator
import time

import torch
import torch._dynamo.utils

log = logging.getLogger(__name__)


class CompiledGraph:
    """``program.graph_module`` under ``torch.compile``, recording what each compilation cost.

    ``compilations``: one ``{"seconds", "shapes"}`` per call that compiled (the seconds are the
    whole call: tracing, Inductor and the first run), ``shapes`` the user inputs' shapes. A call
    counts as compiling when Dynamo's process-wide graph count grew during it: with the ranks of a
    ``SimulatedMesh`` compiling side by side in threads, each rank may list the others' too.
    """

    def __init__(self, program):
        self.what = f"{program.family} {program.mode}"
        self.graph_module = program.graph_module
        self.user_inputs = sum(1 for i in program.inputs if i.kind == "user")
        self.compiled = torch.compile(without_grad_regions(program.graph_module), fullgraph=True)
        self.compilations: list[dict] = []

    def __call__(self, *args):
        counters = torch._dynamo.utils.counters["stats"]
        graphs = counters["unique_graphs"]
        started = time.perf_counter()
        outputs = self.compiled(*args)
        if counters["unique_graphs"] != graphs:
            seconds = time.perf_counter() - started
            shapes = [tuple(a.shape) for a in args[len(args) - self.user_inputs:] if isinstance(a, torch.Tensor)]
            self.compilations.append({"seconds": seconds, "shapes": shapes})
            log.info("compiled the %s program for %s in %.1fs", self.what, shapes[:1], seconds)
        return outputs


_NO_GRAD_REGION = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def without_grad_regions(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph_module`` whose ``torch.no_grad()`` regions (export's
    ``wrap_with_set_grad_enabled(False, submodule, *inputs)``, e.g. Hugging Face's rotary
    embedding) are inlined, their outputs detached: the same values, and no gradient through
    them, as under no_grad. Dynamo cannot re-trace such a region when a symbolic size enters it
    ("unexpected freevars")."""
    if not _no_grad_regions(graph_module.graph):
        return graph_module
    graph = copy.deepcopy(graph_module.graph)
    result = torch.fx.GraphModule(graph_module, graph)
    for node in _no_grad_regions(graph):
        submodule = getattr(result, node.args[1].target)
        env = dict(zip([n for n in submodule.graph.nodes if n.op == "placeholder"], node.args[2:]))
        with graph.inserting_before(node):
            for inner in submodule.graph.nodes:
                if inner.op == "get_attr":
                    raise NotImplementedError(f"a no-grad region reading attribute {inner.target!r} cannot be inlined")
                if inner.op == "output":
                    outputs = [graph.call_function(torch.ops.aten.detach.default, (env[o],))
                               for o in torch.fx.node.map_arg(inner.args[0], lambda a: a)]
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, lambda a: env[a])
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(f"{user.format_node()} reads a no-grad region's output tuple whole")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
    graph.lint()
    result.recompile()
    return result


def _no_grad_regions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is _NO_GRAD_REGION and n.args[0] is False]
