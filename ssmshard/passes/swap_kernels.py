"""The ``swap_kernels`` pass: run the SSM ops of a program on the Triton kernels.

Every ``torch.ops.ssmshard.*`` node that a kernel serves is retargeted to an adapter with the
op's exact signature. On real CUDA tensors an adapter calls the kernel (its autograd included);
on anything else (the fake tensors of graph verification, CPU tensors) it calls the reference
op, so the graph stays verifiable and a program moved to the CPU stays correct.

A node no kernel serves (an op without a kernel yet, a shape outside a kernel's limits) is
listed in ``program.kernel_report`` and named in a warning: never silently left on the slow
path.

Options: ``kernels`` = "triton" (swap; the default) or "reference" (report only).
"""

from __future__ import annotations

import importlib
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..program import op_name
from .manager import register

ssm = torch.ops.ssmshard


def _on_gpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda and not isinstance(t, FakeTensor)


# ----------------------------------------------------------------------------- adapters
# Module-level functions: FX code generation imports graph call targets by qualified name.
def ssd_scan_kernel(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max,
                    cu_seqlens=None):
    if not _on_gpu(x):
        return ssm.ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max,
                            cu_seqlens)
    from ..kernels.ssd_scan import ssd_scan

    out, final = ssd_scan(x, dt, A, B, C, int(chunk_size), D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=(dt_min, dt_max), initial_states=initial_states, cu_seqlens=cu_seqlens,
                          return_final_states=True, out_dtype=torch.float32)
    # The op's contract: with packed sequences the final state is the last sequence's.
    return out, (final[-1:] if cu_seqlens is not None else final)


def causal_conv1d_kernel(x, weight, bias, activation, cu_seqlens=None):
    if not _on_gpu(x):
        return ssm.causal_conv1d(x, weight, bias, activation, cu_seqlens)
    from ..kernels.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight, bias, activation, cu_seqlens=cu_seqlens)


def causal_conv1d_update_kernel(x, conv_state, weight, bias, activation):
    if not _on_gpu(x) or torch.is_grad_enabled():
        return ssm.causal_conv1d_update(x, conv_state, weight, bias, activation)
    from ..kernels.causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(x, conv_state, weight, bias, activation)


def selective_scan_kernel(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens=None):
    if not _on_gpu(u):
        return ssm.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)
    from ..kernels.selective_scan import selective_scan

    y, final = selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens=cu_seqlens,
                              initial_state=initial_state, return_final_state=True, out_dtype=torch.float32)
    return y, (final[-1:] if cu_seqlens is not None else final)


def selective_state_update_kernel(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    if not _on_gpu(x) or torch.is_grad_enabled():
        return ssm.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    from ..kernels.state_update import selective_state_update

    return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def _ssd_limits(node):
    x, B = node.args[0].meta["val"], node.args[3].meta["val"]
    if x.shape[-1] > 128 or B.shape[-1] > 256:
        return f"head dim {x.shape[-1]} > 128 or state size {B.shape[-1]} > 256 (kernel limits)"
    return None


# op -> (adapter, module the kernel lives in, static check returning why it cannot serve a node)
KERNELS = {
    ssm.ssd_scan.default: (ssd_scan_kernel, "ssmshard.kernels.ssd_scan", _ssd_limits),
    ssm.causal_conv1d.default: (causal_conv1d_kernel, "ssmshard.kernels.causal_conv1d", None),
    ssm.causal_conv1d_update.default: (causal_conv1d_update_kernel, "ssmshard.kernels.causal_conv1d", None),
    ssm.selective_scan.default: (selective_scan_kernel, "ssmshard.kernels.selective_scan", None),
    ssm.selective_state_update.default: (selective_state_update_kernel, "ssmshard.kernels.state_update", None),
}
# Ops that are not kernels' business (collectives, norms handled by torch).
_NOT_KERNELS = {"all_reduce", "tp_copy", "all_gather", "gated_rms_norm"}


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
    if mode not in ("triton", "reference"):
        raise ValueError(f"kernels must be 'triton' or 'reference', got {mode!r}")
    report = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith("ssmshard."):
            continue
        name = op_name(node).rsplit(".", 1)[-1]  # "ssmshard.ssd_scan" -> "ssd_scan"
        if name in _NOT_KERNELS:
            continue
        entry = KERNELS.get(node.target)
        why = "no Triton kernel for this op" if entry is None else None
        if entry is not None:
            adapter, module, check = entry
            why = _kernel_module_error(module) or (check(node) if check else None)
        if mode == "reference":
            why = why or "kernels='reference' was asked for"
        if why is None:
            node.target = adapter
        report.append({"node": node.name, "op": name, "kernel": "triton" if why is None else None,
                       "why": why})
    program.graph_module.recompile()
    program.kernel_report = report
    slow = [r for r in report if r["kernel"] is None and mode == "triton"]
    if slow:
        listed = ", ".join(f"{r['node']} ({r['op']}: {r['why']})" for r in slow[:6])
        warnings.warn(f"swap_kernels: {len(slow)} of {len(report)} SSM op nodes stay on the reference path: "
                      f"{listed}{' ...' if len(slow) > 6 else ''}", stacklevel=2)
    return program
