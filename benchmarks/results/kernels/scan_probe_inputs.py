"""The Mamba-2.8B scan's inputs at (b, l), drawn from torch's global generator, as the probes in
state_lanes/ and segment_passes/ use them: bf16 token-contiguous u, delta (around softplus(-3))
and z, A = -exp(N(0, 0.25)), bf16 B and C (b, n, l), float32 D and delta bias."""
import torch


def scan_inputs(b: int, d: int, l: int, n: int, device) -> tuple:
    """(u, delta, z, A, B, C, D, bias), drawn in this order."""
    u = torch.randn(b, d, l, device=device, dtype=torch.bfloat16)
    delta = (torch.randn(b, d, l, device=device) * 0.5 - 3).to(torch.bfloat16)
    z = torch.randn(b, d, l, device=device, dtype=torch.bfloat16)
    A = -torch.exp(torch.randn(d, n, device=device) * 0.5)
    B = torch.randn(b, n, l, device=device, dtype=torch.bfloat16)
    C = torch.randn(b, n, l, device=device, dtype=torch.bfloat16)
    D = torch.randn(d, device=device)
    bias = torch.randn(d, device=device) * 0.1
    return u, delta, z, A, B, C, D, bias
