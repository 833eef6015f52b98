"""Per-parameter gradient errors of the packed and unpacked Mamba-2 programs (GPU kernels and CPU
reference ops, fp32) against the unpacked reference program in float64, at given seeds."""
import copy, random, sys, os
sys.path.insert(0, "tests")
import torch
import ssmshard
from ssmshard.packing import pack
from ssmshard.passes import run_pipeline
from ssmshard.testing import rel_err
import test_packing as tp
sys.path.insert(0, "scratch"); import prec_patch  # noqa
if os.environ.get("VARIANT"):
    sys.path.insert(0, "scratch"); import dt_variants; dt_variants.use(os.environ["VARIANT"])

family = os.environ.get("FAMILY", "mamba2")
dev = "cuda" if torch.cuda.is_available() else "cpu"

def grads(program, batch_or_rows, weights):
    w = tp._with_fresh_leaves(program)
    out = program(batch_or_rows)
    (out * weights).sum().backward()
    params = [k for k, s in program.param_specs.items() if s.kind == "parameter"]
    return {k: w[k].grad.detach().double().cpu() for k in params}

for seed in map(int, sys.argv[1:]):
    base = tp.packing_model(family)
    chunk = getattr(base.config, "chunk_size", 16)
    lengths = tp.random_lengths(random.Random(seed), chunk)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, base.config.vocab_size, (n,), generator=gen) for n in lengths]
    batch = pack(seqs)
    lw = torch.randn(1, batch.input_ids.shape[1], base.config.vocab_size, generator=gen)
    longest = max(lengths)
    rows = torch.randint(0, base.config.vocab_size, (len(lengths), longest), generator=gen)
    rw = torch.zeros(len(lengths), longest, base.config.vocab_size)
    for s, (ids, w) in enumerate(zip(seqs, batch.unpack(lw))):
        rows[s, :len(ids)] = ids
        rw[s, :len(ids)] = w[0]
    results = {}
    m64 = copy.deepcopy(base).double()
    results["truth f64 unpacked cpu-ref"] = grads(ssmshard.capture(m64), rows, rw.double())
    results["f64 packed cpu-ref"] = grads(ssmshard.capture(m64, packed=True), batch, lw.double())
    results["fp32 unpacked cpu-ref"] = grads(ssmshard.capture(base), rows, rw)
    results["fp32 packed cpu-ref"] = grads(ssmshard.capture(base, packed=True), batch, lw)
    if dev == "cuda":
        mg = copy.deepcopy(base).cuda()
        swap = [("swap_kernels", {"kernels": "triton"})]
        bg = pack([s.cuda() for s in seqs])
        for rep in range(2):
            results[f"fp32 unpacked gpu-kernels #{rep}"] = grads(run_pipeline(ssmshard.capture(mg), swap), rows.cuda(), rw.cuda())
            results[f"fp32 packed gpu-kernels #{rep}"] = grads(run_pipeline(ssmshard.capture(mg, packed=True), swap), bg, lw.cuda())
    truth = results.pop("truth f64 unpacked cpu-ref")
    params = list(truth)
    print(f"seed {seed} lengths {lengths}")
    for name, g in results.items():
        per = {k: rel_err(g[k], truth[k]) for k in params}
        worst = sorted(per, key=per.get, reverse=True)[:3]
        vec = rel_err(torch.cat([g[k].flatten() for k in params]), torch.cat([truth[k].flatten() for k in params]))
        print(f"  {name:32s} vector {vec:.2e}; worst " + ", ".join(f"{k.split('.')[-2] + '.' + k.split('.')[-1] if '.' in k else k} {per[k]:.2e}" for k in worst))
    for a, b in (("fp32 packed gpu-kernels #0", "fp32 unpacked gpu-kernels #0"), ("fp32 packed gpu-kernels #0", "fp32 packed gpu-kernels #1"),
                 ("fp32 unpacked gpu-kernels #0", "fp32 unpacked gpu-kernels #1"), ("fp32 packed cpu-ref", "fp32 unpacked cpu-ref")):
        if a in results and b in results:
            per = {k: rel_err(results[a][k], results[b][k]) for k in params}
            w = max(per, key=per.get)
            print(f"  {a} vs {b}: worst {w} {per[w]:.2e}")
