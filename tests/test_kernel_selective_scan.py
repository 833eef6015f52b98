"""Triton selective-scan and decode-step kernels against plain sequential float64 references.

Dimension letters: b batch, d channels, l tokens, n state size, g groups of B / C,
S packed sequences, h heads, p head dim.

Runs on "cuda" when present, else under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET), with tiles small enough for the interpreter.

Tolerances are max |kernel - reference| / max |reference|, per tensor:
- fp32 inputs: 1e-5 (the kernels compute in fp32; the reference in float64).
- bf16 / fp16 inputs: the reference runs in float64 on the same rounded inputs (and on the
  same rounded output gradient), so the only difference beyond fp32 arithmetic is the final
  rounding of outputs and gradients returned in the input dtype: half an ulp, 2^-9 (bf16) or
  2^-12 (fp16) of each element, bounded by that fraction of the max. The tolerance is twice
  that (2^-8, 2^-11). Triton's CPU interpreter converts fp32 to bf16 by truncation (the GPU
  rounds to nearest), a full ulp, so there the bf16 tolerance is 2^-7. Results the kernels
  return in fp32 (final states, gradients of the fp32 parameters A, D, delta_bias,
  initial_state) keep the fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmshard import ops  # noqa: F401  (registers torch.ops.ssmshard)
from ssmshard.kernels import reference
from ssmshard.kernels.selective_scan import (ScanConfig, _forward_kernel, _resolve_forward, _segments, default_config,
                                             selective_scan, selective_scan_as_op)
from ssmshard.kernels.selective_scan_fwd import scan_fwd_kernel
from ssmshard.kernels.state_update import selective_state_update
from ssmshard.testing import rel_err
from test_ops import seq_state_update  # float64 decode-step loop, Mamba-2 layout, head by head

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter pays for every masked lane: tiny tiles there, real ones on the GPU.
CFG = (ScanConfig(chunk=16) if DEVICE == "cuda"
       else ScanConfig(chunk=8, fwd_block_d=4, bwd_block_d=4, bwd_warps=1))
CHUNK = CFG.chunk
# The parallel-over-time forward (the backward is shared). On the interpreter its tile spans
# two checkpoint chunks, so checkpoints are also written from inside a tile.
PARALLEL_CFG = (ScanConfig(chunk=16, fwd_variant="parallel", par_block_d=32, par_tokens=4, par_warps=1)
                if DEVICE == "cuda" else
                ScanConfig(**{**CFG.__dict__, "fwd_variant": "parallel", "par_block_d": 4, "par_tokens": 2 * CHUNK}))
# Both forwards feed the tile backward; the parallel backward runs after the parallel forward
# (on the interpreter with 2-token tiles, so a checkpoint chunk holds several).
PARALLEL_BWD_CFG = ScanConfig(**{**PARALLEL_CFG.__dict__, "bwd_variant": "parallel", "bwd_warps": 1,
                                 "bwd_block_d": 8 if DEVICE == "cuda" else 4, "bwd_tokens": 4 if DEVICE == "cuda" else 2})
# A state too wide to unroll: Mamba-2's 128 on a GPU; 40 under the CPU interpreter (its tile padded
# to 64 and masked), where 128 took 40 s of the three variants' tests.
WIDE_N = 128 if DEVICE == "cuda" else 40
VARIANTS = {"sequential": CFG, "parallel": PARALLEL_CFG, "parallel_bwd": PARALLEL_BWD_CFG}
FP32_TOL = 1e-5
ROUNDING_TOL = {torch.float32: FP32_TOL, torch.bfloat16: 2.0**-8 if DEVICE == "cuda" else 2.0**-7,
                torch.float16: 2.0**-11}


# --- float64 sequential reference: one Python step per token ---------------------------------


def seq_selective_scan(u, delta, A, B, C, D, z, delta_bias, softplus, init, offsets):
    """y (b, d, l) and final states (b or S, d, n). ``offsets``: packed-sequence offsets
    (list of ints) or None; the state restarts at each sequence start."""
    bsz, d, l = u.shape
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    dt = F.softplus(dt) if softplus else dt
    B = B if B.dim() == 4 else B[:, None]
    C = C if C.dim() == 4 else C[:, None]
    B = B.repeat_interleave(d // B.shape[1], dim=1)  # (b, g, n, l) -> (b, d, n, l)
    C = C.repeat_interleave(d // C.shape[1], dim=1)
    offsets = offsets or [0, l]
    zero = u.new_zeros(bsz, d, A.shape[1])
    ys, finals = [], []
    for s in range(len(offsets) - 1):
        if init is None:
            h = zero
        else:
            h = init[s : s + 1] if len(offsets) > 2 else init
        for t in range(offsets[s], offsets[s + 1]):
            h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[..., t]
            ys.append((h * C[..., t]).sum(-1))
        finals.append(h)
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y, torch.cat(finals, 0) if len(offsets) > 2 else finals[0]


# --- helpers ----------------------------------------------------------------------------------



def make_scan_inputs(b, d, l, n, g=None, dtype=torch.float32, D=True, z=True, bias=True,
                     softplus=True, num_init=None):
    """Inputs as a dict; per-token tensors in ``dtype``, parameters and states in fp32."""
    bc = (b, n, l) if g is None else (b, g, n, l)
    # Without softplus delta is the step itself: keep it positive.
    delta = torch.randn(b, d, l) if softplus else torch.rand(b, d, l) * 0.5 + 0.05
    return dict(
        u=torch.randn(b, d, l).to(dtype),
        delta=delta.to(dtype),
        A=-torch.exp(torch.randn(d, n) * 0.5),
        B=torch.randn(*bc).to(dtype),
        C=torch.randn(*bc).to(dtype),
        D=torch.randn(d) if D else None,
        z=torch.randn(b, d, l).to(dtype) if z else None,
        delta_bias=torch.randn(d) * 0.5 if bias else None,
        initial_state=torch.randn(num_init, d, n) if num_init else None,
    ), softplus


NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def run_kernel(inputs, softplus, offsets=None, cfg=CFG):
    """Leaves on DEVICE (requiring grad), and the kernel's (y, final)."""
    leaves = {k: (v.to(DEVICE).requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE) if offsets else None
    y, final = selective_scan(
        *(leaves[k] for k in NAMES[:8]), softplus, cu_seqlens=cu,
        initial_state=leaves["initial_state"], return_final_state=True, config=cfg,
    )
    return leaves, y, final


def check_scan(inputs, softplus, offsets=None, cfg=CFG):
    """Outputs and every input gradient, kernel vs the float64 reference on the same values."""
    dtype = inputs["u"].dtype
    leaves, y, final = run_kernel(inputs, softplus, offsets, cfg)
    assert y.dtype == dtype and final.dtype == torch.float32
    ref_leaves = {k: (v.double().requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    y_ref, final_ref = seq_selective_scan(*(ref_leaves[k] for k in NAMES[:8]), softplus,
                                          ref_leaves["initial_state"], offsets)
    tol = ROUNDING_TOL[dtype]
    assert rel_err(y, y_ref) <= tol, f"y: {rel_err(y, y_ref):.3g}"
    assert rel_err(final, final_ref) <= FP32_TOL, f"final state: {rel_err(final, final_ref):.3g}"

    # The output gradient arrives in y's dtype: give the reference the same rounded values.
    w_y = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).double()
    w_f = torch.randn(final_ref.shape, dtype=torch.float64)
    names = [k for k in NAMES if inputs[k] is not None]
    got = torch.autograd.grad((y.double() * w_y.to(DEVICE)).sum() + (final.double() * w_f.to(DEVICE)).sum(),
                              [leaves[k] for k in names])
    want = torch.autograd.grad((y_ref * w_y).sum() + (final_ref * w_f).sum(), [ref_leaves[k] for k in names])
    for k, g_got, g_want in zip(names, got, want):
        assert g_got.dtype == inputs[k].dtype, k
        err, limit = rel_err(g_got, g_want), ROUNDING_TOL[inputs[k].dtype]
        assert err <= limit, f"grad of {k}: relative error {err:.3g} > {limit:.3g}"


# --- selective_scan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "b, d, l, n, g, flags",
    [
        # odd length, channels not a multiple of the block, groups, everything on
        (2, 6, 19, 16, 2, dict()),
        # two whole chunks, n = 1, no B/C groups, no D / z / bias / softplus
        (1, 4, 2 * CHUNK, 1, None, dict(D=False, z=False, bias=False, softplus=False)),
        # n past unroll_n_max (the state loop is not unrolled), a length-3 tail
        (1, 2, CHUNK + 3, WIDE_N, None, dict(D=False, bias=False)),
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_fp32(fresh_seed, b, d, l, n, g, flags, variant):
    inputs, softplus = make_scan_inputs(b, d, l, n, g, num_init=b, **flags)
    check_scan(inputs, softplus, cfg=VARIANTS[variant])


def test_scan_fp32_no_initial_state(fresh_seed):
    inputs, softplus = make_scan_inputs(1, 5, 2 * CHUNK + 5, 16, bias=False)
    check_scan(inputs, softplus)


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_segments(fresh_seed, variant):
    # The sequence split over 3 segments (one extra pass hands states across them); the
    # parallel variant's segments are whole tiles, so it gets 2.
    inputs, softplus = make_scan_inputs(1, 4, 3 * CHUNK - 2, 16, g=2, num_init=1)
    check_scan(inputs, softplus, cfg=ScanConfig(**{**VARIANTS[variant].__dict__, "segments": 3}))


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_many_segments(fresh_seed, variant):
    # More segments than one round of segment_carry_kernel's loads (UNROLL = 8), forwards and
    # (the adjoint) backwards, the last round partly masked.
    cfg = ScanConfig(**{**VARIANTS[variant].__dict__, "segments": 11})
    l = 11 * 16 - 3
    assert _segments(l, cfg)[0] == 11
    inputs, softplus = make_scan_inputs(1, 4, l, 4, num_init=1)
    check_scan(inputs, softplus, cfg=cfg)


# Length-1 sequences, a boundary exactly on a chunk edge, an empty sequence, odd lengths.
PACK = [0, 1, CHUNK, CHUNK + 1, CHUNK + 1, 2 * CHUNK + 3, 2 * CHUNK + 4, 3 * CHUNK + 1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("with_init", [True, False])
def test_scan_packed(fresh_seed, with_init, variant):
    inputs, softplus = make_scan_inputs(1, 6, PACK[-1], 16, g=2, num_init=len(PACK) - 1 if with_init else None)
    check_scan(inputs, softplus, offsets=PACK, cfg=VARIANTS[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_packed_segments(fresh_seed, variant):
    inputs, softplus = make_scan_inputs(1, 4, PACK[-1], 8, num_init=len(PACK) - 1)
    check_scan(inputs, softplus, offsets=PACK, cfg=ScanConfig(**{**VARIANTS[variant].__dict__, "segments": 2}))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("starts", [(18, 47), (18, 60), (18, 41)],
                         ids=["boundaries", "segment-inside-one", "end-on-chunk-first-token"])
def test_scan_packed_segment_passes_skip_dead_work(fresh_seed, variant, starts):
    """Four segments of 16 tokens over a packed row, sequences placed so that the segment
    passes trim or skip work (``_segment_pass_ranges``): a sequence starting exactly on a
    segment boundary (16), sequences spanning boundaries, a segment holding several ends and
    starts, a segment lying inside one sequence, and a sequence whose last token is the first
    of a checkpoint chunk on the interpreter (the adjoint-only pass stops by whole chunks)."""
    cfg = ScanConfig(**{**VARIANTS[variant].__dict__, "segments": 4})
    l = 64
    assert _segments(l, cfg) == (4, 16)  # the layout the offsets below are placed against
    offsets = [0, 3, 16, *starts, l]  # sequences [0,3) [3,16) [16,b) [b,c) [c,64)
    inputs, softplus = make_scan_inputs(1, 4, l, 8, num_init=len(offsets) - 1)
    check_scan(inputs, softplus, offsets=offsets, cfg=cfg)


def test_scan_parallel_short_tile(fresh_seed):
    # The parallel forward with tiles shorter than a checkpoint chunk (the GPU default shape),
    # packed, n not a power of two.
    cfg = ScanConfig(**{**PARALLEL_CFG.__dict__, "par_tokens": 4})
    inputs, softplus = make_scan_inputs(1, 6, PACK[-1], 5, g=2, num_init=len(PACK) - 1)
    check_scan(inputs, softplus, offsets=PACK, cfg=cfg)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scan_low_precision(fresh_seed, dtype, variant):
    # One row (the batch strides are test_scan_fp32's): the casts are what this checks.
    inputs, softplus = make_scan_inputs(1, 8, 2 * CHUNK + 5, 16, g=2, dtype=dtype, num_init=1)
    check_scan(inputs, softplus, cfg=VARIANTS[variant])


def test_scan_sequential_steps_narrower_than_a_vector(fresh_seed):
    """``ScanConfig.fwd_tokens``: bf16 u, delta, z and y advanced 4 tokens a step (one 16-byte
    vector of them would be 8), an odd tail included; and a bad value refused."""
    inputs, softplus = make_scan_inputs(2, 8, 2 * CHUNK + 5, 16, g=2, dtype=torch.bfloat16, num_init=2)
    cfg = ScanConfig(**{**CFG.__dict__, "fwd_tokens": 4})
    u = inputs["u"].to(DEVICE)
    assert _forward_kernel(u, u, u, u, 16, cfg)[2]["V"] == 4  # the step launched, not only the values
    assert _forward_kernel(u, u, u, u, 16, CFG)[2]["V"] == 8  # bf16 throughout: one 16-byte vector
    check_scan(inputs, softplus, cfg=cfg)
    with pytest.raises(ValueError, match="fwd_tokens must be None or a power of two"):
        ScanConfig(fwd_tokens=3)


def test_auto_forward_resolves_by_layout_and_call(fresh_seed):
    """``fwd_variant="auto"``: the sequential kernel at 4 tokens a step (the launched V checked,
    not only the values) for token-contiguous inference calls in one segment; the parallel
    kernel for channel-contiguous inputs, split rows and calls that keep checkpoints. Values of
    the no-grad bf16 call (bf16 y) against the float64 reference."""
    auto = ScanConfig(**{**CFG.__dict__, "fwd_variant": "auto"})
    inputs, softplus = make_scan_inputs(2, 8, 2 * CHUNK + 5, 16, g=2, dtype=torch.bfloat16, num_init=2)
    u, delta, z = (inputs[k].to(DEVICE) for k in ("u", "delta", "z"))
    picked = _resolve_forward(auto, u, delta, z, num_segments=1, keep_checkpoints=False)
    assert (picked.fwd_variant, picked.fwd_tokens) == ("sequential", 4)
    kernel, _, constants = _forward_kernel(u, delta, z, u, 16, picked)
    assert kernel is scan_fwd_kernel and constants["V"] == 4
    channel_major = u.transpose(1, 2).contiguous().transpose(1, 2)
    for args in [(u, delta, z, 2, False), (u, delta, z, 1, True), (channel_major, delta, z, 1, False),
                 (u, delta, channel_major, 1, False)]:
        assert _resolve_forward(auto, *args).fwd_variant == "parallel", args[3:]
    assert _resolve_forward(CFG, u, delta, z, 1, False) is CFG  # concrete variants stay as they are

    y_ref, final_ref = seq_selective_scan(*(inputs[k].double() if inputs[k] is not None else None for k in NAMES[:8]),
                                          softplus, inputs["initial_state"].double(), None)
    with torch.no_grad():
        y, final = selective_scan(*(inputs[k].to(DEVICE) if inputs[k] is not None else None for k in NAMES[:8]),
                                  softplus, initial_state=inputs["initial_state"].to(DEVICE),
                                  return_final_state=True, out_dtype=torch.bfloat16, config=auto)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= ROUNDING_TOL[torch.bfloat16], f"y: {rel_err(y, y_ref):.3g}"
    assert rel_err(final, final_ref) <= FP32_TOL, f"final state: {rel_err(final, final_ref):.3g}"
    # With gradients (checkpoints kept) "auto" runs the parallel kernel: values and gradients.
    check_scan(inputs, softplus, cfg=auto)


def test_packed_equals_sequences_alone(fresh_seed):
    """No state crosses a boundary: the packed outputs and gradients equal those of each
    sequence run on its own. Large initial states make any leak across a boundary obvious."""
    offsets = [0, 1, CHUNK, CHUNK + 5, 2 * CHUNK + 2]
    inputs, softplus = make_scan_inputs(1, 4, offsets[-1], 16, num_init=len(offsets) - 1)
    inputs["initial_state"] = inputs["initial_state"] * 10
    leaves, y, final = run_kernel(inputs, softplus, offsets)
    w_y, w_f = torch.randn_like(y), torch.randn_like(final)
    names = [k for k in NAMES if inputs[k] is not None]
    grads = torch.autograd.grad((y * w_y).sum() + (final * w_f).sum(), [leaves[k] for k in names])
    packed = dict(zip(names, grads))
    summed = {k: torch.zeros_like(packed[k]) for k in ("A", "D", "delta_bias")}
    for s, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        piece = {k: inputs[k] for k in ("A", "D", "delta_bias")}
        piece.update({k: inputs[k][..., lo:hi] for k in ("u", "delta", "B", "C", "z")})
        piece["initial_state"] = inputs["initial_state"][s : s + 1]
        s_leaves, s_y, s_final = run_kernel(piece, softplus)
        assert rel_err(s_y, y[..., lo:hi]) <= FP32_TOL and rel_err(s_final, final[s : s + 1]) <= FP32_TOL
        s_grads = torch.autograd.grad((s_y * w_y[..., lo:hi]).sum() + (s_final * w_f[s : s + 1]).sum(),
                                      [s_leaves[k] for k in names])
        for k, gr in zip(names, s_grads):
            if k in summed:
                summed[k] += gr
            elif k == "initial_state":
                assert rel_err(gr, packed[k][s : s + 1]) <= FP32_TOL, k
            else:
                assert rel_err(gr, packed[k][..., lo:hi]) <= FP32_TOL, k
    for k, total in summed.items():
        assert rel_err(total, packed[k]) <= FP32_TOL, k


def test_matches_reference_op(fresh_seed):
    """The swap target: the outputs and gradients of torch.ops.ssmshard.selective_scan. Both run
    in fp32 and sum in different orders, so each is held to FP32_TOL of the float64 loop (two fp32
    results can differ by twice that: A's gradient sums over batch and time)."""
    inputs, softplus = make_scan_inputs(2, 6, CHUNK + 7, 8, g=3, num_init=2)
    args = [inputs[k] for k in NAMES[:8]] + [softplus, inputs["initial_state"]]
    order = list(NAMES[:8]) + ["softplus", "initial_state"]
    names = [n for n, a in zip(order, args) if isinstance(a, torch.Tensor)]
    reference = lambda *a: seq_selective_scan(*a[:9], a[9], None)  # noqa: E731
    kernel = lambda *a: selective_scan_as_op(*a, config=CFG)  # noqa: E731
    results = []
    for fn, dtype in ((kernel, torch.float32), (torch.ops.ssmshard.selective_scan, torch.float32),
                      (reference, torch.float64)):
        leaves = [a.to(DEVICE if dtype == torch.float32 else "cpu", dtype).requires_grad_(True)
                  if isinstance(a, torch.Tensor) else a for a in args]
        y, final = fn(*leaves)
        assert y.dtype == dtype and final.dtype == dtype
        w = torch.Generator().manual_seed(0)
        weights = [torch.randn(t.shape, generator=w, dtype=torch.float64).to(y.device, dtype) for t in (y, final)]
        loss = (y * weights[0]).sum() + (final * weights[1]).sum()
        grads = torch.autograd.grad(loss, [x for x in leaves if isinstance(x, torch.Tensor)])
        results.append([t.detach().cpu().double() for t in (y, final, *grads)])
    for what, got in zip(("kernel", "op"), results[:2]):
        for name, a, b in zip(["y", "final state", *names], got, results[2]):
            assert rel_err(a, b) <= FP32_TOL, (what, name, f"seed {fresh_seed}")


def test_no_grad_path_and_default_config(fresh_seed):
    # Inference skips the checkpoints; the default launch configuration is used.
    inputs, softplus = make_scan_inputs(2, 8, 11, 4, num_init=2)
    args = {k: (v.to(DEVICE) if v is not None else None) for k, v in inputs.items()}
    with torch.no_grad():
        y = selective_scan(*(args[k] for k in NAMES[:8]), softplus, initial_state=args["initial_state"])
    y_ref, _ = seq_selective_scan(*(inputs[k].double() if inputs[k] is not None else None for k in NAMES[:8]),
                                  softplus, inputs["initial_state"].double(), None)
    assert rel_err(y, y_ref) <= FP32_TOL


@pytest.mark.parametrize("packed", [False, True])
def test_default_config_on_a_split_row(fresh_seed, packed):
    # A row long enough for default_config to split it into segments: one sequence gets
    # 16-channel forward tiles, a packed row 32 (each won its shape on an H200). The default's
    # no-grad output must match the float64 loop either way.
    b, d, l, n = 1, 16, 512, 4
    offsets = [0, 200, 201, 512] if packed else None
    cfg = default_config(b, d, l, torch.device(DEVICE), packed=packed)
    assert cfg.segments > 1 and cfg.par_block_d == (32 if packed else 16)
    inputs, softplus = make_scan_inputs(b, d, l, n, num_init=3 if packed else 1)
    args = {k: (v.to(DEVICE) if v is not None else None) for k, v in inputs.items()}
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE) if packed else None
    with torch.no_grad():
        y = selective_scan(*(args[k] for k in NAMES[:8]), softplus, cu_seqlens=cu, initial_state=args["initial_state"],
                           out_dtype=torch.float32)
    y_ref, _ = seq_selective_scan(*(inputs[k].double() if inputs[k] is not None else None for k in NAMES[:8]),
                                  softplus, inputs["initial_state"].double(), offsets)
    assert rel_err(y, y_ref) <= FP32_TOL


def test_rejects_bad_arguments():
    inputs, _ = make_scan_inputs(2, 4, 8, 4)
    args = [inputs[k].to(DEVICE) if inputs[k] is not None else None for k in NAMES[:8]]
    with pytest.raises(ValueError, match="b must be 1"):
        selective_scan(*args, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE))
    one = [a[:1] if a is not None and a.dim() >= 3 else a for a in args]
    with pytest.raises(ValueError, match="int32"):
        selective_scan(*one, cu_seqlens=torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="rise from 0 to l=8"):
        selective_scan(*one, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32, device=DEVICE))
    # Offsets checked once are not read again (a device sync) until they change in place.
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    selective_scan(*one, cu_seqlens=cu)
    cu[1] = 9
    with pytest.raises(ValueError, match="rise from 0 to l=8"):
        selective_scan(*one, cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state must be"):
        selective_scan(*args, initial_state=torch.zeros(3, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of B/C groups"):
        selective_scan(*args[:3], torch.zeros(2, 3, 4, 8, device=DEVICE), torch.zeros(2, 3, 4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="fwd_variant must be one of"):
        ScanConfig(fwd_variant="fast")
    with pytest.raises(ValueError, match="bwd_maxnreg must be None or a register count"):
        ScanConfig(bwd_maxnreg=300)
    with pytest.raises(ValueError, match="par_tokens must be a power of two"):
        ScanConfig(fwd_variant="parallel", par_tokens=12)


# --- selective_state_update -------------------------------------------------------------------


def to_device(*ts):
    return [t.to(DEVICE) if t is not None else None for t in ts]


def to_cpu(*ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_update_mamba2_expanded_views(fresh_seed, state_dtype):
    # As Hugging Face calls it: dt, A, D, dt_bias are stride-0 expansions of per-head values.
    b, h, p, n, g = 3, 4, 5, 16, 2
    state = torch.randn(b, h, p, n).to(state_dtype)
    x, z = torch.randn(b, h, p), torch.randn(b, h, p)
    dt = torch.randn(b, h, 1).expand(b, h, p)
    A = -torch.exp(torch.randn(h, 1, 1)).expand(h, p, n)
    B, C = torch.randn(b, g, n), torch.randn(b, g, n)
    D, dt_bias = torch.randn(h, 1).expand(h, p), torch.randn(h, 1).expand(h, p)
    args = (state, x, dt, A, B, C, D, z, dt_bias, True)
    out, new = to_cpu(*selective_state_update(*to_device(*args[:9]), True))
    out_ref, new_ref = seq_state_update(*[t.double() for t in args[:9]], True)
    assert rel_err(out, out_ref) <= FP32_TOL
    assert new.dtype == state_dtype and rel_err(new, new_ref) <= ROUNDING_TOL[state_dtype]
    # Same as the reference op, and in place into a preallocated state.
    out_op, new_op = reference.selective_state_update(*args)
    buffer = state.clone().to(DEVICE)
    out2, new2 = selective_state_update(buffer, *to_device(*args[1:9]), True, out_state=buffer)
    assert new2.data_ptr() == buffer.data_ptr()
    assert rel_err(out2.cpu(), out_op) <= FP32_TOL
    assert rel_err(buffer.cpu().float(), new_op.float()) <= ROUNDING_TOL[state_dtype]


@pytest.mark.parametrize("config", [None, dict(BLOCK_P=1, num_warps=1), dict(BLOCK_P=2, num_warps=8),
                                    dict(BLOCK_P=64, num_warps=4)])
@pytest.mark.parametrize("a_per_head", [True, False])
def test_state_update_tile_configs(fresh_seed, config, a_per_head):
    # Every tiling (channels per program, warps; p = 5 leaves partial blocks) and both decay paths:
    # A one value per head (a stride-0 expansion: one exp per channel) and A per (channel, state).
    b, h, p, n, g = 2, 4, 5, 16, 2
    state, x, z = torch.randn(b, h, p, n), torch.randn(b, h, p), torch.randn(b, h, p)
    dt, dt_bias, D = torch.randn(b, h, p) * 0.5, torch.randn(h, p), torch.randn(h, p)
    A = -torch.exp(torch.randn(h, 1, 1)).expand(h, p, n)
    if not a_per_head:
        A = A * torch.exp(torch.randn(h, p, n) * 0.3)
    B, C = torch.randn(b, g, n), torch.randn(b, g, n)
    out, new = to_cpu(*selective_state_update(*to_device(state, x, dt, A, B, C, D, z, dt_bias), True, config=config))
    out_ref, new_ref = seq_state_update(*[t.double() for t in (state, x, dt, A, B, C, D, z, dt_bias)], True)
    assert rel_err(out, out_ref) <= FP32_TOL and rel_err(new, new_ref) <= FP32_TOL


@pytest.mark.parametrize("grouped", [False, True])
def test_state_update_mamba1(fresh_seed, grouped):
    b, d, n = 2, 12, 16
    g = 3 if grouped else None
    state, x, dt, z = torch.randn(b, d, n), torch.randn(b, d), torch.randn(b, d) * 0.5, torch.randn(b, d)
    A = -torch.exp(torch.randn(d, n) * 0.5)
    B = torch.randn(b, g, n) if grouped else torch.randn(b, n)
    C = torch.randn(b, g, n) if grouped else torch.randn(b, n)
    D, dt_bias = torch.randn(d), torch.randn(d)
    out, new = to_cpu(*selective_state_update(*to_device(state, x, dt, A, B, C, D, z, dt_bias), True))
    # Float64 reference in the Mamba-2 layout: one head per group, d // g channels each.
    gg = g or 1
    heads = lambda t: t.double().unflatten(1, (gg, d // gg))  # noqa: E731
    out_ref, new_ref = seq_state_update(
        heads(state), heads(x), heads(dt), A.double().unflatten(0, (gg, d // gg)),
        B.double() if grouped else B.double()[:, None], C.double() if grouped else C.double()[:, None],
        D.double().unflatten(0, (gg, d // gg)), heads(z), dt_bias.double().unflatten(0, (gg, d // gg)), True,
    )
    assert rel_err(out, out_ref.flatten(1, 2)) <= FP32_TOL
    assert rel_err(new, new_ref.flatten(1, 2)) <= FP32_TOL
    if not grouped:
        out_op, new_op = reference.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True)
        assert rel_err(out, out_op) <= FP32_TOL and rel_err(new, new_op) <= FP32_TOL


def test_state_update_rejects_mismatched_out_state():
    state = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="out_state must match"):
        selective_state_update(state, torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(4, 2),
                               torch.zeros(1, 2), torch.zeros(1, 2), out_state=torch.zeros(1, 4, 3))
