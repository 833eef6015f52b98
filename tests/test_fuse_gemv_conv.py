"""A Mamba layer's ``in_proj`` and conv update as one launch at batch 1: the kernel
(``kernels.gemv_conv``; on a GPU where there is one, else Triton's CPU interpreter) against the
GEMV and conv-update kernels run one after the other, and the ``fuse_gemv_conv`` pass in the
decode programs of the Mamba families, whose greedy tokens stay HF's.

Dimension letters: n projection output features, k input features, d conv channels (features
lo .. lo + d), s conv state slots, w conv taps."""

import operator
import types

import pytest
import torch

import ssmshard
from ssmshard.kernels import gemv_conv as kgc
from ssmshard.kernels.causal_conv1d import causal_conv1d_update
from ssmshard.kernels.gemv import gemv
from ssmshard.passes import fuse_gemv_conv as fgc
from ssmshard.passes.manager import PassContext

from conftest import pipeline_steps, real_tensor, small_model
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

aten = torch.ops.aten
TILE = dict(BLOCK_N=8, BLOCK_K=32, num_warps=2, num_stages=1)  # several programs on the conv's range


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("slots,biases,activation", [(4, True, "silu"), (3, False, None), (6, True, None)])
def test_kernel_equals_the_two_kernels(dtype, state_dtype, slots, biases, activation, fresh_seed):
    """The same bits as ``gemv`` then ``causal_conv1d_update`` (the unfused decode step's kernels),
    the conv's channels straddling program boundaries (lo and d not multiples of BLOCK_N), the
    state updated in place; a state longer than w - 1 (s = 6, w = 4) keeps its older inputs."""
    generator = torch.Generator().manual_seed(fresh_seed)
    n, k, d, w, lo = 300, 96, 130, 4, 70

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(dt)

    x, weight, conv_weight = to_device(randn(1, 1, k), randn(n, k), randn(d, w))
    bias, conv_bias = to_device(randn(n), randn(d)) if biases else (None, None)
    state = to_device(randn(1, d, slots, dt=state_dtype))[0]
    y_two = gemv(x, weight, bias, config=TILE)
    state_two = state.clone()
    out_two, _ = causal_conv1d_update(y_two.transpose(1, 2)[:, lo:lo + d], state_two, conv_weight, conv_bias,
                                      activation, out_state=state_two)
    y, out = kgc.gemv_conv(x, weight, bias, state, conv_weight, conv_bias, activation, lo, config=TILE)
    y, out, state, y_two, out_two, state_two = to_cpu(y, out, state, y_two, out_two, state_two)
    assert torch.equal(y, y_two), f"seed {fresh_seed}"
    assert torch.equal(out, out_two.reshape(1, d)), f"seed {fresh_seed}"
    assert torch.equal(state, state_two), f"seed {fresh_seed}"


def test_kernel_rejects_what_it_cannot_compute():
    x, weight, state, conv_weight = to_device(torch.randn(1, 8), torch.randn(16, 8), torch.randn(1, 4, 3),
                                              torch.randn(4, 4))
    with pytest.raises(ValueError, match="one row"):
        kgc.gemv_conv(x.expand(2, 8), weight, None, state, conv_weight, None, "silu", 0)
    with pytest.raises(ValueError, match="within the 16 output features"):
        kgc.gemv_conv(x, weight, None, state, conv_weight, None, "silu", 13)
    with pytest.raises(ValueError, match="s >= w - 1"):
        kgc.gemv_conv(x, weight, None, state[..., :2], conv_weight, None, "silu", 0)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        kgc.gemv_conv(x, weight, None, state, conv_weight, None, "gelu", 0)


def _generate(model, ids, monkeypatch, tp, fused_kernel: bool):
    """Greedy tokens of a ``SimulatedMesh`` at ``tp`` under the GPU plan's passes, and its rank 0
    decode program. ``fused_kernel``: the fused call runs ``kernels.gemv_conv`` on the CPU tensors
    (the interpreter) where a CUDA tensor would; the other adapters run the reference ops."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    if fused_kernel:
        monkeypatch.setattr(fgc, "_on_gpu", real_tensor)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
    with torch.no_grad():
        tokens = mesh.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4)
    return tokens, mesh.ranks[0]._generation["decode"]


FEATURES, CHANNELS, TAPS = 16, 6, 4  # the projection's n, the conv's d and w


def _layer_graph(case: str):
    """A decode step's projection and conv update as the pass finds them (x (b, d, 1) a view of
    the projection's output); ``case`` varies where the conv's channels are and what the pass must
    leave alone."""
    graph = torch.fx.Graph()
    h, weight, state, conv_weight = (graph.placeholder(name) for name in ("h", "weight", "state", "conv_weight"))
    y = graph.call_function(fgc.LINEAR, (h, weight, None))  # (b, 1, n)
    columns = graph.call_function(aten.transpose.int, (y, 1, 2))  # (b, n, 1)
    outputs = []
    if case in ("every_other_feature", "copied"):  # Zamba's layout: x and the gate interleaved
        x = graph.call_function(aten.slice.Tensor, (columns, 1, 0, FEATURES, 2))
        if case == "copied":
            x = graph.call_function(aten.clone.default, (x,))
        outputs.append(graph.call_function(aten.slice.Tensor, (columns, 1, 1, FEATURES, 2)))
    else:
        first = CHANNELS if case != "conv_second" else FEATURES - CHANNELS
        parts = graph.call_function(aten.split_with_sizes.default, (columns, [first, FEATURES - first], 1))
        x = graph.call_function(operator.getitem, (parts, 1 if case == "conv_second" else 0))
        outputs.append(graph.call_function(operator.getitem, (parts, 0 if case == "conv_second" else 1)))
    if case == "state_read_between":
        outputs.append(graph.call_function(aten.clone.default, (state,)))
    conv = graph.call_function(fgc.CONV, (x, state, conv_weight, None, "silu"))
    outputs.append(graph.call_function(operator.getitem, (conv, 0)))
    graph.output(tuple(outputs))
    return graph


@pytest.mark.parametrize("case", ["conv_first", "conv_second", "every_other_feature", "copied", "state_read_between"])
def test_pass_fuses_only_a_range_of_features_read_in_place(case, fresh_seed):
    """Fused where the conv reads a range of the projection's features through views (first or
    last): the same outputs and new state. Left alone: every other feature (a strided view), a copy
    of them (Zamba's conv input), the state read between the projection and the conv."""
    from test_fuse_cache_write import _annotated

    generator = torch.Generator().manual_seed(fresh_seed)
    d = CHANNELS if case not in ("every_other_feature", "copied") else FEATURES // 2
    inputs = [torch.randn(2, 1, 8, generator=generator), torch.randn(FEATURES, 8, generator=generator),
              torch.randn(2, d, TAPS, generator=generator), torch.randn(d, TAPS, generator=generator)]
    unfused_inputs, fused_inputs = [t.clone() for t in inputs], [t.clone() for t in inputs]
    expected = _annotated(_layer_graph(case), inputs)(*unfused_inputs)
    module = _annotated(_layer_graph(case), inputs)
    program = types.SimpleNamespace(mode="decode", graph=module.graph)
    fgc.fuse_gemv_conv(program, PassContext(options={}))
    module.recompile()
    fused = case in ("conv_first", "conv_second")
    assert len(program.gemv_conv_report) == fused, case
    assert any(n.target is fgc.CONV for n in module.graph.nodes) != fused, case
    for got, want in zip(module(*fused_inputs), expected):
        assert torch.equal(got, want), (case, fresh_seed)
    assert torch.equal(fused_inputs[2], unfused_inputs[2]), "the new conv states differ"


@pytest.mark.parametrize("family,tp,batch", [("mamba", 2, 1), ("mamba2", 2, 1), ("mamba", 1, 2), ("mamba2", 2, 2)])
def test_generation_with_the_fusion_equals_hf(family, tp, batch, monkeypatch, fresh_seed):
    """Every conv update of the decode program is fused (Mamba's x, Mamba-2's xBC, each rank's
    channels at tp 2), and the tokens are HF's: at batch 1 through the fused kernel, at batch 2
    through the two adapters the call falls back to. (Zamba2's layer is Mamba-2's: on a GPU,
    ``test_graphed_batch_one_decode_on_a_gpu``; at tp 2 under the GPU plan's passes,
    tests/test_fold_cache_positions.py.)"""
    if batch == 1 and torch.cuda.is_available():
        pytest.skip("the fused kernel runs on CUDA tensors here: test_graphed_batch_one_decode_on_a_gpu")
    model = small_model(family)
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, 7), generator=generator)
    tokens, decode = _generate(model, ids, monkeypatch, tp, fused_kernel=batch == 1)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected), f"{family} tp {tp} batch {batch} seed {fresh_seed}"
    fused = [n for n in decode.graph.nodes if n.target is fgc.gemv_conv_kernel]
    unfused = [n for n in decode.graph.nodes if n.target is fgc.CONV]
    assert len(fused) == len(decode.gemv_conv_report) and fused and not unfused, f"{len(unfused)} left unfused"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel on CUDA tensors needs a GPU")
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2", "zamba2"])
def test_graphed_batch_one_decode_on_a_gpu(family, fresh_seed):
    """One prompt on a GPU: the graphed decode with the fused kernel gives the tokens of the eager
    decode, of the plan without the pass (graphed) and of HF's greedy ``generate``."""
    model = small_model(family).cuda()
    try:
        generator = torch.Generator().manual_seed(fresh_seed)
        ids = torch.randint(1, model.config.vocab_size, (1, 9), generator=generator).cuda()
        options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20)
        mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1))
        unfused = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1, skip_passes=["fuse_gemv_conv"]))
        with torch.no_grad():
            graphed = mesh.generate(ids, cuda_graph=True, **options)
            eager = mesh.generate(ids, cuda_graph=False, **options)
            without = unfused.generate(ids, cuda_graph=True, **options)
            hf = model.generate(ids, do_sample=False, **options)
        report = mesh.ranks[0]._generation["decode"].gemv_conv_report
    finally:
        model.cpu()
    where = f"{family} (seed {fresh_seed})"
    assert report, where
    assert torch.equal(graphed, eager) and torch.equal(graphed, without), where
    assert torch.equal(graphed, hf), where


def test_plan_runs_it_on_decode_programs_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("inplace_decode_states") < decode.index("fold_weights") < decode.index("fuse_gemv_conv")
    assert "fuse_gemv_conv" not in pipeline_steps(ssmshard.Plan(), mode="prefill")
    assert "fuse_gemv_conv" not in pipeline_steps(ssmshard.Plan(skip_passes=["fuse_gemv_conv"]))
    assert "fuse_gemv_conv" not in pipeline_steps(ssmshard.Plan(), kernels="reference")
