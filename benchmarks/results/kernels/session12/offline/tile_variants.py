"""Offline sm_90 compiles of the Mamba-1 parallel kernels at several tile shapes (twelfth session).

    PYTHONPATH=<triton 3.6.0>:. python tile_variants.py bwd ssmshard.kernels.selective_scan_bwd_parallel 8x4x1 16x2x1
    PYTHONPATH=<triton 3.6.0>:. python tile_variants.py fwd <module> 32x4x1 16x4x1x2   # last field: num_stages

Run from the repository root with this file copied there (it imports benchmarks/). Prints per
tile (channels x tokens x warps): registers, the hot loop's warp instructions per
(channel, token, state) element per lane, its MUFU / SHFL / LDG counts, spills, shared memory,
and the register layouts Triton chose. ``<module>`` is the kernel module to compile (a copy
with changes, e.g. a pipelined loop, or the package's own).
"""
import importlib
import os
import re
import sys
import warnings

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
warnings.filterwarnings("ignore")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402

import compile_scan_alignment as csa  # noqa: E402
from roofline_scan import loops, mix, registers  # noqa: E402

FLAGS = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False, RANGED=False, N_PAD=16)
KERNEL_FLAGS = {
    "fwd": ("scan_fwd_parallel_kernel", dict(STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=True)),
    "bwd": ("scan_bwd_parallel_kernel", dict(HAS_DFINAL=False, HAS_CARRY=False, LAM_ONLY=False)),
}


def compile_tile(fn, constants, warps, stages=None, maxnreg=None):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + ("bf16" if name in csa.BF16_POINTERS else "i32" if name in csa.INT_POINTERS else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("_l") or name in ("sA_n", "si_n", "sf_n", "sdf_n"):
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {}), **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def main():
    which, module, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    name, flags = KERNEL_FLAGS[which]
    fn = getattr(importlib.import_module(module), name)
    for spec in specs:
        fields = [int(v) for v in spec.split("x")]
        block_d, tokens, warps = fields[:3]
        stages = fields[3] if len(fields) > 3 else None
        kernel = compile_tile(fn, {**FLAGS, **flags, "T": tokens, "BLOCK_D": block_d}, warps, stages)
        sass = get_sass(kernel.asm["cubin"])
        body = loops(sass)
        hot = mix(body[0] if which == "fwd" else body[-1])  # backward: pass B is the last loop
        per_lane = block_d * tokens * 16 / (32 * warps)
        print(f"{which} {spec}: registers {registers(kernel.asm['cubin'])}, hot loop {sum(hot.values())} "
              f"= {sum(hot.values()) / per_lane:.1f} per element, MUFU {hot['MUFU']} SHFL {hot['SHFL']} "
              f"LDG {hot['LDG']}, spill loads {sass.count('LDL')}, shared {kernel.metadata.shared} B")
        for layout in sorted(set(re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>)", kernel.asm["ttgir"]))):
            print("   ", layout)


if __name__ == "__main__":
    main()
