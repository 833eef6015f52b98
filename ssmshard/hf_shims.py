"""Stand-ins for the kernel functions that Hugging Face modeling files call.

HF's SSM mixers call module-level functions (``mamba_selective_scan``, ``mamba2_chunk_scan``,
``causal_conv1d_fn``, ...). Their torch fallbacks loop over tokens in Python, which export
would unroll into thousands of nodes and specialise to one sequence length. During capture
we swap each of them, in the modeling module's namespace, for a shim with the same
signature that calls one ssmshard custom op, so every scan is one graph node.

The fused training entry points (``mamba_inner_fn``, ``mamba2_split_conv1d_scan_combined``)
return ``None`` from HF's own fallback, which makes the mixer take its unfused path; the shims
do the same, whatever kernel package happens to be installed.

Decode-step functions mutate their state argument in place in HF; the shims keep that
contract (``state.copy_(new_state)``) and export's functionalisation turns it into a pure
data flow.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch

from . import ops  # noqa: F401  (registers torch.ops.ssmshard.*)

_ssm = torch.ops.ssmshard


def _refuse_packing(kwargs, what):
    # Sequence boundaries inside a row (seq_idx / cu_seqlens) must never be ignored silently.
    for key in ("seq_idx", "cu_seqlens"):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{what} was called with {key}: packed sequences are not supported by the captured "
                "reference ops yet. Pass one sequence per row (padded) instead."
            )


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    _refuse_packing(kwargs, "causal_conv1d_fn")
    return _ssm.causal_conv1d(hidden_states, weight, bias, activation)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    out, new_state = _ssm.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)
    conv_state.copy_(new_state)
    return out


def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                         delta_softplus=False, return_last_state=False, **kwargs):
    _refuse_packing(kwargs, "selective_scan")
    out, last_state = _ssm.selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias,
                                          bool(delta_softplus), None)
    return (out, last_state) if return_last_state else out


def selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                           dt_softplus=False, z=None, **kwargs):
    out, new_state = _ssm.selective_state_update(state, hidden_states, dt, A, B, C, D, z, dt_bias,
                                                 bool(dt_softplus))
    state.copy_(new_state)
    return out


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                      initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                      return_final_states=False, **kwargs):
    _refuse_packing(kwargs, "mamba2_chunk_scan")
    if kwargs.get("z") is not None:
        raise NotImplementedError("mamba2_chunk_scan with z is not used by any supported HF mixer")
    dt_min, dt_max = (float(v) for v in dt_limit)
    out, final_states = _ssm.ssd_scan(hidden_states, dt, A, B, C, int(chunk_size), D, dt_bias,
                                      initial_states, bool(dt_softplus), dt_min, dt_max)
    return (out, final_states) if return_final_states else out


def fused_path_unavailable(*args, **kwargs):
    """Same answer as HF's own fallback for fused kernels: "not here", take the unfused path."""
    return None


# HF function name -> shim. One table for all families: the modeling files share these names.
SHIMS = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "mamba_selective_scan": mamba_selective_scan,
    "mamba_selective_state_update": selective_state_update,
    "mamba2_selective_state_update": selective_state_update,
    "mamba2_chunk_scan": mamba2_chunk_scan,
    "mamba_inner_fn": fused_path_unavailable,
    "mamba2_split_conv1d_scan_combined": fused_path_unavailable,
}


def gated_rms_norm_forward(self, hidden_states, gate=None):
    """Forward of HF's ``*RMSNormGated`` modules as one op.

    Newer transformers normalise per group (``self.group_size``); older ones over the whole
    width, which is the same op with one group.
    """
    group_size = getattr(self, "group_size", None) or hidden_states.shape[-1]
    return _ssm.gated_rms_norm(hidden_states, gate, self.weight, float(self.variance_epsilon), int(group_size))


@contextlib.contextmanager
def swapped_kernel_functions(modeling_module: str):
    """Within the block, the modeling module calls the shims instead of its kernel functions."""
    module = importlib.import_module(modeling_module)
    saved = {name: getattr(module, name) for name in SHIMS if hasattr(module, name)}
    gated_norms = [cls for name, cls in vars(module).items()
                   if name.endswith("RMSNormGated") and isinstance(cls, type)]
    saved_forwards = {cls: cls.forward for cls in gated_norms}
    try:
        for name in saved:
            setattr(module, name, SHIMS[name])
        for cls in gated_norms:
            cls.forward = gated_rms_norm_forward
        yield sorted(saved)
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        for cls, forward in saved_forwards.items():
            cls.forward = forward
