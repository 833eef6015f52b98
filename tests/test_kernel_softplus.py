"""The softplus both scans discretise dt with (``scan_common.softplus``), against float64.

Mamba and Mamba-2 start dt log-uniform in [1e-3, 1e-1], so softplus runs at inputs around
-7 to -2, where log(1 + exp(v)) written plainly loses the digits that 1 + exp(v) rounds away
(relative error 6e-5 at dt = 1e-3). Bound per element: float32 rounding (a few ulps) plus the
rounding of v * log2(e) inside exp on the GPU, which scales with |v|: (|v| + 16) * 2^-24.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmshard.kernels.scan_common import discretise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _discretise_kernel(delta_ptr, bias_ptr, out_ptr, n, SOFTPLUS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    delta = tl.load(delta_ptr + offs, mask=mask, other=0.0)
    bias = tl.load(bias_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, discretise(delta, bias, SOFTPLUS), mask=mask)


def _discretise(delta: torch.Tensor, bias: torch.Tensor, softplus: bool = True) -> torch.Tensor:
    out = torch.empty_like(delta)
    block = 256
    _discretise_kernel[(triton.cdiv(delta.numel(), block),)](delta, bias, out, delta.numel(), softplus, BLOCK=block)
    return out


def test_softplus_matches_float64_across_its_range(fresh_seed):
    # Mamba's initial dt range (inverse softplus of 1e-3 .. 1e-1), the whole range where exp(-|v|)
    # stays a normal float32 (|v| <= 80), and a few fixed points.
    gen = torch.Generator().manual_seed(fresh_seed)
    dt_init = torch.exp(torch.empty(2000).uniform_(-6.9078, -2.3026, generator=gen))
    v = torch.cat([
        torch.log(torch.expm1(dt_init.double())).float(),
        torch.empty(4000).uniform_(-80.0, 80.0, generator=gen),
        torch.tensor([-80.0, -20.0, -6.9, -1e-3, 0.0, 1e-3, 14.0, 15.5, 20.0, 21.0, 80.0]),
    ])
    # The kernel adds the bias in float32 first; the float64 reference starts from that same sum.
    bias = torch.empty(v.shape).uniform_(-1.0, 1.0, generator=gen)
    delta = v - bias
    v = delta + bias
    got = _discretise(delta.to(DEVICE), bias.to(DEVICE)).cpu().double()
    want = torch.nn.functional.softplus(v.double())
    bound = (v.double().abs() + 16) * 2.0**-24 * want
    worst = ((got - want).abs() / bound).argmax()
    assert ((got - want).abs() <= bound).all(), (
        f"softplus({v[worst].item():.6g}) = {got[worst].item():.9g}, float64 {want[worst].item():.9g} "
        f"(relative error {((got[worst] - want[worst]) / want[worst]).abs().item():.2e}, seed {fresh_seed})")


def test_discretise_without_softplus_is_the_sum(fresh_seed):
    delta, bias = torch.randn(300), torch.randn(300)
    got = _discretise(delta.to(DEVICE), bias.to(DEVICE), softplus=False).cpu()
    assert torch.equal(got, delta + bias)
