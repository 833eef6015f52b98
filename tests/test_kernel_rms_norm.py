"""The RMSNorm ops and their Triton kernel: the reference is Hugging Face's modules' arithmetic
(bit for bit), the kernel (Triton's interpreter on the CPU) equals the reference."""

import inspect

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mamba.modeling_mamba import MambaRMSNorm
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm
from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNorm

import ssmshard.ops  # noqa: F401  (registers torch.ops.ssmshard)
from ssmshard.kernels import rms_norm as kernel
from ssmshard.testing import rel_err

# transformers 5.25 renamed Mamba-2's gated norm (MambaRMSNormGated -> Mamba2RMSNormGated).
Mamba2GatedNorm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated

ssm = torch.ops.ssmshard
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' tests: Triton's interpreter on the CPU
WIDTHS = [1, 7, 64, 100, 257, 3000, 8192]  # powers of two and not, up to the widest row
EPS = 1e-5


def _ulp(t, dtype):
    magnitude = t.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * torch.finfo(dtype).eps


def assert_equal_up_to_rounding(actual, expected, weight=None, normalised=None):
    """float32: within 1e-6 relative (the kernel sums the squares in another order). 16-bit: the
    normalised value (``normalised``: the reference's, before the weight) may round to the
    neighbouring 16-bit value, which the weight scales, and the product rounds once more: within
    ``|weight| * ulp(normalised) + ulp(output)``; one ulp without a weight."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    if expected.dtype == torch.float32:
        bound = 1e-6 * e.abs().clamp_min(1.0)
    else:
        bound = _ulp(torch.maximum(a.abs(), e.abs()), expected.dtype)
        if normalised is not None:
            bound = bound + weight.double().abs() * _ulp(normalised, normalised.dtype)
    assert ((a - e).abs() <= bound).all(), (a - e).abs().max()


def _weight(d, dtype):
    return (1 + 0.5 * torch.randn(d)).to(dtype)


@pytest.mark.parametrize("hf_norm", [MambaRMSNorm, Mamba2RMSNorm, Zamba2RMSNorm, LlamaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_rmsnorm_bit_for_bit(hf_norm, dtype, fresh_seed):
    d = 100
    module = hf_norm(d, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_weight(d, dtype))
    x = (3 * torch.randn(2, 5, d)).to(dtype)
    with torch.no_grad():
        assert torch.equal(ssm.rms_norm(x, module.weight, EPS), module(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_reference_is_mambas_block_bit_for_bit(dtype, fresh_seed):
    """Mamba's block with residual_in_fp32: residual (float32) + mixer output, cast to the norm
    weight's dtype, normalised by the next block's norm."""
    d = 64
    module = MambaRMSNorm(d, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_weight(d, dtype))
    residual, hidden = torch.randn(3, 2, d), torch.randn(3, 2, d).to(dtype)
    summed, normed = ssm.add_rms_norm(hidden, residual, module.weight, EPS, dtype)
    with torch.no_grad():
        expected_sum = residual + hidden
        assert torch.equal(summed, expected_sum) and summed.dtype == torch.float32
        assert torch.equal(normed, module(expected_sum.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_reference_is_hf_gated_norm_bit_for_bit(dtype, fresh_seed):
    d = 96
    if "group_size" in inspect.signature(Mamba2GatedNorm).parameters:
        group, module = 32, Mamba2GatedNorm(d, group_size=32, eps=EPS).to(dtype)
    else:  # transformers before the grouped norm: one group of all channels
        group, module = d, Mamba2GatedNorm(d, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_weight(d, dtype))
    x, gate = torch.randn(2, 3, d).to(dtype), torch.randn(2, 3, d).to(dtype)
    with torch.no_grad():
        assert torch.equal(ssm.gated_rms_norm(x, gate, module.weight, EPS, group), module(x, gate))


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_rms_norm_equals_reference(d, dtype, fresh_seed):
    x, weight = (3 * torch.randn(3, 5, d, device=DEVICE)).to(dtype), _weight(d, dtype).to(DEVICE)
    ones = torch.ones(d, dtype=dtype, device=DEVICE)
    assert_equal_up_to_rounding(kernel.rms_norm(x, ones, EPS), ssm.rms_norm(x, ones, EPS))  # one rounding
    assert_equal_up_to_rounding(kernel.rms_norm(x, weight, EPS), ssm.rms_norm(x, weight, EPS),
                                weight, ssm.rms_norm(x, ones, EPS))


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("dtype,residual_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_kernel_add_rms_norm_equals_reference(d, dtype, residual_dtype, fresh_seed):
    x, residual = torch.randn(4, d, device=DEVICE).to(dtype), torch.randn(4, d, device=DEVICE).to(residual_dtype)
    weight = _weight(d, dtype).to(DEVICE)
    summed, normed = kernel.add_rms_norm(x, residual, weight, EPS, dtype)
    expected_sum, expected_norm = ssm.add_rms_norm(x, residual, weight, EPS, dtype)
    assert torch.equal(summed, expected_sum)  # one float32 add, rounded once: no freedom
    assert_equal_up_to_rounding(normed, expected_norm, weight,
                                ssm.rms_norm(expected_sum.to(dtype), torch.ones_like(weight), EPS))


def test_kernel_weight_dtype_promotes_like_torch(fresh_seed):
    """A float32 weight on a bfloat16 activation gives float32, as ``weight * y.to(bf16)`` does."""
    x, weight = torch.randn(2, 3, 50, device=DEVICE).to(torch.bfloat16), _weight(50, torch.float32).to(DEVICE)
    out = kernel.rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    assert_equal_up_to_rounding(out, ssm.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("d,group", [(96, 32), (30, 30), (60, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gated_norm_equals_reference(d, group, dtype, fresh_seed):
    x, gate = (torch.randn(2, 3, d, device=DEVICE).to(dtype) for _ in range(2))
    weight = _weight(d, dtype).to(DEVICE)
    assert_equal_up_to_rounding(kernel.gated_rms_norm(x, gate, weight, EPS, group),
                                ssm.gated_rms_norm(x, gate, weight, EPS, group), weight,
                                ssm.gated_rms_norm(x, gate, torch.ones_like(weight), EPS, group))


@pytest.mark.parametrize("rows", ["evenly spaced", "unevenly spaced"])
def test_kernel_reads_channel_slices_of_a_wider_tensor(rows, fresh_seed):
    """Mamba-2 reads its gate as a channel slice of in_proj's output: rows evenly spaced, read in
    place; the first half of each sequence's rows is not evenly spaced (a gap between the batch
    rows) and is copied first. Both give the reference's values (inputs, gate and residual all
    slices)."""
    d, dtype = 96, torch.bfloat16
    packed = torch.randn(2, 6, 3 * d + 5, device=DEVICE).to(dtype)
    x, gate, residual = (packed[..., i * d:(i + 1) * d] for i in range(3))
    if rows == "unevenly spaced":
        x, gate, residual = (t[:, :3] for t in (x, gate, residual))
    weight = _weight(d, dtype).to(DEVICE)
    # Read in place (the same memory) exactly when the rows are evenly spaced.
    assert (kernel._as_rows(gate, d).data_ptr() == gate.data_ptr()) == (rows == "evenly spaced")
    assert_equal_up_to_rounding(kernel.gated_rms_norm(x, gate, weight, EPS, 32),
                                ssm.gated_rms_norm(x, gate, weight, EPS, 32), weight,
                                ssm.gated_rms_norm(x, gate, torch.ones_like(weight), EPS, 32))
    summed, normed = kernel.add_rms_norm(x, residual, weight, EPS, dtype)
    expected_sum, expected_norm = ssm.add_rms_norm(x, residual, weight, EPS, dtype)
    assert summed.is_contiguous() and normed.is_contiguous()
    assert torch.equal(summed, expected_sum)
    assert_equal_up_to_rounding(normed, expected_norm, weight,
                                ssm.rms_norm(expected_sum.to(dtype), torch.ones_like(weight), EPS))


def test_kernel_refuses_rows_wider_than_it_holds():
    with pytest.raises(ValueError, match="at most 8192"):
        kernel.rms_norm(torch.randn(1, 8193, device=DEVICE), torch.randn(8193, device=DEVICE), EPS)


def test_add_rms_norm_gradient_is_torchs(fresh_seed):
    """The op's autograd (the reference differentiated) equals torch autograd of the unfused ops
    (float32: the norm computes in float32 whatever its input)."""
    d = 24
    x, residual = (torch.randn(3, d, requires_grad=True) for _ in range(2))
    weight = torch.randn(d, requires_grad=True)
    summed, normed = ssm.add_rms_norm(x, residual, weight, EPS, torch.float32)
    loss = (summed.sin() * normed).sum()
    grads = torch.autograd.grad(loss, (x, residual, weight))
    s = residual + x
    expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS))
    expected_grads = torch.autograd.grad((s.sin() * expected).sum(), (x, residual, weight))
    for g, e in zip(grads, expected_grads):  # sums over d: the order of addition differs
        assert rel_err(g, e) <= 1e-5
