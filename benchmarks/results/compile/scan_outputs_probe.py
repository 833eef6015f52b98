"""The Mamba-1 scan kernel alone writing float32 and bf16 y (what the ``scan_outputs`` pass
changes), at the Mamba-2.8B mixer's width (d=5120, N=16); median ms of
``triton.testing.do_bench``. Without arguments: stand-in tensors laid out as in the eager
program, for the default config and two other tiles (the parallel kernel's 8-token tiles, the
sequential kernel), and the count of shared-memory layout conversions (``local_alloc``) in each
compiled kernel's TTGIR. ``--in-program``: the tensors the eager Mamba-2.8B forward hands its
first scan (recorded from the kernel adapter's call), with its values and with each input
replaced by random values in the same layout, without the final state, and under register caps.

    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py                 # scan_outputs_probe.log
    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py --in-program    # scan_outputs_in_program.log
    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py --tiles-in-program   # scan_tiles_in_program.log
    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py --tiles-in-program 1x16384   # one shape
    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py --split-rows   # scan_split_rows.log
    PYTHONPATH=$PWD python benchmarks/results/compile/scan_outputs_probe.py --narrow-tiles   # scan_narrow_tiles.log
"""
import dataclasses
import sys as _sys

import torch
from triton.testing import do_bench

from ssmshard.kernels import selective_scan as scan_module
from ssmshard.kernels.selective_scan import default_config, selective_scan

D, N = 5120, 16


def inputs(b, l):
    dev, bf16 = "cuda", torch.bfloat16
    xz = torch.randn(b, l, 2 * D, device=dev, dtype=bf16).transpose(1, 2)  # in_proj's output
    u = torch.randn(b, l, D, device=dev, dtype=bf16).transpose(1, 2)  # stand-in for the conv's output layout
    z = xz[:, D:]
    bc = torch.randn(b, l, 2 * N, device=dev, dtype=bf16).transpose(1, 2)
    delta = (torch.randn(b, l, D, device=dev, dtype=bf16) * 0.5).transpose(1, 2).contiguous()
    return dict(u=u, delta=delta, A=-torch.rand(D, N, device=dev).exp(), B=bc[:, :N], C=bc[:, N:],
                D=torch.randn(D, device=dev), z=z, delta_bias=torch.randn(D, device=dev) * 0.1)


def shared_memory_conversions():
    """{kernel name: local_alloc count in TTGIR} of every compiled variant so far."""
    counts = {}
    for kernel in (scan_module.scan_fwd_kernel, scan_module.scan_fwd_parallel_kernel):
        for device_cache in kernel.device_caches.values():
            for key, compiled in device_cache[0].items():
                ttgir = compiled.asm.get("ttgir", "")
                counts[f"{kernel.fn.__name__}:{hash(key) % 10000}"] = ttgir.count("local_alloc")
    return counts


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; d={D} n={N}")
    for b, l in ((8, 2048), (1, 16384)):
        a = inputs(b, l)
        base = default_config(b, D, l, a["u"].device)
        configs = {"default": base,
                   "parallel, 8-token tiles": dataclasses.replace(base, par_tokens=8),
                   "sequential": dataclasses.replace(base, fwd_variant="sequential"),
                   "sequential, 4-token steps": dataclasses.replace(base, fwd_variant="sequential", fwd_tokens=4)}
        reference = None
        for name, cfg in configs.items():
            for out_dtype in (torch.float32, torch.bfloat16):
                def run():
                    return selective_scan(**a, delta_softplus=True, out_dtype=out_dtype, config=cfg)
                y = run()
                if reference is None:
                    reference = y.float()
                err = ((y.float() - reference).abs().max() / reference.abs().max()).item()
                ms = do_bench(run, return_mode="median")
                print(f"b={b} l={l} {name:26s} y {str(out_dtype):15s} {ms:7.3f} ms  max rel diff {err:.1e}", flush=True)
    try:
        for kernel, count in shared_memory_conversions().items():
            print(f"{kernel}: local_alloc x{count}")
    except (AttributeError, KeyError, TypeError, IndexError) as error:  # Triton's cache layout differs by release
        print(f"TTGIR not read: {type(error).__name__}: {error}")


def program_scan_calls(shapes, skip_passes):
    """{(b, l): (args, kwargs)} of the first scan call of the eager Mamba-2.8B forward at each shape
    (recorded from the kernel adapter's call), random bf16 weights, the plan's passes but
    ``skip_passes``; the tensors' strides printed."""
    import os
    import sys

    import torch.distributed as dist

    import ssmshard
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
    from decode_gpu import GPU_MODELS
    from generate_gpu import build_random_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29558")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    config = GPU_MODELS["mamba-2.8b"]()
    model = build_random_model(config, "cuda", torch.bfloat16)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False, skip_passes=skip_passes))
    calls = {}
    for b, l in shapes:
        recorded = []

        def recording(*args, **kwargs):
            recorded.append((args, kwargs))
            return selective_scan(*args, **kwargs)

        scan_module.selective_scan = recording
        with torch.no_grad():
            dm(torch.randint(0, config.vocab_size, (b, l), device="cuda"))
        scan_module.selective_scan = selective_scan
        calls[(b, l)] = recorded[0]
        print(f"b={b} l={l}, passes skipped: {skip_passes}")
        for name, value in recorded[0][1].items():
            if isinstance(value, torch.Tensor):
                print(f"  {name}: {tuple(value.shape)} {value.dtype} strides {value.stride()}")
            elif name in ("out_dtype", "return_final_state"):
                print(f"  {name}: {value}")
    return calls


def in_program(b=8, l=2048):
    """The float32 / bf16 comparison on the tensors the eager forward hands its first scan (without
    ``scan_outputs``): with its values, each input replaced by random values in the same layout,
    without the final state, under register caps."""
    args, kwargs = program_scan_calls([(b, l)], ["scan_outputs"])[(b, l)]

    def like(t, scale=1.0):  # random values in t's layout (a storage of t's size, viewed as t is)
        storage = torch.randn(t.untyped_storage().nbytes() // t.element_size(), device=t.device) * scale
        return storage.to(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    swaps = {"the program's values": {},
             "no final state": {"return_final_state": False},
             "u random": {"u": like(kwargs["u"])},
             "delta random (x 0.5)": {"delta": like(kwargs["delta"], 0.5)},
             "z random": {"z": like(kwargs["z"])},
             "B, C random": {"B": like(kwargs["B"]), "C": like(kwargs["C"])}}
    for maxnreg in (64, 80, 96, 128):
        swaps[f"maxnreg {maxnreg}"] = {"config": dataclasses.replace(
            default_config(b, D, l, kwargs["u"].device), par_maxnreg=maxnreg)}
    for what, swapped in swaps.items():
        for out_dtype in (torch.float32, torch.bfloat16):
            options = {**kwargs, **swapped, "out_dtype": out_dtype}
            with torch.no_grad():
                ms = do_bench(lambda: selective_scan(*args, **options), return_mode="median")
            print(f"in the program's layout, b={b} l={l}, {what:22s} y {str(out_dtype):15s}: {ms:.3f} ms", flush=True)
    for name in ("u", "delta", "z"):
        t = kwargs[name].float()
        print(f"  {name}: mean |.| {t.abs().mean().item():.3g}, max |.| {t.abs().max().item():.3g}")


def tiles_in_program():
    """The scan as the forward now calls it (``scan_outputs`` and ``token_major_in_proj``: u, z,
    delta token-contiguous, bf16 y, no final state) under other launch configurations: the
    parallel kernel's 8-token tiles, the sequential kernel (one 16-byte vector of tokens a step,
    and 4 tokens a step whatever y's dtype), and (batch 1) half and twice the default segment
    count; float32 y beside each. "default" is ``default_config``'s pick, "parallel" the parallel
    kernel that was the default before "auto". (``scan_tiles_in_program.log`` predates the rows
    after "sequential".)"""
    shapes = [tuple(map(int, shape.split("x"))) for shape in _sys.argv[_sys.argv.index("--tiles-in-program") + 1:]]
    for (b, l), (args, kwargs) in program_scan_calls(shapes or [(8, 2048), (1, 16384)], []).items():
        base = default_config(b, D, l, kwargs["u"].device)
        configs = {"default": base, "parallel": dataclasses.replace(base, fwd_variant="parallel"),
                   "parallel, 8-token tiles": dataclasses.replace(base, fwd_variant="parallel", par_tokens=8),
                   "sequential": dataclasses.replace(base, fwd_variant="sequential"),
                   "sequential, 4-token steps": dataclasses.replace(base, fwd_variant="sequential", fwd_tokens=4),
                   "sequential, 2-token steps": dataclasses.replace(base, fwd_variant="sequential", fwd_tokens=2),
                   "sequential, 4-token steps, 2 warps": dataclasses.replace(base, fwd_variant="sequential",
                                                                            fwd_tokens=4, fwd_warps=2)}
        if base.segments > 1:
            configs[f"{base.segments // 2} segments"] = dataclasses.replace(base, segments=base.segments // 2)
            configs[f"{base.segments * 2} segments"] = dataclasses.replace(base, segments=base.segments * 2)
        for name, cfg in configs.items():
            for out_dtype in (torch.bfloat16, torch.float32):
                options = {**kwargs, "config": cfg, "out_dtype": out_dtype}
                with torch.no_grad():
                    ms = do_bench(lambda: selective_scan(*args, **options), return_mode="median")
                print(f"b={b} l={l} {name:26s} (segments {cfg.segments}) y {str(out_dtype):15s}: {ms:.3f} ms",
                      flush=True)


def split_rows():
    """Batch-1 rows, split into segments: the parallel kernel (the default) against the sequential
    kernel at 4-token steps with the default and twice the segment count, and with 16-channel
    programs (half of each warp's lanes repeat the other half's channels: twice the warps), on
    the forward's inputs (token-contiguous, bf16 y, no final state) at 2048, 4096 and 16384 tokens."""
    for (b, l), (args, kwargs) in program_scan_calls([(1, 2048), (1, 4096), (1, 16384)], []).items():
        base = default_config(b, D, l, kwargs["u"].device)
        sequential = dataclasses.replace(base, fwd_variant="sequential", fwd_tokens=4)
        configs = {"parallel (default)": dataclasses.replace(base, fwd_variant="parallel"),
                   "sequential, 4-token steps": sequential,
                   "sequential, 4-token steps, 2x segments": dataclasses.replace(sequential, segments=2 * base.segments),
                   "sequential, 4-token steps, 16 channels": dataclasses.replace(sequential, fwd_block_d=16),
                   "sequential, 4-token steps, 16 channels, 2x segments": dataclasses.replace(
                       sequential, fwd_block_d=16, segments=2 * base.segments)}
        for name, cfg in configs.items():
            options = {**kwargs, "config": cfg, "out_dtype": torch.bfloat16}
            with torch.no_grad():
                ms = do_bench(lambda: selective_scan(*args, **options), return_mode="median")
            print(f"b={b} l={l} {name:52s} (segments {_segments_of(l, cfg)}) y bf16: {ms:.3f} ms", flush=True)


def narrow_tiles():
    """Batch 1 at 16384 tokens: the parallel kernel with narrower channel tiles (2 to 16 channels on
    one warp: the other lanes take state indices, so more programs fill the GPU) and fewer
    segments, down to one (no segment pass), on the forward's inputs; y compared with the
    default's (bf16, relative)."""
    for (b, l), (args, kwargs) in program_scan_calls([(1, 16384)], []).items():
        base = default_config(b, D, l, kwargs["u"].device)
        with torch.no_grad():
            want = selective_scan(*args, **{**kwargs, "config": base, "out_dtype": torch.float32})
        for block_d in (16, 8, 4, 2):
            for segments in sorted({1, 2, 4, 8, base.segments}):
                cfg = dataclasses.replace(base, fwd_variant="parallel", par_block_d=block_d, segments=segments)
                options = {**kwargs, "config": cfg, "out_dtype": torch.bfloat16}
                with torch.no_grad():
                    got = selective_scan(*args, **{**options, "out_dtype": torch.float32})
                    ms = do_bench(lambda: selective_scan(*args, **options), return_mode="median")
                diff = ((got - want).abs().max() / want.abs().max()).item()
                print(f"b={b} l={l} parallel, {block_d:2d} channels, segments {_segments_of(l, cfg):2d}: {ms:.3f} ms"
                      f" (y against the default's: {diff:.2e})", flush=True)


def _segments_of(l, cfg):
    return scan_module._segments(l, cfg)[0]


if __name__ == "__main__":
    if "--in-program" in _sys.argv:
        in_program()
    elif "--tiles-in-program" in _sys.argv:
        tiles_in_program()
    elif "--split-rows" in _sys.argv:
        split_rows()
    elif "--narrow-tiles" in _sys.argv:
        narrow_tiles()
    else:
        main()
