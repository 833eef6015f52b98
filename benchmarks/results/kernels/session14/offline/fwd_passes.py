"""Offline sm_90 compiles of the Mamba-1 parallel forward (fourteenth session): the segment pass and the
main pass, with and without checkpoints, 16- and 32-channel tiles; registers and the hot loop's mix.

    PYTHONPATH=<triton 3.6.0>:. python benchmarks/results/kernels/session14/offline/fwd_passes.py
    TREE=<old checkout> PYTHONPATH=<triton 3.6.0>:. python ...   # that tree's kernels
"""
import importlib, os, re, sys, warnings
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
warnings.filterwarnings("ignore")
from triton.tools.disasm import get_sass
sys.path.insert(0, "benchmarks/results/kernels/session12/offline")
from tile_variants import compile_tile, FLAGS
from roofline_scan import loops, mix, registers

if os.environ.get("TREE"):  # an older checkout's kernels (its ckpt_chunk is a runtime argument)
    sys.path.insert(0, os.path.abspath(os.environ["TREE"]))
    for m in [m for m in sys.modules if m.startswith("ssmshard")]:
        del sys.modules[m]
mod = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "ssmshard.kernels.selective_scan_fwd_parallel")
fn = mod.scan_fwd_parallel_kernel
extra = {}
for name in fn.arg_names:
    if name in ("CHAIN", "WEIGHTED"): extra[name] = False
for label, flags in [
    ("main 16x4", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=True, BLOCK_D=16)),
    ("main ckpt 16x4", dict(STORE_FINAL=False, STORE_CKPT=True, WITH_OUTPUT=True, HAS_CARRY=True, BLOCK_D=16)),
    ("segment 16x4", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=False, HAS_CARRY=False, BLOCK_D=16)),
    ("main 32x4", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=False, BLOCK_D=32)),
    ("main ckpt 32x4", dict(STORE_FINAL=False, STORE_CKPT=True, WITH_OUTPUT=True, HAS_CARRY=False, BLOCK_D=32)),
]:
    consts = {**FLAGS, **extra, **flags, "T": 4, "ckpt_chunk": 64}
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    if os.environ.get("TREE"):
        consts.pop("ckpt_chunk")
    k = compile_tile(fn, consts, 1)
    sass = get_sass(k.asm["cubin"])
    body = loops(sass)
    sizes = [sum(mix(b).values()) for b in body]
    hot = mix(max(body, key=len))
    per_lane = consts["BLOCK_D"] * 4 * 16 / 32
    top = ", ".join(f"{op} {c}" for op, c in hot.most_common(8))
    print(f"{label}: regs {registers(k.asm['cubin'])}, loops {sizes}, hot {sum(hot.values())} = "
          f"{sum(hot.values())/per_lane:.2f}/elem; {top}; spills {sass.count('LDL')}")
    if os.environ.get("LAYOUTS"):
        for layout in sorted(set(re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>)", k.asm["ttgir"]))):
            print("   ", layout)
