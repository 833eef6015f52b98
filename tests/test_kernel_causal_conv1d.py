"""Triton causal conv1d kernels against a plain float64 loop over sequences, tokens and taps.

Dimension letters: b batch, d channels, l tokens, k conv width, s sequences (or, for the
update kernel, conv-state length).

Runs on CUDA when present, else under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before the kernels are imported). Sizes are small for the interpreter.

Tolerances, as max |got - want| / max |want| per tensor:
  float32: the kernels add k products (forward) or sum over b*l tokens (dweight) in float32:
    1e-6 for outputs and dx, 1e-5 for dweight / dbias / d(initial states).
  bfloat16 / float16: the float64 loop runs on the same rounded inputs, and the kernels
    round once at the end, so each element is within half an ulp of its output dtype plus
    the float32 error above: rtol 2**-8 (bf16) / 2**-11 (fp16) element-wise.
  Final states are copies of inputs (or of initial states, when both share x's dtype):
    compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmshard import ops  # noqa: F401  (registers torch.ops.ssmshard)
from ssmshard.kernels import causal_conv1d as kconv
from ssmshard.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = torch.ops.ssmshard
FP32_OUT_TOL, FP32_GRAD_TOL = 1e-6, 1e-5
RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}

# Tiny tiles put many tile edges (and so block boundaries) inside short test sequences.
SMALL_TOKENS_FIRST = kconv.TileConfig(block_d=8, block_l=8, group=4, num_warps=1, channels_last=False)
SMALL_CHANNELS_LAST = kconv.TileConfig(block_d=8, block_l=8, group=4, num_warps=1, channels_last=True)


# --- float64 reference: one Python step per sequence, token and tap --------------------------


def loop_conv(x, weight, bias, activation, cu_seqlens=None, initial_states=None):
    """(out, final_states) of the packed / batched depthwise causal conv, any float dtype."""
    bsz, d, l = x.shape
    k = weight.shape[1]
    if cu_seqlens is None:
        spans = [(row, 0, l) for row in range(bsz)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
    outs = torch.zeros_like(x).unbind(0)
    outs = [list(o.unbind(-1)) for o in outs]  # per row, per token: (d,)
    finals = []
    for s, (row, start, end) in enumerate(spans):
        history = initial_states[s] if initial_states is not None else x.new_zeros(d, k - 1)
        stream = list(history.unbind(-1)) + list(x[row, :, start:end].unbind(-1))  # (d,) each
        for t in range(end - start):
            acc = bias.clone() if bias is not None else x.new_zeros(d)
            for i in range(k):  # tap i reads k-1-i tokens back; the window starts at stream[t]
                acc = acc + weight[:, i] * stream[t + i]
            outs[row][start + t] = F.silu(acc) if activation else acc
        finals.append(torch.stack(stream[len(stream) - (k - 1):], -1))
    out = torch.stack([torch.stack(o, -1) for o in outs], 0)
    return out, torch.stack(finals, 0)


def loop_update(x, conv_state, weight, bias, activation):
    """Token-by-token decode: the window is the state's last k-1 inputs then the new ones."""
    k, s = weight.shape[1], conv_state.shape[-1]
    seen = list(conv_state.unbind(-1))
    outs = []
    for t in range(x.shape[-1]):
        seen.append(x[..., t])
        acc = bias.clone() if bias is not None else x.new_zeros(x.shape[:-1])
        for i in range(k):
            acc = acc + weight[:, i] * seen[len(seen) - k + i]
        outs.append(F.silu(acc) if activation else acc)
    return torch.stack(outs, -1), torch.stack(seen[len(seen) - s:], -1)


# --- helpers --------------------------------------------------------------------------------



def check(got, want, dtype, tol, what):
    if dtype == torch.float32:
        err = rel_err(got, want)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"
    else:
        scale = want.double().abs().max().item()
        torch.testing.assert_close(got.double(), want.double(), rtol=RTOL[dtype], atol=1e-6 * scale,
                                   msg=lambda m: f"{what}: {m}")


def make_x(b, d, l, dtype, layout):
    """x (b, d, l) in one of the layouts models produce."""
    if layout == "tokens_contiguous":
        return torch.randn(b, d, l, device=DEVICE).to(dtype)
    if layout == "channels_last":  # Mamba-2: (b, l, d) projection transposed
        return torch.randn(b, l, d, device=DEVICE).to(dtype).transpose(1, 2)
    if layout == "channels_last_half":  # Mamba-1: one half of a (b, l, 2d) projection
        return torch.randn(b, l, 2 * d, device=DEVICE).to(dtype).transpose(1, 2)[:, d:]
    raise ValueError(layout)


def cu_from_lengths(lengths):
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return cu.to(DEVICE)


def run_case(dtype, k, lengths=None, batch=2, d=6, l=21, layout="tokens_contiguous", bias=True,
             activation="silu", init=True, final=True, config=None, param_dtype=None):
    """Kernel vs loop on outputs and every input gradient; returns the kernel's results.

    param_dtype: dtype of weight, bias and initial states (default: x's)."""
    param_dtype = param_dtype or dtype
    packed = lengths is not None
    if packed:
        batch, l = 1, sum(lengths)
        cu = cu_from_lengths(lengths)
        n_seqs = len(lengths)
    else:
        cu, n_seqs = None, batch
    x = make_x(batch, d, l, dtype, layout)
    w = (torch.randn(d, k, device=DEVICE) / k**0.5).to(param_dtype)
    b = torch.randn(d, device=DEVICE).to(param_dtype) if bias else None
    h0 = torch.randn(n_seqs, d, k - 1, device=DEVICE).to(param_dtype) if init else None
    leaves = [t for t in (x, w, b, h0) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    gy = torch.randn(batch, d, l, device=DEVICE).to(dtype)
    gf = torch.randn(n_seqs, d, k - 1, device=DEVICE).to(dtype)

    want_out, want_fin = loop_conv(*(t.detach().double() if t is not None else None for t in (x, w, b)),
                                   activation, cu, h0.detach().double() if init else None)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    rb = ref_leaves[2] if bias else None
    rh = ref_leaves[-1] if init else None
    r_out, r_fin = loop_conv(ref_leaves[0], ref_leaves[1], rb, activation, cu, rh)
    loss = (r_out * gy.double()).sum() + ((r_fin * gf.double()).sum() if final else 0)
    want_grads = torch.autograd.grad(loss, ref_leaves)

    if config is None:
        res = kconv.causal_conv1d(x, w, b, activation, cu_seqlens=cu, initial_states=h0,
                                  return_final_states=final)
        out, fin = res if final else (res, None)
        got_grads = torch.autograd.grad([out] + ([fin] if final else []), leaves, [gy] + ([gf] if final else []))
    else:  # explicit tiles: call the launchers directly
        with torch.no_grad():
            out, fin = kconv.conv_forward(x, w, b, activation, cu, h0, final, config=config)
            dx, dw, db, dh = kconv.conv_backward(x, w, b, activation, cu, h0, gy, gf if final else None,
                                                 config=config)
        got_grads = [g for g in (dx, dw, db, dh) if g is not None]

    assert out.dtype == dtype and out.shape == x.shape and out.stride() == torch.empty_like(x).stride()
    check(out, want_out, dtype, FP32_OUT_TOL, "out")
    if final:
        assert fin.dtype == dtype and fin.shape == (n_seqs, d, k - 1)
        assert torch.equal(fin, want_fin.to(dtype)), "final states are copies of inputs (in x's dtype)"
    names = ["dx", "dweight", "dbias", "dinit"]
    names = [n for n, t in zip(names, (x, w, b, h0)) if t is not None]
    for name, got, want, leaf in zip(names, got_grads, want_grads, leaves):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        check(got, want, dtype, FP32_OUT_TOL if name == "dx" else FP32_GRAD_TOL, name)
    return x, w, b, h0, cu, out, fin, got_grads


# --- the conv --------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("layout", ["tokens_contiguous", "channels_last"])
def test_conv_batched_matches_loop(fresh_seed, k, layout):
    run_case(torch.float32, k, batch=2, l=23, layout=layout)


@pytest.mark.parametrize(
    "k,config",
    [(2, SMALL_TOKENS_FIRST), (3, SMALL_CHANNELS_LAST), (4, SMALL_TOKENS_FIRST), (4, SMALL_CHANNELS_LAST)],
    ids=["k2-tokens_first", "k3-channels_last", "k4-tokens_first", "k4-channels_last"],
)
def test_conv_packed_matches_loop(fresh_seed, k, config):
    # Length-1 sequences, sequences shorter than k-1, an empty one, starts on and next to
    # the 8-token tile edges (0, 8, 16, 24 ...) and an odd total length.
    lengths = [1, 7, 1, 2, 0, 5, 8, 1, 3, 9]
    run_case(torch.float32, k, lengths=lengths, config=config)


@pytest.mark.parametrize("option", ["no_bias", "no_activation", "no_init", "no_final", "swish"])
def test_conv_options(fresh_seed, option):
    kwargs = {"no_bias": dict(bias=False), "no_activation": dict(activation=None),
              "no_init": dict(init=False), "no_final": dict(final=False),
              "swish": dict(activation="swish")}[option]
    run_case(torch.float32, 4, lengths=[3, 1, 12, 2, 6], **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv_half_precision(fresh_seed, dtype):
    run_case(dtype, 4, lengths=[5, 1, 2, 17, 3])
    run_case(dtype, 4, batch=2, l=19, layout="channels_last", param_dtype=torch.float32)


def test_conv_strided_half_projection(fresh_seed):
    # Mamba-1 hands over one half of a (b, l, 2d) projection, transposed: read in place.
    run_case(torch.float32, 4, batch=1, d=20, l=133, layout="channels_last_half")


def test_packed_equals_each_sequence_alone(fresh_seed):
    lengths, d, k = [4, 1, 9, 2], 5, 4
    cu = cu_from_lengths(lengths)
    x = torch.randn(1, d, sum(lengths), device=DEVICE, requires_grad=True)
    w = torch.randn(d, k, device=DEVICE, requires_grad=True)
    b = torch.randn(d, device=DEVICE)
    h0 = torch.randn(len(lengths), d, k - 1, device=DEVICE, requires_grad=True)
    out, fin = kconv.causal_conv1d(x, w, b, "silu", cu_seqlens=cu, initial_states=h0, return_final_states=True)
    gy, gf = torch.randn_like(out), torch.randn_like(fin)
    packed = torch.autograd.grad((out * gy).sum() + (fin * gf).sum(), [x, w, h0])
    dw_sum = torch.zeros_like(w)
    for s, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xs = x.detach()[:, :, start:end].clone().requires_grad_(True)
        hs = h0.detach()[s : s + 1].clone().requires_grad_(True)
        ws = w.detach().clone().requires_grad_(True)
        o, f = kconv.causal_conv1d(xs, ws, b, "silu", initial_states=hs, return_final_states=True)
        assert rel_err(o, out[:, :, start:end]) <= FP32_OUT_TOL
        torch.testing.assert_close(f, fin[s : s + 1], rtol=0, atol=0)
        gx, gw, gh = torch.autograd.grad((o * gy[:, :, start:end]).sum() + (f * gf[s : s + 1]).sum(), [xs, ws, hs])
        assert rel_err(gx, packed[0][:, :, start:end]) <= FP32_OUT_TOL
        assert rel_err(gh, packed[2][s : s + 1]) <= FP32_OUT_TOL
        dw_sum += gw
    assert rel_err(dw_sum, packed[1]) <= FP32_GRAD_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["tokens_contiguous", "channels_last"])
def test_conv_equals_reference_op(fresh_seed, dtype, layout):
    """Drop-in for torch.ops.ssmshard.causal_conv1d: same outputs and gradients."""
    x = make_x(2, 8, 30, dtype, layout).requires_grad_(True)
    w = (torch.randn(8, 4, device=DEVICE) / 2).to(dtype).requires_grad_(True)
    b = torch.randn(8, device=DEVICE).to(dtype).requires_grad_(True)
    gy = torch.randn(2, 8, 30, device=DEVICE).to(dtype)
    want = OPS.causal_conv1d(x, w, b, "silu")
    got = kconv.causal_conv1d(x, w, b, "silu")
    want_g = torch.autograd.grad(want, [x, w, b], gy)
    got_g = torch.autograd.grad(got, [x, w, b], gy)
    # The op computes in the weight's dtype: at bfloat16 it rounds after the conv and after
    # silu (2**-8 of the largest value each), the kernel once (2**-7 under the interpreter,
    # which truncates): 2**-6 bounds the sum. Float32: summation order only.
    tol = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2.0**-6, 2.0**-6)}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    for name, g, r in zip(["out", "dx", "dweight", "dbias"], [got, *got_g], [want, *want_g]):
        err = rel_err(g, r)
        assert err <= tol[name not in ("out", "dx")], f"{name}: {err:.3g}"


# --- decode step -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("state_len,tokens", [(None, 1), (None, 3), (1, 1), (2, 5)])
def test_update_matches_loop_and_reference_op(fresh_seed, k, state_len, tokens):
    # state_len: extra slots beyond k - 1 (None: exactly k, as HF allocates it).
    s = k if state_len is None else k - 1 + state_len
    x = torch.randn(3, 5, tokens, device=DEVICE)
    state = torch.randn(3, 5, s, device=DEVICE)
    w = torch.randn(5, k, device=DEVICE)
    b = torch.randn(5, device=DEVICE)
    out, new_state = kconv.causal_conv1d_update(x, state, w, b, "silu")
    want_out, want_state = loop_update(x.double(), state.double(), w.double(), b.double(), "silu")
    assert rel_err(out, want_out) <= FP32_OUT_TOL
    assert torch.equal(new_state.double(), want_state)
    op_out, op_state = OPS.causal_conv1d_update(x, state, w, b, "silu")
    assert rel_err(out, op_out) <= FP32_OUT_TOL  # summation order differs: see the module docstring
    torch.testing.assert_close(new_state, op_state, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_in_place_equals_full_conv(fresh_seed, dtype):
    """Prefill with final states, then decode token by token into the same state buffer
    (a channels-last state view, as a strided cache would hand it): the outputs are the
    full conv's, the state ends as the full conv's final state."""
    k, d, l, prefill = 4, 6, 12, 5
    x = torch.randn(2, d, l, device=DEVICE).to(dtype)
    w = torch.randn(d, k, device=DEVICE).to(dtype)
    b = torch.randn(d, device=DEVICE).to(dtype)
    full, full_final = kconv.causal_conv1d(x, w, b, "silu", return_final_states=True)
    _, state = kconv.causal_conv1d(x[..., :prefill], w, b, "silu", return_final_states=True)
    buffer = torch.zeros(2, k, d, device=DEVICE, dtype=dtype).transpose(1, 2)  # (b, d, s = k)
    buffer[..., 1:] = state
    for t in range(prefill, l):
        y, returned = kconv.causal_conv1d_update(x[..., t], buffer, w, b, "silu", out_state=buffer)
        assert returned is buffer and y.shape == (2, d)
        if dtype == torch.float32:
            assert rel_err(y, full[..., t]) <= FP32_OUT_TOL
        else:  # both round the same float32 sum once
            torch.testing.assert_close(y, full[..., t], rtol=0, atol=0)
    torch.testing.assert_close(buffer[..., 1:], full_final, rtol=0, atol=0)


# --- refusals ---------------------------------------------------------------------------------


def test_refuses_bad_inputs():
    x = torch.randn(2, 4, 8, device=DEVICE)
    w = torch.randn(4, 3, device=DEVICE)
    cu = cu_from_lengths([3, 5])
    cases = [
        (lambda: kconv.causal_conv1d(x, w, activation="relu"), "activation"),
        (lambda: kconv.causal_conv1d(x, w, cu_seqlens=cu), "batch 1"),
        (lambda: kconv.causal_conv1d(x[:1], w, cu_seqlens=cu.long()), "int32"),
        (lambda: kconv.causal_conv1d(x[:1], w, cu_seqlens=cu_from_lengths([3, 4]).cpu()), "rise from 0|device"),
        (lambda: kconv.causal_conv1d(x, w, initial_states=torch.randn(2, 4, 3, device=DEVICE)), "initial_states"),
        (lambda: kconv.causal_conv1d(x[:1], w, cu_seqlens=cu, initial_states=torch.randn(1, 4, 2, device=DEVICE)),
         "sequences=2"),
        (lambda: kconv.causal_conv1d(x, torch.randn(4, 9, device=DEVICE)), "width"),
        (lambda: kconv.causal_conv1d(x.long(), w), "float32"),
        (lambda: kconv.causal_conv1d_update(x, torch.randn(2, 4, 1, device=DEVICE), w), "shorter"),
        (lambda: kconv.causal_conv1d_update(x, torch.randn(2, 4, 3, device=DEVICE), w.requires_grad_()),
         "inference-only"),
    ]
    for call, words in cases:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=words):
            call()
