"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run or is turned off, and on a
Hopper GPU the decode kernels give the same values with and without it."""

import pytest
import torch

from ssmshard.kernels import pdl


def test_pdl_is_off_on_the_cpu_and_when_turned_off(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA call


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper or later GPU")
def test_decode_kernels_give_the_same_values_with_and_without_pdl(monkeypatch, fresh_seed):
    from ssmshard.kernels.gemv import gemv
    from ssmshard.kernels.rms_norm import add_rms_norm
    from ssmshard.kernels.state_update import selective_state_update

    gen = torch.Generator("cuda").manual_seed(fresh_seed)
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(1, 2560, device="cuda", generator=gen)
    norm_weight = torch.randn(2560, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(4160, 2560, device="cuda", dtype=torch.bfloat16, generator=gen)
    state = torch.randn(1, 8, 64, 128, device="cuda", generator=gen)
    dt, A = torch.rand(1, 8, 64, device="cuda", generator=gen), -torch.rand(8, 64, 128, device="cuda", generator=gen)
    B, C = (torch.randn(1, 1, 128, device="cuda", generator=gen) for _ in range(2))

    def step():
        summed, normed = add_rms_norm(x, residual, norm_weight, 1e-5, torch.bfloat16)
        y = gemv(normed, weight)
        out, new = selective_state_update(state, y[:, :512].float().view(1, 8, 64), dt, A, B, C)
        return summed, normed, y, out, new

    assert pdl.enabled(torch.device("cuda"))
    with_pdl = step()
    monkeypatch.setenv(pdl.ENV, "0")
    without = step()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
