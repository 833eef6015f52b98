"""Compile our chunk-output kernel (and, with `peer`, mamba_ssm's _chunk_scan_fwd_kernel, cut
from its installed source) for sm_90 with Triton 3.6 on a CPU machine, write the SASS, count
opcodes. Session 10's loop counts came from this and sass_loops.py:

    PYTHONPATH=/tmp/triton36 python sass_compile_output.py both|ours|peer M K WARPS STAGES
    python sass_loops.py ours_M_K_WARPS_STAGES.sass

OURS_MODULE=path/to/ssd_scan_fwd.py compiles another version of our module (one whose output
kernel takes the same arguments); PEER_SCAN=path to a file holding the peer kernel
(peer_scan.py, cut from mamba_ssm/ops/triton/ssd_chunk_scan.py: its _chunk_scan_fwd_kernel
under @triton.jit).
"""
import os, re, subprocess, sys, tempfile, collections
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.environ.get("PEER_SCAN", "/tmp/sass/peer_scan.py"))); sys.path.insert(0, ROOT)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib.util
cuobj = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def build(fn, ints, ptr_types, constexprs, warps, stages):
    sig, attrs, cx = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in cx: sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptr_types.get(name, "bf16"); attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("dt_min", "dt_max"): sig[name] = "fp32"
        else:
            v = ints[name]
            if v == 1: sig[name] = "constexpr"; cx[name] = 1
            else:
                sig[name] = "i32"
                if v % 16 == 0: attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"]); name = f.name
    sass = subprocess.run([cuobj, "-sass", name], capture_output=True, text=True).stdout
    return k, sass

def stats(label, sass):
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    c = collections.Counter(o.split(".")[0] for o in ops)
    print(label, "static instrs", len(ops), dict(c.most_common(25)))

which = sys.argv[1] if len(sys.argv) > 1 else "both"
M, K, W, S = [int(v) for v in (sys.argv[2:6] if len(sys.argv) > 5 else (32, 32, 2, 5))]
if which in ("peer", "both"):
    import peer_scan
    fn = peer_scan._chunk_scan_fwd_kernel
    ints = dict(chunk_size=256, hdim=64, dstate=128, batch=8, seqlen=2048, nheads_ngroups_ratio=80,
        stride_cb_batch=8*65536, stride_cb_chunk=65536, stride_cb_head=65536, stride_cb_csize_m=256, stride_cb_csize_k=1,
        stride_x_batch=2048*5120, stride_x_seqlen=5120, stride_x_head=64, stride_x_hdim=1,
        stride_z_batch=0, stride_z_seqlen=0, stride_z_head=0, stride_z_hdim=0,
        stride_out_batch=2048*5120, stride_out_seqlen=5120, stride_out_head=64, stride_out_hdim=1,
        stride_dt_batch=80*2048, stride_dt_chunk=256, stride_dt_head=2048, stride_dt_csize=1,
        stride_dA_cs_batch=80*2048, stride_dA_cs_chunk=256, stride_dA_cs_head=2048, stride_dA_cs_csize=1,
        stride_seq_idx_batch=0, stride_seq_idx_seqlen=0,
        stride_C_batch=262144, stride_C_seqlen=128, stride_C_head=128, stride_C_dstate=1,
        stride_states_batch=8*80*8192, stride_states_chunk=80*8192, stride_states_head=8192, stride_states_hdim=128, stride_states_dstate=1,
        stride_D_head=1)
    ptrs = {"cb_ptr": "fp32", "dt_ptr": "fp32", "dA_cumsum_ptr": "fp32", "seq_idx_ptr": "i32", "D_ptr": "fp32"}
    cx = dict(IS_CAUSAL=True, HAS_D=True, D_HAS_HDIM=False, HAS_Z=False, HAS_SEQ_IDX=False, BLOCK_SIZE_M=M,
              BLOCK_SIZE_N=64, BLOCK_SIZE_K=K, BLOCK_SIZE_DSTATE=128, IS_TRITON_22=True)
    k, sass = build(fn, ints, ptrs, cx, W, S)
    open(f"peer_{M}_{K}_{W}_{S}.sass", "w").write(sass); stats("peer", sass)
    print("peer regs/smem", k.metadata.shared)
if which in ("ours", "both"):
    import importlib
    modname = os.environ.get("OURS_MODULE", "ssmshard.kernels.ssd_scan_fwd")
    if modname.endswith(".py"):
        spec = importlib.util.spec_from_file_location("ours_mod", modname); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(modname)
    fn = mod.ssd_chunk_output_kernel
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import compile_ssd_scan as C
    ptrs = {n: "fp32" for n in C.FP32_BUFFERS} | {n: "i32" for n in C.INT32_BUFFERS}
    cx = dict(HAS_D=True, D_PER_P=False, HAS_Z=False, STORE_YPRE=False, CB_STORED=True, DOT_PRECISION="tf32",
              UPCAST=False, BLOCK_P=64, BLOCK_N=128, BLOCK_M=M, BLOCK_K=K)
    ints = dict(C.INT_ARGS); ints["n_slots"] = 64
    k, sass = build(fn, ints, ptrs, cx, W, S)
    open(f"ours_{M}_{K}_{W}_{S}.sass", "w").write(sass); stats("ours", sass)
    print("ours regs/smem", k.metadata.shared)
