"""Triton SSD scan (ssmshard.kernels.ssd_scan) against a float64 per-token reference.

Dimension letters: b batch, l length, h heads, p head dim, g groups, n state size,
S packed sequences, T chunk size.

Runs on CUDA when available, else under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before the kernels are imported). Sizes are small for the interpreter.
Errors are max |kernel - reference| / max |reference| per tensor, on fresh random inputs.

Tolerances (worst seen over 24 seeds in brackets):
- float32: the kernels compute in float32 (tl.dot with exact fp32 products, not tf32), so
  they sit at float32 rounding of sums over a few dozen terms: 1e-5 for outputs and
  states [6e-7], 3e-5 for gradients [3e-6].
- bfloat16: the reference runs in float64 on the same bf16-rounded inputs. The kernels
  round tensor-core operands to bf16 (decayed C.B weights, x * dt, the carried states)
  and outputs and gradients to bf16, each a relative error up to 2^-8 (2^-7 under the
  interpreter, which truncates instead of rounding); a few add up: 4e-2 [1.9e-2].
- dA, dD and d dt_bias sum one term per token, of both signs: their error is measured
  against the sum of the terms' magnitudes (from the reference's per-token gradients),
  not against the partly cancelled sum, which can be near zero.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ssmshard import ops  # noqa: F401  (registers torch.ops.ssmshard)
from ssmshard.kernels.ssd_scan import ssd_scan, ssd_scan_like_op
from ssmshard.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL, FP32_GRAD_TOL = 1e-5, 3e-5
BF16_TOL = 4e-2
INPUT_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


# --- float64 per-token reference ------------------------------------------------------


def sequential_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), cu_seqlens=None, initial_states=None):
    """One Python step per token; the state restarts at every sequence start.

    Sequences are the batch rows, or with cu_seqlens (b == 1) the packed spans. A is (h,)
    or per token (b, l, h); D is (h,), (h, p) or per token (b, l, h, p). Returns (out (b, l, h, p), final states (S or b, h, p, n)).
    """
    bsz, l, h, p = x.shape
    g, n = B.shape[-2:]
    dt = dt if dt_bias is None else dt + dt_bias
    dt = F.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(*dt_limit)
    B = B.repeat_interleave(h // g, dim=2)  # head i reads group i // (h // g): (b, l, h, n)
    C = C.repeat_interleave(h // g, dim=2)
    if cu_seqlens is None:
        spans = [(row, 0, l) for row in range(bsz)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    ys = [[None] * l for _ in range(bsz)]
    finals = []
    for seq, (row, lo, hi) in enumerate(spans):
        state = x.new_zeros(h, p, n) if initial_states is None else initial_states[seq]
        for t in range(lo, hi):
            dt_t = dt[row, t, :, None, None]  # (h, 1, 1)
            A_t = A[row, t] if A.dim() == 3 else A
            state = torch.exp(dt_t * A_t[:, None, None]) * state + dt_t * x[row, t, :, :, None] * B[row, t, :, None, :]
            y = (state * C[row, t, :, None, :]).sum(-1)  # (h, p)
            if D is not None:
                D_t = D[row, t] if D.dim() == 4 else D if D.dim() == 2 else D[:, None]
                y = y + D_t * x[row, t]
            ys[row][t] = y
        finals.append(state)
    out = torch.stack([torch.stack(row) for row in ys])
    if z is not None:
        out = out * z * torch.sigmoid(z)
    return out, torch.stack(finals)


# --- inputs and comparison -----------------------------------------------------------


def make_inputs(b, l, h, p, g, n, *, D="h", z=True, bias=True, init=None, dtype=torch.float32,
                dt_scale=0.5, dt_shift=0.0):
    """Random inputs on DEVICE. A in [-0.3, -0.05]: decays slow enough that states carried
    across several chunks still matter. init: number of initial states, or None."""
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape) * scale + shift).to(DEVICE)

    inputs = {
        "x": rnd(b, l, h, p).to(dtype),
        "dt": rnd(b, l, h, scale=dt_scale, shift=dt_shift).to(dtype),
        "A": -(0.05 + 0.25 * torch.rand(h)).to(DEVICE),
        "B": rnd(b, l, g, n).to(dtype),
        "C": rnd(b, l, g, n).to(dtype),
        "D": None if D is None else rnd(*((h,) if D == "h" else (h, p))),
        "z": rnd(b, l, h, p).to(dtype) if z else None,
        "dt_bias": rnd(h, scale=0.3) if bias else None,
        "initial_states": None if init is None else rnd(init, h, p, n, scale=0.5),
    }
    return inputs



def check_against_sequential(inputs, chunk_size, options, tol, grad_tol, cu_seqlens=None, final=True):
    """Forward and every input gradient of ssd_scan vs sequential_ssd in float64."""
    # detach, not clone: leaves keep the inputs' strides (views of a shared buffer stay views).
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items() if v is not None}
    leaves64 = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    # A and D per token, so the reference also gives the per-token terms of dA and dD.
    bsz, l, h, p = inputs["x"].shape
    leaves64["A"] = leaves64["A"].detach().expand(bsz, l, h).clone().requires_grad_(True)
    if "D" in leaves64:
        D_rows = leaves64["D"].detach().reshape(h, -1).expand(h, p)  # (h,) or (h, p) -> (h, p)
        leaves64["D"] = D_rows.expand(bsz, l, h, p).clone().requires_grad_(True)
    cu_cpu = None if cu_seqlens is None else cu_seqlens.cpu()
    want_out, want_final = sequential_ssd(**leaves64, **options, cu_seqlens=cu_cpu)
    got = ssd_scan(chunk_size=chunk_size, **leaves, **options, cu_seqlens=cu_seqlens,
                   return_final_states=final)
    got_out, got_final = got if final else (got, None)

    assert got_out.dtype == inputs["x"].dtype and got_out.shape == want_out.shape
    errors = {"out": rel_err(got_out, want_out)}
    grad_out = torch.randn_like(want_out)
    loss64 = (want_out * grad_out).sum()
    loss = (got_out.double() * grad_out).sum()
    if final:
        assert got_final.dtype == torch.float32 and got_final.shape == want_final.shape
        errors["final"] = rel_err(got_final, want_final)
        grad_final = torch.randn_like(want_final)
        loss64 = loss64 + (want_final * grad_final).sum()
        loss = loss + (got_final.double() * grad_final).sum()
    names = list(leaves)
    want_grads = dict(zip(names, torch.autograd.grad(loss64, [leaves64[k] for k in names])))
    got_grads = dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names])))
    # Sums over tokens: measured against the sum of their terms' magnitudes.
    term_scale = {"A": want_grads["A"].abs().sum((0, 1)).max()}
    want_grads["A"] = want_grads["A"].sum((0, 1))
    if "D" in names:
        summed = (0, 1) if inputs["D"].dim() == 2 else (0, 1, 3)
        term_scale["D"] = want_grads["D"].abs().sum(summed).max()
        want_grads["D"] = want_grads["D"].sum(summed)
    if "dt_bias" in names:  # dt_bias enters exactly like dt: its terms are d dt
        term_scale["dt_bias"] = want_grads["dt"].abs().sum((0, 1)).max()
    for name in names:
        got_g, want_g = got_grads[name], want_grads[name]
        assert got_g.dtype == leaves[name].dtype and got_g.shape == want_g.shape, name
        if name in term_scale:
            errors["d" + name] = ((got_g.double() - want_g).abs().max() / term_scale[name]).item()
        else:
            errors["d" + name] = rel_err(got_g, want_g)
    bad = {k: v for k, v in errors.items() if not v <= (tol if k in ("out", "final") else grad_tol)}
    assert not bad, f"errors above tolerance: {bad} (all: {errors})"
    return errors


def packed_lengths(chunk_size: int) -> list[int]:
    """Random lengths with length-1 sequences, odd lengths, a boundary exactly on a multiple
    of chunk_size in the packed row and boundaries strictly inside chunks."""
    odd = lambda: 2 * int(torch.randint(1, chunk_size + 1, ())) + 1  # noqa: E731
    lengths = [chunk_size, 1, odd(), odd(), 1, odd()]
    bounds = torch.tensor(lengths).cumsum(0)[:-1]
    assert (bounds % chunk_size == 0).any() and (bounds % chunk_size != 0).any()
    return lengths


def cu_from(lengths):
    return torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)


# --- tests ------------------------------------------------------------------------------


BATCH_CASES = {
    # every option on, two groups of two heads, D per (h, p), dt clamped from above too
    "full": dict(shape=dict(b=2, l=37, h=4, p=8, g=2, n=16, D="hp", init=2), chunk=16,
                 options=dict(dt_softplus=True, dt_limit=(0.02, 1.0)), final=True),
    # state size 1, no gate / bias / softplus: raw dt around 0.2, the negative ones clamped to 0
    "n1_plain": dict(shape=dict(b=1, l=23, h=2, p=4, g=1, n=1, D="h", z=False, bias=False,
                                dt_scale=0.3, dt_shift=0.2), chunk=8, options={}, final=True),
    # rows shorter than the chunk, of a length that is no power of two
    "short_rows": dict(shape=dict(b=3, l=21, h=2, p=4, g=1, n=8, D="h"), chunk=64,
                       options=dict(dt_softplus=True), final=True),
    # rows a multiple of the chunk long, every chunk full
    "aligned": dict(shape=dict(b=2, l=32, h=4, p=8, g=1, n=16, D="h"), chunk=16,
                    options=dict(dt_softplus=True), final=True),
    # state size 128, no D, out only (no final states)
    "n128": dict(shape=dict(b=1, l=20, h=2, p=4, g=2, n=128, D=None, init=1), chunk=16,
                 options=dict(dt_softplus=True), final=False),
}


@pytest.mark.parametrize("case", BATCH_CASES, ids=list(BATCH_CASES))
def test_batch_matches_sequential(case, fresh_seed):
    spec = BATCH_CASES[case]
    inputs = make_inputs(**spec["shape"])
    check_against_sequential(inputs, spec["chunk"], spec["options"], FP32_TOL, FP32_GRAD_TOL, final=spec["final"])


def route_cb(monkeypatch, stored: bool) -> list:
    """Make the output kernel read C.B^T stored once per group (or multiply it per head).

    Stored, every entry that ``ssd_chunk_cb_kernel`` leaves unwritten or that no output may
    use (column j > row i, rows past the chunk's length) is set to NaN, so a kernel that read
    one into its result fails. Returns the shapes of the stored buffers (empty: not stored).
    """
    from ssmshard.kernels import ssd_scan_fwd

    calls = []
    real_run_chunk_cb = ssd_scan_fwd.run_chunk_cb

    def poisoned(B, C, table):
        cb = real_run_chunk_cb(B, C, table)  # (k, g, T, R)
        T, R = cb.shape[-2:]
        above = torch.ones(T, R, dtype=torch.bool, device=cb.device).triu(1)
        past_end = torch.arange(T, device=cb.device)[None, :] >= table.chunk_len[:, None]  # (k, T)
        cb.masked_fill_(above, float("nan"))
        cb.masked_fill_(past_end[:, None, :, None], float("nan"))
        calls.append(tuple(cb.shape))
        return cb

    monkeypatch.setattr(ssd_scan_fwd, "CB_STORED_MIN_HEADS_PER_GROUP", 2 if stored else 10**9)
    monkeypatch.setattr(ssd_scan_fwd, "run_chunk_cb", poisoned)
    return calls


@pytest.mark.parametrize("cb_stored", [True, False], ids=["cb_stored", "cb_inline"])
def test_packed_matches_sequential(cb_stored, fresh_seed, monkeypatch):
    """Both ways of getting C_i . B_j in the output kernel: stored once per group (heads share
    a group) and computed per head; the test checks which one ran."""
    calls = route_cb(monkeypatch, cb_stored)
    chunk = 8
    lengths = packed_lengths(chunk)
    inputs = make_inputs(1, sum(lengths), 4, 8, 2, 16, D="h", init=len(lengths))
    check_against_sequential(inputs, chunk, dict(dt_softplus=True, dt_limit=(0.0, 5.0)),
                             FP32_TOL, FP32_GRAD_TOL, cu_seqlens=cu_from(lengths))
    assert bool(calls) == cb_stored


def test_packed_equals_each_sequence_alone(fresh_seed):
    chunk = 8
    lengths = [1, chunk, 2 * int(torch.randint(1, chunk, ())) + 1, 3]
    inputs = make_inputs(1, sum(lengths), 2, 4, 1, 8, D="hp", init=len(lengths))
    options = dict(chunk_size=chunk, dt_softplus=True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
    out, final = ssd_scan(**leaves, **options, cu_seqlens=cu_from(lengths), return_final_states=True)
    grad_out, grad_final = torch.randn_like(out), torch.randn_like(final)
    packed_grads = torch.autograd.grad((out * grad_out).sum() + (final * grad_final).sum(), list(leaves.values()))

    bounds = cu_from(lengths).tolist()
    shared = {"A", "D", "dt_bias"}  # per-head parameters: their gradients add up over sequences
    summed = {k: torch.zeros_like(leaves[k]) for k in shared}
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = {k: (v if k in shared else v[s:s + 1] if k == "initial_states" else v[:, lo:hi])
                 .detach().clone().requires_grad_(True) for k, v in leaves.items()}
        out_s, final_s = ssd_scan(**alone, **options, return_final_states=True)
        assert rel_err(out_s, out[:, lo:hi].double()) <= 1e-5
        assert rel_err(final_s, final[s:s + 1].double()) <= 1e-5
        loss = (out_s * grad_out[:, lo:hi]).sum() + (final_s * grad_final[s:s + 1]).sum()
        grads = dict(zip(alone, torch.autograd.grad(loss, list(alone.values()))))
        for name, packed in zip(leaves, packed_grads):
            if name in shared:
                summed[name] += grads[name]
            else:
                part = packed[s:s + 1] if name == "initial_states" else packed[:, lo:hi]
                assert rel_err(grads[name], part.double()) <= 1e-5, (s, name)
    for name, packed in zip(leaves, packed_grads):
        if name in shared:
            assert rel_err(summed[name], packed.double()) <= 1e-5, name


@pytest.mark.parametrize("cb_stored", [True, False], ids=["cb_stored", "cb_inline"])
def test_bf16_packed_matches_sequential(cb_stored, fresh_seed, monkeypatch):
    calls = route_cb(monkeypatch, cb_stored)
    chunk = 16
    lengths = packed_lengths(chunk)[:4]
    inputs = make_inputs(1, sum(lengths), 2, 8, 1, 16, D="hp", init=len(lengths), dtype=torch.bfloat16)
    check_against_sequential(inputs, chunk, dict(dt_softplus=True), BF16_TOL, BF16_TOL, cu_seqlens=cu_from(lengths))
    assert bool(calls) == cb_stored


def zamba2_layout_inputs(b, l, h, p, g, n):
    """Inputs as Zamba2's mixer hands them to the scan under bf16 autocast: x, B and C are
    views of one channel-major conv output (b, conv_dim, l) transposed and split; dt a bf16
    slice of the input projection; A = -(1..h), D and dt_bias (dt of 0.001 to 0.1 through
    softplus) float32 parameters."""
    d, conv_dim = h * p, h * p + 2 * g * n
    conv_out = F.silu(torch.randn(b, conv_dim, l)).to(DEVICE, torch.bfloat16).transpose(1, 2)
    x, B, C = torch.split(conv_out, [d, g * n, g * n], dim=-1)
    projection = (torch.randn(b, l, conv_dim + h) * 0.5).to(DEVICE, torch.bfloat16)
    dt0 = torch.exp(torch.rand(h) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    return {
        "x": x.reshape(b, l, h, p), "dt": projection[..., conv_dim:],
        "A": -torch.arange(1, h + 1, dtype=torch.float32, device=DEVICE),
        "B": B.reshape(b, l, g, n), "C": C.reshape(b, l, g, n),
        "D": torch.ones(h, device=DEVICE), "dt_bias": (dt0 + torch.log(-torch.expm1(-dt0))).to(DEVICE),
    }


def test_bf16_zamba2_layout(fresh_seed):
    """bf16 in Zamba2's layout (one group per head, dstate 32): finite gradients within bf16
    tolerance of float64. On an H200 (Triton 3.6) the benchmark's shape gave NaN dC and ddt
    before the backward's state blocks were widened to 64 (MIN_SPLIT_BLOCK_N); the CPU
    interpreter never showed it (a GPU code-generation fault), so the GPU runs that shape."""
    if DEVICE == "cuda":
        b, l, h, p, g, n, chunk = 16, 512, 8, 64, 8, 32, 256  # benchmarks/small_models.py zamba2
    else:
        b, l, h, p, g, n, chunk = 2, 48, 8, 16, 8, 32, 16
    inputs = zamba2_layout_inputs(b, l, h, p, g, n)
    assert not inputs["x"].is_contiguous() and inputs["D"].dtype == torch.float32
    check_against_sequential(inputs, chunk, dict(dt_softplus=True, dt_limit=(1e-3, math.inf)),
                             BF16_TOL, BF16_TOL)


def test_backward_state_blocks_at_least_64(fresh_seed, monkeypatch):
    """The dx/dB and dC kernels run state blocks of at least MIN_SPLIT_BLOCK_N = 64 for any
    dstate: 32-wide blocks miscompiled on sm_90 (see ssd_scan_bwd). The interpreter cannot
    show that fault, so this pins the launch instead."""
    from ssmshard.kernels import ssd_scan_bwd

    widths = []
    for name in ("dx_dB", "dC"):
        kernel = getattr(ssd_scan_bwd, name)

        def recording(grid, _kernel=kernel, **kwargs):
            widths.append(kwargs["BLOCK_N"])
            return _kernel(grid, **kwargs)

        monkeypatch.setattr(ssd_scan_bwd, name, recording)
    inputs = make_inputs(1, 16, 2, 8, 2, 16, z=False, dtype=torch.bfloat16)
    check_against_sequential(inputs, 16, dict(dt_softplus=True), BF16_TOL, BF16_TOL)
    assert widths and min(widths) >= 64, widths


# The chunk-output kernel lets exp overflow above the diagonal (j > i) and selects those
# entries away afterwards; under the CPU interpreter numpy reports the overflows and inf * 0.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("cb_stored", [True, False], ids=["cb_stored", "cb_inline"])
def test_strong_decay_overflows_above_diagonal(cb_stored, fresh_seed, monkeypatch):
    """A in [-30, -20] and dt >= 0.5: cs falls by at least 10 per token, so exp(cs_i - cs_j)
    overflows to inf for j > i inside a 16-token chunk, and the kernel must select those away
    after the product (a select before it would leave inf * 0 = NaN in stored rows). Forward
    only: dA is badly conditioned in this regime (as it was before the select changed)."""
    calls = route_cb(monkeypatch, cb_stored)
    inputs = make_inputs(2, 37, 4, 8, 1, 16, D="h")
    inputs["A"] = -(20.0 + 10.0 * torch.rand(4, device=DEVICE))
    options = dict(dt_softplus=True, dt_limit=(0.5, 5.0))
    args = {k: v for k, v in inputs.items() if v is not None}
    want_out, want_final = sequential_ssd(**{k: v.double() for k, v in args.items()}, **options)
    got_out, got_final = ssd_scan(**args, chunk_size=16, **options, return_final_states=True)
    assert rel_err(got_out, want_out) <= FP32_TOL and rel_err(got_final, want_final) <= FP32_TOL
    assert bool(calls) == cb_stored


@pytest.mark.parametrize("h", [3, 20])  # 20: full blocks of heads (_DT_BLOCK_H = 8) and a partial one
def test_dt_rows_written_whole(h, fresh_seed, monkeypatch):
    """Every (head, slot) row of cs and dt is written whole, empty slots included: dt is 0 and
    cs keeps its last value past the chunk's length (readers load whole rows unmasked). Inside
    the length, dt and cs match a plain float64 softplus and cumsum."""
    from ssmshard.kernels import ssd_scan_fwd
    from ssmshard.kernels.ssd_triton_common import ChunkTable

    lengths = [3, 8, 13, 1]
    n_tok, chunk = sum(lengths), 8  # rows are next_pow2(8) = 16 long (block dims >= 16)
    table = ChunkTable(cu_from(lengths), n_tok, chunk)
    real_empty, real_empty_like = torch.empty, torch.empty_like
    # Buffers start as NaN, so any position the kernel leaves unwritten shows.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(math.nan))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(math.nan))
    dt = torch.randn(n_tok, h, device=DEVICE)
    A = -(0.05 + torch.rand(h, device=DEVICE))
    dtd, cs = ssd_scan_fwd.run_dt_cumsum(dt, A, table, ssd_scan_fwd.dt_kwargs(None, True, 0.0, math.inf))
    monkeypatch.undo()
    assert torch.isfinite(dtd).all() and torch.isfinite(cs).all()
    assert table.n_slots > int(table.seq_first_chunk[-1])  # the table has empty slots
    want_dt = torch.nn.functional.softplus(dt.double())  # (t, h)
    for k, (start, length) in enumerate(zip(table.chunk_start.tolist(), table.chunk_len.tolist())):
        want = want_dt[start:start + length].T  # (h, length)
        torch.testing.assert_close(dtd[:, k, :length].double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cs[:, k, :length].double(), (want * A.double()[:, None]).cumsum(1),
                                   rtol=1e-5, atol=1e-6)
        assert (dtd[:, k, length:] == 0).all(), k
        last = cs[:, k, length - 1:length] if length > 0 else torch.zeros(h, 1, device=DEVICE)
        # Equal up to rounding: a GPU cumsum may add the same terms in another order.
        torch.testing.assert_close(cs[:, k, length:], last.expand(-1, cs.shape[2] - length), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk, lengths", [
    (16, [5, 16, 3, 21, 32, 1]),  # partial chunks, edges on the chunk, a one-token sequence
    (100, [5, 100, 3, 121, 1]),  # chunks of several token blocks (BLOCK_T <= 64 here)
])
def test_no_result_reads_cs_past_a_chunk_end(chunk, lengths, fresh_seed, monkeypatch):
    """Past a chunk's length, cs equals its last value only up to rounding (a GPU cumsum may
    add in another order; at |cs| ~ 500 one rounding is 3e-5 of exp(cs)). Perturbing cs
    there must change no output, final state or gradient: every reader takes the chunk's
    last value at its own position."""
    from ssmshard.kernels import ssd_scan_bwd, ssd_scan_fwd

    real = ssd_scan_fwd.run_dt_cumsum

    def perturbed(dt, A, table, dt_args):
        dtd, cs = real(dt, A, table, dt_args)
        past_end = torch.arange(cs.shape[2], device=cs.device) >= table.chunk_len[:, None]  # (slot, position)
        return dtd, torch.where(past_end, cs * 1.001 - 1e-3, cs)

    args = make_inputs(1, sum(lengths), 3, 4, 1, 8, D=None, z=False, bias=True)
    args = {k: v.detach().requires_grad_() for k, v in args.items() if v is not None}
    options = dict(chunk_size=chunk, dt_softplus=True, cu_seqlens=cu_from(lengths), return_final_states=True)
    results = []
    for patch in (False, True):
        if patch:  # the backward recomputes cs (and the chunk states) with its own call
            monkeypatch.setattr(ssd_scan_fwd, "run_dt_cumsum", perturbed)
            monkeypatch.setattr(ssd_scan_bwd, "run_dt_cumsum", perturbed)
        out, final = ssd_scan(**args, **options)
        grads = torch.autograd.grad((out * torch.cos(out.detach())).sum() + final.sum(), list(args.values()))
        results.append((out, final, *grads))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_short_rows_share_a_power_of_two_chunk(monkeypatch):
    """Rows shorter than the chunk run with the chunk cut to the next power of two: the chunk
    size keys the autotuner, so a length mix must not bring one tuning per distinct length."""
    from ssmshard.kernels import ssd_scan as module

    seen = []
    real_forward = module.ssd_forward

    def recording_forward(*args):
        table = args[8]
        seen.append((table.chunk_size, table.n_slots))
        return real_forward(*args)

    monkeypatch.setattr(module, "ssd_forward", recording_forward)
    for length in (5, 17, 21, 32, 33, 200):
        inputs = make_inputs(2, length, 2, 4, 1, 8, D=None, z=False, bias=False)
        ssd_scan(**{k: v for k, v in inputs.items() if v is not None}, chunk_size=64)
    # Rows of one length get exactly their chunk count as slots (2 rows x ceil(l / T)); the
    # device-side bound would give 3 at l = 33.
    assert seen == [(16, 2), (32, 2), (32, 2), (32, 2), (64, 2), (64, 8)]


def test_row_tables_are_reused_and_equal_a_fresh_table():
    """Tables of equal-length rows are kept per shape; each equals the table built from the
    rows' cu_seqlens, with the exact chunk count as slots."""
    from ssmshard.kernels.ssd_triton_common import ChunkTable

    for n_rows, length, chunk in ((3, 33, 16), (1, 16, 16), (2, 5, 16)):
        table = ChunkTable.for_rows(n_rows, length, chunk, torch.device(DEVICE))
        assert ChunkTable.for_rows(n_rows, length, chunk, torch.device(DEVICE)) is table
        fresh = ChunkTable(cu_from([length] * n_rows), n_rows * length, chunk)
        assert table.n_slots == n_rows * -(-length // chunk) <= fresh.n_slots
        for got, want in zip(table.tensors(), fresh.tensors()):
            assert torch.equal(got, want[:got.numel()])
        assert (fresh.chunk_len[table.n_slots:] == 0).all()


def test_final_state_gradient_alone(fresh_seed):
    # Only the final states feed the loss: the backward gets no output gradient at all.
    inputs = make_inputs(2, 10, 2, 4, 1, 8, D="h", z=False, init=2)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
    leaves64 = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    _, final = ssd_scan(**leaves, chunk_size=4, dt_softplus=True, return_final_states=True)
    _, want = sequential_ssd(**leaves64, dt_softplus=True)
    weight = torch.randn_like(want)
    got_grads = torch.autograd.grad((final.double() * weight).sum(), list(leaves.values()), allow_unused=True)
    want_grads = torch.autograd.grad((want * weight).sum(), list(leaves64.values()), allow_unused=True)
    for name, got_g, want_g in zip(leaves, got_grads, want_grads):
        if want_g is None or not want_g.abs().max() > 0:  # D and C do not reach the final state
            assert got_g is None or got_g.abs().max() == 0, name
        else:
            assert rel_err(got_g, want_g) <= FP32_GRAD_TOL, name


def test_matches_reference_op(fresh_seed):
    """The swap target: same function as torch.ops.ssmshard.ssd_scan, float32 out, and same grads."""
    inputs = make_inputs(2, 13, 2, 4, 2, 8, D="h", z=False, init=2)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    tail = (inputs["D"], inputs["dt_bias"], inputs["initial_states"], True, 0.01, 2.0)
    leaves_op = [t.clone().requires_grad_(True) for t in args + list(tail[:3])]
    leaves_kernel = [t.clone().requires_grad_(True) for t in args + list(tail[:3])]
    want = torch.ops.ssmshard.ssd_scan(*leaves_op[:5], 8, *leaves_op[5:], *tail[3:])
    got = ssd_scan_like_op(*leaves_kernel[:5], 8, *leaves_kernel[5:], *tail[3:])
    for g_t, w_t in zip(got, want):
        assert g_t.dtype == w_t.dtype == torch.float32 and g_t.shape == w_t.shape
        assert rel_err(g_t, w_t.double()) <= FP32_TOL
    weights = [torch.randn_like(w) for w in want]
    want_grads = torch.autograd.grad(sum((w * v).sum() for w, v in zip(want, weights)), leaves_op)
    got_grads = torch.autograd.grad(sum((g * v).sum() for g, v in zip(got, weights)), leaves_kernel)
    for name, g_t, w_t in zip(INPUT_NAMES[:5] + ("D", "dt_bias", "initial_states"), got_grads, want_grads):
        assert rel_err(g_t, w_t.double()) <= FP32_GRAD_TOL, name


def test_rejects_unsupported_inputs():
    inputs = make_inputs(2, 6, 4, 4, 2, 8, D="h", z=False, bias=False)
    args = {k: v for k, v in inputs.items() if v is not None}
    cu = cu_from([2, 4])
    with pytest.raises(ValueError, match="batch must be 1"):
        ssd_scan(**args, chunk_size=4, cu_seqlens=cu)
    one_row = {k: (v[:1] if v.dim() >= 3 else v) for k, v in args.items()}
    with pytest.raises(ValueError, match="rise from 0 to length"):
        ssd_scan(**one_row, chunk_size=4, cu_seqlens=cu_from([2, 3]).cpu())
    with pytest.raises(ValueError, match="multiple of B/C groups"):
        ssd_scan(**{**args, "B": args["B"][:, :, :1].expand(-1, -1, 3, -1), "C": args["C"][:, :, :1].expand(-1, -1, 3, -1)},
                 chunk_size=4)
    with pytest.raises(TypeError, match="x's dtype"):
        ssd_scan(**{**args, "B": args["B"].double()}, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(**args, chunk_size=0)
    with pytest.raises(NotImplementedError, match="headdim"):
        wide = make_inputs(1, 2, 1, 256, 1, 8, D=None, z=False, bias=False)
        ssd_scan(**{k: v for k, v in wide.items() if v is not None}, chunk_size=4)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_scan(**args, chunk_size=4, initial_states=torch.zeros(3, 4, 4, 8, device=DEVICE))


@pytest.mark.parametrize("cb_stored", [True, False], ids=["cb_stored", "cb_inline"])
def test_every_kernel_config(cb_stored, fresh_seed, monkeypatch):
    """The GPU autotuner may pick any config: each must compute the same function.

    Run i forces config i (modulo the count) of every tuned kernel. The shape keeps the
    configs' blocks distinct after clamping: blocks of 32, 64 and 128 rows in 100-token
    chunks (no power of two: the stored C.B^T rows are padded to 128), head-dim blocks of 32
    and 64; two heads share the group, with C.B^T stored once for both or multiplied per head.
    Two chunks: a one-token sequence, one crossing the chunk boundary, a partial last chunk.
    """
    from ssmshard.kernels import ssd_scan_bwd, ssd_scan_fwd
    from ssmshard.kernels.ssd_triton_common import FORCE_CONFIG_ENV

    tuned = [ssd_scan_fwd.chunk_states, ssd_scan_fwd.chunk_output, ssd_scan_bwd.state_grads,
             ssd_scan_bwd.dx_dB, ssd_scan_bwd.dC]
    calls = route_cb(monkeypatch, cb_stored)
    lengths = [60, 1, 77]
    for index in range(max(len(k.configs) for k in tuned)):
        monkeypatch.setenv(FORCE_CONFIG_ENV, str(index))
        inputs = make_inputs(1, sum(lengths), 2, 64, 1, 64, D="h", init=len(lengths))
        check_against_sequential(inputs, 100, dict(dt_softplus=True), FP32_TOL, FP32_GRAD_TOL,
                                 cu_seqlens=cu_from(lengths))
    assert bool(calls) == cb_stored
