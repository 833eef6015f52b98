"""Capture three decoder layers and repeat the third: capture time that does not grow with depth.

``torch.export`` traces Hugging Face's Python op by op, so capturing a 64-layer model costs 64
times one layer (tens of seconds, docs/startup.md). When every decoder layer is the same module
type with the same parameter names, shapes and dtypes (Mamba, Falcon-Mamba, Mamba-2, Llama), the
graph of layer ``j`` is the graph of layer 2 with layer ``j``'s weights and states. So capture
exports a view of the model cut to its first ``TRACED_LAYERS`` layers and this module copies the
last traced layer's nodes once per remaining layer, chaining each copy's hidden state into the
next. Layers 0 and 1 are traced, not copied, so nothing that only the first layer does is lost.

Nothing is assumed that the traced graph does not show: before repeating, layer 1 and layer 2 of
the traced graph must be the same ops over the same kind of arguments (their own weights, their
own states, the previous layer's nodes at the same positions, the same shared nodes), layer 1's
nodes may be read only by layer 2 and the outputs, and the layers' weights must agree as above.
Otherwise (hybrids such as Zamba and Zamba2, whose layers differ) every layer is traced, as
before, and the log says why. ``SSMSHARD_TRACE_ALL_LAYERS=1`` traces every layer always.

A layer's nodes ("unit"): its weights' and states' placeholders, its body (nodes that export
recorded inside ``layers.<i>``) and its prologue (nodes outside every module computed from its
own placeholders only, such as the copies decode makes of its incoming states, or read by it
alone, such as a static decode's per-layer copy of the cache position).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re

import torch
import torch.fx

from .program import GraphInput, Program

log = logging.getLogger(__name__)

TRACED_LAYERS = 3  # layers 0 and 1 traced as they are, layer 2 traced and repeated
_LAYER_IN_PATH = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def layer_lists(model) -> list[tuple[str, torch.nn.ModuleList]]:
    """(dotted path, module list) of every ``layers`` module list of the model."""
    return [(name, module) for name, module in model.named_modules()
            if name.rpartition(".")[2] == "layers" and isinstance(module, torch.nn.ModuleList)]


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList] | None:
    """(dotted path, module list) of the model's decoder layers, or None if there is not exactly one."""
    found = layer_lists(model)
    return found[0] if len(found) == 1 else None


def why_not_repeatable(model) -> str | None:
    """Why the model's layers cannot be captured by repetition, or None when they can."""
    if os.environ.get("SSMSHARD_TRACE_ALL_LAYERS", "0") not in ("", "0"):
        return "SSMSHARD_TRACE_ALL_LAYERS is set"
    found = decoder_layers(model)
    if found is None:
        return "no single decoder-layer list"
    layers = found[1]
    if len(layers) <= TRACED_LAYERS:
        return f"{len(layers)} layers: nothing to repeat"

    def signature(layer):
        return (type(layer), [(name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters()],
                [(name, tuple(b.shape), b.dtype) for name, b in layer.named_buffers()])

    template = signature(layers[TRACED_LAYERS - 1])
    for index, layer in enumerate(layers):
        if signature(layer) != template:
            return f"layer {index} ({type(layer).__name__}) differs from layer {TRACED_LAYERS - 1}"
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return f"config.layer_types mixes {sorted(set(layer_types))}"
    return None


def truncated(model, layers: int):
    """A view of ``model`` with only its first ``layers`` decoder layers (the model is not changed).

    The modules on the path to the layer list are shallow copies with their own child tables and
    a config copy whose ``num_hidden_layers`` (and ``layer_types``) say ``layers``; the layers
    themselves, their parameters and buffers are the model's own objects, under the same names.
    """
    path, full = decoder_layers(model)
    config = copy.deepcopy(model.config)
    derived = isinstance(getattr(type(config), "layer_types", None), property)  # Mamba's follow the count
    if getattr(config, "layer_types", None) is not None and not derived:
        config.layer_types = list(config.layer_types[:layers])
    config.num_hidden_layers = layers
    names = path.split(".")
    root = parent = _shallow(model, config)
    for name in names[:-1]:
        child = _shallow(parent._modules[name], config)
        parent._modules[name] = child
        parent = child
    parent._modules[names[-1]] = torch.nn.ModuleList(list(full)[:layers])
    return root


def _shallow(module, config):
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    if hasattr(module, "config"):
        clone.config = config
    return clone


@dataclasses.dataclass
class _Unit:
    """One traced layer's nodes, each list in graph order."""
    params: list[torch.fx.Node]
    states: list[torch.fx.Node]
    prologue: list[torch.fx.Node]
    body: list[torch.fx.Node]

    def nodes(self):
        return [*self.params, *self.states, *self.prologue, *self.body]


def _layer_of_path(node) -> int | None:
    layer = None
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _LAYER_IN_PATH.search(path)
        if match:
            layer = int(match.group(2))
    return layer


def _units(program: Program, traced: int) -> list[_Unit]:
    graph = program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    units = [_Unit([], [], [], []) for _ in range(traced)]
    owner: dict[torch.fx.Node, int] = {}
    user_index = 0
    state_first = 3  # user inputs: input_ids, attention_mask, position_ids, states..., [cache_position]
    for node, spec in zip(placeholders, program.inputs):
        if spec.kind == "user":
            slot = user_index - state_first
            if 0 <= slot < len(program.state_specs):
                layer = program.state_specs[slot].layer
                units[layer].states.append(node)
                owner[node] = layer
            user_index += 1
            continue
        match = _LAYER_IN_PATH.search(spec.target)
        if match:
            layer = int(match.group(2))
            units[layer].params.append(node)
            owner[node] = layer
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = _layer_of_path(node)
        if layer is not None:
            units[layer].body.append(node)
            owner[node] = layer
            continue
        inputs = node.all_input_nodes
        layers = {owner.get(i) for i in inputs}
        if inputs and len(layers) == 1 and None not in layers:
            layer = layers.pop()
            if all(i in units[layer].states or i in units[layer].params or i in units[layer].prologue
                   for i in inputs):
                units[layer].prologue.append(node)
                owner[node] = layer
    # A node read by anything but its own layer is shared work that export happened to derive
    # from this layer's input (Llama's mask reads the past length off one layer's keys).
    output = next(n for n in graph.nodes if n.op == "output")
    for unit in units:
        changed = True
        while changed:
            mine = {*unit.prologue, *unit.body}
            shared = [n for n in unit.prologue if any(u is not output and u not in mine for u in n.users)]
            changed = bool(shared)
            for node in shared:
                unit.prologue.remove(node)
                del owner[node]
    # And a node outside the modules that only one layer reads is that layer's own work on shared
    # inputs (a static decode's copy of the cache position, which each layer advances).
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node in owner or not node.users:
            continue
        layers = {owner.get(user) for user in node.users}
        if len(layers) == 1 and None not in layers:
            layer = layers.pop()
            units[layer].prologue.append(node)
            owner[node] = layer
    order = {node: index for index, node in enumerate(graph.nodes)}
    for unit in units:
        unit.prologue.sort(key=order.__getitem__)
    return units


class NotRepeatable(Exception):
    """The traced layers do not have the structure repetition needs (the message says what)."""


def _reference(node, unit: _Unit, previous: _Unit, others: set, relative_name) -> tuple:
    """How a layer's node refers to ``node``, in terms that must match from layer to layer."""
    if node in others or node in previous.body:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            # A size export computed once (in the first layer that needed it) and reuses.
            return "shared", node
    for kind, nodes in (("body", unit.body), ("prologue", unit.prologue), ("state", unit.states)):
        if node in nodes:
            return kind, nodes.index(node)
    if node in previous.body:  # counted from the end: layer 0 may trace extra nodes (shared work done once)
        return "carry", previous.body.index(node) - len(previous.body)
    if node in unit.params:
        return "param", relative_name[node]
    if node in others:
        raise NotRepeatable(f"{node.name} of another layer is read")
    return "shared", node


def _shape_of(node, unit, previous, others, relative_name):
    def ref(value):
        return _reference(value, unit, previous, others, relative_name)

    return (node.target, torch.fx.node.map_arg(node.args, ref), torch.fx.node.map_arg(node.kwargs, ref))


def check_repeatable(units: list[_Unit], output: torch.fx.Node, relative_name) -> None:
    """Raise :class:`NotRepeatable` unless layer 2 is layer 1 again, one layer on (module docstring)."""
    first, second = units[-2], units[-1]
    everything = {n for u in units for n in u.nodes()}
    first_nodes, second_nodes = set(first.nodes()), set(second.nodes())
    for name, a, b in (("bodies", first.body, second.body), ("prologues", first.prologue, second.prologue),
                       ("weights", first.params, second.params), ("states", first.states, second.states)):
        if len(a) != len(b):
            raise NotRepeatable(f"layers' {name} differ in size ({len(a)} and {len(b)} nodes)")
    for one, two in zip(first.params, second.params):
        if relative_name[one] != relative_name[two]:
            raise NotRepeatable(f"weights {relative_name[one]} and {relative_name[two]} at the same position")
    others_of_first = everything - first_nodes - set(units[-3].body)
    others_of_second = everything - second_nodes - set(first.body)
    for part in ("prologue", "body"):
        for one, two in zip(getattr(first, part), getattr(second, part)):
            shape_one = _shape_of(one, first, units[-3], others_of_first, relative_name)
            shape_two = _shape_of(two, second, first, others_of_second, relative_name)
            if shape_one != shape_two:
                raise NotRepeatable(f"{one.name} and {two.name} differ: {shape_one[:2]} / {shape_two[:2]}")
    outputs = output.args[0]
    written = [[i for i, v in enumerate(outputs) if isinstance(v, torch.fx.Node) and v in nodes]
               for nodes in (first_nodes, second_nodes)]
    alike = len(written[0]) == len(written[1]) and all(
        _reference(outputs[i], first, first, set(), relative_name) == _reference(outputs[j], second, second, set(), relative_name)
        for i, j in zip(*written))
    if not alike or (written[0] and written[1][0] != written[0][-1] + 1):
        raise NotRepeatable(f"layers' outputs are not consecutive and alike: at {written[0]} and {written[1]}")
    for node in [*first.prologue, *first.body]:
        for user in node.users:
            if user is not output and user not in second_nodes and user not in first_nodes:
                raise NotRepeatable(f"{node.name} of layer {len(units) - 2} is read by {user.name} outside the next layer")


def repeat_layers(program: Program, total_layers: int) -> Program:
    """Extend a program traced over ``TRACED_LAYERS`` layers to ``total_layers`` (module docstring)."""
    traced = TRACED_LAYERS
    state_specs_per_layer = [s for s in program.state_specs if s.layer == traced - 1]
    gm = program.graph_module
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, program.inputs))
    relative_name = {}
    for node, spec in spec_of.items():
        if spec.kind != "user":
            # Constants export lifts (a tensor an op makes from Python values) are numbered over
            # the whole graph: layers' constants at the same position must hold the same values.
            relative = _LAYER_IN_PATH.sub(r"\1layers.#\3", spec.target)
            relative_name[node] = re.sub(r"lifted_tensor_\d+$", "lifted_tensor", relative) if spec.kind == "constant" else relative
    units = _units(program, traced)
    check_repeatable(units, output, relative_name)
    for one, two in zip(units[-2].params, units[-1].params):
        if spec_of[one].kind == "constant" and not torch.equal(program.constants[spec_of[one].target],
                                                                 program.constants[spec_of[two].target]):
            raise NotRepeatable(f"constants {spec_of[one].target} and {spec_of[two].target} differ")
    template, before = units[-1], units[-2]
    # What the next copy reads as its predecessor's output: position p of the previous layer's
    # body, starting from the template's own body.
    previous_body = list(template.body)
    template_nodes = set(template.nodes())
    outputs = list(output.args[0])
    template_outputs = [(i, v) for i, v in enumerate(outputs) if isinstance(v, torch.fx.Node) and v in template_nodes]
    new_outputs: list[torch.fx.Node] = []
    # Export orders weights by kind (parameters, buffers, constants): each new one goes after
    # the template's last of its kind, as tracing every layer would place it.
    weight_anchor = {spec_of[node].kind: node.next for node in template.params}
    state_anchor = template.states[-1].next if template.states else None
    prologue_anchor = template.prologue[-1].next if template.prologue else None
    body_anchor = template.body[-1].next
    new_inputs: dict[torch.fx.Node, tuple[GraphInput, torch.fx.Node]] = {}  # new placeholder -> (input, template)
    state_specs = list(program.state_specs)
    external_users = {n: [u for u in n.users if u is not output and u not in template_nodes] for n in template.body}

    for layer in range(traced, total_layers):
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in template.params:
            spec = spec_of[node]
            with graph.inserting_before(weight_anchor[spec.kind]):
                name = re.sub(rf"_layers_{traced - 1}_", f"_layers_{layer}_", node.name, count=1)
                fqn = _LAYER_IN_PATH.sub(rf"\1layers.{layer}\3", spec.target, count=1)
                new = graph.placeholder(name)
                new.meta = dict(node.meta)
                env[node] = new
                new_inputs[new] = (GraphInput(new.name, spec.kind, fqn), node)
                program.param_specs[fqn] = dataclasses.replace(program.param_specs[spec.target], fqn=fqn)
                if spec.target in program.constants:
                    program.constants[fqn] = program.constants[spec.target]
        insert_states = graph.inserting_before(state_anchor) if state_anchor is not None else graph.inserting_before(output)
        with insert_states:
            for index, node in enumerate(template.states):
                new = graph.placeholder(f"states_{len(state_specs) + index}")
                new.meta = dict(node.meta)
                env[node] = new
                new_inputs[new] = (GraphInput(new.name, "user", None), node)
        state_specs.extend(dataclasses.replace(spec, layer=layer) for spec in state_specs_per_layer)
        if template.prologue:
            with graph.inserting_before(prologue_anchor):
                for node in template.prologue:
                    env[node] = _copy(graph, node, env, layer)
        carry = dict(zip(before.body, previous_body))
        with graph.inserting_before(body_anchor):
            copies = []
            for node in template.body:
                copies.append(_copy(graph, node, {**carry, **env}, layer))
                env[node] = copies[-1]
        previous_body = copies
        new_outputs.extend(env[v] for _, v in template_outputs)

    # The model's tail (final norm, head) reads the last copy instead of the template.
    last = dict(zip(template.body, previous_body))
    for node, users in external_users.items():
        for user in users:
            user.replace_input_with(node, last[node])
    insert_at = template_outputs[-1][0] + 1 if template_outputs else len(outputs)
    output.args = (outputs[:insert_at] + new_outputs + outputs[insert_at:],)

    _rebuild_inputs(program, graph, spec_of, new_inputs)
    program.state_specs = state_specs
    program.code_stale = True  # the capture pipeline that follows regenerates the code once
    return program


def _copy(graph, node, env, layer):
    new = graph.node_copy(node, lambda n: env.get(n, n))
    stack = node.meta.get("nn_module_stack")
    if stack:
        new.meta["nn_module_stack"] = {
            re.sub(rf"layers_{TRACED_LAYERS - 1}(?!\d)", f"layers_{layer}", key):
                (_LAYER_IN_PATH.sub(rf"\1layers.{layer}\3", path), kind)
            for key, (path, kind) in stack.items()}
    return new


def _rebuild_inputs(program, graph, spec_of, new_inputs):
    """``program.inputs`` and the user-input ``ranges`` in the graph's new placeholder order."""
    old_user = [n for n, s in spec_of.items() if s.kind == "user"]
    inputs, ranges, user_index = [], {}, 0
    for node in (n for n in graph.nodes if n.op == "placeholder"):
        if node in new_inputs:
            spec, template = new_inputs[node]
        else:
            spec, template = spec_of[node], node
        inputs.append(spec)
        if spec.kind == "user":
            source = old_user.index(template)
            for (index, dim), bounds in program.ranges.items():
                if index == source:
                    ranges[(user_index, dim)] = bounds
            user_index += 1
    program.inputs = inputs
    program.ranges = ranges


__all__ = ["TRACED_LAYERS", "NotRepeatable", "check_repeatable", "decoder_layers", "layer_lists", "repeat_layers", "truncated",
           "why_not_repeatable"]
