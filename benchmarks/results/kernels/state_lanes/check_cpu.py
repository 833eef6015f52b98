"""CPU check of state_lanes_kernel.py under the Triton interpreter: y and the final state against
the float64 reference scan (ssmshard.kernels.reference), per layout (spread, prefetch) and shape.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/results/kernels/state_lanes/check_cpu.py
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_lanes_kernel import launch
from ssmshard.kernels import reference
from ssmshard.kernels.selective_scan import _bc4, _fp32_rows
torch.manual_seed(0)
for spread, pf in ((False, False), (True, False), (True, True)):
  for (b, d, l, n, g, lanes, T) in [(1, 8, 37, 16, 1, 4, 4), (2, 16, 20, 16, 1, 8, 4), (1, 12, 9, 12, 1, 4, 4), (1, 8, 16, 16, 1, 16, 4)]:
      u = torch.randn(b, d, l, dtype=torch.float64)
      delta = torch.randn(b, d, l, dtype=torch.float64) * 0.5
      A = -torch.rand(d, n, dtype=torch.float64) * 2
      B = torch.randn(b, n, l, dtype=torch.float64)
      C = torch.randn(b, n, l, dtype=torch.float64)
      D = torch.randn(d, dtype=torch.float64); z = torch.randn(b, d, l, dtype=torch.float64)
      bias = torch.randn(d, dtype=torch.float64) * 0.1
      init = torch.randn(b, d, n, dtype=torch.float64)
      ref_y, ref_h = reference.selective_scan(u, delta, A, B, C, D, z, bias, True, initial_state=init)
      f = lambda t: t.float()
      B32, C32 = _fp32_rows(_bc4(f(B))), _fp32_rows(_bc4(f(C)))
      y = torch.empty(b, d, l); final = torch.empty(b, d, n)
      launch(f(u), f(delta), f(A), B32, C32, f(D), f(z), f(bias), True, f(init), y, final, block_d=4, lanes=lanes, tokens=T if not spread else lanes, spread=spread, prefetch=pf)
      print(f"spread={spread} prefetch={pf} (b, d, l, n, lanes)={(b, d, l, n, lanes)}: y rel", ((y.double() - ref_y).norm() / ref_y.norm()).item(), "h rel", ((final.double() - ref_h).norm() / ref_h.norm()).item())
