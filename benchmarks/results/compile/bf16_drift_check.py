"""The check behind README.md's bf16 drift figures: logits of HF eager, ssmshard eager and
ssmshard compiled (with and without Inductor's ``emulate_precision_casts``) on random bf16 models
cut to a few layers, 2 x 512 tokens, relative error of the last 64 positions' logits. HF eager
runs transformers' own torch path (mamba-ssm not installed on the machine).

    PYTHONPATH=$PWD python benchmarks/results/compile/bf16_drift_check.py     # one GPU
"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, "benchmarks")
import bench_common  # noqa
import ssmshard
from ssmshard.testing import rel_err
from decode_gpu import GPU_MODELS, prompt_ids
from generate_gpu import build_random_model
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
for name, layers in (("mamba2-2.7b", 64), ("mamba2-2.7b", 8), ("mamba-2.8b", 16)):
    cfg = GPU_MODELS[name](); cfg.num_hidden_layers = layers
    model = build_random_model(cfg, dev, torch.bfloat16, 7)
    ids = prompt_ids(cfg.vocab_size, 2, 512, dev, 7)
    out = {}
    with torch.no_grad():
        out["hf"] = model(ids).logits[:, -64:].float()
        for variant in ("eager", "compiled", "compiled_emulate"):
            torch._dynamo.reset()
            torch._inductor.config.emulate_precision_casts = variant == "compiled_emulate"
            dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False, compile=variant != "eager"))
            out[variant] = dm(ids)[:, -64:].float()
            del dm
    print(name, layers, {f"{a} vs {b}": round(rel_err(out[a], out[b]), 5) for a, b in
                         (("eager", "hf"), ("compiled", "hf"), ("compiled_emulate", "hf"), ("compiled", "eager"),
                          ("compiled_emulate", "eager"))}, flush=True)
    del model
    torch.cuda.empty_cache()
