"""The swap_kernels pass: nodes retargeted to the Triton kernels, the rest reported by name."""

import pytest
import torch

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.passes import swap_kernels as swap
from ssmshard.testing import rel_err

from conftest import interpreted_kernels, real_tensor, small_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2"])
def test_swapped_program_matches_the_reference_program(family, fresh_seed):
    """Every scan/conv node gets a kernel; outputs and gradients equal the reference program
    (on the GPU through the Triton kernels; on the CPU the adapters dispatch to the reference)."""
    model = small_model(family).to(DEVICE)
    reference = ssmshard.capture(model)
    swapped = run_pipeline(ssmshard.capture(model), ["swap_kernels"])
    ops = {r["op"] for r in swapped.kernel_report}
    assert {"causal_conv1d"} <= ops and ops & {"selective_scan", "ssd_scan"}
    assert all(r["kernel"] == "triton" for r in swapped.kernel_report), swapped.kernel_report
    ids = torch.randint(0, model.config.vocab_size, (2, 37), device=DEVICE)
    params = [p for p in model.parameters()]
    out_ref = reference(ids)
    grads_ref = torch.autograd.grad(out_ref.square().mean(), params, allow_unused=True)
    out = swapped(ids)
    grads = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
    tol = 1e-4 if DEVICE == "cuda" else 0.0  # the kernels sum in another order; the CPU path is the same code
    assert rel_err(out, out_ref) <= tol
    flat = lambda gs: torch.cat([g.flatten() for g in gs if g is not None])  # noqa: E731
    assert rel_err(flat(grads), flat(grads_ref)) <= 10 * tol


# Narrow enough for Triton's interpreter: the Mamba-1 scan's backward dominates (about 12 s for
# Falcon-Mamba's two layers, 37 s for Zamba's six on a 2-core machine).
_INTERPRETED_SIZES = {
    "falcon_mamba": dict(hidden_size=16, intermediate_size=32, state_size=4),
    "zamba": dict(hidden_size=16, intermediate_size=32, mamba_d_state=4, num_attention_heads=2,
                  num_key_value_heads=2, attention_hidden_size=32, attention_head_dim=16),
}


@interpreted_kernels
@pytest.mark.parametrize("family", ["falcon_mamba", "zamba"])
def test_triton_kernels_of_the_mamba1_variants_equal_hf_eager(family, monkeypatch, fresh_seed):
    """Falcon-Mamba (B, C and dt normalised before the scan) and Zamba (multi-head Mamba-1 mixers
    beside a shared attention block) with their scans and convolutions on the Triton kernels, run by
    Triton's CPU interpreter: logits and every parameter's gradient against HF eager (1e-5 over the
    whole vector, 1e-4 per tensor, float32)."""
    monkeypatch.setattr(swap, "_on_gpu", real_tensor)  # CPU tensors to the kernels, run by the interpreter
    model = small_model(family, **_INTERPRETED_SIZES[family])
    program = run_pipeline(ssmshard.capture(model), ["swap_kernels"])
    assert {r["op"] for r in program.kernel_report} == {"causal_conv1d", "selective_scan"}
    assert all(r["kernel"] == "triton" for r in program.kernel_report), program.kernel_report
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen)
    probe = torch.randn(2, 7, model.config.vocab_size, generator=gen)
    params = list(model.parameters())
    logits = program(ids)
    grads = torch.autograd.grad((logits * probe).sum(), params, allow_unused=True)
    want = model(ids).logits
    want_grads = torch.autograd.grad((want * probe).sum(), params)
    where = (family, fresh_seed)
    assert rel_err(logits, want) < 1e-5, where
    assert all(g is not None for g in grads), where
    assert rel_err(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in want_grads])) < 1e-5, where
    worst = max(rel_err(g, w) for g, w in zip(grads, want_grads))
    assert worst < 1e-4, (where, worst)


def test_nodes_without_a_kernel_are_named(monkeypatch):
    model = small_model("mamba2")
    monkeypatch.delitem(swap.KERNELS, torch.ops.ssmshard.ssd_scan.default)
    with pytest.warns(UserWarning, match=r"ssd_scan.*no Triton kernel"):
        program = run_pipeline(ssmshard.capture(model), ["swap_kernels"])
    slow = [r for r in program.kernel_report if r["kernel"] is None]
    assert slow and all(r["op"] == "ssd_scan" for r in slow)


def test_plan_kernels_option_is_validated():
    with pytest.raises(ssmshard.PlanError, match="kernels"):
        ssmshard.Plan(kernels="cuda")
    with pytest.raises(ssmshard.PlanError, match="CUDA"):
        ssmshard.Plan(kernels="triton").kernel_choice(torch.device("cpu"))
    assert ssmshard.Plan().kernel_choice(torch.device("cpu")) == "reference"
