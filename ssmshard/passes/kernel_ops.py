"""``torch.ops.ssmshard_kernels``: the kernel adapters as opaque ops, for compiled programs.

``swap_kernels`` retargets SSM op nodes to Python adapters that choose, call by call, the Triton
kernel (CUDA tensors) or the reference op. ``torch.compile`` cannot keep such a target: Dynamo
traces the Python inside it, and with the fake tensors it traces on, the adapter takes its
reference branch. Under ``Plan(compile=True)`` the nodes go to these ops instead: one per
adapter, with the op's schema and fake, opaque to Dynamo and Inductor, choosing kernel or
reference when they run. Their outputs are put in the layout the fake declares
(``ops.ssm.in_declared_layout``), because Inductor reads (and asserts) the declared strides.

They are differentiable by recompute through the adapter (so on CUDA through the kernel's own
backward), itself an opaque op (``<name>_grad``): a compiled training step runs each kernel's
forward twice.

``<name>_into_state`` (the decode-step ops): the new state written into the state argument,
declared mutated, and only the output returned, for ``inplace_decode_states`` in compiled
programs (an opaque op may not return one of its inputs).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from ..ops import SIGNATURES
from ..ops.ssm import (FAKES, _register_autograd_by_recompute, declared_outputs, in_declared_layout, on_meta,
                       recompute_grads)

NAMESPACE = "ssmshard_kernels"


def opaque_kernel_op(name: str, adapter: Callable):
    """``ssmshard_kernels::<name>``: ``adapter`` (taking ``ssmshard.<name>``'s arguments) as an opaque op."""
    signature, fake = SIGNATURES[name], FAKES[name]

    def run(*args, **kwargs):
        return in_declared_layout(adapter(*args, **kwargs), declared_outputs(fake, signature, args, kwargs))

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run, mutates_args=(), schema=signature.schema)
    op.register_fake(lambda *args, **kwargs: fake(**signature.bind(args, kwargs)))
    backward = _opaque_backward(name, adapter)
    _register_autograd_by_recompute(op, adapter, lambda args, grads, wanted: backward(*args, list(grads), wanted))
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _opaque_backward(name: str, adapter: Callable):
    """``ssmshard_kernels::<name>_grad(<the op's arguments>, output_grads, wanted)``: the gradients of
    the op's outputs with respect to its arguments at the indices ``wanted`` (zeros where none
    flows), by recompute through ``adapter``. Opaque, so that a compiled backward calls the
    kernel's own backward rather than tracing into it."""
    signature = SIGNATURES[name]
    arguments = re.sub(r"=[^,)]*", "", signature.schema.split(" -> ")[0])  # no defaults: more arguments follow
    schema = arguments[:-1] + ", Tensor?[] output_grads, int[] wanted) -> Tensor[]"

    def run(*args):
        *op_args, output_grads, wanted = args
        with _autograd_recording():
            grads = recompute_grads(adapter, op_args, output_grads, wanted)
        return [torch.zeros_like(op_args[i]) if g is None else in_declared_layout(g, torch.empty_like(on_meta(op_args[i])))
                for i, g in zip(wanted, grads)]

    def fake(*args):
        *op_args, _, wanted = args
        return [torch.empty_like(op_args[i]) for i in wanted]

    op = torch.library.custom_op(f"{NAMESPACE}::{name}_grad", run, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return getattr(getattr(torch.ops, NAMESPACE), f"{name}_grad").default


def opaque_state_writer(name: str, state_argument: str, writer: Callable):
    """``ssmshard_kernels::<name>_into_state``: ``writer`` (returning ``(out, state argument)``, the new
    state written into it) as an opaque op mutating ``state_argument`` and returning ``out``."""
    signature, fake = SIGNATURES[name], FAKES[name]
    arguments = signature.schema.split(" -> ")[0]
    if f"Tensor {state_argument}," not in arguments:
        raise ValueError(f"{name}: no tensor argument {state_argument!r} in {signature.schema}")
    schema = arguments.replace(f"Tensor {state_argument},", f"Tensor(a!) {state_argument},", 1) + " -> Tensor"

    def run(*args, **kwargs):
        out, _ = writer(*args, **kwargs)
        return in_declared_layout(out, declared_outputs(fake, signature, args, kwargs)[0])

    op = torch.library.custom_op(f"{NAMESPACE}::{name}_into_state", run, mutates_args=(state_argument,),
                                 schema=schema)
    op.register_fake(lambda *args, **kwargs: fake(**signature.bind(args, kwargs))[0])
    return getattr(getattr(torch.ops, NAMESPACE), f"{name}_into_state").default


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")


def _autograd_recording():
    """A context in which autograd records again: an op's implementation runs below the autograd
    dispatch keys (excluded from this thread's dispatch), where ``enable_grad`` alone records nothing."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(getattr(torch._C.DispatchKey, key))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)
