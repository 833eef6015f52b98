"""The block-scaled quantized all-reduce (ssmshard.comm.quantized, kernels/quantize.py) and the
``quantize_sync`` pass.

Oracles written here, not taken from the code under test:
* ``two_shot_oracle``: the whole N-rank algorithm as one plain torch computation over all
  ranks' inputs (torch's own round and float8 cast), which every rank must equal bit for bit;
* ``derived_bound``: the per-element error bound of docs/quantized_sync.md, from the inputs;
* bytes: counted at the backend (what each collective moves out of a rank), against what a
  ring all-reduce of bf16 values sends.
"""

import copy
import math
import threading

import pytest
import torch

import ssmshard
from ssmshard import comm
from ssmshard.comm import quantized as q
from ssmshard.comm.simulated import SimulatedGroup
from ssmshard.passes import run_pipeline
from ssmshard.plan import PlanError
from ssmshard.runtime.distributed import _local_part
from ssmshard.runtime.pipeline import shard_program
from ssmshard.testing import rel_err

import quantized_worker as worker
from conftest import SIX_FAMILIES, small_model

QMAX = {"int8": 127.0, "fp8": 448.0}
DELTA = {"int8": 1 / 254, "fp8": 1 / 16}  # max |x - dequantized x| per unit of block max


# ----------------------------------------------------------------------------- oracles
def _dequantized(values, fmt, block):
    """Round trip of (rows, c) float32 values through block codes, with torch's own casts."""
    blocks = values.unflatten(-1, (-1, block))
    scale = blocks.abs().amax(-1, keepdim=True) / QMAX[fmt]
    y = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(y).clamp(-127, 127) if fmt == "int8" else y.to(torch.float8_e4m3fn).float()
    return (codes * scale).flatten(-2)


def two_shot_oracle(parts, fmt, block):
    world, n = len(parts), parts[0].numel()
    chunk = math.ceil(n / (world * block)) * block
    padded = torch.stack([torch.nn.functional.pad(p.reshape(-1).float(), (0, world * chunk - n)) for p in parts])
    dequantized = _dequantized(padded, fmt, block)  # blocks never straddle slices: chunk % block == 0
    total = torch.zeros(world * chunk)
    for row in dequantized:  # float32, rank order
        total = total + row
    return _dequantized(total, fmt, block)[:n].view(parts[0].shape).to(parts[0].dtype)


def derived_bound(parts, fmt, block, out_dtype=torch.float32):
    """Per element: delta (1 + delta) S + delta M + eps (M + 2 delta S) + (N + 8) 2**-23 S, with S the
    sum over ranks of the block's max |x_k| and M the block's max |exact sum|."""
    world, n = len(parts), parts[0].numel()
    padded = math.ceil(n / block) * block

    def block_max(v):  # one value per element: the max |v| of its block
        b = torch.nn.functional.pad(v.reshape(-1).double().abs(), (0, padded - n)).view(-1, block)
        return b.amax(-1, keepdim=True).expand(-1, block).reshape(-1)[:n]

    s = sum(block_max(p) for p in parts)
    m = block_max(sum(p.double() for p in parts))
    d = DELTA[fmt]
    eps = 0.0 if out_dtype == torch.float32 else torch.finfo(out_dtype).eps / 2
    return (d * (1 + d) * s + d * m + eps * (m + 2 * d * s) + (world + 8) * 2.0**-23 * s).view(parts[0].shape)


def _simulated(world, fn, *args):
    return comm.run_simulated(fn, world, *args, group="qsim")


def _inputs(world, index, shape, seed, dtype=torch.float32):
    return [worker.rank_input(seed, index, k, shape).to(dtype) for k in range(world)]


# ----------------------------------------------------------------------------- the collective
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_derived_bound_and_not_a_noop(fmt, dtype, fresh_seed):
    """Sizes that are not multiples of the block (nor of N * block), blocks of 32/64/128, N = 2, 3, 4:
    every element within the derived bound (its float32 / bf16 output rounding included), equal on
    every rank, and different from the exact sum."""
    for index, (world, block, shape) in enumerate([(2, 32, (5, 33)), (3, 64, (1000,)), (4, 128, (2, 3, 131)),
                                                   (4, 64, (7,))]):
        parts = _inputs(world, index, shape, fresh_seed, dtype)
        out = _simulated(world, lambda rank, world: comm.quantized_all_reduce(parts[rank], "qsim", fmt, block, 0,
                                                                              "t"))
        exact = sum(p.double() for p in parts)
        error = (out[0].double() - exact).abs()
        bound = derived_bound(parts, fmt, block, dtype)
        where = f"{fmt} {dtype} N={world} B={block} {shape} (seed {fresh_seed})"
        assert all(torch.equal(o, out[0]) for o in out), where
        assert (error <= bound).all(), f"{where}: worst error / bound {(error / bound).max().item():.3f}"
        assert (error > 0).any(), f"{where}: the quantized sum equals the exact one"


def test_gloo_equals_oracle_and_simulated_and_backward_is_exact(tmp_path, fresh_seed):
    """On gloo groups of N = 2 and 4 (one launch of 4 processes), each rank's result equals the
    plain-torch oracle bit for bit, and equals a SimulatedGroup run; the gradient equals that of
    the exact all-reduce exactly; both backends record the same bytes."""
    worlds = (2, 4)
    ssmshard.launch(worker.gloo_ranks, max(worlds), fresh_seed, str(tmp_path), worlds, backend="gloo")
    for world in worlds:
        simulated = _simulated(world, worker.exercise, "qsim", fresh_seed)
        for rank in range(world):
            on_gloo = torch.load(tmp_path / f"world{world}_rank{rank}.pt")
            where = f"N={world} rank {rank} (seed {fresh_seed})"
            assert on_gloo.keys() == simulated[rank].keys()
            for key, value in on_gloo.items():
                assert torch.equal(value, simulated[rank][key]), f"simulated {key} {where}"
            for index, (fmt, block, shape) in enumerate(worker.CASES):
                parts = _inputs(world, index, shape, fresh_seed)
                expected = two_shot_oracle(parts, fmt, block)
                assert torch.equal(on_gloo[f"{index}.value"], expected), f"case {index} {where}"
                assert torch.equal(on_gloo[f"{index}.grad"], on_gloo[f"{index}.exact_grad"]), f"case {index} {where}"
                assert torch.equal(on_gloo[f"{index}.grad"], worker.upstream_gradient(fresh_seed, index, shape))


class CountingGroup(SimulatedGroup):
    """Counts the bytes each rank's collectives move out of it."""

    def __init__(self, world):
        super().__init__(world)
        self.sent = [0] * world

    def all_to_all_stacked(self, stacked):  # every row but this rank's own leaves it
        self.sent[self.rank()] += (self.world() - 1) * stacked[0].numel() * stacked.element_size()
        return super().all_to_all_stacked(stacked)

    def all_gather_stacked(self, x):  # this rank's x goes to every other rank
        self.sent[self.rank()] += (self.world() - 1) * x.numel() * x.element_size()
        return super().all_gather_stacked(x)

    def all_reduce(self, x):  # a ring all-reduce: reduce-scatter then all-gather of ceil(n / N) chunks
        self.sent[self.rank()] += 2 * (self.world() - 1) * math.ceil(x.numel() / self.world()) * x.element_size()
        return super().all_reduce(x)


def _run_counted(world, fn):
    group = CountingGroup(world)
    results = [None] * world

    def rank_main(rank):
        with group.bind(rank):
            results[rank] = fn(rank)

    with comm.registered("qcount", group):
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return group.sent, results


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("world, block", [(2, 64), (4, 64), (4, 128)])
def test_bytes_sent_at_least_1_8x_fewer_than_bf16(fmt, world, block):
    """Payload + scales counted at the backend: >= 1.8x fewer bytes than a bf16 ring all-reduce of
    the same values, for a size that is not a multiple of the block; the op records the same count."""
    n = 30011
    bf16_bytes = 2 * (world - 1) * math.ceil(n / world) * 2
    with comm.record_quantized_syncs() as recorder:
        sent, _ = _run_counted(world, lambda rank: comm.quantized_all_reduce(torch.randn(n), "qcount", fmt, block, 0,
                                                                             "t"))
    assert all(bf16_bytes / s >= 1.8 for s in sent), (bf16_bytes, sent)
    assert sorted(c.bytes_sent for c in recorder.calls) == sorted(sent)
    assert all(c.bf16_bytes == bf16_bytes for c in recorder.calls)


def test_small_messages_stay_exact_per_call():
    """min_bytes compares each call's message: below it the exact all-reduce runs (bit for bit),
    at it the quantized one; the recorder tells which."""
    parts = [torch.randn(3, 40) for _ in range(2)]
    message = parts[0].numel() * 4

    def both(rank, world):
        return (comm.quantized_all_reduce(parts[rank], "qsim", "int8", 32, message + 1, "small"),
                comm.quantized_all_reduce(parts[rank], "qsim", "int8", 32, message, "large"))

    with comm.record_quantized_syncs() as recorder:
        (below, at), _ = _simulated(2, both)
    assert torch.equal(below, parts[0] + parts[1])
    assert torch.equal(at, two_shot_oracle(parts, "int8", 32)) and not torch.equal(at, below)
    assert {(c.name, c.quantized) for c in recorder.calls} == {("small", False), ("large", True)}


def test_unknown_format_or_block_is_an_error_before_any_collective():
    with pytest.raises(ValueError, match="unknown quantized all-reduce format 'int4'"):
        comm.quantized_all_reduce(torch.ones(4), "never_registered", "int4", 64, 0, "t")
    with pytest.raises(ValueError, match="block of 48"):
        comm.quantized_all_reduce(torch.ones(4), "never_registered", "int8", 48, 0, "t")


# ----------------------------------------------------------------------------- Triton kernels
def _special_values():
    """Every finite e4m3 magnitude, the midpoints between neighbours (ties) and their float32
    neighbours, and int8 ties: exercised with a block max of QMAX (scale 1)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1.0))
    halves = torch.arange(-255, 256) / 2
    values = torch.cat([e4m3, mids, up, down, halves])
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_triton_kernels_equal_the_torch_codec(fmt, fresh_seed):
    """Under TRITON_INTERPRET=1 on CPU (on CUDA when present): the quantize, reduce-requantize and
    dequantize kernels write the same bytes / values as the torch codec (round-half-even and the
    e4m3 encoding built from float32 bits included), and a whole two-shot run equals it."""
    from ssmshard.kernels import quantize as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(fresh_seed)
    special = _special_values().clamp(-QMAX[fmt], QMAX[fmt])
    rows = special[:special.numel() // 31 * 31].view(-1, 31)
    special = torch.cat([rows, torch.full((rows.shape[0], 1), QMAX[fmt])], 1).view(-1)  # scale 1 per block of 32
    for world, block, flat in ((3, 32, special), (2, 64, torch.randn(777, generator=gen) * 10),
                               (4, 128, torch.randn(300, generator=gen).bfloat16())):
        flat = flat.to(device)
        chunk = math.ceil(flat.numel() / (world * block)) * block
        wires = {}
        for codec in (q.TorchCodec, kernels):
            wire, codes, scales = q._wire(world, chunk, block, device)
            codec.quantize(flat, codes, scales, fmt, block)
            _, out_codes, out_scales = q._wire(1, chunk, block, device)
            codec.reduce_requantize(codes, scales, out_codes[0], out_scales[0], fmt, block)
            values = torch.empty(flat.numel() - 5, dtype=flat.dtype, device=device)
            codec.dequantize(codes, scales, values, fmt, block)
            wires[codec] = (wire, out_codes, out_scales, values)
        for a, b in zip(wires[q.TorchCodec], wires[kernels]):
            assert torch.equal(a, b), f"{fmt} N={world} B={block} (seed {fresh_seed})"
        if block == 32:
            assert (wires[kernels][0][:, chunk:].view(torch.float32)[0] == 1).all()  # the special values' scale

    parts = [torch.randn(2, 45, generator=gen).to(device) for _ in range(3)]

    def two_shot(rank, world, codec):
        return q.two_shot_all_reduce(parts[rank], comm.backend_of("qsim"), fmt, 32, codec=codec)

    assert torch.equal(torch.stack(_simulated(3, two_shot, kernels)), torch.stack(_simulated(3, two_shot, q.TorchCodec)))


# ----------------------------------------------------------------------------- the pass
_CAPTURED = {}


def captured_model(family):
    """The small model of ``family`` and its forward program, captured once per process."""
    if family not in _CAPTURED:
        model = small_model(family)
        _CAPTURED[family] = model, ssmshard.capture(model)
    return _CAPTURED[family]


@pytest.fixture(scope="module")
def mamba():
    return captured_model("mamba")  # 2 layers: sync points embed, layers.<i>.x_proj / out_proj, lm_head


def _rank_programs(model, captured, plan):
    """Each rank's program through the runtime's pipeline (``runtime.pipeline.shard_program``), bound to
    fresh leaf copies of its local weights."""
    named = dict(model.named_parameters(remove_duplicate=False))
    programs = []
    for rank in range(plan.tp):
        program = copy.deepcopy(captured)
        placements = plan.layout(program, model)
        program = shard_program(program, model, plan, rank=rank, group="qsim", placements=placements)
        program.bind({fqn: _local_part(named.get(fqn, program.constants.get(fqn)).detach(), placements.get(fqn),
                                       rank).clone().requires_grad_(True) for fqn in program.param_specs})
        programs.append(program)
    return programs


def _forward_backward(programs, ids, upstream, recorder=None):
    """Per rank: (logits, gradients of every weight, quantized calls recorded during backward)."""
    def rank_main(rank, world):
        def calls():  # this rank's: the others' threads record concurrently
            return sum(c.rank == rank for c in recorder.calls) if recorder is not None else 0

        program = programs[rank]
        logits = program(ids)
        before = calls()
        weights = [w for w in program.weights.values() if w.requires_grad]
        grads = torch.autograd.grad((logits * upstream).sum(), weights)
        return logits.detach(), grads, calls() - before
    return _simulated(len(programs), rank_main)


class _QuantizedValueTPGradient(torch.autograd.Function):
    """The quantized all-reduce's value with the gradient TP's ``all_reduce`` gives (its own
    registered backward, run here)."""

    @staticmethod
    def forward(ctx, x, group, fmt, block, min_bytes, name):
        ctx.group = group
        return torch.ops.ssmshard.quantized_all_reduce(x, group, fmt, block, min_bytes, name)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            x = torch.zeros_like(grad, requires_grad=True)
            (dx,) = torch.autograd.grad(comm.all_reduce(x, ctx.group), x, grad)
        return dx, None, None, None, None, None


def quantized_value_tp_gradient(x, group, fmt, block, min_bytes, name):
    return _QuantizedValueTPGradient.apply(x, group, fmt, block, min_bytes, name)


# Each family's all-reduce sync points of layer 0 (its mixer's, then its MLP's where it has one).
LAYER0_ALL_REDUCES = {"mamba": ["layers.0.x_proj", "layers.0.out_proj"],
                      "falcon_mamba": ["layers.0.x_proj", "layers.0.out_proj"],
                      "mamba2": ["layers.0.out_proj"],
                      "zamba": ["layers.0.x_proj", "layers.0.out_proj"],
                      "zamba2": ["layers.0.out_proj"],
                      "llama": ["layers.0.o_proj", "layers.0.down_proj"]}


# The largest ratio of the logits' error to the first-order tolerance below, measured over fresh
# seeds (int8, tp 2, the forward alone): Mamba 0.17, Falcon-Mamba 0.46, Zamba 0.10 (300 seeds
# each), Llama 0.18 (150). Mamba-2 (2.69 over 2,000 seeds) and Zamba2 (1.84 over 2,000) amplify the
# syncs' errors: the median ratio is 0.4-0.5, but a rare input's logits move further. Every call's
# error is still within its derived bound (asserted per call). The allowance: over twice the largest seen.
LOGITS_AMPLIFICATION = {"mamba2": 6, "zamba2": 6}


@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_pass_quantizes_every_all_reduce_logits_close_backward_exact(family, fresh_seed):
    """Plan(tp=2, quantize_syncs="int8"), simulated, each family: every all-reduce sync point (and no
    all-gather) becomes a quantized all-reduce; each call's error within the derived bound; logits
    within the first-order tolerance of TP and not equal to them; gradients equal bit for bit those
    of the same program run with TP's all-reduce backward, and the backward runs no quantized call."""
    model, captured = captured_model(family)
    tp = _rank_programs(model, captured, ssmshard.Plan(tp=2))
    quantized = _rank_programs(model, captured, ssmshard.Plan(tp=2, quantize_syncs="int8", quantize_min_bytes=0))
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=gen)
    upstream = torch.randn(2, 37, model.config.vocab_size, generator=gen)

    points = quantized[0].sync_points
    chosen = [p.name for p in points if p.action == "quantized"]
    assert chosen == [p.name for p in points if p.kind == "all_reduce"] and "lm_head" not in chosen, points
    assert set(LAYER0_ALL_REDUCES[family]) <= set(chosen), chosen
    layers = {name.split(".")[1] for name in chosen if name.startswith("layers.")}
    assert layers == {str(i) for i in range(model.config.num_hidden_layers)}, chosen
    counts, tp_counts = quantized[0].op_counts(), tp[0].op_counts()
    assert counts["ssmshard.quantized_all_reduce"] == len(chosen), counts
    assert counts["ssmshard.all_reduce"] == tp_counts["ssmshard.all_reduce"] - len(chosen)  # training's tp_copy

    with comm.record_quantized_syncs(measure_errors=True) as recorder:
        got = _forward_backward(quantized, ids, upstream, recorder)
    expected = _forward_backward(tp, ids, upstream)
    assert {c.name for c in recorder.calls} == set(chosen) and all(c.quantized for c in recorder.calls)
    assert all(c.bound_ratio <= 1 for c in recorder.calls), recorder.report()
    assert all(backward_calls == 0 for _, _, backward_calls in got)
    # First order: each sync errs by at most delta (2 + delta) N of its largest partial (docs);
    # summed over the syncs, assuming the layers do not amplify relative errors (times the
    # family's measured amplification, LOGITS_AMPLIFICATION).
    first_order = len(chosen) * DELTA["int8"] * (2 + DELTA["int8"]) * 2
    tolerance = first_order * LOGITS_AMPLIFICATION.get(family, 1)
    err = rel_err(got[0][0], expected[0][0])
    assert 0 < err <= tolerance, (err, tolerance, recorder.report())
    # Over the whole logits tensor, no family needs the allowance: the largest ratio of
    # |got - TP| / |TP| (Frobenius) to the first-order tolerance was 0.52 (Mamba-2) and 0.71
    # (Zamba2) over 2,000 seeds each, 0.06-0.20 for the other four over 300.
    whole = ((got[0][0] - expected[0][0]).norm() / expected[0][0].norm()).item()
    assert whole <= first_order, (whole, first_order, recorder.report())

    oracle = [copy.deepcopy(p) for p in quantized]
    for program, source in zip(oracle, quantized):
        program.weights = source.weights
        for node in program.graph.nodes:
            if node.target is torch.ops.ssmshard.quantized_all_reduce.default:
                node.target = quantized_value_tp_gradient
        program.graph_module.recompile()
    for (logits, grads, _), (oracle_logits, oracle_grads, _) in zip(got, _forward_backward(oracle, ids, upstream)):
        assert torch.equal(logits, oracle_logits)
        assert all(torch.equal(a, b) for a, b in zip(grads, oracle_grads))


def test_glob_threshold_and_exact_small_calls(mamba, fresh_seed):
    """{glob: format} with a None override picks exactly the named sync points; a call whose message
    is below quantize_min_bytes (one token) runs exact, so its logits equal TP's bit for bit."""
    model, captured = mamba
    plan = ssmshard.Plan(tp=2, quantize_syncs={"layers.*": "fp8", "layers.0.x_proj": None}, quantize_min_bytes=1024)
    quantized = _rank_programs(model, captured, plan)
    tp = _rank_programs(model, captured, ssmshard.Plan(tp=2))
    assert quantized[0].quantized_syncs == {"layers.0.out_proj": "fp8", "layers.1.x_proj": "fp8",
                                            "layers.1.out_proj": "fp8"}
    gen = torch.Generator().manual_seed(fresh_seed)
    one_token, prompt = (torch.randint(0, model.config.vocab_size, shape, generator=gen) for shape in ((1, 1), (2, 9)))

    def logits(programs, ids):
        return _simulated(2, lambda rank, world: programs[rank](ids).detach())[0]

    with comm.record_quantized_syncs() as recorder:
        small, large = logits(quantized, one_token), logits(quantized, prompt)
    assert torch.equal(small, logits(tp, one_token))
    assert not torch.equal(large, logits(tp, prompt))
    for call in recorder.calls:  # the message: tokens x hidden (64) x 4 bytes on x_proj's input side
        assert call.quantized == (call.numel * 4 >= 1024), call


def test_errors_name_the_sync_point_and_the_fix(mamba):
    model, captured = mamba
    with pytest.raises(PlanError, match="unknown quantized all-reduce format 'int4'"):
        ssmshard.Plan(tp=2, quantize_syncs="int4")
    with pytest.raises(PlanError, match=r"quantize_syncs\['layers.\*'\].*'fp16'"):
        ssmshard.Plan(tp=2, quantize_syncs={"layers.*": "fp16"})
    with pytest.raises(PlanError, match="block of 48"):
        ssmshard.Plan(tp=2, quantize_syncs="int8", quantize_block=48)
    with pytest.raises(PlanError, match="quantize_min_bytes"):
        ssmshard.Plan(tp=2, quantize_syncs="int8", quantize_min_bytes=-1)

    (sharded,) = _rank_programs(model, captured, ssmshard.Plan(tp=2))[:1]
    for syncs, message in [({"lm_head": "int8"}, "'lm_head', which is an all_gather: .* does not sum"),
                           ({"lm_*": "int8"}, r"selects no all-reduce sync point of this forward program \(it matches "
                                              r"only lm_head \(an all_gather\)\)"),
                           ({"layers.0.out_proj": "int8", "layer.1.out_proj": "fp8"},
                            r"\['layer.1.out_proj'\] selects no all-reduce sync point of this forward program; its "
                            r"sync points are embed, layers.0.x_proj, layers.0.out_proj")]:
        with pytest.raises(PlanError, match=message):
            run_pipeline(sharded, [("quantize_sync", {"syncs": syncs})])
    assert sharded.op_counts()["ssmshard.quantized_all_reduce"] == 0  # nothing half-done

    with pytest.raises(PlanError, match="quantize_syncs='int8' selects sync point 'embed', which is a reduce_scatter "
                                        ".*sequence_parallel=False"):
        _rank_programs(model, captured, ssmshard.Plan(tp=2, sequence_parallel=True, quantize_syncs="int8"))


def test_what_globs_select():
    """Wildcards select all-reduces but pass over all-gathers and statistic syncs (gate_norm), which
    an exact name may still select; later globs win, None keeps exact; dropped sync points are left
    alone; a reduce-scatter cannot be quantized."""
    from ssmshard.passes.quantize_sync import choose
    from ssmshard.passes.shard import SyncPoint

    def point(name, kind="all_reduce", role="out_proj", action="kept"):
        return SyncPoint(name, kind, "n", 0, "mamba2", role, "float32", 256, action)

    points = [point("embed", role="embed"), point("layers.0.gate_norm", role="gate_norm"),
              point("layers.0.out_proj"), point("layers.1.gate_norm", role="gate_norm"),
              point("layers.1.out_proj", action="dropped"), point("lm_head", "all_gather", "lm_head")]
    assert choose(points, "int8") == {"embed": "int8", "layers.0.out_proj": "int8"}
    assert choose(points, {"*": "fp8", "embed": None, "layers.1.gate_norm": "int8"}) == {
        "layers.0.out_proj": "fp8", "layers.1.gate_norm": "int8"}
    assert choose(points, {"layers.*": "int8", "layers.0.*": "fp8"}) == {"layers.0.out_proj": "fp8"}
    with pytest.raises(PlanError, match=r"\['layers.*.gate_norm'\] selects no all-reduce sync point .*matches only "
                                        r"layers.0.gate_norm \(a statistic\), layers.1.gate_norm"):
        choose(points, {"layers.*.gate_norm": "int8"})
    with pytest.raises(PlanError, match="'layers.0.out_proj', which is a reduce_scatter"):
        choose([point("layers.0.out_proj", "reduce_scatter")], {"layers.*": "int8", "embed": "int8"})
    assert choose([], "int8") == {}
