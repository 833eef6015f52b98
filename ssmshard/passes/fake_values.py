"""Fake-tensor propagation that recomputes only what a pass changed.

The verifier re-propagates fake values after every pass that may change shapes. A full
propagation runs every op of the program over symbolic shapes, most of it on nodes the pass
did not touch (at tp=1 ``localize`` and ``communicate`` change next to nothing). Here a node is
recomputed only when its op, its arguments or an input's value differ from the last
propagation; a recomputed node whose value comes out with the same metadata (shape, strides,
dtype, device: what a fake tensor carries) keeps its previous value object, so what follows it
is not recomputed either. Each skipped node is one whose op ran before on exactly these input
values, so the values it keeps are what a full propagation would compute.

Within one propagation, a node whose op and arguments equal an earlier node's, inputs compared by
their metadata (every layer of a 64-layer model runs the same ops on inputs of the same shapes),
takes that node's value instead of running the op again: a fake value is a function of its inputs'
metadata and the op's other arguments. Not where that is not so: inputs that carry a constant's
data (lifted constants) and values naming a symbol their inputs do not (data-dependent sizes).

``SSMSHARD_FULL_PROPAGATION=1`` propagates every node, every time.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import map_aggregate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

# node.meta key: (what the node computed from, the value it computed) at its last propagation.
_PROPAGATED = "ssmshard_propagated"
# graph.__dict__ key: alike key -> the value ``shard.context.new_node`` computed for it during one
# pass (run_pipeline drops it after each pass; the verifier then recomputes every new node).
ALIKE_VALUES = "_ssmshard_alike_values"


def propagate_fake_values(gm: torch.fx.GraphModule, vals: list) -> None:
    """Run the graph on its placeholders' fake values, refreshing every node's ``meta["val"]``.

    Attention is propagated through SDPA's math backend: on CUDA the fused backends' fake
    kernels pad the mask with ``constant_pad_nd``, which refuses the symbolic key length of a
    growing-cache decode program. Only shapes and dtypes are computed here, and they do not
    depend on the backend; the program itself runs whichever backend torch picks.

    Ops run under :func:`fake_execution`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    full = os.environ.get("SSMSHARD_FULL_PROPAGATION", "") not in ("", "0")
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), fake_execution():
        _ChangedOnly(gm, detect_fake_mode(vals), full=full).propagate_dont_convert_inputs(*vals)


def fake_execution():
    """The context every op runs in on fake values here (the verifier's propagation, a pass's new
    node): composite ops take their Python decompositions through the Python dispatcher, as
    export traces them. torch 2.11's export keeps Llama's rotary embedding as a higher-order op
    (``_higher_order_ops/wrap.py``) whose subgraph calls the composite ``aten.matmul``; run
    without the Python dispatcher, its fake kernel reads the operands' sizes as integers, and the
    shape environment then replaces the batch and sequence symbols by the example sizes for the
    whole program (benchmarks/results/gpu_suite/)."""
    return enable_python_dispatcher()


class _ChangedOnly(FakeTensorProp):
    def __init__(self, gm, mode, *, full: bool):
        super().__init__(gm, mode)
        self.full = full
        self.alike: dict = {}  # (op, inputs' metadata and arguments) -> (the value computed for them, its symbols)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            # The given values are the placeholders' own meta["val"] objects: keep them, so
            # that their identity tells the nodes below whether an input changed.
            return torch.fx.Interpreter.run_node(self, n)
        if n.op != "call_function":
            return super().run_node(n)
        inputs = (n.target, leaves((n.args, n.kwargs), self.env))
        previous = n.meta.get(_PROPAGATED)
        if (not self.full and previous is not None and previous[1] is n.meta.get("val")
                and _same_inputs(previous[0], inputs) and not self._simplifiable(previous[2])):
            return previous[1]
        old = n.meta.get("val")
        key = None if self.full else alike_key(inputs)
        if key is not None and key in self.alike:
            n.meta["val"], symbols = self.alike[key]
        else:
            super().run_node(n)
            symbols = free_symbols(n.meta.get("val"))
            if key is not None and symbols <= free_symbols(inputs[1]):
                self.alike[key] = (n.meta.get("val"), symbols)
        new = n.meta.get("val")
        if old is not None and new is not None and _same_metadata(old, new):
            n.meta["val"] = new = old  # unchanged: what reads it need not be recomputed (same symbols)
        # Its symbols too: every later propagation asks whether one was replaced (_simplifiable).
        n.meta[_PROPAGATED] = (inputs, new, symbols)
        return new

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.linear.default:
            return linear_value(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def _simplifiable(self, symbols: set) -> bool:
        """Whether a value naming ``symbols`` names one the shape environment has since replaced
        (export may trace two lengths as two symbols and learn later that they are one): a full
        propagation would write the simpler form, so recompute."""
        shape_env = self._mode.shape_env
        if shape_env is None or not shape_env.replacements:
            return False
        replaced = shape_env.replacements
        return any(symbol in replaced for symbol in symbols)


def linear_value(x, weight, bias=None):
    """``aten.linear``'s value for shape propagation: (*x.shape[:-1], out_features), contiguous,
    in x's dtype. torch's own kernel is not used here: on CUDA fake tensors it asks a symbolic-shaped
    input for its ``numel()`` (through ``matmul``) and raises, where on CPU ones it does not."""
    # The checks torch's kernel makes: a pass that wires the wrong value in must still fail here.
    torch._check(weight.dim() == 2 and x.shape[-1] == weight.shape[1],
                 lambda: f"linear: input {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    torch._check(x.dtype == weight.dtype, lambda: f"linear: input {x.dtype} with weight {weight.dtype}")
    torch._check(bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
                 lambda: f"linear: bias {tuple(bias.shape)} for weight {tuple(weight.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def free_symbols(value) -> set:
    if isinstance(value, (tuple, list)):
        return set().union(*(free_symbols(v) for v in value)) if value else set()
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride(), value.storage_offset())
        return set().union(*(s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(value.node.expr.free_symbols)
    return set()


def alike_key(inputs):
    """A hashable stand-in for ``(op, input leaves)`` that two nodes share exactly when the op
    and every argument agree, tensors by metadata; None where no such key is safe."""
    target, values = inputs
    key = [target]
    for leaf in values:
        if isinstance(leaf, FakeTensor):
            if leaf.constant is not None:
                return None  # carries data that a value may depend on
            key.append((FakeTensor, leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad,
                        _exprs(leaf.shape), _exprs(leaf.stride()), _exprs((leaf.storage_offset(),))))
        elif isinstance(leaf, torch.Tensor):
            return None
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            key.append((type(leaf), leaf.node.expr))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            key.append((type(leaf), leaf))
    return tuple(key)


def _exprs(sizes) -> tuple:
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in sizes)


def leaves(args, env) -> list:
    """``args`` flattened, each node replaced by its current value."""
    out = []
    map_aggregate(args, lambda a: out.append(env[a] if isinstance(a, torch.fx.Node) else a))
    return out


def _same_inputs(before, now) -> bool:
    (target_before, leaves_before), (target_now, leaves_now) = before, now
    return (target_before is target_now and len(leaves_before) == len(leaves_now)
            and all(_same_leaf(a, b) for a, b in zip(leaves_before, leaves_now)))


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) or \
            isinstance(b, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False  # a value that is not the very object computed last time
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an argument without a plain equality: treat as changed
        return False


def _same_metadata(a, b) -> bool:
    """Whether two propagated values carry the same metadata (no guard is added comparing them)."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_metadata(x, y) for x, y in zip(a, b)))
    if isinstance(a, FakeTensor) or isinstance(b, FakeTensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.device == b.device
                and a.requires_grad == b.requires_grad and a.layout == b.layout
                and _same_sizes(a.shape, b.shape) and _same_sizes(a.stride(), b.stride())
                and _same_size(a.storage_offset(), b.storage_offset()))
    return False  # symbolic and plain scalars are cheap: take the new one


def _same_sizes(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _same_size(a, b) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)
                and a.node.expr == b.node.expr)  # structural: sympy, not a guard
    return a == b

