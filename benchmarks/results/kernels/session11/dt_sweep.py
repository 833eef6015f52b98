"""Device time of the SSD dt kernel per heads-per-program (BLOCK_H) at the bench shapes (H200).

    PYTHONPATH=$PWD python3 benchmarks/results/kernels/session11/dt_sweep.py OUT.json
"""
import json, math, os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_ssd_scan import CHUNK, make_inputs
from profiling import profile_kernels
from ssmshard.kernels import ssd_scan_fwd
from ssmshard.kernels.ssd_triton_common import ChunkTable

rows = []
for b, l in ((1, 2048), (1, 4096), (1, 16384), (8, 2048)):
    inp = make_inputs(b, l, False, "cuda")
    dt = inp["dt"].reshape(b * l, -1)
    table = ChunkTable.for_rows(b, l, CHUNK, dt.device)
    args = ssd_scan_fwd.dt_kwargs(inp["dt_bias"], True, 0.0, math.inf)
    ref = ssd_scan_fwd.run_dt_cumsum(dt, inp["A"], table, args, block_h=1)
    for block_h in (1, 2, 4, 8, 16):
        got = ssd_scan_fwd.run_dt_cumsum(dt, inp["A"], table, args, block_h=block_h)
        same = all(torch.equal(g, r) for g, r in zip(got, ref))
        ms = sum(k["ms_per_call"] for k in profile_kernels(
            lambda: ssd_scan_fwd.run_dt_cumsum(dt, inp["A"], table, args, block_h=block_h), calls=20))
        rows.append({"batch": b, "length": l, "block_h": block_h, "programs": table.n_slots * -(-80 // block_h),
                     "ms": ms, "equal_to_block_h_1": same})
        print(json.dumps(rows[-1]), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
