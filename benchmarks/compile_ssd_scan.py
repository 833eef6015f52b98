"""Compile every Triton SSD scan kernel config for a GPU target, on a machine without a GPU.

Catches what the CPU interpreter cannot: code the Triton compiler rejects (loop-carried
type changes, dot shapes), shared memory beyond the device, and register spills. Each
kernel is compiled the way a launch specialises it (integer arguments equal to 1 become
constants; pointers and multiples of 16 are marked 16-divisible), for Mamba2-2.7B sizes
with contiguous inputs; cuobjdump then reports registers and stack (spill) bytes.

    python benchmarks/compile_ssd_scan.py [--dtype bf16|fp16|fp32] [--arch 90] [--first-only]

Needs Triton's NVIDIA backend (shipped in the Linux wheel); exits non-zero if any config
fails to compile or needs more shared memory than --max-shared-kib.

Dimension letters: h heads, p head dim, n state size, g groups, T chunk size.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings

os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreter stand-ins
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ssmshard.kernels import ssd_scan_bwd, ssd_scan_fwd, ssd_triton_common  # noqa: E402

HEADS, HEADDIM, DSTATE, CHUNK, GROUPS, TOKENS = 80, 64, 128, 256, 1, 16384

# Integer arguments at B=8 x L=2048 (contiguous inputs); used only for specialisation.
INT_ARGS = dict(
    n_tokens=TOKENS, n_slots=TOKENS // CHUNK, decay_stride=CHUNK, n_seqs=8, heads_per_group=HEADS // GROUPS, headdim=HEADDIM,
    dstate=DSTATE, chunk_size=CHUNK, cb_row=CHUNK, stride_cb_k=GROUPS * CHUNK * CHUNK, stride_cb_g=CHUNK * CHUNK,
    tune_bucket=13, n_heads=HEADS, heads_per_split=20, ds_slots=DSTATE // 16,
    stride_dt_t=HEADS, stride_dt_h=1,
    **{f"stride_{t}_t": HEADS * HEADDIM for t in ("x", "z", "out", "dout", "dy")},
    **{f"stride_{t}_h": HEADDIM for t in ("x", "z", "out", "dout", "dy")},
    **{f"stride_{t}_p": 1 for t in ("x", "z", "out", "dout", "dy")},
    **{f"stride_{t}_t": GROUPS * DSTATE for t in ("B", "C")},
    **{f"stride_{t}_g": DSTATE for t in ("B", "C")},
    **{f"stride_{t}_n": 1 for t in ("B", "C")},
)
FP32_BUFFERS = {"dtd_ptr", "cs_ptr", "final_ptr", "init_ptr", "A_ptr", "D_ptr", "dt_bias_ptr", "ddt_direct_ptr",
                "dB_part_ptr", "dC_part_ptr", "dcs_row_ptr", "ds_part_ptr", "dD_part_ptr", "dinit_ptr",
                "dfinal_ptr", "ds_ptr", "dA_part_ptr", "dbias_part_ptr", "cb_ptr"}
INT32_BUFFERS = {"chunk_start_ptr", "chunk_len_ptr", "seq_first_chunk_ptr", "cu_seqlens_ptr"}
# Every optional input present: the largest variant of each kernel.
FLAGS = {
    "ssd_chunk_states_kernel": {"HAS_INIT": True},
    "ssd_chunk_output_kernel": {"HAS_D": True, "D_PER_P": False, "HAS_Z": True, "STORE_YPRE": True},
    "ssd_state_grads_kernel": {"HAS_Z": True, "HAS_D": True, "HAS_INIT": True, "HAS_DFINAL": True},
    "ssd_dx_dB_kernel": {"HAS_D": True, "D_PER_P": False},
    "ssd_dC_kernel": {},
}
# Kernels compiled once per variant: the output kernel with C.B^T stored once per group, and
# multiplied per head.
VARIANTS = {"ssd_chunk_output_kernel": ({"CB_STORED": True}, {"CB_STORED": False})}


def signature(fn, constexprs, dtype):
    """(signature, constexprs, attrs) as a launch with INT_ARGS would specialise them."""
    sig, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ("fp32" if name in FP32_BUFFERS else "i32" if name in INT32_BUFFERS else dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("dt_min", "dt_max"):
            sig[name] = "fp32"
        elif INT_ARGS[name] == 1:
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if INT_ARGS[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def compile_config(fn, constexprs, num_warps, num_stages, args):
    sig, constexprs, attrs = signature(fn, constexprs, args.dtype)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", args.arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return kernel.metadata.shared, regs and int(regs.group(1)), stack and int(stack.group(1))


def kernel_configs(first_only):
    """(name, jit function, constexprs, num_warps, num_stages) for every config to compile."""
    chunk = {"CHUNK_PAD": CHUNK}
    dt_flags = {"HAS_BIAS": True, "SOFTPLUS": True}
    yield "chunk_table", ssd_triton_common.chunk_table_kernel, {"BLOCK_K": 128, "BLOCK_S": 64}, 4, 2
    yield "dt_cumsum", ssd_scan_fwd.ssd_dt_cumsum_kernel, {**dt_flags, **chunk, "BLOCK_H": ssd_scan_fwd._DT_BLOCK_H}, 4, 2
    yield "dt_grads", ssd_scan_bwd.ssd_dt_grads_kernel, {**dt_flags, **chunk}, 4, 2
    blocks = {"BLOCK_P": triton.next_power_of_2(HEADDIM), "BLOCK_N": triton.next_power_of_2(DSTATE)}
    yield ("chunk_cb", ssd_scan_fwd.ssd_chunk_cb_kernel,
           {"BLOCK_M": ssd_scan_fwd._CB_BLOCK, "BLOCK_N": blocks["BLOCK_N"]}, 4, 2)
    for tunable in (ssd_scan_fwd.chunk_states, ssd_scan_fwd.chunk_output, ssd_scan_bwd.state_grads,
                    ssd_scan_bwd.dx_dB, ssd_scan_bwd.dC):
        fn = tunable.fn
        configs = tunable._prune(tunable.configs, {}, headdim=HEADDIM, dstate=DSTATE, chunk_size=CHUNK,
                                 heads_per_group=HEADS // GROUPS)
        for config in configs[:1] if first_only else configs:
            fixed = {k: v for k, v in blocks.items() if k in fn.arg_names and k not in config.kwargs}
            for variant in VARIANTS.get(fn.__name__, ({},)):
                yield (f"{fn.__name__} {config.kwargs} {variant or ''}", fn,
                       {**FLAGS[fn.__name__], **fixed, **config.kwargs, **variant}, config.num_warps, config.num_stages)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--first-only", action="store_true", help="only each kernel's first (default) config")
    parser.add_argument("--max-shared-kib", type=int, default=227, help="shared memory per block (H100/H200: 227)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    modes = {"DOT_PRECISION": "ieee" if args.dtype == "fp32" else "tf32", "UPCAST": False}
    failures = 0
    print(f"{'kernel / config':<72}{'warps':>6}{'stages':>7}{'smem KiB':>9}{'regs':>6}{'stack B':>8}")
    for name, fn, constexprs, warps, stages in kernel_configs(args.first_only):
        needs_modes = {k: v for k, v in modes.items() if k in fn.arg_names}
        try:
            shared, regs, stack = compile_config(fn, {**constexprs, **needs_modes}, warps, stages, args)
        except Exception as exc:  # report every failing config, not just the first
            failures += 1
            print(f"{name:<72}{warps:>6}{stages:>7}  FAILED: {type(exc).__name__}: {str(exc)[-400:]}")
            continue
        too_big = shared > args.max_shared_kib * 1024
        failures += too_big
        print(f"{name:<72}{warps:>6}{stages:>7}{shared / 1024:>9.1f}{regs:>6}{stack:>8}"
              + ("  shared memory too large" if too_big else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
