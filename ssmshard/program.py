"""``Program``: a captured (and possibly rewritten) model graph that can be called like the model.

The graph is the functional, lifted form torch.export produces: weights (parameters,
buffers, lifted constants) are placeholders just like ``input_ids``. That is what makes
sharding a graph rewrite: a pass changes what a weight placeholder holds and the ops that
consume it, and the runtime feeds each rank its own shards.

Glossary of node tags (``node.meta["ssmshard"]``, set by the ``tag`` pass):
    module     canonical FQN of the innermost nn.Module (the name its parameters carry)
    call_site  the path through which that module was called (differs from ``module`` for
               Zamba2's shared transformer, which is one object called from several layers)
    layer      decoder layer index, or None outside the layers
    block      mamba1 | mamba2 | attention | mlp | embed | norm | head | glue
    role       in_proj | conv | x_proj | dt_proj | scan | gate_norm | out_proj | q_proj | ...
"""

from __future__ import annotations

import collections
import math
import dataclasses
import os
import threading
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils._sympy.numbers import int_oo
from torch.export.graph_signature import InputKind, OutputKind

WEIGHT_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant"}


def _written_arguments(node: torch.fx.Node) -> list:
    """The arguments an op writes in place (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(node.args[position] if position < len(node.args) else node.kwargs.get(argument.name))
    return written


def _drop_unread_constants(graph: torch.fx.Graph, constants) -> None:
    """Erase the nodes of captured constants whose values never reach an output.

    From transformers 5.25, HF's linear-attention cache layers count tokens in a tensor of their
    own (``cumulative_length_linear``) and bump it in place in every mixer. Export captures the
    tensor as a constant (or a fresh copy of one, detached and moved) and keeps the ``add_``,
    because an in-place op is never dead code. ssmshard's programs keep positions themselves and
    never read the counter; left in, each layer would write its own constant on every call (and
    layer repetition would see layers that differ). A constant's nodes go only if nothing outside
    them reads them, they reach no output, and every in-place write among them writes one of them.
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    for constant in constants:
        reached, stack = {constant}, [constant]
        while stack:
            for user in stack.pop().users:
                if user not in reached:
                    reached.add(user)
                    stack.append(user)
        derived = sorted(reached - {constant}, key=order.__getitem__)
        if not derived or any(node.op != "call_function" for node in derived):
            continue  # unread (the caller drops its placeholder), or it reaches the output
        if any(arg not in reached for node in derived for arg in _written_arguments(node)):
            continue
        for node in reversed(derived):
            graph.erase_node(node)


@dataclasses.dataclass
class ParamSpec:
    """One weight placeholder of the graph."""
    fqn: str  # parameter/buffer name in the HF model (``model.layers.0.mixer.in_proj.weight``)
    kind: str  # parameter | buffer | constant
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str = ""  # filled by the tag pass from the consuming nodes
    placement: Any = None  # set by the shard pass: how this weight is split over ranks


@dataclasses.dataclass
class StateSpec:
    """One state tensor of prefill/decode: which layer, and what it holds."""
    layer: int
    kind: str  # conv | ssm | key | value
    dtype: torch.dtype
    ndim: int


@dataclasses.dataclass
class GraphInput:
    name: str  # placeholder name
    kind: str  # parameter | buffer | constant | user | derived (computed from weights: fold_weights)
    target: str | None  # FQN for weights, None for user inputs


class Program:
    """A graph module plus everything needed to call it and to reason about it."""

    def __init__(self, graph_module: torch.fx.GraphModule, *, mode: str, family: str,
                 inputs: list[GraphInput], param_specs: dict[str, ParamSpec],
                 state_specs: list[StateSpec], module_names: dict[str, str],
                 module_types: dict[str, str], capture_device: torch.device,
                 constants: dict[str, torch.Tensor] | None = None, config: Any = None,
                 ranges: dict[tuple[int, int], tuple[int, float]] | None = None, packed: bool = False):
        self.graph_module = graph_module
        self.mode = mode
        # Packed forward: user inputs are (input_ids (1, T), cu_seqlens (S+1,)); see packing.py.
        self.packed = packed
        # Decode over static key/value buffers (capture(static_kv=True)): one more user input,
        # the cache position, after the states; every input keeps its shape from step to step.
        self.static_kv = False
        # The dtype of the SSM states a generation program takes and returns, where not HF's
        # float32 (capture(ssm_state_dtype=...)): a sibling for new shapes is captured alike.
        self.ssm_state_dtype = None
        # Indices of the states a decode program writes into its own state inputs and returns
        # as those same tensors (the ``inplace_decode_states`` pass): the caller's states change.
        self.states_in_place: list[int] = []
        # Weight-only subgraph computed once per binding (``passes.fold_weights.FoldedWeights``):
        # it gives the ``derived`` inputs.
        self.folded = None
        self.family = family
        self.inputs = inputs
        self.param_specs = param_specs
        self.state_specs = state_specs
        self.module_names = module_names  # call-site path -> canonical module FQN
        self.module_types = module_types  # call-site path -> class name
        self.capture_device = torch.device(capture_device)
        self.constants = constants or {}
        self.config = config
        self.weights: dict[str, torch.Tensor] | None = None
        self.history: list[dict] = []  # one record per pass run: name, op-count diff, seconds
        self.capture_seconds: float | None = None
        # (flat user-input index, dim) -> (lo, hi): the shapes this graph was traced to serve.
        self.ranges = ranges or {}
        # Shape-bucket cache: sibling programs captured for shapes outside ``ranges`` (see admits).
        self.siblings: list[Program] = []
        self.recapture = None  # callable(program, user_inputs) -> Program (capture.Recapture), set by capture()
        # Run the graph through torch.compile (Plan(compile=True): runtime/compiled.py), on first call.
        self.compile = False
        self._compiled = None
        # Prefill: this program with causal attention calls for unpadded batches
        # (passes/causal_attention.py), made on first use; False when there is none.
        self.unpadded = None
        # Filled by the sharding passes (passes/shard): rank, tp, group, output placements;
        # the forward collectives as named sync points, and the same as report rows.
        self.tagged = False  # set by the tag pass: every call_function node carries tags
        # The graph changed since its Python code was generated (passes.manager.regenerate_code).
        self.code_stale = False
        # Loaded from the program cache (``program_store.py``): its nodes carry no fake values.
        self.from_store = False
        self.shard: dict | None = None
        self.sync_points: list = []
        self.collectives: list[dict] = []

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_exported(cls, exported, *, mode, family, model, state_specs, capture_device,
                      wrapper_prefix="", packed=False) -> "Program":
        sig = exported.graph_signature
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise RuntimeError(
                    f"captured graph mutates {spec.kind.name} {spec.target}; ssmshard programs must be "
                    "functional. This is a capture bug: please report the model class."
                )

        def strip(name):
            return name[len(wrapper_prefix):] if wrapper_prefix and name.startswith(wrapper_prefix) else name

        inputs, param_specs, constants = [], {}, {}
        state = exported.state_dict
        placeholders = [n for n in exported.graph_module.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, sig.input_specs):
            if spec.kind == InputKind.USER_INPUT:
                inputs.append(GraphInput(node.name, "user", None))
                continue
            if spec.kind not in WEIGHT_KINDS:
                raise RuntimeError(f"unsupported graph input kind {spec.kind} for {spec.target}")
            fqn = strip(spec.target)
            kind = WEIGHT_KINDS[spec.kind]
            inputs.append(GraphInput(node.name, kind, fqn))
            val = node.meta["val"]
            param_specs[fqn] = ParamSpec(fqn, kind, tuple(val.shape), val.dtype)
            if kind == "constant":
                constants[fqn] = exported.constants[spec.target]
            elif spec.target not in state and spec.target in exported.constants:
                constants[fqn] = exported.constants[spec.target]  # non-persistent buffers

        ranges = _user_input_ranges(exported, [n for n, i in zip(placeholders, inputs) if i.kind == "user"])
        module_names, module_types = _module_tables(model)
        gm = exported.graph_module
        _drop_unread_constants(gm.graph, [node for node, spec in zip(placeholders, inputs) if spec.kind == "constant"])
        gm.graph.eliminate_dead_code()
        # Tied weights (lm_head = embeddings) are lifted under both names with one of them
        # unused; keep the graph's inputs to the weights it reads.
        for node, spec in zip(placeholders, list(inputs)):
            if spec.kind != "user" and not node.users:
                gm.graph.erase_node(node)
                inputs.remove(spec)
                param_specs.pop(spec.target, None)
        gm.recompile()
        return cls(gm, mode=mode, family=family, inputs=inputs, param_specs=param_specs,
                   state_specs=state_specs, module_names=module_names, module_types=module_types,
                   capture_device=capture_device, constants=constants, config=getattr(model, "config", None),
                   ranges=ranges, packed=packed)

    # ----------------------------------------------------------------- weights
    def bind(self, model_or_weights) -> "Program":
        """Attach real weights (a model, or a dict FQN -> tensor) and retarget devices."""
        if isinstance(model_or_weights, torch.nn.Module):
            named = dict(model_or_weights.named_parameters(remove_duplicate=False))
            named.update(model_or_weights.named_buffers(remove_duplicate=False))
        else:
            named = dict(model_or_weights)
        weights = {}
        for fqn, spec in self.param_specs.items():
            tensor = named.get(fqn, self.constants.get(fqn))
            if tensor is None:
                raise KeyError(f"no weight for graph input {fqn!r}")
            if tensor.device.type == "meta":
                raise ValueError(f"weight {fqn!r} is on the meta device; load real weights before binding")
            weights[fqn] = tensor
        self.weights = weights
        device = next(iter(weights.values())).device if weights else self.capture_device
        self.retarget(device)
        return self

    def retarget(self, device) -> None:
        """Rewrite ``device=`` arguments of factory ops recorded at capture time."""
        device = torch.device(device)

        def swap(value):
            return device if isinstance(value, torch.device) and value != device else value

        # Positional devices too (``aten.to.device(x, device, dtype)``), and nested graphs:
        # regions HF runs under torch.no_grad/autocast (Llama's rotary embedding) are captured
        # as submodules called by a wrap higher-order op.
        folded = self.folded.graph_module.modules() if self.folded is not None else ()
        for module in (*self.graph_module.modules(), *folded):
            if not isinstance(module, torch.fx.GraphModule):
                continue
            changed = False
            for node in module.graph.nodes:
                args = torch.fx.node.map_aggregate(node.args, swap)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
                if args != node.args or kwargs != node.kwargs:
                    node.args, node.kwargs = args, kwargs
                    changed = True
            if changed:
                module.recompile()
        self.capture_device = device

    # ----------------------------------------------------------------- calling
    @property
    def executable(self):
        """What runs the graph: the graph module, or under ``compile`` its compiled form."""
        if not self.compile:
            return self.graph_module
        if self._compiled is None or self._compiled.graph_module is not self.graph_module:
            from .runtime.compiled import CompiledGraph

            self._compiled = CompiledGraph(self)
        return self._compiled

    @property
    def compilations(self) -> list[dict]:
        """Every compilation of this program and its shape siblings so far: ``{"seconds", "shapes"}``."""
        return [c for p in (self, *self.siblings) if p._compiled is not None for c in p._compiled.compilations]

    def weight_args(self) -> list[torch.Tensor]:
        if self.weights is None:
            raise RuntimeError("this program has no weights bound: call program.bind(model) first "
                               "(a model captured on the meta device has none)")
        derived = self.folded.values(self.weights) if self.folded is not None else {}
        return [derived[i.target] if i.kind == "derived" else self.weights[i.target]
                for i in self.inputs if i.kind != "user"]

    def admits(self, user_inputs) -> bool:
        """Whether the shapes of ``user_inputs`` lie in the ranges this graph was traced for."""
        for (index, dim), (lo, hi) in self.ranges.items():
            if index >= len(user_inputs) or user_inputs[index].dim() <= dim:
                return False
            if not lo <= user_inputs[index].shape[dim] <= hi:
                return False
        return True

    def for_shapes(self, user_inputs) -> "Program":
        """This program, or the sibling in the shape-bucket cache that serves these shapes."""
        for candidate in (self, *self.siblings):
            if candidate.admits(user_inputs):
                return candidate
        if self.recapture is None:
            raise ValueError(
                f"this {self.mode} program serves shapes {self.describe_ranges()}, not "
                f"{[tuple(t.shape) for t in user_inputs][:3]}; capture it again with example shapes "
                "inside the range you need"
            )
        with _RECAPTURE_LOCK:  # the ranks of a SimulatedMesh are threads; export is not thread-safe
            for candidate in self.siblings:  # another thread may have captured it meanwhile
                if candidate.admits(user_inputs):
                    return candidate
            sibling = self.recapture(self, user_inputs)
            self.siblings.append(sibling)
        return sibling

    def describe_ranges(self) -> str:
        parts = [f"input{i}.shape[{d}] in [{lo}, {hi}]" for (i, d), (lo, hi) in sorted(self.ranges.items())
                 if lo != hi]
        return "; ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")

    def __call__(self, input_ids, states=None, *, attention_mask=None, position_ids=None, cu_seqlens=None,
                 cache_position=None, check_inputs: bool = True):
        """forward: ``logits``; prefill/decode/chunk: ``(logits, states)``.

        ``input_ids`` may be a :class:`~ssmshard.packing.PackedBatch` (or come with
        ``cu_seqlens=``) for a packed program; a program captured without packing refuses
        sequence boundaries rather than run the sequences as one. Prefill/decode take HF
        generation inputs: without ``attention_mask`` the batch is unpadded (decode: past length
        read from the key/value states), without ``position_ids`` positions count from the past.
        ``check_inputs``: check the ids (``inputs.check_input_ids``: shape, dtype, device, range)
        before running; only callers that produced the ids themselves skip it. A static-K/V decode
        program (``static_kv``) takes static states, the mask over all their positions and
        ``cache_position`` (0-d: the slot of the new token), all required
        (``runtime.static_kv.StaticKVDecode`` builds them).
        """
        from .inputs import check_input_ids
        from .packing import PackedBatch, packed_call_inputs, refuse_packing_info

        if check_inputs:
            ids = input_ids.input_ids if isinstance(input_ids, PackedBatch) else input_ids
            check_input_ids(ids, self.vocab_size, self.weights_device)
        if self.packed:
            user = list(packed_call_inputs(input_ids, cu_seqlens, position_ids))
        elif self.mode == "forward":
            refuse_packing_info(self.mode, input_ids, cu_seqlens, position_ids)
            user = [input_ids]
        elif self.static_kv:
            if attention_mask is None or position_ids is None or cache_position is None or states is None:
                raise TypeError("a static key/value decode program takes states, attention_mask (over every buffer "
                                "position), position_ids and cache_position; runtime.static_kv.StaticKVDecode "
                                "builds them from prefill's states")
            user = [input_ids, attention_mask, position_ids, *states, cache_position]
        else:
            refuse_packing_info(self.mode, input_ids, cu_seqlens)  # positions are an input here
            stateful = self.mode in ("decode", "chunk")
            states = _require_states(states) if stateful else []
            if attention_mask is None:
                past = self.past_length(states) if stateful else 0
                attention_mask, default_positions = unpadded_mask_and_positions(input_ids, past)
                position_ids = default_positions if position_ids is None else position_ids
            elif position_ids is None:
                _, position_ids = unpadded_mask_and_positions(input_ids, attention_mask.shape[1] - input_ids.shape[1])
            user = [input_ids, attention_mask, position_ids, *states]
        if self.mode == "forward":
            target = self.for_shapes(user)
            outputs = target.executable(*target.weight_args(), *user)
            return outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        return self.run(user)

    def run(self, user_inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(logits, states)`` of a prefill/decode/chunk graph on its user inputs, as the graph
        orders them (the graph of ``program.siblings`` that serves their shapes)."""
        target = self.for_shapes(user_inputs)
        if self.mode in ("prefill", "chunk") and not self.static_kv:
            target = target._unpadded_if(user_inputs[1])
        outputs = target.executable(*target.weight_args(), *user_inputs)
        return outputs[0], list(outputs[1:])

    def _unpadded_if(self, attention_mask) -> "Program":
        """This program, or its copy without what the mask does (``passes/unpadded.py``) when
        every entry of ``attention_mask`` is 1."""
        if self.unpadded is None:
            from .passes.unpadded import unpadded_variant

            self.unpadded = unpadded_variant(self) or False
        if self.unpadded is False or not bool((attention_mask == 1).all()):
            return self
        variant = self.unpadded
        variant.weights, variant.folded = self.weights, self.folded
        if variant.capture_device != self.capture_device:  # this program was retargeted since
            variant.retarget(self.capture_device)
        return variant

    @property
    def vocab_size(self) -> int | None:
        """Rows of the token embedding (the ids a program accepts), else the config's vocab_size."""
        for spec in self.param_specs.values():
            if spec.role == "embed" and len(spec.shape) == 2:
                return spec.shape[0]
        return getattr(self.config, "vocab_size", None)

    @property
    def weights_device(self) -> torch.device | None:
        """Where the bound weights live (None before ``bind``)."""
        if not self.weights:
            return None
        return next(iter(self.weights.values())).device

    def past_length(self, states) -> int:
        """Tokens already seen, from the key states (0 for models without attention)."""
        keys = [t for t, spec in zip(states, self.state_specs) if spec.kind == "key"]
        return max((k.shape[2] for k in keys), default=0)

    # ----------------------------------------------------------------- inspection
    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def require_values(self, what: str) -> None:
        """Raise where ``what`` would read the nodes' fake values, which a stored program lacks."""
        if self.from_store:
            raise ValueError(f"{what} reads every node's value, which a {self.mode} program loaded from the program "
                             "cache does not keep (program_store.py); build the module without program_cache= "
                             "for a program to rewrite or inspect")

    def node_count(self) -> int:
        return sum(1 for n in self.graph.nodes if n.op == "call_function")

    def op_counts(self) -> collections.Counter:
        # Counted by target first: the pipeline asks before and after every pass, and naming each
        # node's target (a schema lookup) was most of that cost on 64-layer programs.
        by_target = collections.Counter(n.target for n in self.graph.nodes if n.op == "call_function")
        counts = collections.Counter()
        for target, count in by_target.items():
            counts[target_name(target)] += count
        return counts

    def print_readable(self, **kwargs) -> str:
        return self.graph_module.print_readable(**kwargs)

    def summary(self) -> str:
        from .inspect import summary_table

        return summary_table(self)

    def report(self, *, activations: bool = False) -> str:
        """Sharding report: each weight's placement and local shape, then every sync point
        (with ``activations``, every op's placement too)."""
        from .inspect import sharding_report

        return sharding_report(self, activations=activations)

    def block_graph(self):
        from .inspect import block_graph

        return block_graph(self)

    def __repr__(self):
        return (f"Program({self.family}, mode={self.mode}{', packed' if self.packed else ''}, "
                f"nodes={self.node_count()}, "
                f"weights={'bound' if self.weights is not None else 'unbound'})")


_RECAPTURE_LOCK = threading.RLock()


def _user_input_ranges(exported, user_nodes):
    """(flat user-input index, dim) -> (lo, hi) for every symbolic dim of the user inputs."""
    ranges = {}
    for index, node in enumerate(user_nodes):
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                vr = exported.range_constraints.get(size.node.expr)
                if vr is not None:
                    bounded = vr.upper not in (int_oo, sympy.oo)
                    ranges[(index, dim)] = (int(vr.lower), int(vr.upper) if bounded else math.inf)
            else:
                ranges[(index, dim)] = (int(size), int(size))
    return ranges


def unpadded_mask_and_positions(input_ids, past: int):
    """An all-ones mask over ``past`` + new tokens and consecutive positions: an unpadded batch."""
    batch, seq = input_ids.shape
    mask = torch.ones(batch, past + seq, dtype=torch.long, device=input_ids.device)
    positions = torch.arange(past, past + seq, device=input_ids.device).expand(batch, seq)
    return mask, positions


def _require_states(states):
    if states is None:
        raise TypeError("decode programs take (input_ids, states)")
    return list(states)


def op_name(node: torch.fx.Node) -> str:
    return target_name(node.target)


def target_name(target) -> str:
    """An op's name as reports show it: ``linear``, ``ssmshard.decode_linear``, ``getitem``."""
    name = getattr(target, "__name__", str(target))
    if hasattr(target, "_schema"):
        name = target._schema.name.split("::")[-1]
        namespace = target.namespace if hasattr(target, "namespace") else ""
        if namespace and namespace != "aten":
            name = f"{namespace}.{name}"
    return name


# Frames of wrappers between the modeling code and the op: from transformers 5.25 the mixers call
# their scan and conv functions through the `kernels` package's layers, and the recorded stack
# ends in the wrapper's forward; the modeling file's call is the line to show.
_WRAPPER_FRAMES = (f"{os.sep}kernels{os.sep}_internals{os.sep}",)


def source_line(node: torch.fx.Node) -> str:
    """The model source line a node was traced from (the innermost frame of its stack trace
    outside wrappers)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in trace.strip().splitlines() if l.strip().startswith("File")]
    own = [l for l in lines if not any(w in l for w in _WRAPPER_FRAMES)]
    return (own or lines or ["(no source line recorded)"])[-1]


def _module_tables(model):
    """Call-site path -> canonical module FQN and class name, for every module.

    A block reused at several call sites (Zamba2's shared transformer) is either one module
    object (older transformers) or separate modules with tied parameters (newer). Either
    way its canonical name is where its parameters are named first, which is also the name
    of the single graph placeholder export gives each shared weight.
    """
    first_name = {}
    for name, param in model.named_parameters():
        first_name.setdefault(id(param), name)
    names, types = {}, {}
    paths = list(model.named_modules(remove_duplicate=False))
    for path, module in paths:
        types[path] = type(module).__name__
        direct = next(iter(module.parameters(recurse=False)), None)
        if direct is not None:
            names[path] = first_name[id(direct)].rpartition(".")[0]
    for path, module in paths:  # containers: by analogy with a descendant that has weights
        if path in names:
            continue
        names[path] = path
        for child_path, child_canonical in names.items():
            if path and child_path.startswith(path + "."):
                suffix = child_path[len(path):]
                if child_canonical.endswith(suffix):
                    names[path] = child_canonical[: -len(suffix)]
                break
    return names, types
