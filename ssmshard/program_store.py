"""A sharded :class:`~ssmshard.program.Program` to a file and back, without its fake values.

What ``runtime/program_cache.py`` keeps across processes. A program holds three kinds of state:

- its graphs (the program's, the weight-only subgraph ``fold_weights`` made, the variant for
  unpadded prefill batches, and any graph nested in them): stored node by node (name, op, target,
  arguments, the tags and placements of ``node.meta``), and rebuilt as fresh graph modules;
- plain tables (inputs, weight and state specs, placements, ranges, the pass history and the
  passes' reports): pickled as they are;
- tensors (constants export lifted, tensor attributes of a graph): kept beside the rest.

What is *not* stored is the fake value of each node (``val``, ``tensor_meta``, the verifier's
propagation records): they belong to the shape environment of the process that captured the
program and cannot be rebuilt faithfully without it. A loaded program therefore runs (its graph
is the one the passes produced, node for node) but is not a program to run passes on or to
report shapes from: ``Program.from_store`` is set, and ``Program.require_values`` raises where
code would read a value that is not there. The process group's name, which differs from process
to process, is stored as a placeholder and given back as the loading module's own.

Ops are stored by name (``aten::add.Tensor``) and looked up in ``torch.ops`` on loading;
other callables (``operator.getitem``, ssmshard's Python helpers) by their importable name. A
program holding anything else cannot be stored: a symbolic size in an argument raises
:class:`ProgramStoreError`, a lambda a user pass inserted pickle's own error, either naming it.
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.fx
from torch.fx.graph import CodeGen

from .program import Program

FORMAT = 1

# node.meta entries a loaded program keeps: the tags passes and reports read, placements, and
# where a node came from. Everything else in meta describes fake values (or export's bookkeeping).
KEPT_META = ("ssmshard", "placement", "input_placements", "stack_trace", "nn_module_stack", "torch_fn", "custom")

# Program attributes that are rebuilt, not stored: the bound weights, the callable capturing
# siblings (it holds the model), siblings and compiled forms (made again on first use).
_NOT_STORED = ("weights", "recapture", "siblings", "_compiled")


class ProgramStoreError(RuntimeError):
    """A program holds something that cannot be stored, or a stored program cannot be loaded."""


def save_program(program: Program, group: str) -> bytes:
    """``program`` (a sharded program whose collectives run over process group ``group``) as bytes."""
    if program.siblings:
        raise ProgramStoreError("a program with shape siblings is stored before its first call, not after")
    unpadded = program.unpadded
    if unpadded is None:
        # Made here, while the fake values it compares are present (``passes/unpadded.py``).
        from .passes.unpadded import unpadded_variant

        unpadded = unpadded_variant(program) or False
    tensors: dict[str, torch.Tensor] = {}
    fields = {name: value for name, value in vars(program).items() if name not in _NOT_STORED}
    fields["graph_module"] = _graph_data(program.graph_module, tensors, "graph")
    fields["unpadded"] = False if unpadded is False else _graph_data(unpadded.graph_module, tensors, "unpadded")
    if program.folded is not None:
        folded = program.folded
        fields["folded"] = (_graph_data(folded.graph_module, tensors, "folded"), folded.sources, folded.names)
    fields["constants"] = {}
    for fqn, tensor in program.constants.items():
        tensors[f"constant:{fqn}"] = tensor
    buffer = io.BytesIO()
    _Pickler(buffer, group).dump({"format": FORMAT, "fields": fields, "constants": list(program.constants)})
    out = io.BytesIO()
    torch.save({"program": buffer.getvalue(), "tensors": tensors}, out)
    return out.getvalue()


def load_program(data: bytes, group: str) -> Program:
    """The program ``save_program`` stored, its collectives over process group ``group``."""
    stored = torch.load(io.BytesIO(data), weights_only=False)  # tensors back on the devices they were on
    tensors = stored["tensors"]
    body = _Unpickler(io.BytesIO(stored["program"]), group).load()
    if body.get("format") != FORMAT:
        raise ProgramStoreError(f"stored program format {body.get('format')}, this ssmshard reads {FORMAT}")
    fields = body["fields"]
    program = Program.__new__(Program)
    program.__dict__.update(fields)
    program.graph_module = _graph_module(fields["graph_module"], tensors)
    program.constants = {fqn: tensors[f"constant:{fqn}"] for fqn in body["constants"]}
    if fields["folded"] is not None:
        from .passes.fold_weights import FoldedWeights

        graph, sources, names = fields["folded"]
        program.folded = FoldedWeights(_graph_module(graph, tensors), sources, names)
    program.weights, program.recapture, program.siblings, program._compiled = None, None, [], None
    program.from_store = True
    unpadded = fields["unpadded"]
    program.unpadded = False
    if unpadded is not False:
        from .passes.unpadded import variant_of

        program.unpadded = variant_of(program, _graph_module(unpadded, tensors))
    return program


# ----------------------------------------------------------------- graphs
class _Ref:
    """An argument that is another node of the same graph, by name."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _graph_data(graph_module: torch.fx.GraphModule, tensors: dict, prefix: str) -> dict:
    if type(graph_module.graph._codegen) is not CodeGen:  # rebuilt graphs generate plain code
        raise ProgramStoreError(f"graph {prefix!r} generates its code with {type(graph_module.graph._codegen).__name__}; "
                                "only graphs with plain code generation are stored")
    attributes = {}
    nodes = []
    for node in graph_module.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            attributes[node.target] = _attribute(graph_module, node.target, tensors, f"{prefix}.{node.target}")
        nodes.append((node.name, node.op, _target(node), torch.fx.node.map_arg(node.args, lambda n: _Ref(n.name)),
                      torch.fx.node.map_arg(node.kwargs, lambda n: _Ref(n.name)),
                      {key: node.meta[key] for key in KEPT_META if key in node.meta}))
    return {"class_name": type(graph_module).__name__, "nodes": nodes, "attributes": attributes}


def _attribute(graph_module, target: str, tensors: dict, key: str):
    value = graph_module
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.fx.GraphModule):
        return ("graph", _graph_data(value, tensors, key))
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach()
        return ("tensor", key, isinstance(value, torch.nn.Parameter))
    raise ProgramStoreError(f"the graph reads attribute {target!r}, a {type(value).__name__}; only graphs and "
                            "tensors are stored")


def _target(node: torch.fx.Node):
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target._schema.name.split("::")
        return ("op", namespace, name, target._overloadname or "default")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("higher_order", target.name())
    return target  # a string (placeholder, get_attr, output) or an importable callable


def _resolve(target):
    if not isinstance(target, tuple):
        return target
    try:
        if target[0] == "op":
            _, namespace, name, overload = target
            return getattr(getattr(getattr(torch.ops, namespace), name), overload)
        return getattr(torch.ops.higher_order, target[1])
    except AttributeError:
        raise ProgramStoreError(f"the stored program calls {target[1:]}, which this process has not registered "
                                "(an op of a library not imported here)") from None


def _graph_module(data: dict, tensors: dict) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for target, value in data["attributes"].items():
        if value[0] == "graph":
            obj = _graph_module(value[1], tensors)
        else:
            _, key, is_parameter = value
            obj = torch.nn.Parameter(tensors[key], requires_grad=False) if is_parameter else tensors[key]
        _set_attribute(root, target, obj)
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def node_of(value):
        return env[value.name] if isinstance(value, _Ref) else value

    for name, op, target, args, kwargs, meta in data["nodes"]:
        node = graph.create_node(op, _resolve(target), torch.fx.node.map_aggregate(args, node_of),
                                 torch.fx.node.map_aggregate(kwargs, node_of), name=name)
        if node.name != name:
            raise ProgramStoreError(f"node {name!r} was rebuilt as {node.name!r}")
        node.meta.update(meta)
        env[name] = node
    return torch.fx.GraphModule(root, graph, class_name=data["class_name"])


def _set_attribute(root: torch.nn.Module, target: str, value) -> None:
    *path, last = target.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, torch.nn.Module):
        owner.add_module(last, value)
    elif isinstance(value, torch.nn.Parameter):
        owner.register_parameter(last, value)
    else:
        owner.register_buffer(last, value)


# ----------------------------------------------------------------- pickling
_REFUSED = (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor, torch.fx.Node)


class _Pickler(pickle.Pickler):
    """Pickles a program's fields: the group's name becomes a placeholder; fake or real tensors,
    symbolic sizes and nodes outside a graph's node list are refused (tensors travel apart). A
    function pickle cannot name (a lambda, a closure) fails as pickle fails; the cache then warns
    and leaves the program unstored."""

    def __init__(self, file, group: str):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.group = group

    def persistent_id(self, obj):
        if isinstance(obj, str) and obj == self.group:
            return "group"
        if isinstance(obj, _REFUSED):
            raise ProgramStoreError(f"a {type(obj).__name__} in the program's tables cannot be stored")
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, group: str):
        super().__init__(file)
        self.group = group

    def persistent_load(self, pid):
        if pid != "group":
            raise ProgramStoreError(f"unknown reference {pid!r} in a stored program")
        return self.group
