"""Are the register-capped parallel backward's loops unchanged by the PREFETCH switch? Compiles the main
pass (with a carry) and the adjoint-only pass at the 168-register cap for sm_90 from an older tree and from
this one, and compares their loops' opcode streams (registers and immediates masked).

    git archive 70c976c ssmshard | tar -x -C scratch/old
    PYTHONPATH=<triton 3.6.0> python benchmarks/results/kernels/session14/offline/bwd_capped_sass_cmp.py
"""
import os, sys, importlib, warnings, re
os.environ.pop("TRITON_INTERPRET", None)
warnings.filterwarnings("ignore")
sys.path[:0] = ["benchmarks", "benchmarks/results/kernels/session12/offline"]
from triton.tools.disasm import get_sass
from roofline_scan import loops
from tile_variants import compile_tile
FLAGS = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False, RANGED=False, N_PAD=16,
             HAS_DFINAL=False, BLOCK_D=8, T=4)
def ops(tree, flags, cap):
    sys.path.insert(0, os.path.abspath(tree))
    for m in [m for m in sys.modules if m.startswith("ssmshard")]: del sys.modules[m]
    fn = importlib.import_module("ssmshard.kernels.selective_scan_bwd_parallel").scan_bwd_parallel_kernel
    sys.path.pop(0)
    f = {k: v for k, v in {**FLAGS, **flags}.items() if k in fn.arg_names}
    sass = get_sass(compile_tile(fn, f, 1, maxnreg=cap).asm["cubin"])
    return [re.sub(r"R\d+|P\d|UR\d+|0x[0-9a-f]+|[-\d.e+]+", "#", l.split("\t")[-1]) for b in loops(sass) for l in b]
for flags in (dict(HAS_CARRY=True, LAM_ONLY=False, PREFETCH=False), dict(HAS_CARRY=False, LAM_ONLY=True, PREFETCH=False)):
    a, b = ops("scratch/old", flags, 168), ops(".", flags, 168)
    print(flags, len(a), len(b), "identical opcode streams" if a == b else f"differ: {sum(x != y for x, y in zip(a, b))} positions")
