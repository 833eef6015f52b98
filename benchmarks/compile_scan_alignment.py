"""How row alignment decides the Mamba-1 parallel forward's global accesses: offline compile for
a GPU target (no GPU needed), PTX vector and scalar loads and stores counted.

    python benchmarks/compile_scan_alignment.py [--arch 90]

Triton marks an integer argument 16-divisible only when it is one (and specialises launches on
that), and emits a vector access only when it can prove the address aligned. A row stride of
l elements with l % 16 != 0 (any packed row, padded batch or single sequence of arbitrary length)
therefore turns each thread's 4-token vectors of u, delta, z, B, C and y into scalar accesses.
Three cases, bf16 u/delta/z, fp32 B/C/y, tiles of 32 channels x 4 tokens x 16 states, 1 warp:
all row strides 16-divisible; none (l = 8130 before the aligned rows of
``selective_scan._row_buffer``); only y's (what remains after them: y stays contiguous).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreter stand-ins
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel  # noqa: E402

FP32_POINTERS = {"A_ptr", "B_ptr", "C_ptr", "D_ptr", "bias_ptr", "init_ptr", "ckpt_ptr", "carry_ptr", "y_ptr",
                 "final_ptr", "seg_end_ptr", "seg_decay_ptr"}
INT_POINTERS = {"seq_ptr", "range_ptr"}
UNIT_STRIDES = {"su_l", "sdl_l", "sz_l", "sy_l", "sA_n", "si_n", "sf_n"}  # tokens contiguous: 1, a constant
ROW_STRIDES = {"su_b", "su_d", "sdl_b", "sdl_d", "sz_b", "sz_d", "sB_b", "sB_g", "sB_n", "sC_b", "sC_g", "sC_n",
               "sy_b", "sy_d"}
CASES = {"all row strides 16-divisible (l % 16 == 0)": set(),
         "no row stride 16-divisible (l = 8130, before aligned rows)": ROW_STRIDES,
         "only y's rows off (after aligned rows; y contiguous)": {"sy_b", "sy_d"}}


def access_counts(misaligned: set, arch: int) -> dict:
    fn = scan_fwd_parallel_kernel
    constants = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False,
                     STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=False, RANGED=False,
                     BLOCK_D=32, T=4, N_PAD=16)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + ("fp32" if name in FP32_POINTERS else "i32" if name in INT_POINTERS else "bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in UNIT_STRIDES:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in misaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
    ptx = kernel.asm["ptx"]
    vector, scalar = r"(\.\w+)*\.v[24]", r"(?!(\.\w+)*\.v[24])(\.\w+)*\s"
    return {"vector loads": len(re.findall(r"ld\.global" + vector, ptx)),
            "scalar loads": len(re.findall(r"ld\.global" + scalar, ptx)),
            "vector stores": len(re.findall(r"st\.global" + vector, ptx)),
            "scalar stores": len(re.findall(r"st\.global" + scalar, ptx))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"triton {triton.__version__}, sm_{args.arch}, scan_fwd_parallel_kernel, PTX global accesses")
    for label, misaligned in CASES.items():
        print(f"  {label:60s} {access_counts(misaligned, args.arch)}")


if __name__ == "__main__":
    main()
