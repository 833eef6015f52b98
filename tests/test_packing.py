"""Packed variable-length batches: ssmshard.pack, the ops with cu_seqlens, packed programs.

The gate is pack/unpack invariance: packing sequences into one row must give the outputs AND
the gradients of running every sequence on its own. Lengths are fresh random numbers each run
(seeded from os.urandom by the ``fresh_seed`` fixture, printed on failure), always including a
length-1 sequence and a boundary exactly on a chunk edge of the chunked scans.

Tolerances (fp32, max |diff| / max |reference|, as everywhere in ssmshard):
* ops: outputs and input gradients, packed vs per-sequence calls of the same op, 1e-5 (only
  the chunk alignment differs, i.e. float32 summation order); outputs vs the float64 sequential
  loops of test_ops.py run sequence by sequence, 1e-5 (test_ops.py's forward tolerance);
* programs: logits 1e-5; gradients 1e-5 over the whole gradient vector and 1e-4 per parameter
  tensor (why: see the test). The packed and the per-sequence programs run the same ops, so
  any difference beyond float32 rounding is a packing bug (a leak across a boundary moves
  outputs and gradients by O(1) of their size).
"""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

import ssmshard
from ssmshard import hf_shims
from ssmshard.kernels import reference
from ssmshard.packed_capture import verify_packed_graph
from ssmshard.packing import pack
from ssmshard.passes import run_pipeline
from ssmshard.testing import rel_err

import tp_worker
from conftest import small_model
from test_ops import make_selective_scan, make_ssd, seq_conv, seq_selective_scan, seq_ssd

OPS = torch.ops.ssmshard
TOL = 1e-5
# Sharded packed gradients against the unsharded packed program, over the whole gradient vector:
# the shards sum every gradient in another order (per-rank partial sums, then the all-reduce).
# Measured up to 1.3e-5 on Mamba-2 in a CI run; a state leaking across a boundary moves
# gradients by O(1).
SHARDED_GRAD_TOL = 3e-5


def random_lengths(rng: random.Random, chunk: int) -> list[int]:
    """Five or six lengths: random ones, a 1, and one whose end falls exactly on a chunk edge."""
    lengths = [rng.randint(2, chunk + 4), 1, rng.randint(1, chunk // 2)]
    lengths.append(chunk - sum(lengths) % chunk or chunk)  # the next sequence starts on a chunk edge
    lengths += [rng.randint(1, chunk) for _ in range(rng.randint(1, 2))]
    assert any(sum(lengths[:i]) % chunk == 0 for i in range(1, len(lengths)))
    return lengths


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def spans(cu_seqlens):
    return list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))


# --- pack / unpack ----------------------------------------------------------------------


def test_pack_layout_and_unpack_round_trip(fresh_seed):
    rng = random.Random(fresh_seed)
    sequences = [torch.randint(0, 100, (n,)) for n in random_lengths(rng, 8)]
    batch = pack(sequences)
    total = sum(len(s) for s in sequences)
    assert batch.input_ids.shape == batch.position_ids.shape == (1, total)
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == offsets([len(s) for s in sequences]).tolist()
    assert batch.position_ids[0].tolist() == [t for s in sequences for t in range(len(s))]
    features = torch.randn(1, total, 3)
    pieces = batch.unpack(features)
    assert [p.shape for p in pieces] == [(1, len(s), 3) for s in sequences]
    assert torch.equal(torch.cat(pieces, 1), features)
    assert all(torch.equal(p[0], s) for p, s in zip(batch.unpack(batch.input_ids), sequences))
    assert torch.equal(pack([s.tolist() for s in sequences]).input_ids, batch.input_ids)
    with pytest.raises(ValueError, match="empty"):
        pack([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="at least one"):
        pack([])
    with pytest.raises(ValueError, match=r"\(1, %d, \.\.\.\)" % total):
        batch.unpack(features[:, :-1])


def test_pack_pads_the_row_to_a_multiple_with_a_filler_sequence(fresh_seed):
    rng = random.Random(fresh_seed)
    sequences = [torch.randint(0, 100, (n,)) for n in random_lengths(rng, 8)]
    total = sum(len(s) for s in sequences)
    multiple = rng.choice([8, 16, 64])
    batch = pack(sequences, pad_to_multiple_of=multiple, pad_id=7)
    padded = -(-total // multiple) * multiple
    assert batch.input_ids.shape == batch.position_ids.shape == (1, padded)
    assert batch.padding == padded - total and batch.num_sequences == len(sequences)
    assert batch.lengths == [len(s) for s in sequences]
    expected_offsets = offsets([len(s) for s in sequences] + ([batch.padding] if batch.padding else []))
    assert batch.cu_seqlens.tolist() == expected_offsets.tolist()
    assert batch.input_ids[0, total:].tolist() == [7] * batch.padding
    assert all(torch.equal(p[0], s) for p, s in zip(batch.unpack(batch.input_ids), sequences))
    assert len(batch.unpack(batch.input_ids)) == len(sequences)
    exact = pack([torch.arange(16)], pad_to_multiple_of=16)
    assert exact.padding == 0 and exact.cu_seqlens.tolist() == [0, 16]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack(sequences, pad_to_multiple_of=0)


# --- ops: packed == per-sequence calls == float64 sequential loops per sequence ---------


def _per_sequence(fn, cu_seqlens, split, args, cat_dim):
    """Run ``fn`` on each sequence's slice of the token-indexed args; concatenate the outputs."""
    outs = [fn(*split(args, s, e)) for s, e in spans(cu_seqlens)]
    first = [o[0] if isinstance(o, tuple) else o for o in outs]
    return torch.cat(first, cat_dim), outs[-1][1] if isinstance(outs[-1], tuple) else None


def _split_scan(args, s, e):  # selective_scan: u, delta, z, B, C are (b, ..., l)
    u, delta, A, B, C, D, z, bias, softplus, init = args
    return [u[..., s:e], delta[..., s:e], A, B[..., s:e], C[..., s:e], D, z[..., s:e], bias, softplus, init]


def _split_ssd(args, s, e):  # ssd_scan: x, dt, B, C are (b, l, ...)
    x, dt, A, B, C, *rest = args
    return [x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], *rest]


def _split_conv(args, s, e):
    x, *rest = args
    return [x[..., s:e], *rest]


def _packed_op_case(name, lengths):
    total = sum(lengths)
    if name == "selective_scan":
        args = make_selective_scan(b=1, d=6, n=4, l=total, g=2, init=False)
        return args, _split_scan, seq_selective_scan, -1
    if name == "ssd_scan":
        args = make_ssd(b=1, l=total, h=4, p=3, g=2, n=4, chunk=8, D="hp", init=False, dt_max=3.0)
        wrapped = lambda x, dt, A, B, C, chunk, D, bias, init, sp, lo, hi: seq_ssd(  # noqa: E731
            x, dt, A, B, C, D, bias, init, sp, lo, hi)
        return args, _split_ssd, wrapped, 1
    k = 4
    args = [torch.randn(1, 5, total), torch.randn(5, k), torch.randn(5), "silu"]
    return args, _split_conv, seq_conv, -1


@pytest.mark.parametrize("name", ["selective_scan", "ssd_scan", "causal_conv1d"])
def test_op_with_cu_seqlens_equals_per_sequence_calls(name, fresh_seed):
    rng = random.Random(fresh_seed)
    lengths = random_lengths(rng, 8)  # 8: the SSD chunk of this case
    cu = offsets(lengths)
    args, split, sequential, cat_dim = _packed_op_case(name, lengths)
    op = getattr(OPS, name)
    packed = op(*args, cu)
    packed_out = packed[0] if isinstance(packed, tuple) else packed
    expected, last_state = _per_sequence(op, cu, split, args, cat_dim)
    assert rel_err(packed_out, expected) < TOL, f"{name} {lengths} (seed {fresh_seed})"
    if last_state is not None:  # the final state is the last sequence's
        assert rel_err(packed[1], last_state) < TOL
    args64 = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    oracle, _ = _per_sequence(sequential, cu, split, args64, cat_dim)
    assert rel_err(packed_out, oracle) < TOL, f"{name} vs float64 loop {lengths} (seed {fresh_seed})"

    # Gradients of every float input: the packed op's against the per-sequence calls'.
    leaves = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    weights = torch.randn(packed_out.shape)
    out = op(*leaves, cu)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad((out * weights).sum(), [a for a in leaves if isinstance(a, torch.Tensor)])
    leaves_ref = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    per_seq, _ = _per_sequence(op, cu, split, leaves_ref, cat_dim)
    grads_ref = torch.autograd.grad((per_seq * weights).sum(),
                                    [a for a in leaves_ref if isinstance(a, torch.Tensor)])
    for index, (g, r) in enumerate(zip(grads, grads_ref)):
        assert rel_err(g, r) < TOL, f"{name} grad of tensor arg {index} {lengths} (seed {fresh_seed})"


@pytest.mark.parametrize("chunk", [3, 5])
def test_selective_scan_reference_resets_across_its_own_chunks(chunk, fresh_seed):
    """The op picks a chunk as long as these sequences; smaller chunks carry state between them."""
    lengths = random_lengths(random.Random(fresh_seed), chunk)
    cu = offsets(lengths)
    args = make_selective_scan(b=1, d=4, n=3, l=sum(lengths), init=False)
    packed, final = reference.selective_scan(*args, cu_seqlens=cu, chunk_size=chunk)
    args64 = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    oracle, last = _per_sequence(seq_selective_scan, cu, _split_scan, args64, -1)
    assert rel_err(packed, oracle) < TOL and rel_err(final, last) < TOL, f"{lengths} (seed {fresh_seed})"


def test_packed_ops_pass_opcheck_and_refuse_bad_offsets():
    cu = offsets([3, 1, 4])
    cases = {
        "selective_scan": make_selective_scan(b=1, d=4, n=4, l=8, g=2, init=False),
        "ssd_scan": make_ssd(b=1, l=8, h=4, p=2, g=2, n=4, chunk=4, init=False),
        "causal_conv1d": [torch.randn(1, 3, 8), torch.randn(3, 4), torch.randn(3), "silu"],
    }
    for name, args in cases.items():
        leaves = [a.clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                  for a in args]
        torch.library.opcheck(getattr(OPS, name).default, [*leaves, cu],
                              test_utils=["test_schema", "test_autograd_registration", "test_faketensor"])
    conv = cases["causal_conv1d"]
    with pytest.raises(ValueError, match="from 0 to the packed length 8"):
        OPS.causal_conv1d(*conv, offsets([3, 4]))
    with pytest.raises(ValueError, match="strictly increasing"):
        OPS.causal_conv1d(*conv, torch.tensor([0, 3, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch 1"):
        OPS.causal_conv1d(conv[0].expand(2, -1, -1), *conv[1:], cu)
    scan = make_ssd(b=1, l=8, h=4, p=2, g=2, n=4, chunk=4, init=True)
    with pytest.raises(ValueError, match="initial states"):
        OPS.ssd_scan(*scan, cu)


# --- programs: packed forward and gradients == each sequence on its own ------------------


# Zamba2 clamps dt from below at time_step_min (1e-3 by default). With the random test weights,
# some dt lands within float32 noise of that kink, where the clamp's derivative jumps from 1 to 0:
# packed and per-sequence runs, equal to 1e-6 everywhere else, then differ by O(1) in that
# element's dt gradient (a CI failure: dt 1.0000002e-3 on one path and 0.9999996e-3 on the
# other put a dt_bias gradient off by 0.17). A floor of 1e-9 lies out of reach: dt is
# softplus(projection + bias) with bias >= softplus^-1(1e-3), so it would take a projection of
# about -14 to get there.
_SMOOTH_DT = {"zamba2": {"time_step_min": 1e-9}}


def packing_model(family):
    """The test model of ``family``, with no dt clamp within reach for Zamba2 (see above)."""
    return small_model(family, **_SMOOTH_DT.get(family, {}))


_PROGRAMS = {}


def programs(family):
    if family not in _PROGRAMS:
        model = packing_model(family)
        _PROGRAMS[family] = (ssmshard.capture(model), ssmshard.capture(model, packed=True))
    return _PROGRAMS[family]


def _with_fresh_leaves(program):
    program.weights = {k: v.detach().clone().requires_grad_(program.param_specs[k].kind == "parameter")
                       for k, v in program.weights.items()}
    return program.weights


PACKED_FAMILIES = ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2", "llama"]

# Gradient bounds (whole vector, per tensor), float32. Largest errors measured over random seeds
# on the reference ops (sweeps of 200-500 seeds each): Mamba 1.1e-6 / 4.4e-5,
# Mamba-2 4.2e-6 / 5.4e-6, Llama 6.6e-7 / 1.2e-6, all within (TOL, 1e-4). Zamba2 reached
# 3.6e-5 / 1.1e-4 (8 of 300 seeds over 1e-5): the model amplifies float32 rounding in the
# backward pass (growing through its shared attention blocks) five to nine times more than the
# Mamba-2 model. The unpacked program against itself (each sequence at its own length vs the
# same sequences in padded rows) already differs by up to 9.2e-6 on the vector (Mamba-2:
# 1.7e-6); the packed program's error is at most 11x that (Mamba-2: 8.7x). A state leaking
# across a boundary moves gradients by O(1).
_GRAD_TOLS = {"zamba2": (1e-4, 5e-4)}
# On the GPU kernels, per tensor, Mamba-2 is back at the reference ops' bounds. Before the
# stable pairwise form, the SSD backward took the log-decay gradient from an identity whose
# in-chunk terms cancel (ssd_scan_bwd's da_terms): the A_log gradient then erred sixteen times
# the reference ops' float32 error (H200, seed 917710232: 2.7e-5 against 1.7e-6 from float64)
# and packed against one at a time reached 1.4e-4 to 1.6e-4, which needed 5e-4 here. With the
# pairwise form, seed 917710232 and seeds 1-11 pass at 1e-4 on an H200 (docs/kernels.md,
# precision notes). A leak moves gradients by O(1).
_KERNEL_GRAD_TOLS = {"mamba2": (TOL, 1e-4), "zamba2": (1e-4, 5e-4)}


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_program_equals_each_sequence_alone(family, fresh_seed):
    """Logits and every parameter gradient (sum of per-sequence losses vs the packed loss), on
    the reference ops.

    Gradients: max |diff| / max |reference| over the whole gradient vector (all parameters) at
    1e-5, and per parameter tensor at 1e-4 (Zamba2: see ``_GRAD_TOLS``). Per tensor, gradients
    that are long cancelling sums over tokens (D, A_log) move by ~1e-5 of their own size when the
    packed run groups tokens into other chunks (float32 summation order); a leak across a
    boundary moves gradients by O(1). The per-tensor bound keeps a small-gradient parameter from
    hiding behind the large ones.
    """
    _check_packed_equals_each_sequence_alone(family, packing_model(family), *programs(family), fresh_seed)


@pytest.mark.parametrize("family", ["mamba", "llama"])
def test_filler_padding_of_a_packed_row_changes_no_real_token(family, fresh_seed):
    """``pack(..., pad_to_multiple_of=16)``: the same check, with filler tokens at the row's end
    (zero loss weight there). A filler that leaked into real tokens (a scan state or an attention
    key across its boundary) would change their logits and gradients."""
    _check_packed_equals_each_sequence_alone(family, packing_model(family), *programs(family), fresh_seed,
                                             pad_to_multiple_of=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")
@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_program_on_the_kernels_equals_each_sequence_alone(family, fresh_seed):
    """The same check with the programs on the GPU and the Triton kernels swapped in (fp32)."""
    model = copy.deepcopy(packing_model(family)).cuda()
    swap = [("swap_kernels", {"kernels": "triton"})]
    unpacked, packed = (run_pipeline(ssmshard.capture(model, packed=p), swap) for p in (False, True))
    if family != "llama":
        assert packed.kernel_report and all(r["kernel"] == "triton" for r in packed.kernel_report), \
            packed.kernel_report
    _check_packed_equals_each_sequence_alone(family, model, unpacked, packed, fresh_seed, device="cuda",
                                             grad_tols=_KERNEL_GRAD_TOLS.get(family))


def _check_packed_equals_each_sequence_alone(family, model, unpacked, packed, fresh_seed, device="cpu",
                                             pad_to_multiple_of=1, grad_tols=None):
    chunk = getattr(model.config, "chunk_size", 16)  # Mamba-2 / Zamba2 chunk edge; 16 elsewhere
    lengths = random_lengths(random.Random(fresh_seed), chunk)
    if pad_to_multiple_of > 1 and sum(lengths) % pad_to_multiple_of == 0:
        lengths.append(1)  # so that the row does get a filler
    # A generator of our own: the global RNG's state here depends on which caches earlier tests
    # filled (capturing draws from it), and then the printed seed would not replay the failure.
    gen = torch.Generator().manual_seed(fresh_seed)
    sequences = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    pad_id = int(torch.randint(0, model.config.vocab_size, (), generator=gen))
    batch = pack(sequences, pad_to_multiple_of=pad_to_multiple_of, pad_id=pad_id)
    loss_weights = torch.randn(1, batch.input_ids.shape[1], model.config.vocab_size, generator=gen).to(device)
    assert (batch.padding > 0) == (pad_to_multiple_of > 1)
    loss_weights[:, batch.input_ids.shape[1] - batch.padding:] = 0  # the filler predicts nothing

    packed_weights = _with_fresh_leaves(packed)
    logits = packed(batch)
    (logits * loss_weights).sum().backward()

    # Each sequence alone, all in one call: sequence s in row s of the unpacked program, followed
    # by random padding tokens. The models are causal, so a row's outputs up to its length do not
    # see the padding, and zero loss weights on the padding make the loss the sum of the
    # per-sequence losses.
    unpacked_weights = _with_fresh_leaves(unpacked)
    longest = max(lengths)
    rows = torch.randint(0, model.config.vocab_size, (len(lengths), longest), generator=gen).to(device)  # (S, L_max)
    row_weights = torch.zeros(len(lengths), longest, model.config.vocab_size, device=device)
    for s, (ids, w) in enumerate(zip(sequences, batch.unpack(loss_weights))):
        rows[s, :len(ids)] = ids
        row_weights[s, :len(ids)] = w[0]
    out = unpacked(rows)
    (out * row_weights).sum().backward()
    alone = [out[s:s + 1, :n].detach() for s, n in enumerate(lengths)]

    for got, want in zip(batch.unpack(logits), alone):
        assert rel_err(got, want) < TOL, f"{family} logits {lengths} (seed {fresh_seed})"
    params = [k for k, spec in unpacked.param_specs.items() if spec.kind == "parameter"]
    assert params == [k for k, spec in packed.param_specs.items() if spec.kind == "parameter"]
    got = torch.cat([packed_weights[k].grad.flatten() for k in params])
    want = torch.cat([unpacked_weights[k].grad.flatten() for k in params])
    vector_tol, tensor_tol = grad_tols or _GRAD_TOLS.get(family, (TOL, 1e-4))
    error = rel_err(got, want)
    assert error < vector_tol, f"{family} gradients {error:.2e} {lengths} (seed {fresh_seed})"
    errors = {k: rel_err(packed_weights[k].grad, unpacked_weights[k].grad) for k in params}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tensor_tol, f"{family} grad {worst}: {errors[worst]:.2e} {lengths} (seed {fresh_seed})"


def test_single_token_batch_is_served_by_the_same_graph():
    unpacked, packed = programs("mamba2")
    ids = torch.randint(0, 256, (1, 1))
    assert rel_err(packed(pack([ids[0]])), unpacked(ids)) < TOL
    assert packed.siblings == []


# --- refusals: packing information is never dropped silently ------------------------------


def test_unpacked_program_refuses_sequence_boundaries():
    unpacked, _ = programs("llama")
    batch = pack([torch.arange(3), torch.arange(4)])
    with pytest.raises(ValueError, match="packed=True"):
        unpacked(batch)
    with pytest.raises(ValueError, match="packed=True"):
        unpacked(batch.input_ids, cu_seqlens=batch.cu_seqlens)
    with pytest.raises(ValueError, match="restarts"):
        unpacked(batch.input_ids, position_ids=batch.position_ids)
    plain = torch.arange(7)[None]  # positions the program assumes anyway are accepted
    assert torch.equal(unpacked(batch.input_ids, position_ids=plain), unpacked(batch.input_ids))


def test_packed_program_refuses_inconsistent_inputs():
    _, packed = programs("llama")
    batch = pack([torch.arange(3), torch.arange(4)])
    with pytest.raises(ValueError, match="cu_seqlens="):
        packed(batch.input_ids)
    with pytest.raises(ValueError, match="position_ids must restart"):
        packed(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=torch.arange(7)[None])
    with pytest.raises(ValueError, match="from 0 to the packed length 7"):
        packed(batch.input_ids, cu_seqlens=offsets([3, 3]))
    with pytest.raises(ValueError, match="batch 1"):
        packed(batch.input_ids.expand(2, -1), cu_seqlens=batch.cu_seqlens)


def test_capture_refuses_what_packing_cannot_serve():
    with pytest.raises(NotImplementedError, match="forward programs only"):
        ssmshard.capture(small_model("mamba"), mode="prefill", packed=True)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        ssmshard.capture(ssmshard.build_small_model("mistral", sliding_window=4), packed=True)
    eager = ssmshard.build_small_model("llama", attn_implementation="eager")
    with pytest.raises(NotImplementedError, match="sdpa"):
        ssmshard.capture(eager, packed=True)
    # Boundaries handed down by HF itself are refused, not dropped.
    with pytest.raises(NotImplementedError, match="seq_idx"):
        hf_shims.causal_conv1d_fn(torch.randn(1, 2, 5), torch.randn(2, 4),
                                  seq_idx=torch.zeros(1, 5, dtype=torch.int32))


@pytest.mark.parametrize("family, target", [("zamba2", torch.ops.aten.scaled_dot_product_attention.default),
                                            ("mamba2", torch.ops.ssmshard.ssd_scan.default)])
def test_graph_check_catches_a_mixer_without_boundaries(family, target):
    """The post-capture check fails on an attention without the packed mask or a scan without
    cu_seqlens, as an HF version that bypassed the shims or the mask would produce."""
    _, packed = programs(family)
    node = next(n for n in packed.graph.nodes if n.target is target)
    saved = node.args
    name = "attn_mask" if target is torch.ops.aten.scaled_dot_product_attention.default else "cu_seqlens"
    index = [a.name for a in target._schema.arguments].index(name)
    node.args = (*saved[:index], None, *saved[index + 1:])
    try:
        with pytest.raises((NotImplementedError, RuntimeError), match="mask|cu_seqlens"):
            verify_packed_graph(packed)
    finally:
        node.args = saved
    verify_packed_graph(packed)


# --- tensor parallel ----------------------------------------------------------------------


def test_distributed_packed_forward_and_grads_match_unsharded_packed_program(tmp_path, fresh_seed):
    """tp=2 over gloo: Mamba-2 (heads and B/C groups split, cu_seqlens replicated into every
    scan and conv) and Llama (heads split under the block-diagonal mask, GQA). The sharded
    packed program's logits and gradient slices against the unsharded packed program's,
    computed here once (the workers do not capture it again)."""
    cases = {}
    for family in ("mamba2", "llama"):
        model = small_model(family)
        lengths = random_lengths(random.Random(fresh_seed), getattr(model.config, "chunk_size", 16))
        batch = pack([torch.randint(0, model.config.vocab_size, (n,)) for n in lengths])
        loss_weights = torch.randn(1, batch.input_ids.shape[1], model.config.vocab_size)
        _, packed = programs(family)
        leaves = _with_fresh_leaves(packed)
        logits = packed(batch)
        (logits * loss_weights).sum().backward()
        cases[family] = {"input_ids": batch.input_ids, "cu_seqlens": batch.cu_seqlens,
                         "position_ids": batch.position_ids, "loss_weights": loss_weights,
                         "logits": logits.detach(), "lengths": lengths,
                         "grads": {k: v.grad for k, v in leaves.items() if v.grad is not None}}
    torch.save(cases, tmp_path / "cases.pt")
    out = tmp_path / "packed.json"
    ssmshard.launch(tp_worker.packed_errors, 2, str(tmp_path / "cases.pt"), str(out), backend="gloo")
    results = json.loads(out.read_text())
    assert len(results) == 2 * len(cases)
    for r in results:
        where = f"{r} {cases[r['family']]['lengths']} (seed {fresh_seed})"
        assert r["logits_err"] < TOL and r["kwargs_logits_err"] < TOL, where
        assert r["grad_err"] < SHARDED_GRAD_TOL, where
        assert r["collectives"] > 0 and r["refused_unpacked_module"], where
