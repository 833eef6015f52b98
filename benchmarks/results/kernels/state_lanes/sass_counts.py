"""SASS instructions per (channel, token, state) in the scan loops: the state-lanes kernels of
this folder and ssmshard's two forward kernels, compiled offline for sm_90 (no GPU needed). Run
it with the GPU image's triton (3.6.0): layouts, and with them the counts, differ between
releases (triton 3.9 puts the parallel kernel's 32 channels on shuffling lanes).

    PYTHONPATH=$PWD python benchmarks/results/kernels/state_lanes/sass_counts.py
    STATE_LANES_KERNEL=<the b521457 kernel file> ... sass_counts.py   # the first layout

(here: triton 3.6.0 installed on its own ahead of the environment's, `PYTHONPATH=<triton 3.6 site-packages>:$PWD`).

Shapes as the probe runs them: bf16 u / delta / z / y, fp32 A / B / C / D / bias, softplus, D
and z on (the segment pass: without output, D or z); unit token strides and 16-divisible
sizes, as Triton specialises them at launch. A loop's count is the instructions between a
backward branch and its target; the longest such loop is the scan's loop over tiles (the
whole tiles' and the last partial tile's loops are the same length to a few instructions).
"""
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# STATE_LANES_KERNEL: another file of the kernels to count (the first layout: git show b521457:<this folder>/state_lanes_kernel.py)
if os.environ.get("STATE_LANES_KERNEL"):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("state_lanes_kernel", os.environ["STATE_LANES_KERNEL"])
    lanes = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(lanes)
else:
    import state_lanes_kernel as lanes  # noqa: E402
from ssmshard.kernels.selective_scan_fwd import scan_fwd_kernel  # noqa: E402
from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel  # noqa: E402

BF16_POINTERS = {"u_ptr", "delta_ptr", "z_ptr", "y_ptr"}
UNIT_STRIDES = {"su_l", "sdl_l", "sz_l", "sy_l", "sA_n"}
DIVISIBLE = {"sB_n", "sC_n", "su_d", "sdl_d", "sz_d", "sy_d", "l", "sB_b", "sB_g", "sC_b", "sC_g", "su_b",
             "sdl_b", "sz_b", "sy_b", "d", "e", "seg_len"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sass(kernel, constants: dict, num_warps: int) -> tuple[str, str]:
    names = kernel.arg_names
    signature, fixed, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constants or name in UNIT_STRIDES:
            signature[name], fixed[(i,)] = "constexpr", constants.get(name, 1)
        elif name.endswith("_ptr"):
            signature[name] = "*bf16" if name in BF16_POINTERS else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    global conversions_in_loops
    conversions_in_loops = _conversions_in_loops(compiled.asm["ttgir"])
    path = "/tmp/state_lanes_probe.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage).group(1)
    return subprocess.run([f"{BIN}/cuobjdump", "-sass", path], capture_output=True, text=True).stdout, regs


def _conversions_in_loops(ttgir: str) -> int:
    """Layout conversions (``ttg.convert_layout``) inside the TTGIR's loops."""
    depth = count = 0
    for line in ttgir.splitlines():
        depth += "scf.for" in line
        count += depth > 0 and "convert_layout" in line
        depth -= depth > 0 and line.strip().startswith("scf.yield")
    return count


conversions_in_loops = 0  # of the last compile_sass


def longest_loop(sass: str) -> list[str]:
    instructions = [(int(m.group(1), 16), m.group(2)) for m in
                    (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            loops.append([t for a, t in instructions if start <= a <= address])
    return max(loops, key=len, default=[])


def report(label, kernel, constants, num_warps, elements_per_thread):
    sass, regs = compile_sass(kernel, constants, num_warps)
    loop = longest_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
    print(f"{label:<44} {regs:>4} regs  {len(loop):>4} instr / {elements_per_thread:>2} elements = "
          f"{len(loop) / elements_per_thread:5.1f}  (SHFL {ops['SHFL']}, MUFU {ops['MUFU']}, BAR {ops['BAR']}; "
          f"layout conversions in loops {conversions_in_loops})")


FLAGS = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, HAS_INIT=False, STORE_FINAL=False)
for label, kernel, lanes_, nj, t, block_d, warps, spread in (
        ("lanes 4, T 4, 8 ch, per lane", lanes.scan_fwd_lanes_kernel, 4, 4, 4, 8, 1, False),
        ("lanes 4, T 4, 8 ch, spread", lanes.scan_fwd_lanes_kernel, 4, 4, 4, 8, 1, True),
        ("lanes 4, T 4, 8 ch, spread, prefetch", lanes.scan_fwd_lanes_pf_kernel, 4, 4, 4, 8, 1, True),
        ("lanes 8, T 8, 4 ch, spread, prefetch", lanes.scan_fwd_lanes_pf_kernel, 8, 2, 8, 4, 1, True)):
    report(label, kernel, dict(FLAGS, BLOCK_D=block_d, LANES=lanes_, NJ=nj, T=t, SPREAD=spread), warps, nj * t)

print("triton", triton.__version__)
for with_output in (False, True):
    flags = dict(HAS_D=with_output, HAS_Z=with_output, HAS_BIAS=True, SOFTPLUS=True, PACKED=False, HAS_INIT=False,
                 STORE_FINAL=False, STORE_CKPT=False, WITH_OUTPUT=with_output, HAS_CARRY=with_output, RANGED=False,
                 N_PAD=16, ckpt_chunk=64)
    what = "main pass" if with_output else "segment pass"
    # 16 channels on one warp (the batch-1 tile): 16 x 4 x 16 elements over 32 lanes
    report(f"parallel, 16 ch, T 4, {what}", scan_fwd_parallel_kernel, dict(flags, BLOCK_D=16, T=4), 1, 32)
    report(f"parallel, 32 ch, T 4, {what}", scan_fwd_parallel_kernel, dict(flags, BLOCK_D=32, T=4), 1, 64)
    report(f"sequential, 32 ch, V 4, {what}", scan_fwd_kernel, dict(flags, BLOCK_D=32, V=4, N_STATIC=16), 1, 64)
