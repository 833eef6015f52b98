"""Variants of the SSD backward's suffix sum da (ssd_dt_grads_kernel), patched in by name."""
import inspect, os, textwrap
import triton, triton.language as tl
import ssmshard.kernels.ssd_scan_bwd as bwd
from ssmshard.kernels.ssd_triton_common import load_chunk_dt

SRC = inspect.getsource(bwd.ssd_dt_grads_kernel.fn)
OLD = "    da = tl.sum(dcs, 0) - tl.cumsum(dcs, 0) + dcs  # sum over positions >= t\n"
assert OLD in SRC
VARIANTS = {
    "total_minus_prefix": SRC,
    "reverse_cumsum": SRC.replace(OLD, "    da = tl.cumsum(dcs, 0, reverse=True)\n"),
    "flipped_cumsum": SRC.replace(OLD, "    da = tl.flip(tl.cumsum(tl.flip(dcs, 0), 0), 0)\n"),
    "fp64_prefix": SRC.replace(OLD, "    dcs64 = dcs.to(tl.float64)\n    da = (tl.sum(dcs64, 0) - tl.cumsum(dcs64, 0) + dcs64).to(tl.float32)\n"),
}

def use(name):
    path = f"/tmp/ssd_dt_variant_{name}.py"
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\nfrom ssmshard.kernels.ssd_triton_common import load_chunk_dt\n\n" + VARIANTS[name])
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"ssd_dt_variant_{name}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    bwd.ssd_dt_grads_kernel = mod.ssd_dt_grads_kernel
