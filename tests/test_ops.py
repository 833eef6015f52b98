"""Tests for the ssmshard custom ops against plain sequential float64 references.

Dimension letters: b batch, l length, d channels, n state size, g groups,
h heads, p head dim, k conv width, s conv state length.

The scan ops compute in float32 internally, so they are fed float32 inputs and
compared (max-abs diff / max-abs reference) with the float64 loops below run
on the same values. The convs compute in the weight's dtype and are checked
in float64.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ssmshard import ops  # noqa: F401  (importing registers torch.ops.ssmshard)
from ssmshard.kernels import reference
from ssmshard.testing import rel_err

OPS = torch.ops.ssmshard
FWD_TOL = 1e-5
GRAD_TOL = 1e-4


# --- sequential float64 references: one Python step per token ---------------


def seq_selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    bsz, d, l = u.shape
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    dt = F.softplus(dt) if delta_softplus else dt
    B = B if B.dim() == 4 else B[:, None]
    C = C if C.dim() == 4 else C[:, None]
    # channel c reads group c // (d // g)
    B = B.repeat_interleave(d // B.shape[1], dim=1)  # (b, d, n, l)
    C = C.repeat_interleave(d // C.shape[1], dim=1)
    h = u.new_zeros(bsz, d, A.shape[1]) if initial_state is None else initial_state
    ys = []
    for t in range(l):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[..., t]
        ys.append((h * C[..., t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y, h


def seq_ssd(x, dt, A, B, C, D, dt_bias, initial_states, dt_softplus, dt_min, dt_max):
    bsz, l, h, p = x.shape
    dt = dt if dt_bias is None else dt + dt_bias
    dt = F.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(dt_min, dt_max)
    B = B.repeat_interleave(h // B.shape[2], dim=2)  # (b, l, h, n)
    C = C.repeat_interleave(h // C.shape[2], dim=2)
    state = x.new_zeros(bsz, h, p, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(l):
        dt_t = dt[:, t, :, None, None]  # (b, h, 1, 1)
        state = torch.exp(dt_t * A[:, None, None]) * state + dt_t * x[:, t, :, :, None] * B[:, t, :, None, :]
        y = (state * C[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + (D if D.dim() == 2 else D[:, None]) * x[:, t]
        ys.append(y)
    return torch.stack(ys, 1), state


def _act(y, activation):
    return y if activation is None else y * torch.sigmoid(y)


def seq_conv(x, weight, bias, activation):
    d, k = weight.shape
    cols = []
    for t in range(x.shape[-1]):
        acc = torch.zeros_like(x[..., 0]) if bias is None else bias.expand_as(x[..., 0]).clone()
        for j in range(k):
            src = t - (k - 1) + j
            if src >= 0:
                acc = acc + weight[:, j] * x[..., src]
        cols.append(acc)
    return _act(torch.stack(cols, -1), activation)


def seq_conv_update(x, conv_state, weight, bias, activation):
    k, s = weight.shape[1], conv_state.shape[-1]
    seen, cols = conv_state, []
    for t in range(x.shape[-1]):
        seen = torch.cat([seen, x[..., t : t + 1]], -1)  # append one token
        acc = 0 if bias is None else bias
        for j in range(k):  # the newest k inputs; s >= k - 1 guarantees they exist
            acc = acc + weight[:, j] * seen[..., seen.shape[-1] - k + j]
        cols.append(acc)
    return _act(torch.stack(cols, -1), activation), seen[..., seen.shape[-1] - s :]


def seq_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """Mamba-2 layout, one head at a time; Mamba-1 (3-d state) as a single head."""
    if state.dim() == 3:
        out, new = seq_state_update(
            state[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None],
            None if D is None else D[None], None if z is None else z[:, None],
            None if dt_bias is None else dt_bias[None], dt_softplus,
        )
        return out[:, 0], new[:, 0]
    h, g = state.shape[1], B.shape[1]
    outs, news = [], []
    for i in range(h):
        grp = i // (h // g)
        dt_i = dt[:, i] if dt_bias is None else dt[:, i] + dt_bias[i]
        dt_i = F.softplus(dt_i) if dt_softplus else dt_i  # (b, p)
        decay = torch.exp(dt_i[..., None] * A[i])  # (b, p, n)
        new = state[:, i] * decay + (dt_i * x[:, i])[..., None] * B[:, grp, None, :]
        out = (new * C[:, grp, None, :]).sum(-1)
        if D is not None:
            out = out + D[i] * x[:, i]
        if z is not None:
            out = out * z[:, i] * torch.sigmoid(z[:, i])
        outs.append(out)
        news.append(new)
    return torch.stack(outs, 1), torch.stack(news, 1)


# --- helpers --------------------------------------------------------------------


def assert_close(got, want, tol, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def to_double(args):
    return [a.double() if isinstance(a, torch.Tensor) else a for a in args]


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_grads(op, seq_fn, args, tol=GRAD_TOL):
    """Gradients of a random-weighted sum of all outputs, op vs sequential float64 reference."""
    tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    leaves32 = {i: args[i].detach().clone().requires_grad_(True) for i in tensor_idx}
    leaves64 = {i: args[i].detach().double().requires_grad_(True) for i in tensor_idx}
    args32 = [leaves32.get(i, a) for i, a in enumerate(args)]
    args64 = [leaves64.get(i, a) for i, a in enumerate(args)]
    outs32 = as_tuple(op(*args32))
    outs64 = as_tuple(seq_fn(*args64))
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs64]
    loss32 = sum((o.double() * w).sum() for o, w in zip(outs32, weights))
    loss64 = sum((o * w).sum() for o, w in zip(outs64, weights))
    g32 = torch.autograd.grad(loss32, [leaves32[i] for i in tensor_idx])
    g64 = torch.autograd.grad(loss64, [leaves64[i] for i in tensor_idx])
    for i, a, b in zip(tensor_idx, g32, g64):
        assert a.dtype == args[i].dtype
        assert_close(a, b, tol, f"grad of arg {i}")


def negative(*shape):
    # A < 0 so states decay, as in real models (A = -exp(A_log)).
    return -torch.exp(torch.randn(*shape) * 0.5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- selective_scan (Mamba-1) -------------------------------------------------


def make_selective_scan(b, d, n, l, g=None, D=True, z=True, bias=True, softplus=True, init=True):
    bc_shape = (b, n, l) if g is None else (b, g, n, l)
    # Without softplus delta is used as is, so keep it positive.
    delta = torch.randn(b, d, l) if softplus else torch.rand(b, d, l) * 0.5 + 0.05
    return [
        torch.randn(b, d, l),
        delta,
        negative(d, n),
        torch.randn(*bc_shape),
        torch.randn(*bc_shape),
        torch.randn(d) if D else None,
        torch.randn(b, d, l) if z else None,
        torch.randn(d) * 0.5 if bias else None,
        softplus,
        torch.randn(b, d, n) if init else None,
    ]


SCAN_CASES = {
    "l1": dict(b=2, d=4, n=16, l=1),
    "odd_l_n1_grouped": dict(b=1, d=6, n=1, l=7, g=2),
    "bare": dict(b=2, d=3, n=4, l=9, D=False, z=False, bias=False, softplus=False, init=False),
    "one_chunk_exact": dict(b=1, d=4, n=16, l=64, g=1),
    "multi_chunk_odd": dict(b=2, d=4, n=16, l=101, g=4, z=False),
}


@pytest.mark.parametrize("case", SCAN_CASES.values(), ids=SCAN_CASES.keys())
def test_selective_scan_forward(case):
    args = make_selective_scan(**case)
    out, state = OPS.selective_scan(*args)
    assert out.dtype == state.dtype == torch.float32
    want_out, want_state = seq_selective_scan(*to_double(args))
    assert_close(out, want_out, FWD_TOL, "out")
    assert_close(state, want_state, FWD_TOL, "final_state")


@pytest.mark.parametrize("chunk", [1, 3, 8, 20])
def test_selective_scan_chunking_invariant(chunk):
    # The reference's own chunk length must only change rounding.
    args = make_selective_scan(b=2, d=4, n=16, l=20, g=2)
    want = seq_selective_scan(*to_double(args))
    got = reference.selective_scan(*args, chunk_size=chunk)
    for a, b in zip(got, want):
        assert_close(a, b, FWD_TOL)


def test_selective_scan_low_precision_inputs_give_float32():
    args = [a.bfloat16() if isinstance(a, torch.Tensor) else a for a in make_selective_scan(1, 4, 4, 5)]
    out, state = OPS.selective_scan(*args)
    assert out.dtype == state.dtype == torch.float32


@pytest.mark.parametrize(
    "case",
    [dict(b=2, d=4, n=3, l=70, g=2), dict(b=1, d=3, n=1, l=5, D=False, z=False, bias=False, softplus=False)],
    ids=["multi_chunk_full", "bare"],
)
def test_selective_scan_grad(case):
    check_grads(OPS.selective_scan, seq_selective_scan, make_selective_scan(**case))


# --- ssd_scan (Mamba-2) -----------------------------------------------------------


def make_ssd(b, l, h, p, g, n, chunk, D="h", bias=True, init=True, softplus=True, dt_min=0.0, dt_max=math.inf):
    dt = torch.randn(b, l, h) if softplus else torch.rand(b, l, h) * 0.5 + 0.05
    Dt = {"h": torch.randn(h), "hp": torch.randn(h, p), None: None}[D]
    return [
        torch.randn(b, l, h, p),
        dt,
        negative(h),
        torch.randn(b, l, g, n),
        torch.randn(b, l, g, n),
        chunk,
        Dt,
        torch.randn(h) * 0.5 if bias else None,
        torch.randn(b, h, p, n) if init else None,
        softplus,
        dt_min,
        dt_max,
    ]


def seq_ssd_from_op_args(x, dt, A, B, C, chunk, D, dt_bias, init, softplus, dt_min, dt_max):
    return seq_ssd(x, dt, A, B, C, D, dt_bias, init, softplus, dt_min, dt_max)


SSD_CASES = {
    "l1": dict(b=2, l=1, h=2, p=3, g=1, n=16, chunk=4),
    "l_not_multiple": dict(b=2, l=7, h=4, p=2, g=2, n=16, chunk=4, D="hp"),
    "l_multiple": dict(b=1, l=8, h=2, p=4, g=1, n=1, chunk=4, init=False),
    "chunk_longer_than_l": dict(b=1, l=6, h=3, p=2, g=3, n=4, chunk=16, D=None, bias=False),
    "clamped": dict(b=2, l=13, h=4, p=2, g=2, n=16, chunk=5, dt_min=0.3, dt_max=0.9),
    "no_softplus_chunk1": dict(b=1, l=5, h=2, p=2, g=1, n=2, chunk=1, softplus=False, dt_min=-math.inf),
}


@pytest.mark.parametrize("case", SSD_CASES.values(), ids=SSD_CASES.keys())
def test_ssd_scan_forward(case):
    args = make_ssd(**case)
    out, state = OPS.ssd_scan(*args)
    assert out.dtype == state.dtype == torch.float32
    want_out, want_state = seq_ssd_from_op_args(*to_double(args))
    assert_close(out, want_out, FWD_TOL, "out")
    assert_close(state, want_state, FWD_TOL, "final_states")


def test_ssd_scan_chunk_size_invariant():
    args = make_ssd(b=2, l=23, h=4, p=3, g=2, n=8, chunk=1)
    results = [OPS.ssd_scan(*args[:5], chunk, *args[6:]) for chunk in (1, 4, 8, 23, 64)]
    for out, state in results[1:]:
        assert_close(out, results[0][0], FWD_TOL)
        assert_close(state, results[0][1], FWD_TOL)


@pytest.mark.parametrize(
    "case",
    [dict(b=2, l=11, h=4, p=2, g=2, n=3, chunk=4, D="hp", dt_min=0.2, dt_max=1.0),
     dict(b=1, l=4, h=2, p=2, g=1, n=2, chunk=4, D="h", init=False, softplus=False)],
    ids=["chunked_full", "one_chunk"],
)
def test_ssd_scan_grad(case):
    check_grads(OPS.ssd_scan, seq_ssd_from_op_args, make_ssd(**case))


# --- causal_conv1d / causal_conv1d_update ------------------------------------


@pytest.mark.parametrize("k,l", [(4, 1), (4, 9), (1, 3), (3, 2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
def test_causal_conv1d_forward(k, l, bias, activation):
    x, w = torch.randn(2, 5, l, dtype=torch.float64), torch.randn(5, k, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64) if bias else None
    out = OPS.causal_conv1d(x, w, b, activation)
    assert out.dtype == torch.float64
    assert_close(out, seq_conv(x, w, b, activation), 1e-12)


def test_causal_conv1d_dtypes_follow_x():
    x, w, b = torch.randn(1, 3, 6).bfloat16(), torch.randn(3, 4), torch.randn(3)
    out = OPS.causal_conv1d(x, w, b, "silu")
    assert out.dtype == torch.bfloat16
    # Computed in the weight's dtype, then rounded once.
    torch.testing.assert_close(out, seq_conv(x.float(), w, b, "silu").bfloat16())


@pytest.mark.parametrize("op", ["causal_conv1d", "causal_conv1d_update"])
def test_conv_rejects_unknown_activation(op):
    x, w = torch.randn(1, 2, 3), torch.randn(2, 4)
    args = (x, w, None, "relu") if op == "causal_conv1d" else (x, torch.randn(1, 2, 4), w, None, "relu")
    with pytest.raises(ValueError, match="relu"):
        getattr(OPS, op)(*args)


@pytest.mark.parametrize("s_extra,l", [(0, 1), (1, 1), (3, 2), (1, 5)])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_causal_conv1d_update_forward(s_extra, l, bias, activation):
    k = 4
    s = k - 1 + s_extra
    x, state = torch.randn(2, 3, l, dtype=torch.float64), torch.randn(2, 3, s, dtype=torch.float64)
    w = torch.randn(3, k, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64) if bias else None
    out, new_state = OPS.causal_conv1d_update(x, state, w, b, activation)
    want_out, want_state = seq_conv_update(x, state, w, b, activation)
    assert_close(out, want_out, 1e-12)
    assert torch.equal(new_state, want_state)


def test_causal_conv1d_update_dtypes():
    x, state = torch.randn(2, 3, 1).bfloat16(), torch.randn(2, 3, 4)
    out, new_state = OPS.causal_conv1d_update(x, state, torch.randn(3, 4), None, None)
    assert out.dtype == torch.bfloat16 and new_state.dtype == torch.float32


def test_causal_conv1d_grads():
    x, w, b = torch.randn(2, 3, 7), torch.randn(3, 4), torch.randn(3)
    check_grads(OPS.causal_conv1d, seq_conv, [x, w, b, "silu"], tol=1e-5)
    state = torch.randn(2, 3, 5)
    check_grads(OPS.causal_conv1d_update, seq_conv_update, [x[..., :2], state, w, b, "silu"], tol=1e-5)


# --- selective_state_update ------------------------------------------------------


def make_update_mamba1(b, d, n, D=True, z=True, bias=True, softplus=True):
    return [
        torch.randn(b, d, n), torch.randn(b, d), torch.randn(b, d) if softplus else torch.rand(b, d) + 0.05,
        negative(d, n), torch.randn(b, n), torch.randn(b, n),
        torch.randn(d) if D else None, torch.randn(b, d) if z else None,
        torch.randn(d) if bias else None, softplus,
    ]


def make_update_mamba2(b, h, p, g, n, D=True, z=True, bias=True, softplus=True):
    return [
        torch.randn(b, h, p, n), torch.randn(b, h, p), torch.randn(b, h, p) if softplus else torch.rand(b, h, p) + 0.05,
        negative(h, p, n), torch.randn(b, g, n), torch.randn(b, g, n),
        torch.randn(h, p) if D else None, torch.randn(b, h, p) if z else None,
        torch.randn(h, p) if bias else None, softplus,
    ]


UPDATE_CASES = {
    "mamba1": (make_update_mamba1, dict(b=2, d=5, n=16)),
    "mamba1_bare_n1": (make_update_mamba1, dict(b=1, d=3, n=1, D=False, z=False, bias=False, softplus=False)),
    "mamba2_grouped": (make_update_mamba2, dict(b=2, h=4, p=3, g=2, n=16)),
    "mamba2_bare": (make_update_mamba2, dict(b=1, h=3, p=2, g=1, n=4, D=False, z=False, bias=False)),
}


@pytest.mark.parametrize("case", UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_selective_state_update_forward_and_grad(case):
    make, kw = case
    args = make(**kw)
    out, new_state = OPS.selective_state_update(*args)
    want_out, want_state = seq_state_update(*to_double(args))
    assert_close(out, want_out, FWD_TOL, "out")
    assert_close(new_state, want_state, FWD_TOL, "new_state")
    check_grads(OPS.selective_state_update, seq_state_update, args)


def test_selective_state_update_dtypes():
    args = make_update_mamba2(b=1, h=2, p=2, g=1, n=4)
    args[1], args[2], args[7] = args[1].bfloat16(), args[2].bfloat16(), args[7].bfloat16()
    out, new_state = OPS.selective_state_update(*args)
    assert out.dtype == torch.bfloat16 and new_state.dtype == torch.float32


# --- prefill then decode equals a longer prefill --------------------------------


def test_mamba1_prefill_then_decode():
    u, delta, A, B, C, D, z, bias, sp, init = make_selective_scan(b=2, d=4, n=16, l=10)
    _, state = OPS.selective_scan(
        u[..., :-1], delta[..., :-1], A, B[..., :-1], C[..., :-1], D, z[..., :-1], bias, sp, init
    )
    out_last, state_last = OPS.selective_state_update(
        state, u[..., -1], delta[..., -1], A, B[..., -1], C[..., -1], D, z[..., -1], bias, sp
    )
    out_full, state_full = OPS.selective_scan(u, delta, A, B, C, D, z, bias, sp, init)
    assert_close(out_last, out_full[..., -1], FWD_TOL)
    assert_close(state_last, state_full, FWD_TOL)


def test_mamba2_prefill_then_decode():
    x, dt, A, B, C, chunk, D, bias, init, sp, lo, hi = make_ssd(b=2, l=9, h=4, p=3, g=2, n=8, chunk=4, D="h")
    _, state = OPS.ssd_scan(x[:, :-1], dt[:, :-1], A, B[:, :-1], C[:, :-1], chunk, D, bias, init, sp, lo, hi)
    h, p, n = 4, 3, 8
    # The decode step takes per-(head, head dim) parameters: broadcast the per-head ones.
    out_last, state_last = OPS.selective_state_update(
        state, x[:, -1], dt[:, -1, :, None].expand(-1, h, p), A[:, None, None].expand(h, p, n),
        B[:, -1], C[:, -1], D[:, None].expand(h, p), None, bias[:, None].expand(h, p), sp,
    )
    out_full, state_full = OPS.ssd_scan(x, dt, A, B, C, chunk, D, bias, init, sp, lo, hi)
    assert_close(out_last, out_full[:, -1], FWD_TOL)
    assert_close(state_last, state_full, FWD_TOL)


@pytest.mark.parametrize("s", [3, 4, 6])
def test_conv_prefill_then_decode(s):
    k, l = 4, 9
    f64 = dict(dtype=torch.float64)
    x, w, b = torch.randn(2, 3, l + 2, **f64), torch.randn(3, k, **f64), torch.randn(3, **f64)
    prefix = x[..., :l]
    state = F.pad(prefix, (max(s - l, 0), 0))[..., -s:]  # the last s inputs, zero-padded on the left
    out, new_state = OPS.causal_conv1d_update(x[..., l:], state, w, b, "silu")
    full = OPS.causal_conv1d(x, w, b, "silu")
    assert_close(out, full[..., l:], 1e-12)
    assert torch.equal(new_state, x[..., -s:])


# --- export / fake tensors ------------------------------------------------------


def _export_cases():
    scan = make_selective_scan(b=2, d=4, n=4, l=5, g=2)
    ssd = make_ssd(b=2, l=6, h=4, p=2, g=2, n=4, chunk=4, D="hp", dt_max=2.0)
    x, w, b = torch.randn(2, 3, 5), torch.randn(3, 4), torch.randn(3)
    return {
        "selective_scan": scan,
        "ssd_scan": ssd,
        "causal_conv1d": [x, w, b, "silu"],
        "causal_conv1d_update": [x[..., :1], torch.randn(2, 3, 4), w, b, None],
        "selective_state_update": make_update_mamba2(b=2, h=4, p=2, g=2, n=4),
        "gated_rms_norm": [torch.randn(2, 3, 6), torch.randn(2, 3, 6), torch.randn(6), 1e-5, 3],
        "rms_norm": [torch.randn(2, 3, 5), torch.randn(5), 1e-5],
        "add_rms_norm": [torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(5), 1e-5, torch.float32],
        "decode_linear": [torch.randn(2, 1, 5), torch.randn(3, 5), torch.randn(3)],
        "decode_linear_group": [torch.randn(2, 1, 5), [torch.randn(3, 5), torch.randn(4, 5)]],
        # q and k as attention hands them over: (b, l, h, p) viewed as (b, h, l, p).
        "rotary": [[torch.randn(2, 1, 4, 8).transpose(1, 2), torch.randn(2, 1, 2, 8).transpose(1, 2)],
                   torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)],
    }


def _map_tensors(args, fn):
    """``args`` with ``fn`` applied to every tensor, those inside lists (``Tensor[]``) included."""
    return [type(a)(fn(t) for t in a) if isinstance(a, (list, tuple)) else fn(a) if isinstance(a, torch.Tensor)
            else a for a in args]


def _tensors(args):
    """Every tensor of ``args`` in order, list elements included."""
    found = []
    _map_tensors(args, found.append)
    return found


EXPORT_CASES = _export_cases()


class _CallOp(torch.nn.Module):
    def __init__(self, name, args):
        super().__init__()
        self.op = getattr(OPS, name)
        # Non-tensor arguments are baked in; tensors (or None) are module inputs.
        self.template = args

    def forward(self, *tensors):
        it = iter(tensors)
        return self.op(*_map_tensors(self.template, lambda _: next(it)))


@pytest.mark.parametrize("name", EXPORT_CASES.keys())
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_export_single_node(name, device):
    args = EXPORT_CASES[name]
    tensors = tuple(a.to(device) for a in _tensors(args))
    ep = torch.export.export(_CallOp(name, args), tensors, strict=False)
    target = getattr(OPS, name).default
    # Multi-output ops are followed by getitem nodes that unpack the tuple.
    calls = [n.target for n in ep.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [target]
    if device == "cpu":
        for got, want in zip(as_tuple(ep.module()(*tensors)), as_tuple(getattr(OPS, name)(*args))):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", EXPORT_CASES.keys())
def test_fake_matches_real(name):
    args = EXPORT_CASES[name]
    real = as_tuple(getattr(OPS, name)(*args))
    with FakeTensorMode() as mode:
        fake_args = _map_tensors(args, mode.from_tensor)
        fake = as_tuple(getattr(OPS, name)(*fake_args))
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


INFERENCE_ONLY = ("decode_linear_group", "rotary")  # registered without autograd (ops/ssm.py)


def test_a_backward_through_an_inference_only_op_is_an_error():
    x, weights = torch.randn(1, 5, requires_grad=True), [torch.randn(3, 5), torch.randn(2, 5)]
    outs = OPS.decode_linear_group(x, weights)
    with pytest.raises(RuntimeError, match="decode_linear_group"):
        outs[0].sum().backward()


@pytest.mark.parametrize("name", EXPORT_CASES.keys())
def test_opcheck(name):
    # Schema, fake-impl, autograd-registration and AOT-dispatch consistency checks.
    args = _map_tensors(EXPORT_CASES[name], lambda a: a.clone().requires_grad_(a.is_floating_point()))
    utils = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static"]
    if name in INFERENCE_ONLY:
        utils = ["test_schema", "test_faketensor"]
    elif name not in ("selective_scan", "ssd_scan"):
        # Passes for the scans too, but tracing their backward with symbolic
        # shapes takes ~15 s, too slow for this file.
        utils.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(OPS, name).default, args, test_utils=utils)


def test_ops_return_the_layout_their_fake_declares():
    """A compiled graph reads an opaque op's outputs with the strides of its fake (Inductor asserts
    them): the conv of a transposed input (in_proj's output, as HF feeds it) keeps that layout,
    a scan's outputs are contiguous, on the reference implementations as on the fakes."""
    x = torch.randn(2, 9, 6).transpose(1, 2)  # (b, d, l) viewed from (b, l, d)
    w, b = torch.randn(6, 4), torch.randn(6)
    out = OPS.causal_conv1d(x, w, b, "silu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = OPS.causal_conv1d(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), "silu")
    assert out.stride() == fake.stride() == x.stride()
    assert_close(out, seq_conv(x, w, b, "silu"), 1e-5)
    scan_args = make_selective_scan(2, 4, 3, 5)
    y, state = OPS.selective_scan(*scan_args)
    assert y.is_contiguous() and state.is_contiguous()
