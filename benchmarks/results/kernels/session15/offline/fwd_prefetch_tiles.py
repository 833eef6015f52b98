"""Offline sm_90 compiles (triton 3.6) of the Mamba-1 parallel forward at narrow tiles, with and without
B / C read a tile ahead (fifteenth session): registers, the hot loop's SASS instructions per
(channel, token, state) element per lane, and (LAYOUTS=1) the register layouts.

    PYTHONPATH=<triton 3.6.0>:. python benchmarks/results/kernels/session15/offline/fwd_prefetch_tiles.py \
        8x4x1x0 8x4x1x1 16x4x1x1     # channels x tokens x warps x prefetch
"""
import importlib, os, re, sys, warnings
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
warnings.filterwarnings("ignore")
from triton.tools.disasm import get_sass
sys.path.insert(0, "benchmarks/results/kernels/session12/offline")
from tile_variants import compile_tile, FLAGS
from roofline_scan import loops, mix, registers
mod = importlib.import_module("ssmshard.kernels.selective_scan_fwd_parallel")
fn = mod.scan_fwd_parallel_kernel
specs = sys.argv[1:] or ["2x4x1", "4x4x1", "8x4x1", "16x4x4", "8x4x2"]
for spec in specs:
    bd, t, w, pf = (int(x) for x in spec.split("x"))
    for label, flags in [("main", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=False)),
                         ("main ckpt", dict(STORE_FINAL=False, STORE_CKPT=True, WITH_OUTPUT=True, HAS_CARRY=False)),
                         ("segment", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=False, HAS_CARRY=False))]:
        consts = {**FLAGS, **flags, "T": t, "ckpt_chunk": 64, "BLOCK_D": bd, "PREFETCH_BC": bool(pf)}
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        k = compile_tile(fn, consts, w)
        sass = get_sass(k.asm["cubin"])
        body = loops(sass)
        sizes = [sum(mix(b).values()) for b in body]
        hot = mix(max(body, key=len))
        per_lane = bd * t * 16 / (32 * w)
        top = ", ".join(f"{op} {c}" for op, c in hot.most_common(9))
        print(f"{spec} {label}: regs {registers(k.asm['cubin'])}, loops {sizes}, hot {sum(hot.values())} = "
              f"{sum(hot.values())/per_lane:.2f}/elem; {top}; spills {sass.count('LDL')}", flush=True)
        if os.environ.get("LAYOUTS"):
          for layout in sorted(set(re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>)", k.asm["ttgir"]))):
            print("   ", layout)
