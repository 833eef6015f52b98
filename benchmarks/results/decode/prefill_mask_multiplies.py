"""Batch-1 prefill of one unpadded prompt: the prefill program as captured (its Mamba mixers
multiply by the attention mask), its unpadded copy (passes/unpadded.py, what ``Program.run``
picks for an all-ones mask) and the forward program, each timed (median of 5, CUDA events) and
profiled kernel by kernel, on one GPU; then the kernel-time differences.

    PYTHONPATH=$PWD python benchmarks/results/decode/prefill_mask_multiplies.py mamba-2.8b,mamba2-2.7b 16 4096
      (models from decode_gpu.py, layers, prompt length; writes $OUT/prefill_mask_multiplies.json)
"""
import collections, os, statistics, sys, json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench_common
import torch, torch.distributed as dist
import ssmshard
from decode_gpu import GPU_MODELS
from generate_gpu import build_random_model
from ssmshard.program import unpadded_mask_and_positions

bench_common.init_single_process_group(torch.device("cuda"))
dev = torch.device("cuda")
layers, length = int(sys.argv[2]), int(sys.argv[3])
out = {}
for name in sys.argv[1].split(","):
    cfg = GPU_MODELS[name](); cfg.num_hidden_layers = layers
    model = build_random_model(cfg, dev, torch.bfloat16)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False))
    step, _ = dm.generation_programs()
    prog = step  # bound prefill program
    ids = torch.randint(1, cfg.vocab_size, (1, length), device=dev)
    mask, pos = unpadded_mask_and_positions(ids, 0)
    fns = {"forward": lambda: dm(ids),
           "prefill_masked": lambda: prog.executable(*prog.weight_args(), ids, mask, pos),
           "prefill_run": lambda: prog.run([ids, mask, pos])}
    res = {}
    with torch.no_grad():
        for k, fn in fns.items():
            for _ in range(2): fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
                a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                fn(); torch.cuda.synchronize()
            kt = collections.defaultdict(lambda: [0, 0.0])
            for e in p.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    kt[e.name[:90]][0] += 1; kt[e.name[:90]][1] += e.time_range.elapsed_us()
            res[k] = {"ms": statistics.median(ts), "kernels": {n: v for n, v in sorted(kt.items(), key=lambda x: -x[1][1])}}
            print(name, k, "median ms %.3f" % res[k]["ms"], "kernel us %.0f" % sum(v[1] for v in kt.values()), "launches", sum(v[0] for v in kt.values()), flush=True)
    # kernel diff: run vs masked, masked vs forward
    for a, b in (("prefill_masked", "prefill_run"), ("forward", "prefill_run")):
        ka, kb = res[a]["kernels"], res[b]["kernels"]
        diff = sorted(((kb.get(n, [0, 0])[1] - ka.get(n, [0, 0])[1], n, ka.get(n, [0, 0])[0], kb.get(n, [0, 0])[0]) for n in set(ka) | set(kb)), key=lambda x: -abs(x[0]))
        print(f"--- {name}: {b} - {a} (us, calls a, calls b)")
        for d, n, ca, cb in diff[:14]:
            print(f"   {d:9.0f}  {ca:4d} {cb:4d}  {n}")
    out[name] = res
    del dm, model, prog, step; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_mask_multiplies.json"), "w"), indent=1)
