"""Small-message all-reduce latency: NCCL against torch symmetric memory's peer-memory kernels.

    python benchmarks/allreduce_gpu.py --tp 2 --out DIR            # one GPU per rank, NCCL
    python benchmarks/allreduce_gpu.py --smoke --out DIR           # CPU, gloo: checks the script

Per message size (bf16), microseconds per all-reduce, median over --repeats timings of a CUDA
graph that replays --per-graph all-reduces back to back (what decode does: one graph per step):
``nccl_eager`` (no graph), ``nccl_graph``, ``one_shot_graph`` (the kernel behind
``Plan(allreduce='symm_mem')``, ``comm/symmetric.py``) and ``two_shot_graph``
(``symm_mem.two_shot_all_reduce_``, in place on the peer buffer). Each path's result is checked
against NCCL's on integer-valued operands (exact in any summation order) before it is timed.
NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). Writes ``allreduce_tp<N>.json``
and ``allreduce_tp<N>.png``. ``--smoke`` times gloo's eager all-reduce only; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_common  # noqa: E402  (before torch: --smoke sets the Triton interpreter)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ssmshard  # noqa: E402

SIZES = [2048, 4096, 8192, 16384, 65536, 262144, 1048576]  # bytes (bf16: half as many values)


def _graph_us(fn, per_graph: int, repeats: int) -> float:
    """Microseconds per call of ``fn`` replayed ``per_graph`` times inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return statistics.median(times)


def _eager_us(fn, per_graph: int, repeats: int, cuda: bool) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(per_graph):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / per_graph)
    return statistics.median(times)


def measure(rank, world, args, out_dir):
    cuda = not args.smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    rows = []
    if cuda:
        from torch.distributed import _symmetric_memory as symm_mem

        torch.cuda.set_device(device)
        name = group.group_name
        peer = symm_mem.empty(max(args.sizes), dtype=torch.uint8, device=device)
        symm_mem.rendezvous(peer, name)
    for size in args.sizes:
        numel = size // 2
        gen = torch.Generator(device=device).manual_seed(rank)
        x = torch.randint(-8, 8, (numel,), generator=gen, device=device).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group)
        row = {"bytes": size, "nccl_eager": _eager_us(lambda: dist.all_reduce(x.clone(), group=group),
                                                      args.per_graph, args.repeats, cuda)}
        if cuda:
            staging = peer[:size].view(torch.bfloat16)
            one_shot = lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", name)  # noqa: E731

            def two_shot():
                staging.copy_(x)
                return torch.ops.symm_mem.two_shot_all_reduce_(staging, "sum", name)

            checks = {"one_shot": torch.equal(one_shot(), want), "two_shot": torch.equal(two_shot().clone(), want)}
            buf = x.clone()
            row.update({
                "nccl_graph": _graph_us(lambda: dist.all_reduce(buf, group=group), args.per_graph, args.repeats),
                "one_shot_graph": _graph_us(one_shot, args.per_graph, args.repeats),
                "two_shot_graph": _graph_us(two_shot, args.per_graph, args.repeats),
                "equal_to_nccl": checks})
        # Algorithm bandwidth of NCCL in the graph (bytes of the message per second): where large
        # messages (prefill's) stand against the link.
        row["nccl_graph_gb_s"] = size / row["nccl_graph"] / 1e3 if cuda else None
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        report = {"tp": world, "dtype": "bfloat16", "per_graph": args.per_graph, "repeats": args.repeats,
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu (smoke: gloo)",
                  "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                  "unit": "microseconds per all-reduce (median)", "rows": rows}
        path = os.path.join(out_dir, f"{args.name or f'allreduce_tp{world}'}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        keys = [k for k in ("nccl_eager", "nccl_graph", "one_shot_graph", "two_shot_graph") if k in rows[0]]
        bench_common.bar_chart(os.path.join(out_dir, f"{args.name or f'allreduce_tp{world}'}.png"),
                               f"bf16 all-reduce, tp={world}, {report['device']}",
                               [f"{r['bytes'] / 1024:g} KiB" for r in rows],
                               {k: [r[k] for r in rows] for k in keys}, "µs per all-reduce (median)", log=True)
        print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--per-graph", type=int, default=64, help="all-reduces per timed graph replay")
    parser.add_argument("--repeats", type=int, default=50, help="timed replays (the median is reported)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 sizes: checks the script")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message bytes (even)")
    parser.add_argument("--name", help="output file stem (default allreduce_tp<N>)")
    parser.add_argument("--out", default=".", help="output folder")
    args = parser.parse_args(argv)
    if any(size % 2 for size in args.sizes):
        parser.error("--sizes: bf16 messages take an even number of bytes")
    if args.smoke:
        args.tp, args.per_graph, args.repeats, args.sizes = 2, 2, 2, args.sizes[:2]
    elif torch.cuda.device_count() < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ssmshard.launch(measure, args.tp, args, os.path.abspath(args.out), backend="gloo" if args.smoke else "nccl")


if __name__ == "__main__":
    main()
