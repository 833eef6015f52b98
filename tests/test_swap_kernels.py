"""The swap_kernels pass: nodes retargeted to the Triton kernels, the rest reported by name."""

import pytest
import torch

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.passes import swap_kernels as swap
from ssmshard.testing import rel_err

from conftest import small_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", ["mamba", "mamba2", "zamba2"])
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
