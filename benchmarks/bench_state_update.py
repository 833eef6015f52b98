"""GPU benchmark of the one-token state update (ssmshard.kernels.state_update) against its floor.

For the SSM layers of the Mamba-2.8B (Mamba-1 layout), Mamba2-2.7B and Zamba2-2.7B
configurations at batch 1 to 256: the device time of one call as a decode step sees it (in a
CUDA graph, back to back over as many layers' states as overflow the L2 cache, each state
updated in place), beside the time its bytes take at the copy bandwidth measured in the same
run (the state read and written once, plus x, dt, z, B, C and the output). Arguments are laid
out as Hugging Face's mixers hand them over (Mamba-2: dt, A, D, dt_bias stride-0 expansions of
per-head values). Every variant is checked against a float64 step first.

Variants: ``ssmshard`` (``default_config``), ``peer`` (mamba-ssm's Triton
``selective_state_update``, loaded from its sdist with ``--peer-sdist``; nothing is built or
copied into the repository), and with ``--sweep`` every (channels per program, warps) tiling.

    python benchmarks/bench_state_update.py [--out results.json] [--sweep] [--peer-sdist DIR] [--smoke]

Writes JSON to --out (else $OUT/bench_state_update.json), a plot beside it (.png, with
matplotlib) and prints a table. ``--smoke`` runs tiny shapes on the CPU interpreter (checks the
script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import itertools
import json
import os
import sys
import tarfile
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (first: --smoke selects Triton's CPU interpreter)
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_gemv import L2_OVERFLOW_BYTES, graphed_us  # noqa: E402  (same timing as the GEMV benchmark)
from ssmshard.kernels import state_update as ksu  # noqa: E402
from static_kv_decode_gpu import copy_bandwidth  # noqa: E402

# (model, heads h, channels per head p, states n, groups g, A one value per head)
SHAPES = [("mamba-2.8b", 1, 5120, 16, 1, False), ("mamba2-2.7b", 80, 64, 128, 1, True),
          ("zamba2-2.7b", 80, 64, 64, 1, True)]
BATCHES = (1, 16, 64, 256)
DEVICE = "cuda"
if bench_common.SMOKE:
    SHAPES = [("tiny-mamba", 1, 24, 16, 1, False), ("tiny-mamba2", 4, 8, 32, 2, True)]
    BATCHES, DEVICE = (1, 3), "cpu"


def layer_args(h, p, n, g, per_head, batch, state_dtype, dtype, device):
    """One layer's arguments in the layout of HF's mixers (Mamba-1: h = 1, tensors without the head dim)."""
    mamba1 = not per_head and h == 1
    kw = dict(device=device, dtype=dtype)
    x, z = torch.randn(batch, h, p, **kw), torch.randn(batch, h, p, **kw)
    if per_head:  # Mamba-2: per-head dt, A, D, dt_bias expanded over channels (and states), z unused
        dt = torch.randn(batch, h, 1, **kw).expand(batch, h, p)
        A = -torch.exp(torch.randn(h, 1, 1, device=device)).expand(h, p, n)
        D = torch.randn(h, 1, device=device).expand(h, p)
        dt_bias = torch.randn(h, 1, device=device).expand(h, p)
        z = None
    else:
        dt = torch.randn(batch, h, p, **kw) * 0.5
        A = -torch.exp(torch.randn(h, p, n, device=device) * 0.5)
        D, dt_bias = torch.randn(h, p, device=device), torch.randn(h, p, device=device)
    B, C = torch.randn(batch, g, n, **kw), torch.randn(batch, g, n, **kw)
    state = torch.randn(batch, h, p, n, device=device).to(state_dtype)
    if mamba1:  # (b, d, n) state, (b, d) x/dt/z, (d, n) A, (b, n) B/C, (d,) D/dt_bias
        return dict(state=state[:, 0], x=x[:, 0], dt=dt[:, 0], A=A[0], B=B[:, 0], C=C[:, 0], D=D[0],
                    z=z[:, 0], dt_bias=dt_bias[0])
    return dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


def step_bytes(args) -> int:
    """Bytes one call must move: the state read and written, the per-token vectors read, out written."""
    total = 2 * args["state"].numel() * args["state"].element_size()
    for name in ("x", "z", "B", "C"):
        if args[name] is not None:
            total += args[name].numel() * args[name].element_size()
    dt = args["dt"]
    total += dt.numel() * dt.element_size() if dt.stride(-1) else dt.shape[0] * dt.shape[1] * dt.element_size()
    return total + args["x"].numel() * args["x"].element_size()  # out


def float64_step(args):
    """Reference: one step of the state update in float64 (Mamba-1 and Mamba-2 layouts)."""
    a = {k: (v.double() if v is not None else None) for k, v in args.items()}
    mamba1 = a["state"].dim() == 3
    if mamba1:
        a = {k: (None if v is None else v.unsqueeze(0 if k in ("A", "D", "dt_bias") else 1)) for k, v in a.items()}
    dt = torch.nn.functional.softplus(a["dt"] + a["dt_bias"])
    g = a["B"].shape[1]
    Bh = a["B"].repeat_interleave(a["state"].shape[1] // g, dim=1)
    Ch = a["C"].repeat_interleave(a["state"].shape[1] // g, dim=1)
    new = a["state"] * torch.exp(dt[..., None] * a["A"]) + (dt * a["x"])[..., None] * Bh[:, :, None, :]
    out = (new * Ch[:, :, None, :]).sum(-1) + a["D"] * a["x"]
    if a["z"] is not None:
        out = out * torch.nn.functional.silu(a["z"])
    return (out[:, 0], new[:, 0]) if mamba1 else (out, new)


def load_peer(sdist_dir: str | None):
    """mamba-ssm's Triton ``selective_state_update`` from the sdist in ``sdist_dir`` (or None).

    Only the two pure-Triton files are unpacked into a temporary package (the package's own
    ``__init__`` imports its CUDA extensions, which this kernel does not use)."""
    if not sdist_dir:
        return None
    tarballs = sorted(glob.glob(os.path.join(sdist_dir, "mamba_ssm-*.tar.gz")))
    if not tarballs:
        print(f"no mamba_ssm sdist in {sdist_dir}: no peer rows")
        return None
    root = tempfile.mkdtemp(prefix="peer_")
    wanted = ("mamba_ssm/ops/triton/selective_state_update.py", "mamba_ssm/ops/triton/softplus.py")
    with tarfile.open(tarballs[-1]) as tar:
        for member in tar.getmembers():
            inner = member.name.split("/", 1)[-1]
            if inner in wanted:
                member.name = inner
                tar.extract(member, root)
    for pkg in ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton"):
        open(os.path.join(root, pkg, "__init__.py"), "a").close()
    try:
        import einops  # noqa: F401
    except ImportError:  # used only by the peer's pure-torch reference function, which is not called
        sys.modules["einops"] = types.SimpleNamespace(rearrange=None, repeat=None)
    sys.path.insert(0, root)
    module = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    print(f"peer: {tarballs[-1]}")
    return module.selective_state_update


def sweep_configs():
    return [dict(BLOCK_P=bp, num_warps=w) for bp, w in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8))]


def rel_err(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_state_update.json"))
    parser.add_argument("--sweep", action="store_true", help="also time every tiling")
    parser.add_argument("--peer-sdist", default=None, help="directory holding mamba_ssm-*.tar.gz")
    parser.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the SSM state's dtype (float32: what decode programs hold)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    state_dtype = torch.float32 if bench_common.SMOKE else getattr(torch, args.state_dtype)
    dtype = torch.float32 if bench_common.SMOKE else torch.bfloat16
    peer = load_peer(args.peer_sdist)
    bandwidth = None if bench_common.SMOKE else copy_bandwidth(torch.device(DEVICE))
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "dtype": str(dtype),
              "state_dtype": str(state_dtype), "torch": torch.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    variants = {"ssmshard": lambda a: ksu.selective_state_update(**a, dt_softplus=True, out_state=a["state"])}
    if peer is not None:
        variants["peer"] = lambda a: peer(**a, dt_softplus=True)  # updates the state in place
    for (model, h, p, n, g, per_head), batch in itertools.product(SHAPES, BATCHES):
        probe = layer_args(h, p, n, g, per_head, batch, state_dtype, dtype, DEVICE)
        nbytes = step_bytes(probe)
        state_bytes = probe["state"].numel() * probe["state"].element_size()
        layers = max(2, min(64, L2_OVERFLOW_BYTES // state_bytes)) if DEVICE == "cuda" else 2
        # The layers' states the graph walks (not the probe's, which the checks below start from).
        states = [torch.randn_like(probe["state"], dtype=torch.float32).to(state_dtype) for _ in range(layers)]
        row = {"model": model, "heads": h, "p": p, "n": n, "groups": g, "batch": batch, "bytes": nbytes,
               "floor_us": nbytes / bandwidth * 1e6 if bandwidth else None, "layers_in_graph": layers,
               "default_config": ksu.default_config(p if h > 1 or per_head else p // g, n, batch, state_dtype)}
        ref_out, ref_state = float64_step(probe)
        for name, fn in variants.items():
            trial = {**probe, "state": probe["state"].clone()}
            out = fn(trial)
            out = out[0] if isinstance(out, tuple) else out
            row[f"err_{name}"] = max(rel_err(out, ref_out), rel_err(trial["state"], ref_state))
            # fn(a) with a's state replaced by each layer's: the graph walks all of them.
            row[f"{name}_us"] = graphed_us(lambda x, s, f=fn: f({**x, "state": s}), states, probe)
        if args.sweep:
            sweep = []
            for cfg in sweep_configs():
                fn = lambda x, s, c=cfg: ksu.selective_state_update(  # noqa: E731
                    **{**x, "state": s}, dt_softplus=True, out_state=s, config=c)
                try:
                    sweep.append({**cfg, "us": graphed_us(fn, states, probe)})
                except Exception as e:  # noqa: BLE001 - a tiling the compiler rejects is recorded, not timed
                    sweep.append({**cfg, "error": type(e).__name__})
            timed = [s for s in sweep if "us" in s]
            row["best"] = min(timed, key=lambda s: s["us"]) if timed else None
            row["sweep"] = sweep
        result["rows"].append(row)
        floor = f"{row['floor_us']:8.2f}" if row["floor_us"] else "-"
        times = "  ".join(f"{name} {row[f'{name}_us']:8.2f} (err {row[f'err_{name}']:.1e})" for name in variants)
        best = f"  best {row['best']['us']:8.2f} {row['best']}" if row.get("best") else ""
        print(f"{model:12s} batch {batch:4d}  floor {floor}  {times}{best}", flush=True)
        del states
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    groups = [f"{r['model']} b{r['batch']}" for r in result["rows"]]
    series = {name: [r[f"{name}_us"] for r in result["rows"]] for name in variants}
    series["bytes at copy bandwidth"] = [r["floor_us"] for r in result["rows"]]
    bench_common.bar_chart(os.path.splitext(args.out)[0] + ".png", f"decode state update, {result['device']}",
                           groups, series, "us per call", log=True)


if __name__ == "__main__":
    main()
