"""Host time of the Mamba-1 scan, section by section (sixteenth session): the wrapper's
functions and every Triton launch are wrapped in perf_counter timers (inclusive times, us per
call of the whole step), at shapes whose GPU work is shorter than the host's.

    PYTHONPATH=benchmarks python benchmarks/results/kernels/session16/host_sections.py
"""
import collections
import functools
import json
import time

import torch
import triton
from triton.runtime.jit import JITFunction

from bench_selective_scan import N_STATE, ORDER, make_inputs
from ssmshard.kernels import selective_scan as ss

spent = collections.defaultdict(float)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
    return wrapper


for name in ("_forward", "_backward", "_launch_forward", "_chain_segments", "default_config", "_check_scan_args",
             "_fp32_rows", "_aligned_rows", "_row_buffer", "_segments", "_segment_pass_ranges"):
    setattr(ss, name, timed(name, getattr(ss, name)))
ss._Grads.__init__ = timed("_Grads.__init__", ss._Grads.__init__)
ss._Grads.reduced = timed("_Grads.reduced", ss._Grads.reduced)
ss._SelectiveScanFn.backward = staticmethod(timed("Function.backward", ss._SelectiveScanFn.backward))
ss._SelectiveScanFn.forward = staticmethod(timed("Function.forward", ss._SelectiveScanFn.forward))
_run = JITFunction.run


def run(self, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return _run(self, *args, **kwargs)
    finally:
        spent[f"launch {self.fn.__name__}"] += time.perf_counter() - t0


JITFunction.run = run
for cdiv_owner in (triton,):
    cdiv_owner.cdiv = timed("triton.cdiv", cdiv_owner.cdiv)

dev = torch.device("cuda")
for b, d, l, segments in [(1, 256, 128, 1), (1, 256, 2048, 16)]:
    x = make_inputs(b, d, l, N_STATE, dev)
    cfg = ss.ScanConfig(**{**ss.default_config(b, d, l, dev).__dict__, "segments": segments})
    leaves = [x[k].detach().requires_grad_(True) for k in ORDER]
    dy = torch.randn_like(leaves[0])
    for what, step in (("fwd no grad", lambda: ss.selective_scan(*[t.detach() for t in leaves], True, config=cfg)),
                       ("fwd+bwd", lambda: torch.autograd.grad(ss.selective_scan(*leaves, True, config=cfg),
                                                               leaves, dy))):
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        spent.clear()
        calls = 300
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
        row = {"b": b, "d": d, "l": l, "segments": segments, "step": what, "total_us": round(total / calls * 1e6, 1)}
        row.update({k: round(v / calls * 1e6, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])})
        print(json.dumps(row), flush=True)
