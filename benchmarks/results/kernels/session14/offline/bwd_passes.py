"""Offline sm_90 compiles of the Mamba-1 parallel backward (fourteenth session): main pass with and without
a carry, and the adjoint-only pass, at the split-row register cap (168); registers, loop sizes, spills.

    PYTHONPATH=<triton 3.6.0> python benchmarks/results/kernels/session14/offline/bwd_passes.py <tree>   # <tree>: . or an old checkout
"""
import importlib, os, sys, warnings
os.environ.pop("TRITON_INTERPRET", None)
tree = sys.argv[1]
sys.path[:0] = [tree, "benchmarks", "benchmarks/results/kernels/session12/offline"]
warnings.filterwarnings("ignore")
from triton.tools.disasm import get_sass
from roofline_scan import loops, mix, registers
from tile_variants import compile_tile
sys.path.insert(0, os.path.abspath(tree))
for m in [m for m in sys.modules if m.startswith("ssmshard")]: del sys.modules[m]
mod = importlib.import_module("ssmshard.kernels.selective_scan_bwd_parallel")
print(mod.__file__)
fn = mod.scan_bwd_parallel_kernel
FLAGS = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False, RANGED=False, N_PAD=16,
             HAS_DFINAL=False, BLOCK_D=8, T=4)
def compile_one(constants, maxnreg):
    return compile_tile(fn, constants, 1, maxnreg=maxnreg)
for label, flags, cap in [("main carry cap168", dict(HAS_CARRY=True, LAM_ONLY=False, PREFETCH=False), 168),
                          ("main nocarry", dict(HAS_CARRY=False, LAM_ONLY=False, PREFETCH=True), None),
                          ("main nocarry, no prefetch", dict(HAS_CARRY=False, LAM_ONLY=False, PREFETCH=False), None),
                          ("lam_only cap168", dict(HAS_CARRY=False, LAM_ONLY=True, PREFETCH=False), 168)]:
    flags = {k: v for k, v in flags.items() if k in fn.arg_names}  # older trees have no PREFETCH
    k = compile_one({**FLAGS, **flags}, cap)
    sass = get_sass(k.asm["cubin"])
    body = loops(sass)
    sizes = [sum(mix(b).values()) for b in body]
    print(f"{label}: regs {registers(k.asm['cubin'])}, loops {sizes}, spill ld {sass.count('LDL')} st {sass.count('STL')}")
