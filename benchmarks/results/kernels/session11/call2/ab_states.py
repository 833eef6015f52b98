"""A/B of the SSD chunk-states kernel: old (nested loops, scratch/old_fwd.py) vs new (one flat loop).
Recreate the modules it loads: `git show cf948bb:ssmshard/kernels/ssd_scan_fwd.py > scratch/old_fwd.py`,
then `cp scratch/old_fwd.py scratch/new_fwd.py && patch scratch/new_fwd.py
benchmarks/results/kernels/session11/call2/blockend_fwd.patch` (the block-end-decay variant).
Device time (profiler) per call at the bench shapes, each autotuned; states compared."""
import importlib.util, json, math, os, sys
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_ssd_scan import CHUNK, make_inputs, packed_lengths
from profiling import profile_kernels
from ssmshard.kernels import ssd_scan_fwd as new
from ssmshard.kernels.ssd_triton_common import ChunkTable
def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
variants = [("old", load("scratch/old_fwd.py")), ("blockend", load("scratch/new_fwd.py")), ("tree", new)]
torch.manual_seed(0)
lengths = packed_lengths(16384, torch.Generator().manual_seed(0))
cases = [("B8xL2048", 8, 2048, None), ("B1xL2048", 1, 2048, None), ("B1xL4096", 1, 4096, None),
         ("B1xL16384", 1, 16384, None), (f"packed{len(lengths)}", 1, 16384, lengths)]
report = []
for name, b, l, lens in cases:
    inp = make_inputs(b, l, False, "cuda")
    x = inp["x"].reshape(b * l, 80, 64); B = inp["B"].reshape(b * l, 1, 128); dt = inp["dt"].reshape(b * l, 80)
    if lens is None:
        table = ChunkTable.for_rows(b, l, CHUNK, x.device)
    else:
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        table = ChunkTable(cu, b * l, CHUNK)
    dtd, cs = new.run_dt_cumsum(dt, inp["A"], table, new.dt_kwargs(inp["dt_bias"], True, 0.0, math.inf))
    row = {"case": name}
    results = {}
    for tag, mod in variants:
        fn = lambda: mod.run_chunk_states(x, dtd, cs, B, None, table)
        for _ in range(3):
            results[tag] = fn()
        table_k = profile_kernels(fn, calls=10)
        row[f"{tag}_ms"] = sum(r["ms_per_call"] for r in table_k)
        tuned = mod.chunk_states.tuned
        row[f"{tag}_config"] = str(getattr(tuned, "best_config", None))
        row[f"{tag}_config_ms"] = {str(c): float(v[0] if isinstance(v, (list, tuple)) else v)
                                   for c, v in (getattr(tuned, "configs_timings", None) or {}).items()}
    used = int(table.seq_first_chunk[-1])
    so, fo = results["old"]
    for tag, _ in variants[1:]:
        sn, fn_ = results[tag]
        row[f"{tag}_states_err"] = ((so[:used].float() - sn[:used].float()).abs().max() / so[:used].float().abs().max()).item()
        row[f"{tag}_final_err"] = ((fo - fn_).abs().max() / fo.abs().max()).item()
    report.append(row)
    print(json.dumps(row), flush=True)
print(f"\n{torch.cuda.get_device_name()}")
for r in report:
    print(r["case"], "  ".join(f"{t} {r[t + '_ms']:.4f} ms" for t, _ in variants),
          "  ".join(f"{t} err {r[t + '_states_err']:.1e}/{r[t + '_final_err']:.1e}" for t, _ in variants[1:]))
    for t, _ in variants:
        print("   ", t, r[t + "_config"])
json.dump(report, open(os.path.join(os.environ.get("OUT", "."), "ab_states.json"), "w"), indent=1)
