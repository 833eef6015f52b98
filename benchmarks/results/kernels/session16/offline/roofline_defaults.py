"""Roofline of the Mamba-1 scan as ``default_config`` launches it today (sixteenth session):
every launch of one forward+backward, its issue floor from the sm_90 SASS of its hot loops,
against its measured device time; and what the 1.25x forward+backward target would ask.

    PYTHONPATH=<triton 3.6.0>:. python benchmarks/results/kernels/session16/offline/roofline_defaults.py \\
        benchmarks/results/kernels/session16/<call>/prof.jsonl benchmarks/results/kernels/session16/<call>/host_overhead.jsonl

No GPU: the kernels are compiled offline with the H200 image's triton (3.6.0) for sm_90 with the
constants and register caps the default config launches them with (B=1 d=5120: 16-channel
forward tiles, split rows, backward capped at 168 registers; B=8: 32-channel forward tiles,
one segment, backward uncapped with its loads a tile ahead). Issue floor = warp instructions
of the hot loops x the tiles the launch walks / (132 SMs x 1.98 GHz x 4 per clock): published
H200 figures, not measured. ``prof.jsonl``: per-launch device times (torch.profiler, medians,
``session14/prof.py``); ``host_overhead.jsonl``: the peer's forward+backward (CUDA-graph
median, ``session16/host_overhead.py``) in the same call.
Dimension letters: b batch, d channels, l tokens, n state size (16), T tokens per tile (4).
"""
import json
import os
import sys
import warnings

os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = [".", "benchmarks", "benchmarks/results/kernels/session12/offline"]
warnings.filterwarnings("ignore")

from triton.tools.disasm import get_sass  # noqa: E402

from roofline_scan import loops, mix, registers  # noqa: E402
import ssmshard.kernels.selective_scan as scan  # noqa: E402
from ssmshard.kernels.selective_scan_bwd_parallel import scan_bwd_parallel_kernel  # noqa: E402
from ssmshard.kernels.selective_scan_fwd_parallel import scan_fwd_parallel_kernel  # noqa: E402
from tile_variants import FLAGS, compile_tile  # noqa: E402

import torch  # noqa: E402

D, N, T, CHUNK = 5120, 16, 4, 64
ISSUE_PER_MS = 132 * 1.98e9 * 4 / 1e3  # warp instructions per ms, whole GPU
PASS_A_SHARE = (CHUNK / T - 1) / (CHUNK / T)  # pass A stores the state entering all but a chunk's first tile


_compiled = {}


def hot_loops(fn, constants, maxnreg):
    key = (fn.__name__, tuple(sorted(constants.items())), maxnreg)
    if key not in _compiled:
        _compiled[key] = _compile(fn, constants, maxnreg)
    return _compiled[key]


def _compile(fn, constants, maxnreg):
    constants = {k: v for k, v in {**FLAGS, **constants}.items() if k in fn.arg_names}
    kernel = compile_tile(fn, constants, 1, maxnreg=maxnreg)
    body = loops(get_sass(kernel.asm["cubin"]))
    return [sum(mix(b).values()) for b in body], registers(kernel.asm["cubin"])


def per_element(instructions, block_d):
    return instructions / (block_d * T * N / 32)  # per (channel, token, state) per lane


def launches(b, l):
    """(name, warp instructions issued by its hot loops, registers) of each launch, in order."""
    scan.sm_count = lambda device: 132  # the H200's SMs: the config default_config picks there
    cfg = scan._pick_config(b, D, l, torch.device("cuda"), False)
    G = scan._segments(l, cfg)[0]
    lanes = b * D * l * N / 32  # (channel, token, state) elements per lane
    fwd = dict(STORE_FINAL=False, T=T, BLOCK_D=cfg.par_block_d, ckpt_chunk=CHUNK)
    bwd = dict(HAS_DFINAL=False, T=T, BLOCK_D=cfg.bwd_block_d, PREFETCH=cfg.bwd_maxnreg is None)
    out = []
    if G > 1:  # zero-state segment pass: all segments but the last
        sizes, regs = hot_loops(scan_fwd_parallel_kernel, dict(fwd, STORE_CKPT=False, WITH_OUTPUT=False,
                                                               HAS_CARRY=False), cfg.par_maxnreg)
        out.append(("fwd segment pass", lanes * (G - 1) / G * per_element(max(sizes), cfg.par_block_d), regs))
    sizes, regs = hot_loops(scan_fwd_parallel_kernel, dict(fwd, STORE_CKPT=True, WITH_OUTPUT=True,
                                                           HAS_CARRY=G > 1), cfg.par_maxnreg)
    out.append(("fwd main pass (checkpoints)", lanes * per_element(max(sizes), cfg.par_block_d), regs))
    if G > 1:  # adjoint-only pass: all segments but the first
        sizes, regs = hot_loops(scan_bwd_parallel_kernel, dict(bwd, HAS_CARRY=False, LAM_ONLY=True), cfg.bwd_maxnreg)
        out.append(("bwd adjoint-only pass", lanes * (G - 1) / G * per_element(max(sizes), cfg.bwd_block_d), regs))
    sizes, regs = hot_loops(scan_bwd_parallel_kernel, dict(bwd, HAS_CARRY=G > 1, LAM_ONLY=False), cfg.bwd_maxnreg)
    pass_a, pass_b = per_element(sizes[0], cfg.bwd_block_d), per_element(sizes[-1], cfg.bwd_block_d)
    out.append(("bwd main pass (A + B)", lanes * (PASS_A_SHARE * pass_a + pass_b), regs))
    return cfg, G, out


def main():
    prof = [json.loads(x) for x in open(sys.argv[1])]
    peer = {}
    for r in map(json.loads, open(sys.argv[2]) if len(sys.argv) > 2 else []):
        if r.get("d") == D and r.get("peer_fwd_bwd_graph_ms"):
            peer[(r["b"], r["l"])] = r["peer_fwd_bwd_graph_ms"] * 1e3
    print("triton sm_90 SASS (offline); issue rate 132 SMs x 1.98 GHz x 4 warp instr/clock (published)")
    report = []
    for row in (r for r in prof if r["what"] == "fwd_bwd"):
        b, l = row["b"], row["l"]
        cfg, G, planned = launches(b, l)
        measured = [us for _, us in row["launches"]]
        assert len(measured) == len(planned), (b, l, row["launches"], [p[0] for p in planned])
        print(f"\nB={b} d={D} L={l}: {G} segment(s), forward tile {cfg.par_block_d} ch, backward cap {cfg.bwd_maxnreg}")
        floor_sum = 0.0
        for (name, instr, regs), us in zip(planned, measured):
            floor_us = instr / ISSUE_PER_MS * 1e3
            floor_sum += floor_us
            print(f"  {name:28s} {regs:3d} regs  measured {us:8.1f} us  issue floor {floor_us:7.1f} us  "
                  f"({floor_us / us:4.0%} of the issue rate)")
        scan_us, total_us = sum(measured), row["total_us"]
        line = dict(b=b, l=l, segments=G, scan_kernels_us=round(scan_us, 1), all_kernels_us=total_us,
                    issue_floor_us=round(floor_sum, 1), issue_share=round(floor_sum / scan_us, 3))
        print(f"  scan kernels {scan_us:.1f} us (all kernels {total_us:.1f} us: the rest is B/C copies, "
              f"the carry and the dB/dC/dA sums); issue floor {floor_sum:.1f} us = {floor_sum / scan_us:.0%}")
        if (b, l) in peer:
            target_us = peer[(b, l)] / 1.25
            others = total_us - scan_us
            need = floor_sum / (target_us - others) if target_us > others else float("inf")
            line.update(peer_fwd_bwd_us=round(peer[(b, l)], 1), target_us=round(target_us, 1),
                        issue_share_needed=round(need, 3))
            print(f"  peer {peer[(b, l)]:.1f} us -> 1.25x target {target_us:.1f} us: with the "
                  f"other kernels as they are, the scan kernels would have to issue at {need:.0%} of the peak rate")
        report.append(line)
    print("\n" + json.dumps(report))


if __name__ == "__main__":
    main()
