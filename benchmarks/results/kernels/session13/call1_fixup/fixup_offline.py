"""Offline sm_90 compile of segment_fixup_kernel and the LOCAL_Y scan (triton 3.6)."""
import os, re, sys, warnings
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "."); sys.path.insert(0, "benchmarks/results/kernels/session12/offline")
warnings.filterwarnings("ignore")
from triton.tools.disasm import get_sass
from tile_variants import compile_tile, FLAGS
from roofline_scan import loops, mix, registers
import compile_scan_alignment as csa
csa.BF16_POINTERS |= {"y_ptr"}
csa.INT_POINTERS |= {"hi_ptr", "first_start_ptr"}
import importlib
mod = importlib.import_module(sys.argv[1])
which = sys.argv[2]
for spec in sys.argv[3:]:
    bd, T, w = (int(v) for v in spec.split("x"))
    if which == "fixup":
        fn = mod.segment_fixup_kernel
        const = dict(HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, STORE_FINAL=False, STORE_CKPT=False, BLOCK_D=bd, T=T, N_PAD=16)
    else:
        fn = mod.scan_fwd_parallel_kernel
        const = {**FLAGS, "STORE_FINAL": False, "STORE_CKPT": False, "WITH_OUTPUT": True, "HAS_CARRY": which == "recompute",
                 "LOCAL_Y": which == "local", "T": T, "BLOCK_D": bd}
        if which != "local":
            const["ylocal_ptr"] = None; const["first_start_ptr"] = None
        else:
            const["first_start_ptr"] = None
    k = compile_tile(fn, const, w)
    sass = get_sass(k.asm["cubin"])
    body = loops(sass)
    for i, b in enumerate(body):
        m = mix(b)
        print(f"{which} {spec}: regs {registers(k.asm['cubin'])} loop{i} {sum(m.values())} instr = {sum(m.values())/(bd*T*16/(32*w)):.1f}/elt "
              f"MUFU {m['MUFU']} SHFL {m['SHFL']} LDG {m['LDG']} STG {m['STG']} BAR {m['BAR']} LDS {m['LDS']} STS {m['STS']}, spills {sass.count('LDL')}, shared {k.metadata.shared}")
    for layout in sorted(set(re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>)", k.asm["ttgir"]))):
        print("   ", layout)
