"""The ``swap_kernels`` pass: run the SSM ops and the norms of a program on the Triton kernels.

Every ``torch.ops.ssmshard.*`` node that a kernel serves is retargeted to an adapter with the
op's exact signature. On real CUDA tensors an adapter calls the kernel (its autograd included);
on anything else (the fake tensors of graph verification, CPU tensors) it calls the reference
op, so the graph stays verifiable and a program moved to the CPU stays correct.

A node no kernel serves (an op without a kernel yet, a shape outside a kernel's limits) is
listed in ``program.kernel_report`` and named in a warning: never silently left on the slow
path.

Options: ``kernels`` = "triton" (swap; the default) or "reference" (report only); ``compile``:
retarget to the adapters as opaque ops (``kernel_ops``), which ``torch.compile`` keeps as they
are, instead of the Python adapters (``Plan(compile=True)``).

Under ``compile`` the norms and the rotary embedding are the exception: their nodes call the reference functions
(``kernels/reference.py``), which Dynamo traces into ATen ops, so that Inductor generates each
norm fused with its neighbours: the cast after it, the residual add, the strided slice of the
packed projection a gate is read from. An opaque norm kernel makes those separate passes over
memory (on an H200, Mamba-2's gated norm at 16384 x 5120 with its gate copy and cast took 0.56 ms
as the opaque kernel, 0.24 ms as Inductor's kernel; docs/compile.md).
"""

from __future__ import annotations

import importlib
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..kernels import reference
from ..ops import SIGNATURES
from ..program import op_name
from .kernel_ops import opaque_kernel_op
from .manager import register

ssm = torch.ops.ssmshard


# The floating dtypes the Triton kernels take (kernels/rounding.TL_DTYPES; not imported from
# there, since that module needs Triton, which a CPU-only install may lack).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_gpu(t) -> bool:
    """A real CUDA tensor, or a non-empty list of them (``rotary``'s first argument)."""
    if isinstance(t, (list, tuple)):
        return bool(t) and all(_on_gpu(item) for item in t)
    return isinstance(t, torch.Tensor) and t.is_cuda and not isinstance(t, FakeTensor)


# ----------------------------------------------------------------------------- adapters
def _last_sequence(final, cu_seqlens):
    """The op's contract: with packed sequences the final state is the last sequence's."""
    return final[-1:] if cu_seqlens is not None else final


def _call_selective_scan(kernel, a):
    out_dtype, final_state = a.pop("out_dtype") or torch.float32, a.pop("final_state")
    if not final_state:  # the op's empty stand-in: a kernel not writing the state runs faster (scan_outputs)
        y = kernel(**a, return_final_state=False, out_dtype=out_dtype)
        return y, y.new_empty((*y.shape[:2], 0), dtype=torch.float32)
    y, final = kernel(**a, return_final_state=True, out_dtype=out_dtype)
    return y, _last_sequence(final, a["cu_seqlens"])


def _call_ssd_scan(kernel, a):
    dt_limit = (a.pop("dt_min"), a.pop("dt_max"))
    out, final = kernel(**a, dt_limit=dt_limit, return_final_states=True, out_dtype=torch.float32)
    return out, _last_sequence(final, a["cu_seqlens"])


def _call_by_name(kernel, a):
    return kernel(**a)


def _adapter(name: str, module: str, call, inference_only: bool):
    """The graph target replacing ``ssmshard.<name>`` nodes. It takes the op's own arguments (its
    declared schema) and hands them by name, through ``call``, to the Triton function of the same
    name in ``module`` on CUDA tensors; to the reference op elsewhere, and under grad mode when
    the kernel is ``inference_only`` (no backward).

    The adapter is bound to a module-level name (``<name>_kernel``): FX code generation
    imports graph call targets by qualified name.
    """
    signature, op = SIGNATURES[name], getattr(ssm, name)

    def adapter(*args, **kwargs):
        bound = signature.bind(args, kwargs)
        if not _on_gpu(bound[signature.names[0]]) or (inference_only and torch.is_grad_enabled()):
            return op(*args, **kwargs)
        return call(getattr(importlib.import_module(module), name), bound)

    adapter.__name__ = adapter.__qualname__ = f"{name}_kernel"
    adapter.__doc__ = f"``ssmshard.{name}`` on its Triton kernel (CUDA tensors) or the reference op."
    globals()[adapter.__name__] = adapter
    return adapter


def _ssd_limits(node):
    a = SIGNATURES["ssd_scan"].bind(node.args, node.kwargs)
    x, B = a["x"].meta["val"], a["B"].meta["val"]
    if x.shape[-1] > 128 or B.shape[-1] > 256:
        return f"head dim {x.shape[-1]} > 128 or state size {B.shape[-1]} > 256 (kernel limits)"
    return None


def _norm_limits(node):
    """One program normalises one group of channels (a row, but for the gated norm's groups)."""
    name = op_name(node).rsplit(".", 1)[-1]
    a = SIGNATURES[name].bind(node.args, node.kwargs)
    width = a["group_size"] if name == "gated_rms_norm" else a["x"].meta["val"].shape[-1]
    limit = importlib.import_module("ssmshard.kernels.rms_norm").MAX_WIDTH  # importable: checked before
    return f"group of {width} channels > {limit} (kernel limit)" if width > limit else None


# Op (and Triton function) name, the kernel's module, how the adapter calls it, whether the
# kernel is inference-only, and a static check returning why it cannot serve a node.
_TRITON = [
    ("selective_scan", "ssmshard.kernels.selective_scan", _call_selective_scan, False, None),
    ("ssd_scan", "ssmshard.kernels.ssd_scan", _call_ssd_scan, False, _ssd_limits),
    ("causal_conv1d", "ssmshard.kernels.causal_conv1d", _call_by_name, False, None),
    ("causal_conv1d_update", "ssmshard.kernels.causal_conv1d", _call_by_name, True, None),
    ("selective_state_update", "ssmshard.kernels.state_update", _call_by_name, True, None),
    # The norms' kernels have no backward: under grad mode the adapters run the reference op.
    ("rms_norm", "ssmshard.kernels.rms_norm", _call_by_name, True, _norm_limits),
    ("add_rms_norm", "ssmshard.kernels.rms_norm", _call_by_name, True, _norm_limits),
    ("gated_rms_norm", "ssmshard.kernels.rms_norm", _call_by_name, True, _norm_limits),
    # A decode step's linear layers (``decode_gemv``); more rows than the kernel serves go to cuBLAS.
    ("decode_linear", "ssmshard.kernels.gemv", _call_by_name, True, None),
    ("decode_linear_group", "ssmshard.kernels.gemv", _call_by_name, True, None),
    # Attention's rotary embedding (``fuse_rotary``); the kernel has no backward.
    ("rotary", "ssmshard.kernels.rotary", _call_by_name, True, None),
]
# op -> (adapter, module the kernel lives in, static check)
KERNELS = {getattr(ssm, name).default: (_adapter(name, module, call, inference_only), module, check)
           for name, module, call, inference_only, check in _TRITON}
# op -> its adapter as an opaque op (``kernel_ops``): the target under ``compile``.
KERNEL_OPS = {op: opaque_kernel_op(op.name().split("::")[-1], adapter) for op, (adapter, _, _) in KERNELS.items()}
# op -> the reference function its nodes call under ``compile``, for Inductor to fuse (docstring).
LEFT_TO_INDUCTOR = {getattr(ssm, name).default: getattr(reference, name)
                    for name in ("rms_norm", "add_rms_norm", "gated_rms_norm", "rotary")}
COMPILE_TARGETS = {**KERNEL_OPS, **LEFT_TO_INDUCTOR}
# The ops a kernel could serve: every op with a declared signature. Collectives and other
# ssmshard ops are not kernels' business.
_KERNEL_CANDIDATES = set(SIGNATURES)


def _kernel_module_error(module: str):
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or Triton missing
        return f"{module} unavailable: {type(exc).__name__}: {exc}"
    return None


@register("swap_kernels")
def swap_kernels(program, ctx):
    """Retarget reference SSM op nodes to their Triton kernels (see module docstring)."""
    mode = ctx.options.get("kernels", "triton")
    targets = COMPILE_TARGETS if ctx.options.get("compile", False) else None
    if mode not in ("triton", "reference"):
        raise ValueError(f"kernels must be 'triton' or 'reference', got {mode!r}")
    report = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith("ssmshard."):
            continue
        name = op_name(node).rsplit(".", 1)[-1]  # "ssmshard.ssd_scan" -> "ssd_scan"
        if name not in _KERNEL_CANDIDATES:
            continue
        entry = KERNELS.get(node.target)
        why = "no Triton kernel for this op" if entry is None else None
        if entry is not None:
            adapter, module, check = entry
            why = _kernel_module_error(module) or (check(node) if check else None)
        if mode == "reference":
            why = why or "kernels='reference' was asked for"
        kernel = None
        if why is None:
            kernel = "inductor" if targets is not None and node.target in LEFT_TO_INDUCTOR else "triton"
            node.target = adapter if targets is None else targets[node.target]
        report.append({"node": node.name, "op": name, "kernel": kernel, "why": why})
    program.kernel_report = report
    slow = [r for r in report if r["kernel"] is None and mode == "triton"]
    if slow:
        listed = ", ".join(f"{r['node']} ({r['op']}: {r['why']})" for r in slow[:6])
        warnings.warn(f"swap_kernels: {len(slow)} of {len(report)} SSM op nodes stay on the reference path: "
                      f"{listed}{' ...' if len(slow) > 6 else ''}", stacklevel=2)
    return program
