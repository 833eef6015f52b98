"""The one declaration of each ``torch.ops.ssmshard`` state-space-model op's arguments.

Everything that handles an op's arguments takes them from this table: the registration and
the fake (``ops.ssm``), the Triton adapters (``passes.swap_kernels``) and the sharding rules
(``bound_args`` reads the registered schema). The functions that implement an op or feed it
name the same arguments (the reference in ``kernels.reference``, the Triton entry points, the
Hugging Face shims); tests/test_op_signatures.py checks each of them against this table.

The schemas are part of every captured graph, the sharding rules and the kernels: change one
only together with all of those.

Dimension letters: b batch, l length, d channels, n state size, g groups, h heads, p head
dim, k conv width, s conv state length, S packed sequences.
"""

from __future__ import annotations

import dataclasses

import torch

NAMESPACE = "ssmshard"


@dataclasses.dataclass(frozen=True)
class OpSignature:
    name: str  # the op is torch.ops.ssmshard.<name>
    schema: str  # "(arguments) -> returns", torch.library's schema language
    doc: str  # shapes and meaning, in the dimension letters above
    # The parsed arguments (``torch._C.Argument``: name, type, default), in order.
    arguments: tuple = dataclasses.field(init=False, repr=False, compare=False)
    # ``(name, has a default, the default)`` per argument, as plain Python values. Both are made
    # here, not on first use: ``bind`` runs inside compiled programs (the state writers), where
    # Dynamo can neither call into ``torch._C.Argument`` nor enter the lock a ``cached_property``
    # takes on its first access (first in a process whose programs came from the program cache).
    _defaults: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        arguments = tuple(torch._C.parse_schema(self.qualname + self.schema).arguments)
        object.__setattr__(self, "arguments", arguments)
        object.__setattr__(self, "_defaults", tuple(
            (a.name, a.has_default_value(), a.default_value if a.has_default_value() else None) for a in arguments))

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arguments)

    def bind(self, args, kwargs) -> dict:
        """``{argument name: value}`` of one call, schema defaults filled in."""
        defaults = self._defaults
        if len(args) > len(defaults):
            raise TypeError(f"{self.qualname} takes {len(defaults)} arguments, got {len(args)}")
        values = {name: value for (name, _, _), value in zip(defaults, args)}
        unknown = set(kwargs) - {name for name, _, _ in defaults[len(args):]}
        if unknown:
            raise TypeError(f"{self.qualname} got unexpected or repeated arguments {sorted(unknown)}")
        for name, has_default, default in defaults[len(args):]:
            if name in kwargs:
                values[name] = kwargs[name]
            elif has_default:
                values[name] = default
            else:
                raise TypeError(f"{self.qualname} is missing argument {name!r}")
        return values


SIGNATURES: dict[str, OpSignature] = {s.name: s for s in [
    OpSignature(
        "selective_scan",
        "(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
        "bool delta_softplus, Tensor? initial_state, Tensor? cu_seqlens=None, ScalarType? out_dtype=None, "
        "bool final_state=True) -> (Tensor, Tensor)",
        "Mamba-1 scan. u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or (b, g, n, l); D, delta_bias: "
        "(d,); initial_state: (b, d, n). Returns out (b, d, l) in out_dtype (float32 when None) and the "
        "final state (b, d, n), float32; with final_state=False an empty (b, d, 0) in its place, not "
        "computed. The ``scan_outputs`` pass sets both from what the graph reads."),
    OpSignature(
        "ssd_scan",
        "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, SymInt chunk_size, Tensor? D, Tensor? dt_bias, "
        "Tensor? initial_states, bool dt_softplus, float dt_min, float dt_max, Tensor? cu_seqlens=None) "
        "-> (Tensor, Tensor)",
        "Mamba-2 SSD scan. x: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n); D: (h,) or (h, p); "
        "dt_bias: (h,); initial_states: (b, h, p, n); dt clamped to [dt_min, dt_max]. Returns out "
        "(b, l, h, p) and the final states (b, h, p, n), float32."),
    OpSignature(
        "causal_conv1d",
        "(Tensor x, Tensor weight, Tensor? bias, str? activation, Tensor? cu_seqlens=None) -> Tensor",
        "Depthwise causal conv. x: (b, d, l); weight: (d, k); bias: (d,); activation None, 'silu' or "
        "'swish'. Returns (b, d, l) in x's dtype."),
    OpSignature(
        "causal_conv1d_update",
        "(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias, str? activation) -> (Tensor, Tensor)",
        "Conv decode step. x: (b, d, l) new inputs; conv_state: (b, d, s), the last s inputs. Returns "
        "out (b, d, l) and the new state (b, d, s)."),
    OpSignature(
        "selective_state_update",
        "(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
        "Tensor? dt_bias, bool dt_softplus, Tensor? dt_proj_weight=None) -> (Tensor, Tensor)",
        "One recurrent decode step. Mamba-2: state (b, h, p, n); x, dt, z (b, h, p); A (h, p, n); B, C "
        "(b, g, n); D, dt_bias (h, p). Mamba-1: state (b, d, n); x, dt, z (b, d); A (d, n); B, C (b, n); "
        "D, dt_bias (d,); with dt_proj_weight (d, r), dt is dt_proj's input (b, r) and the op projects it "
        "(the fuse_dt_proj pass). Returns out (like x) and the new state (like state)."),
    OpSignature(
        "gated_rms_norm",
        "(Tensor x, Tensor? gate, Tensor weight, float eps, SymInt group_size) -> Tensor",
        "Mamba-2's gated RMSNorm: x * silu(gate) normalised over groups of group_size channels, times "
        "weight. x, gate: (..., d); weight: (d,)."),
    OpSignature(
        "rms_norm",
        "(Tensor x, Tensor weight, float eps) -> Tensor",
        "The RMSNorm of Mamba, Mamba-2, Zamba2 and Llama: x normalised over its last dimension in float32, "
        "back to x's dtype, times weight. x: (..., d); weight: (d,)."),
    OpSignature(
        "add_rms_norm",
        "(Tensor x, Tensor residual, Tensor weight, float eps, ScalarType norm_dtype) -> (Tensor, Tensor)",
        "The residual add and the RMSNorm after it: summed = residual + x (torch's type promotion: float32 "
        "with Mamba's residual_in_fp32), then rms_norm(summed.to(norm_dtype), weight, eps). x, residual: "
        "(..., d); weight: (d,). Returns summed and the normed value."),
    OpSignature(
        "decode_linear",
        "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        "A linear layer of a decode step, ``F.linear``: x (..., k); weight (n, k); bias (n,). Returns "
        "(..., n). Its kernel streams the weight for up to 64 rows, cuBLAS where that is faster (the "
        "``decode_gemv`` pass)."),
    OpSignature(
        "decode_linear_group",
        "(Tensor x, Tensor[] weights) -> Tensor[]",
        "Linear layers of a decode step that read the same input, without bias: ``[F.linear(x, w) for w "
        "in weights]``. x (..., k); each weight (n_i, k). Its kernel runs them in one launch for one row, "
        "``decode_linear``'s per weight for more "
        "(the ``group_decode_linears`` pass)."),
    OpSignature(
        "rotary",
        "(Tensor[] xs, Tensor cos, Tensor sin) -> Tensor[]",
        "The rotary position embedding of attention's queries and keys, Hugging Face's "
        "``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` for each x of xs (b, h, l, p), "
        "``rotate_half(x) = cat(-x[..., p/2:], x[..., :p/2])``; cos, sin broadcast to each x. Returns one "
        "tensor per x (the ``fuse_rotary`` pass)."),
]}
