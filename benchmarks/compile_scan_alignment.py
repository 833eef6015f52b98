"""How row alignment and row length decide the Mamba-1 parallel kernels' global accesses:
offline compile for a GPU target (no GPU needed), PTX vector and scalar loads and stores counted.

    python benchmarks/compile_scan_alignment.py [--arch 90]

Triton marks an integer argument 16-divisible only when it is one (and specialises launches on
that), and emits a vector access only when it can prove the address aligned and the mask
constant over the vector. Two things therefore turn each thread's 4-token vectors of u, delta,
z, dy, B, C and y into scalar accesses on rows of arbitrary length l (any packed row, padded
batch or single sequence): a row stride of l elements (fixed by ``selective_scan._row_buffer``'s
aligned rows) and the token mask ``t < l`` (fixed by scanning whole tiles unmasked, the last
partial tile apart: ``scan_common.token_mask``). The partial-tile code is compiled beside the
whole-tile loop, so each kernel keeps a block of scalar accesses that runs once per row.
Tiles: forward 32 channels x 4 tokens x 16 states, backward 8 x 4 x 16; 1 warp; bf16
u / delta / z, fp32 B / C / y / dy.
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

from ssmshard.kernels.selective_scan_bwd_parallel import scan_bwd_parallel_kernel  # noqa: E402
from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel  # noqa: E402

BF16_POINTERS = {"u_ptr", "delta_ptr", "z_ptr", "du_ptr", "ddelta_ptr", "dz_ptr"}
INT_POINTERS = {"seq_ptr", "range_ptr"}
ROW_STRIDES = {"su_b", "su_d", "sdl_b", "sdl_d", "sz_b", "sz_d", "sB_b", "sB_g", "sB_n", "sC_b", "sC_g", "sC_n",
               "sy_b", "sy_d", "sdy_b", "sdy_d", "row_len"}
KERNELS = {
    "forward (scan_fwd_parallel_kernel)": (scan_fwd_parallel_kernel, dict(
        STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=True, HAS_CARRY=False, BLOCK_D=32)),
    "backward (scan_bwd_parallel_kernel)": (scan_bwd_parallel_kernel, dict(
        HAS_DFINAL=False, HAS_CARRY=False, LAM_ONLY=False, BLOCK_D=8)),
}
CASES = {"l % 16 == 0": set(),
         "l % 16 != 0, aligned rows (as launched now)": {"l"},
         "l % 16 != 0, rows not aligned": {"l"} | ROW_STRIDES}


def compile_kernel(fn, constants: dict, misaligned: set, arch: int, maxnreg: int | None = None):
    """``fn`` compiled for sm_``arch`` with the benchmark's dtypes; the integer arguments named in
    ``misaligned`` are not declared 16-divisible (all others are, as Triton finds at launch).
    ``maxnreg``: ptxas's register cap (``ScanConfig.par_maxnreg`` / ``bwd_maxnreg``)."""
    constants = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False,
                     RANGED=False, T=4, N_PAD=16, **constants)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + ("bf16" if name in BF16_POINTERS else "i32" if name in INT_POINTERS else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("_l") or name in ("sA_n", "si_n", "sf_n", "sdf_n"):  # tokens / states contiguous
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in misaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})})


def access_counts(fn, constants: dict, misaligned: set, arch: int) -> dict:
    ptx = compile_kernel(fn, constants, misaligned, arch).asm["ptx"]
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
    print(f"triton {triton.__version__}, sm_{args.arch}, PTX global accesses")
    for kernel_label, (fn, constants) in KERNELS.items():
        print(kernel_label)
        for label, misaligned in CASES.items():
            print(f"  {label:45s} {access_counts(fn, constants, misaligned, args.arch)}")

if __name__ == "__main__":
    main()
