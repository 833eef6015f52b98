"""Capture a prefix of the decoder layers and copy its layers for the rest: capture time that
does not grow with depth.

``torch.export`` traces Hugging Face's Python op by op, so capturing a 64-layer model costs 64
times one layer (tens of seconds, docs/startup.md). Layer ``j``'s graph is the graph of an
earlier layer of the same kind with layer ``j``'s weights and states. So capture exports a view
of the model cut to a prefix of its layers and this module copies traced layers' nodes once per
remaining layer, chaining each copy's hidden state into the next.

Kinds and templates. A layer's kind is its module class (with its ``config.layer_types``
entry where the config has one). Layer ``j`` is copied from its template: the last traced layer
whose kind, and whose predecessor's kind, are layer ``j``'s and its predecessor's (a hybrid's
shared block reads a Mamba layer's output, a Mamba layer a hybrid's). The traced prefix is the
shortest (at least ``TRACED_LAYERS``) that holds two traced examples of every such pair after it
and that ends on the pair the model ends on (the final norm reads the last layer). A kind's first
layer may have traced work that later layers reuse, and then fails its check as an example: the
next plan tried excludes first layers from the examples. Layers all alike: three traced, the third
the template of every copy, as tracing layers 0 to 2 shows. Zamba2-2.7B (54 layers, hybrids at 6,
12, ..., 42, 47, 51): 15 traced (21 without first layers as examples).

Nothing is assumed that the traced graph does not show: each template and the earlier example of
its pair must be the same ops over the same kind of arguments (their own weights and states, the
previous layer's nodes at the same positions from its end, the same shared nodes); a traced
layer's nodes may be read only by the next layer and the outputs; and the modules a template
calls must have the same class and plain attributes in the copied layer (layer indices aside).
Otherwise every layer is traced, and the log says why. ``SSMSHARD_TRACE_ALL_LAYERS=1`` traces
every layer always.

Weights go by object, not by name: the template's weight at path ``p`` inside its layer is, in
the copy, the tensor at ``p`` inside the copied layer (at ``family.repeat_path(p, ...)`` where a
family indexes modules per call site: Zamba2's adapters), of the same shape and dtype. A tensor
the graph reads already (a shared block's weights) keeps its placeholder; a new one is named and
placed as export names and places them (the last of its names in ``named_parameters`` order).
The example check maps its weights the same way, so a wrong mapping is :class:`NotRepeatable`,
not a wrong program.

A layer's nodes ("unit"): its states' placeholders and lifted constants, its body (nodes that
export recorded inside ``layers.<i>``) and its prologue (nodes outside every module computed from
its own states only, such as the copies decode makes of its incoming states, or read by it alone,
such as a static decode's per-layer copy of the cache position).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import os
import re
from typing import Callable

import torch
import torch.fx

from .program import GraphInput, Program

log = logging.getLogger(__name__)

TRACED_LAYERS = 3  # the fewest layers traced: layers 0 and 1 as they are, layer 2 the template
_LAYER_IN_PATH = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")
_WEIGHT_KINDS = ("parameter", "buffer")
# Plain module attributes that name a layer's position, not how it computes.
_POSITION_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "block_id"})

# (path inside the source layer, source layer, target layer, model) -> path inside the target
RepeatPath = Callable[[str, int, int, torch.nn.Module], str]


def _same_path(path, source, target, model):
    return path


class NotRepeatable(Exception):
    """The layers do not have the structure repetition needs (the message says what)."""


def layer_lists(model) -> list[tuple[str, torch.nn.ModuleList]]:
    """(dotted path, module list) of every ``layers`` module list of the model."""
    return [(name, module) for name, module in model.named_modules()
            if name.rpartition(".")[2] == "layers" and isinstance(module, torch.nn.ModuleList)]


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList] | None:
    """(dotted path, module list) of the model's decoder layers, or None if there is not exactly one."""
    found = layer_lists(model)
    return found[0] if len(found) == 1 else None


@dataclasses.dataclass(frozen=True)
class Repetition:
    """Which layers capture traces and where each of the others is copied from (module docstring)."""
    total: int  # the model's decoder layers
    traced: int  # layers 0 .. traced - 1 are traced
    templates: dict[int, int]  # copied layer -> the traced layer it is a copy of
    examples: dict[int, int]  # template -> the earlier traced layer of its pair it is checked against


def layer_kinds(model) -> list[tuple[str, str | None]]:
    """Each decoder layer's kind: its class name and its ``config.layer_types`` entry, if any."""
    layers = decoder_layers(model)[1]
    types = getattr(model.config, "layer_types", None)
    return [(type(layer).__name__, types[i] if types is not None and i < len(types) else None)
            for i, layer in enumerate(layers)]


def repetitions(model) -> list[Repetition]:
    """The plans to try, shortest prefix first (module docstring); :class:`NotRepeatable` says why
    there is none. The first may take a kind's first layer as an example; where that layer traced
    work later layers reuse, its check fails and the second, which does not, is next."""
    if os.environ.get("SSMSHARD_TRACE_ALL_LAYERS", "0") not in ("", "0"):
        raise NotRepeatable("SSMSHARD_TRACE_ALL_LAYERS is set")
    if decoder_layers(model) is None:
        raise NotRepeatable("no single decoder-layer list")
    kinds = layer_kinds(model)
    if len(kinds) <= TRACED_LAYERS:
        raise NotRepeatable(f"{len(kinds)} layers: nothing to repeat")
    first_of_kind = {kinds.index(kind) for kind in set(kinds)}
    plans = []
    for excluded in (set(), first_of_kind):
        plan = _shortest_prefix(kinds, excluded)
        if plan is not None and plan not in plans:
            plans.append(plan)
    if not plans:
        raise NotRepeatable(f"{len(kinds)} layers of {len(set(kinds))} kinds: no shorter prefix holds two examples "
                            "of every pair of consecutive kinds after it")
    return plans


def _shortest_prefix(kinds: list, excluded: set) -> Repetition | None:
    """The shortest prefix with two examples (none in ``excluded``) of every pair after it."""
    total = len(kinds)

    def pair(i):
        return kinds[i - 1], kinds[i]

    for traced in range(TRACED_LAYERS, total):
        if pair(traced - 1) != pair(total - 1):
            continue
        examples = collections.defaultdict(list)
        for i in range(1, traced):
            if i not in excluded:
                examples[pair(i)].append(i)
        if all(len(examples[pair(j)]) >= 2 for j in range(traced, total)):
            templates = {j: examples[pair(j)][-1] for j in range(traced, total)}
            return Repetition(total, traced, templates, {t: examples[pair(t)][-2] for t in set(templates.values())})
    return None


def why_not_repeatable(model) -> str | None:
    """Why the model's layers cannot be captured by repetition, or None when they can."""
    try:
        repetitions(model)
    except NotRepeatable as error:
        return str(error)
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
    constants: list[torch.fx.Node]
    states: list[torch.fx.Node]
    prologue: list[torch.fx.Node]
    body: list[torch.fx.Node]

    def nodes(self):
        return [*self.constants, *self.states, *self.prologue, *self.body]

    @functools.cached_property
    def positions(self) -> dict[torch.fx.Node, tuple[str, int]]:
        """node -> (its part, its index there), for body, prologue and state nodes; read only once
        ``_units`` has finished the lists (thousands of lookups per check: no list scans)."""
        found = {}
        for part, nodes in (("body", self.body), ("prologue", self.prologue), ("state", self.states)):
            for index, node in enumerate(nodes):
                found.setdefault(node, (part, index))
        return found

    def in_body(self, node) -> bool:
        return self.positions.get(node, ("",))[0] == "body"


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
        if match and spec.kind == "constant":  # weights go by object (_Weights), constants by layer
            layer = int(match.group(2))
            units[layer].constants.append(node)
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
            if all(i in units[layer].states or i in units[layer].constants or i in units[layer].prologue
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


class _Weights:
    """The model's weights by object: which tensor a placeholder reads, where each layer holds it,
    and the name and place export gives it (module docstring)."""

    def __init__(self, model, program: Program, repeat_path: RepeatPath):
        self.model, self.repeat_path = model, repeat_path
        self.layers = decoder_layers(model)[1]
        self._paths: dict[int, dict[int, str]] = {}
        # Export lifts every name of a tied tensor and reads the last; its weights come in that order.
        self.export_name: dict[int, str] = {}
        self.export_rank: dict[int, int] = {}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            self.export_name[id(tensor)] = name
        for rank, (name, tensor) in enumerate(named):
            if self.export_name[id(tensor)] == name:
                self.export_rank[id(tensor)] = rank
        self.tensor_of: dict[torch.fx.Node, torch.Tensor] = {}
        placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, program.inputs):
            if spec.kind in _WEIGHT_KINDS:
                get = self.model.get_parameter if spec.kind == "parameter" else self.model.get_buffer
                self.tensor_of[node] = get(spec.target)
        self.placeholder_of = {id(t): node for node, t in self.tensor_of.items()}

    def path_in(self, layer: int, node) -> str | None:
        """The path of the tensor ``node`` reads inside decoder layer ``layer``, None if outside it."""
        if layer not in self._paths:
            module = self.layers[layer]
            table = {}
            for name, tensor in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)]:
                table.setdefault(id(tensor), name)
            self._paths[layer] = table
        return self._paths[layer].get(id(self.tensor_of[node]))

    def key(self, node, layer: int, frame: int):
        """How layer ``layer`` refers to weight ``node``, said in layer ``frame``'s terms."""
        path = self.path_in(layer, node)
        if path is None:
            return "shared", node
        return "weight", self.repeat_path(path, layer, frame, self.model)

    def counterpart(self, node, source: int, target: int) -> torch.Tensor | None:
        """The tensor layer ``target`` holds where layer ``source`` holds ``node``'s (None: not a layer's)."""
        path = self.path_in(source, node)
        if path is None:
            return None
        mapped = self.repeat_path(path, source, target, self.model)
        module, _, name = mapped.rpartition(".")
        owner = self.layers[target].get_submodule(module) if module else self.layers[target]
        tensor = getattr(owner, name, None)
        template = self.tensor_of[node]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != template.shape or tensor.dtype != template.dtype:
            raise NotRepeatable(f"layer {target} holds no {tuple(template.shape)} {template.dtype} tensor at {mapped} "
                                f"(layer {source}'s {path})")
        return tensor


def _reference(node, unit: _Unit, previous: _Unit, others: set, relative_name, weight_key) -> tuple:
    """How a layer's node refers to ``node``, in terms that must match from layer to layer."""
    if node in others or previous.in_body(node):
        if not isinstance(node.meta.get("val"), torch.Tensor):
            # A size export computed once (in the first layer that needed it) and reuses.
            return "shared", node
    position = unit.positions.get(node)
    if position is not None:
        return position
    if previous.in_body(node):  # counted from the end: a kind's first layer may trace extra nodes
        return "carry", previous.positions[node][1] - len(previous.body)
    if node in unit.constants:
        return "constant", relative_name[node]
    if node in others:
        raise NotRepeatable(f"{node.name} of another layer is read")
    key = weight_key(node)
    return key if key is not None else ("shared", node)


def _shape_of(node, unit, previous, others, relative_name, weight_key):
    def ref(value):
        return _reference(value, unit, previous, others, relative_name, weight_key)

    return (node.target, torch.fx.node.map_arg(node.args, ref), torch.fx.node.map_arg(node.kwargs, ref))


def _check_template(units, template: int, example: int, output, relative_name, weights: _Weights) -> None:
    """Raise :class:`NotRepeatable` unless ``template`` is ``example`` again, some layers on."""
    first, second = units[example], units[template]
    everything = {n for u in units for n in u.nodes()}
    for name, a, b in (("bodies", first.body, second.body), ("prologues", first.prologue, second.prologue),
                       ("constants", first.constants, second.constants), ("states", first.states, second.states)):
        if len(a) != len(b):
            raise NotRepeatable(f"layers {example} and {template}: {name} differ in size ({len(a)} and {len(b)} nodes)")
    for one, two in zip(first.constants, second.constants):
        if relative_name[one] != relative_name[two]:
            raise NotRepeatable(f"constants {relative_name[one]} and {relative_name[two]} at the same position")

    def weight_key(layer):
        return lambda node: weights.key(node, layer, template) if node in weights.tensor_of else None

    others_of_first = everything - set(first.nodes()) - set(units[example - 1].body)
    others_of_second = everything - set(second.nodes()) - set(units[template - 1].body)
    for part in ("prologue", "body"):
        for one, two in zip(getattr(first, part), getattr(second, part)):
            shape_one = _shape_of(one, first, units[example - 1], others_of_first, relative_name, weight_key(example))
            shape_two = _shape_of(two, second, units[template - 1], others_of_second, relative_name,
                                  weight_key(template))
            if shape_one != shape_two:
                raise NotRepeatable(f"{one.name} (layer {example}) and {two.name} (layer {template}) differ: "
                                    f"{shape_one[:2]} / {shape_two[:2]}")
    outputs = output.args[0]
    written = []
    for unit in (first, second):
        mine = set(unit.nodes())
        written.append([v for v in outputs if isinstance(v, torch.fx.Node) and v in mine])
    if [_reference(v, first, first, set(), relative_name, lambda n: None) for v in written[0]] != \
            [_reference(v, second, second, set(), relative_name, lambda n: None) for v in written[1]]:
        raise NotRepeatable(f"layers {example} and {template} write different outputs")


def _check_layers_read_in_order(units, checked, output) -> None:
    """The tensors of the ``checked`` layers (templates and examples) are read by the layer
    itself, the next one and the outputs only; and each layer's outputs follow the previous one's."""
    next_position = 0
    outputs = output.args[0]
    position = {v: i for i, v in enumerate(outputs) if isinstance(v, torch.fx.Node)}
    for index, unit in enumerate(units):
        mine = set(unit.nodes())
        allowed = mine | (set(units[index + 1].nodes()) if index + 1 < len(units) else set())
        for node in [*unit.prologue, *unit.body] if index in checked and index + 1 < len(units) else []:
            for user in node.users:
                if user is not output and user not in allowed and isinstance(node.meta.get("val"), torch.Tensor):
                    raise NotRepeatable(f"{node.name} of layer {index} is read by {user.name} outside the next layer")
        written = sorted(position[v] for v in mine if v in position)
        if written and (written[0] < next_position or written != list(range(written[0], written[0] + len(written)))):
            raise NotRepeatable(f"layer {index}'s outputs are not consecutive and after the previous layer's")
        next_position = written[-1] + 1 if written else next_position


def _check_modules(model, weights: _Weights, template_unit: _Unit, template: int, target: int) -> None:
    """The modules the template calls have the same class and plain attributes in ``target``."""
    called = set()
    for node in template_unit.body:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            match = _LAYER_IN_PATH.search(path)
            if match and int(match.group(2)) == template:
                called.add(path[match.end():] if match.group(3) else "")
    for path in sorted(called):
        mapped = weights.repeat_path(path, template, target, model)
        try:
            one = weights.layers[template].get_submodule(path)
            two = weights.layers[target].get_submodule(mapped)
        except AttributeError as error:
            raise NotRepeatable(f"layer {target} has no module {mapped!r}: {error}") from None
        if type(one) is not type(two):
            raise NotRepeatable(f"layer {target}'s {mapped} is a {type(two).__name__}, "
                                f"layer {template}'s a {type(one).__name__}")
        plain = (bool, int, float, str, type(None))
        for name, value in vars(one).items():
            if isinstance(value, plain) and name not in _POSITION_ATTRIBUTES and getattr(two, name, value) != value:
                raise NotRepeatable(f"layer {target}'s {mapped or 'layer'}.{name} is {getattr(two, name)!r}, "
                                    f"layer {template}'s {value!r}")


def repeat_layers(program: Program, model, plan: Repetition, repeat_path: RepeatPath | None = None) -> Program:
    """Extend a program traced over ``plan.traced`` layers to all ``plan.total`` of ``model`` (the
    full model, whose layers hold the copies' weights; module docstring)."""
    weights = _Weights(model, program, repeat_path or _same_path)
    graph = program.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, program.inputs))
    # Constants export lifts (a tensor an op makes from Python values) are numbered over the
    # whole graph: layers' constants at the same position must hold the same values.
    relative_name = {node: re.sub(r"lifted_tensor_\d+$", "lifted_tensor",
                                  _LAYER_IN_PATH.sub(r"\1layers.#\3", spec.target))
                     for node, spec in spec_of.items() if spec.kind == "constant"}
    units = _units(program, plan.traced)
    _check_plan(program, model, plan, units, weights, spec_of, relative_name, output)
    last = plan.traced - 1

    order = {node: index for index, node in enumerate(graph.nodes)}
    outputs = list(output.args[0])
    unit_nodes = [set(unit.nodes()) for unit in units]
    written = {t: [v for v in outputs if isinstance(v, torch.fx.Node) and v in unit_nodes[t]] for t in plan.examples}
    traced_outputs = [i for i, v in enumerate(outputs)
                      if isinstance(v, torch.fx.Node) and any(v in u for u in unit_nodes)]
    first_user = next(n for n in placeholders if spec_of[n].kind == "user")
    constants = [n for n in placeholders if spec_of[n].kind == "constant"]
    states = [n for unit in units for n in unit.states]
    prologues = [n for t in plan.examples for n in units[t].prologue]  # a kind's first layer may have more
    # Each kind of new node goes after the last traced one of its kind, in layer order, as
    # tracing every layer would place it.
    constant_anchor = constants[-1].next if constants else first_user
    state_anchor = max(states, key=order.__getitem__).next if states else output
    prologue_anchor = max(prologues, key=order.__getitem__).next if prologues else None
    body_anchor = units[last].body[-1].next
    tail_users = {n: [u for u in n.users if u is not output and u not in unit_nodes[last]] for n in units[last].body}
    earlier = set().union(*unit_nodes[:last])
    for node in list(graph.nodes)[order[body_anchor]:-1]:  # the tail may read the last layer only
        for value in node.all_input_nodes:
            if value in earlier and isinstance(value.meta.get("val"), torch.Tensor):
                raise NotRepeatable(f"{node.name} after the layers reads {value.name} of a layer before the last")
    new_inputs: dict[torch.fx.Node, tuple[GraphInput, torch.fx.Node]] = {}  # new placeholder -> (input, template)
    state_specs = list(program.state_specs)
    bodies = {i: unit.body for i, unit in enumerate(units)}
    new_outputs: list[torch.fx.Node] = []

    for layer in range(plan.traced, plan.total):
        template = plan.templates[layer]
        unit = units[template]
        env: dict[torch.fx.Node, torch.fx.Node] = {}

        def module_path(path, template=template, layer=layer):  # a call site in the template -> in the copy
            match = _LAYER_IN_PATH.search(path)
            if match is None or int(match.group(2)) != template:
                return path
            inner = weights.repeat_path(path[match.end():], template, layer, model) if match.group(3) else ""
            return f"{path[:match.start()]}{match.group(1)}layers.{layer}{match.group(3)}{inner}"

        read = dict.fromkeys(i for node in [*unit.prologue, *unit.body] for i in node.all_input_nodes)
        for node in read:
            if node in weights.tensor_of:
                tensor = weights.counterpart(node, template, layer)
                if tensor is not None:  # else a weight outside the layers: read as it is
                    env[node] = weights.placeholder_of.get(id(tensor)) or _new_weight(
                        program, graph, weights, node, spec_of[node], tensor, first_user, new_inputs)
        with graph.inserting_before(constant_anchor):
            for node in unit.constants:
                spec = spec_of[node]
                fqn = _LAYER_IN_PATH.sub(rf"\1layers.{layer}\3", spec.target, count=1)
                name = re.sub(rf"_layers_{template}_", f"_layers_{layer}_", node.name, count=1)
                env[node] = new = graph.placeholder(name)
                new.meta = dict(node.meta)
                new_inputs[new] = (GraphInput(new.name, "constant", fqn), node)
                program.param_specs[fqn] = dataclasses.replace(program.param_specs[spec.target], fqn=fqn)
                program.constants[fqn] = program.constants[spec.target]
        with graph.inserting_before(state_anchor):
            for index, node in enumerate(unit.states):
                env[node] = new = graph.placeholder(f"states_{len(state_specs) + index}")
                new.meta = dict(node.meta)
                new_inputs[new] = (GraphInput(new.name, "user", None), node)
        # A prefill writes the states it does not read: its specs follow the template's, inputs or not.
        state_specs.extend(dataclasses.replace(spec, layer=layer)
                           for spec in program.state_specs if spec.layer == template)
        if unit.prologue:
            with graph.inserting_before(prologue_anchor):
                for node in unit.prologue:
                    env[node] = _copy(graph, node, env, template, layer, module_path)
        env.update(_carry(units[template - 1].body, bodies[layer - 1], read, layer))
        with graph.inserting_before(body_anchor):
            copies = []
            for node in unit.body:
                copies.append(_copy(graph, node, env, template, layer, module_path))
                env[node] = copies[-1]
        bodies[layer] = copies
        new_outputs.extend(env[v] for v in written[template])

    # The model's tail (final norm, head) reads the last copy instead of the last traced layer.
    final = dict(zip(units[last].body, bodies[plan.total - 1]))
    for node, users in tail_users.items():
        for user in users:
            user.replace_input_with(node, final[node])
    insert_at = traced_outputs[-1] + 1 if traced_outputs else len(outputs)
    output.args = (outputs[:insert_at] + new_outputs + outputs[insert_at:],)

    _name_and_order_weights(program, graph, weights, spec_of, new_inputs, constants[0] if constants else first_user)
    _rebuild_inputs(program, graph, spec_of, new_inputs)
    program.state_specs = state_specs
    program.code_stale = True  # the capture pipeline that follows regenerates the code once
    return program


def _check_plan(program, model, plan: Repetition, units, weights: _Weights, spec_of, relative_name, output) -> None:
    """Every check of the module docstring on the traced graph, before anything changes."""
    _check_layers_read_in_order(units, {*plan.examples, *plan.examples.values()}, output)
    for template, example in plan.examples.items():
        _check_template(units, template, example, output, relative_name, weights)
        for one, two in zip(units[example].constants, units[template].constants):
            if not _same_constant(program.constants[spec_of[one].target], program.constants[spec_of[two].target]):
                raise NotRepeatable(f"constants {spec_of[one].target} and {spec_of[two].target} differ")
    for layer, template in plan.templates.items():
        _check_modules(model, weights, units[template], template, layer)
    if plan.templates[plan.total - 1] != plan.traced - 1:
        raise NotRepeatable(f"the last layer's template is layer {plan.templates[plan.total - 1]}, "
                            f"not the last traced one")


def _same_constant(one: torch.Tensor, two: torch.Tensor) -> bool:
    # A model on the meta device lifts meta constants: no values to compare, and none to run with
    # (such a program is for inspection), so shape and dtype decide.
    if one.device.type == "meta" or two.device.type == "meta":
        return one.shape == two.shape and one.dtype == two.dtype
    return torch.equal(one, two)


def _carry(source: list, target: list, read: dict, layer: int) -> dict:
    """The previous layer's nodes the template reads (``source``, its own predecessor's body) as
    the copy's predecessor's (``target``), at the same positions from the end."""
    carry = {}
    for index, node in enumerate(source):
        if node not in read:
            continue
        from_end = len(source) - index
        if from_end > len(target) or target[-from_end].target != node.target:
            raise NotRepeatable(f"layer {layer} reads {node.name} of its predecessor, which layer {layer - 1} lacks")
        carry[node] = target[-from_end]
    return carry


def _new_weight(program, graph, weights: _Weights, template_node, spec: GraphInput, tensor, anchor, new_inputs):
    fqn = weights.export_name[id(tensor)]
    with graph.inserting_before(anchor):
        new = graph.placeholder(f"{template_node.name.partition('_')[0]}_{fqn.replace('.', '_').lower()}")
    new.meta = dict(template_node.meta)
    new_inputs[new] = (GraphInput(new.name, spec.kind, fqn), template_node)
    program.param_specs[fqn] = dataclasses.replace(program.param_specs[spec.target], fqn=fqn)
    weights.placeholder_of[id(tensor)] = new
    weights.tensor_of[new] = tensor
    return new


def _name_and_order_weights(program, graph, weights: _Weights, spec_of, new_inputs, anchor) -> None:
    """Every weight under the name, and in the place, export gives it in the whole model: a block
    shared by several layers is named after its last call site, which the traced prefix may lack."""
    for node, tensor in weights.tensor_of.items():
        spec = new_inputs[node][0] if node in new_inputs else spec_of[node]
        name = weights.export_name[id(tensor)]
        if spec.target != name:
            renamed = dataclasses.replace(spec, target=name)
            if node in new_inputs:
                new_inputs[node] = (renamed, new_inputs[node][1])
            else:
                spec_of[node] = renamed
            program.param_specs[name] = dataclasses.replace(program.param_specs.pop(spec.target), fqn=name)
    for node in sorted(weights.tensor_of, key=lambda n: weights.export_rank[id(weights.tensor_of[n])]):
        anchor.prepend(node)


def _copy(graph, node, env, template, layer, module_path):
    new = graph.node_copy(node, lambda n: env.get(n, n))
    stack = node.meta.get("nn_module_stack")
    if stack:
        new.meta["nn_module_stack"] = {
            re.sub(rf"layers_{template}(?!\d)", f"layers_{layer}", key): (module_path(path), kind)
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


__all__ = ["TRACED_LAYERS", "NotRepeatable", "Repetition", "decoder_layers", "layer_kinds", "layer_lists",
           "repeat_layers", "repetitions", "truncated", "why_not_repeatable"]
