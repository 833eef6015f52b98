"""A gated MLP's ``act(gate) * up`` as one launch: the kernel (``kernels.gated_activation``; on a
GPU where there is one, else Triton's CPU interpreter) against torch's two ops, and the
``fuse_gated_activation`` pass, which fuses only where the product alone reads the activation and
nothing broadcasts. Its tokens against HF under the GPU plan (Llama's SiLU, Zamba2's GELU):
tests/test_fold_cache_positions.py.

Dimension letters: b batch, n features (of gate and up; their tensor holds 2n when chunked)."""

import types

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.kernels import gated_activation as kgated
from ssmshard.passes import fuse_gated_activation as fga
from ssmshard.passes.manager import PassContext

from conftest import pipeline_steps
from test_fuse_cache_write import _annotated  # a graph whose nodes carry their values from one run
from test_kernel_selective_scan import to_cpu, to_device  # the GPU where there is one, else the interpreter

aten = torch.ops.aten
TORCH = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize("activation", sorted(kgated.ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch(activation, dtype, fresh_seed):
    """Element by element within twice the error of one rounding step of the product and of the
    activation, plus the activation's own float32 error, of the order of eps32 * |gate| (GELU's
    1 + erf cancels far below zero): on a GPU libdevice's exp and erf against torch's kernels,
    which differ in the last bit in places; under the interpreter NumPy's against torch's CPU ones.
    The gate and up halves of one (b, 1, 2n) tensor, as ``chunk`` hands them over, n above one
    block of the kernel."""
    generator = torch.Generator().manual_seed(fresh_seed)
    both = (3 * torch.randn(3, 1, 2 * 1100, generator=generator)).to(dtype)
    gate, up = to_device(*both.chunk(2, dim=-1))
    got = kgated.gated_activation(gate, up, activation)
    act = TORCH[activation](gate)
    expected = act * up
    assert got.is_contiguous() and got.shape == expected.shape
    got, expected, act, gate, up = (t.float() for t in to_cpu(got, expected, act, gate, up))
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    bound = 2 * (eps * expected.abs() + (eps * act.abs() + eps32 * gate.abs()) * up.abs())
    error = (got - expected).abs()
    worst = float((error / bound.clamp_min(torch.finfo(torch.float32).tiny)).max())
    assert bool((error <= bound).all()), f"{activation} {dtype} seed {fresh_seed}: error {worst:.2f}x the bound"


def test_kernel_rejects_what_it_cannot_compute():
    a = torch.randn(2, 8)
    with pytest.raises(ValueError, match="activation 'relu'"):
        kgated.gated_activation(*to_device(a, a), "relu")
    with pytest.raises(ValueError, match="must share one shape"):
        kgated.gated_activation(*to_device(a, a[:, :4]), "silu")
    with pytest.raises(ValueError, match="must share one shape"):
        kgated.gated_activation(*to_device(a, a.double()), "silu")


def _mlp_graph(case: str):
    """``act(gate) * up`` as captured; ``case`` varies what the pass must leave alone."""
    graph = torch.fx.Graph()
    gate, up = graph.placeholder("gate"), graph.placeholder("up")
    if case == "gelu_tanh":
        act = graph.call_function(aten.gelu.default, (gate,), {"approximate": "tanh"})
    else:
        act = graph.call_function(aten.silu.default, (gate,))
    if case == "broadcast":
        up = graph.call_function(aten.slice.Tensor, (up, 0, 0, 1))  # one row for every row of gate
    product = graph.call_function(aten.mul.Tensor, (up, act) if case == "up_first" else (act, up))
    outputs = [product, act] if case == "activation_read_twice" else [product]
    graph.output(tuple(outputs))
    return graph


@pytest.mark.parametrize("case", ["silu", "up_first", "gelu_tanh", "activation_read_twice", "broadcast", "compiled"])
def test_pass_fuses_only_where_the_kernel_computes_the_same(case, fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    inputs = [torch.randn(4, 1, 6, generator=generator) for _ in range(2)]
    expected = _annotated(_mlp_graph(case), inputs)(*inputs)
    module = _annotated(_mlp_graph(case), inputs)
    program = types.SimpleNamespace(mode="decode", graph=module.graph)
    fga.fuse_gated_activation(program, PassContext(options={"compile": case == "compiled"}))
    module.recompile()
    fused = [n for n in module.graph.nodes if n.target is fga.gated_activation_kernel]
    left_alone = case in ("activation_read_twice", "broadcast", "compiled")
    name = "gelu_tanh" if case == "gelu_tanh" else "silu"
    assert program.gated_activation_report == ({} if left_alone else {name: 1}), case
    assert len(fused) == (not left_alone) and (left_alone or fused[0].args[2] == name)
    for got, want in zip(module(*inputs), expected):
        assert torch.equal(got, want), (case, fresh_seed)


def test_plan_runs_it_on_decode_programs_and_skip_passes_leaves_it_out():
    decode = pipeline_steps(ssmshard.Plan())
    assert decode.index("group_decode_linears") < decode.index("fuse_gated_activation") < decode.index("swap_kernels")
    assert "fuse_gated_activation" not in pipeline_steps(ssmshard.Plan(), mode="prefill")
    assert "fuse_gated_activation" not in pipeline_steps(ssmshard.Plan(skip_passes=["fuse_gated_activation"]))
    assert "fuse_gated_activation" not in pipeline_steps(ssmshard.Plan(), kernels="reference")
