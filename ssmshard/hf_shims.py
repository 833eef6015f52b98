"""Stand-ins for the kernel functions that Hugging Face modeling files call.

HF's SSM mixers call module-level functions (``mamba_selective_scan``, ``mamba2_chunk_scan``,
``causal_conv1d_fn``, ...). Their torch fallbacks loop over tokens in Python, which export
would unroll into thousands of nodes and specialise to one sequence length. During capture
we swap each of them, in the modeling module's namespace, for a shim with the same
signature that calls one ssmshard custom op, so every scan is one graph node.

The fused training entry points (``mamba_inner_fn``, ``mamba2_split_conv1d_scan_combined``)
return ``None`` from HF's own fallback, which makes the mixer take its unfused path; the shims
do the same, whatever kernel package happens to be installed.

Each shim calls its op by the argument names of the op's declaration (``ops.signatures``),
so the dispatcher rejects a name the declaration does not have, and a test checks that every
shim passes every argument.

Decode-step functions mutate their state argument in place in HF; the shims keep that
contract (``state.copy_(new_state)``) and export's functionalisation turns it into a pure
data flow.

Packed sequences: HF mixers have no argument that would carry ``cu_seqlens`` from the model's
call down to the kernel functions (and where they forward ``**kwargs``, versions differ in
what they do with it). So the packed capture wrapper puts the graph's ``cu_seqlens`` tensor
in a context variable for the duration of the trace (``packed_sequences``), and every scan
and conv shim passes it to its op: each of those graph nodes then takes ``cu_seqlens`` as an
input. Decode-step shims refuse to run under packing.

Continued prefill (chunked prefill): HF's Mamba-1 mixers (Mamba, Falcon-Mamba, Zamba) call the
full-sequence scan without the layer's recurrent state, so a prompt processed in chunks would
restart every chunk from zero (Mamba-2 mixers pass ``initial_states`` themselves, and HF's
conv cache already prepends the previous chunk's inputs). The chunk capture wrapper therefore
queues each Mamba-1 layer's state, in layer order, in a context variable
(``continued_scans``); the scan shim takes the next one as the op's ``initial_state`` (one
head of it per call for Zamba's per-head scans), and the wrapper checks every state was used.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch

from . import ops  # noqa: F401  (registers torch.ops.ssmshard.*)

_ssm = torch.ops.ssmshard

# The cu_seqlens tensor of the packed batch being traced, or None outside packed capture.
_PACKED_CU_SEQLENS: contextvars.ContextVar = contextvars.ContextVar("ssmshard_packed_cu_seqlens", default=None)


@contextlib.contextmanager
def packed_sequences(cu_seqlens: torch.Tensor):
    """Within the block, every scan/conv shim passes ``cu_seqlens`` to its op."""
    token = _PACKED_CU_SEQLENS.set(cu_seqlens)
    try:
        yield
    finally:
        _PACKED_CU_SEQLENS.reset(token)


def _packed_cu_seqlens(kwargs, what):
    """The cu_seqlens of the packed trace (or None); boundaries passed through HF are refused.

    Sequence boundaries that HF hands down (``seq_idx`` / ``cu_seqlens`` kwargs) come from a
    call ssmshard did not make; they must never be ignored silently.
    """
    for key in ("seq_idx", "cu_seqlens"):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{what} was called with {key} by the Hugging Face model: ssmshard does not take "
                "packing information through HF's arguments. Capture with "
                "ssmshard.capture(model, packed=True) and call the program with ssmshard.pack(...)."
            )
    return _PACKED_CU_SEQLENS.get()


class _ScanStateQueue:
    """Recurrent states of the Mamba-1 layers, in the order their scans are traced."""

    def __init__(self, states):
        self.states = list(states)
        self.layer = 0
        self.head = 0

    def next_for(self, u: torch.Tensor) -> torch.Tensor:
        if self.layer >= len(self.states):
            raise RuntimeError(f"a continued prefill traced more Mamba-1 scans than the {len(self.states)} "
                               "recurrent states it was given: the family's scans_need_states declaration "
                               "(ssmshard/families/) or capture is wrong; please report the model class")
        state = self.states[self.layer]
        if state.dim() == 4:  # Zamba: (b, heads, channels, N), one scan per head
            taken = state[:, self.head]
            self.head += 1
            if self.head == state.shape[1]:
                self.layer, self.head = self.layer + 1, 0
        else:  # (b, channels, N)
            taken, self.layer = state, self.layer + 1
        if taken.shape[:2] != u.shape[:2]:
            raise RuntimeError(f"continued prefill: recurrent state {tuple(taken.shape)} does not fit the "
                               f"scan input {tuple(u.shape)}: a capture bug, please report the model class")
        return taken

    def check_consumed(self):
        if self.layer != len(self.states) or self.head:
            raise RuntimeError(f"a continued prefill used {self.layer} of {len(self.states)} recurrent states: "
                               "a capture bug, please report the model class")


_CONTINUED_SCANS: contextvars.ContextVar = contextvars.ContextVar("ssmshard_continued_scans", default=None)


@contextlib.contextmanager
def continued_scans(states):
    """Within the block, Mamba-1 scan shims start from ``states`` (one per layer, in order)."""
    queue = _ScanStateQueue(states)
    token = _CONTINUED_SCANS.set(queue)
    try:
        yield
        queue.check_consumed()
    finally:
        _CONTINUED_SCANS.reset(token)


def _refuse_under_packing(what):
    if _PACKED_CU_SEQLENS.get() is not None:
        raise NotImplementedError(f"{what} (a decode step) is not supported with packed sequences; "
                                  "packed programs are forward-only")


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    cu_seqlens = _packed_cu_seqlens(kwargs, "causal_conv1d_fn")
    return _ssm.causal_conv1d(x=hidden_states, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    _refuse_under_packing("causal_conv1d_update")
    out, new_state = _ssm.causal_conv1d_update(x=hidden_states, conv_state=conv_state, weight=weight, bias=bias,
                                               activation=activation)
    conv_state.copy_(new_state)
    return out


def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                         delta_softplus=False, return_last_state=False, **kwargs):
    cu_seqlens = _packed_cu_seqlens(kwargs, "selective_scan")
    queue = _CONTINUED_SCANS.get()
    initial_state = None if queue is None else queue.next_for(hidden_states)
    out, last_state = _ssm.selective_scan(u=hidden_states, delta=dt, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                                          delta_softplus=bool(delta_softplus), initial_state=initial_state,
                                          cu_seqlens=cu_seqlens, out_dtype=None, final_state=True)
    return (out, last_state) if return_last_state else out


def selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                           dt_softplus=False, z=None, **kwargs):
    _refuse_under_packing("selective_state_update")
    out, new_state = _ssm.selective_state_update(state=state, x=hidden_states, dt=dt, A=A, B=B, C=C, D=D, z=z,
                                                 dt_bias=dt_bias, dt_softplus=bool(dt_softplus),
                                                 dt_proj_weight=None)  # HF hands dt projected
    state.copy_(new_state)
    return out


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                      initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                      return_final_states=False, **kwargs):
    cu_seqlens = _packed_cu_seqlens(kwargs, "mamba2_chunk_scan")
    if kwargs.get("z") is not None:
        raise NotImplementedError("mamba2_chunk_scan with z is not used by any supported HF mixer")
    dt_min, dt_max = (float(v) for v in dt_limit)
    out, final_states = _ssm.ssd_scan(x=hidden_states, dt=dt, A=A, B=B, C=C, chunk_size=int(chunk_size), D=D,
                                      dt_bias=dt_bias, initial_states=initial_states,
                                      dt_softplus=bool(dt_softplus), dt_min=dt_min, dt_max=dt_max,
                                      cu_seqlens=cu_seqlens)
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
    return _ssm.gated_rms_norm(x=hidden_states, gate=gate, weight=self.weight, eps=float(self.variance_epsilon),
                               group_size=int(group_size))


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
