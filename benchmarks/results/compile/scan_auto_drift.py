"""Does the Mamba-1 scan kernel picked by layout ("auto": the sequential kernel at 4 tokens a step
on the forward's token-contiguous inputs) move bf16 logits further from float32 than the parallel
kernel it replaces? Random bf16 Mamba-2.8B-sized models cut to 16 and 64 layers, batch 8 x 2048
(one segment a row, so "auto" runs the sequential kernel), ``Plan(tp=1, training=False)``. The
reference is Hugging Face eager in float32 on the same weights (its torch path: mamba-ssm is not
installed on the machine); HF eager in bf16 is its own bf16 drift, for scale. Relative error
(max |a - b| / max |b|) of the last 256 positions' logits.

    PYTHONPATH=$PWD python benchmarks/results/compile/scan_auto_drift.py     # one GPU
"""
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
import ssmshard  # noqa: E402
from decode_gpu import GPU_MODELS, prompt_ids  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402
from ssmshard.testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scan_outputs_gpu import with_scan_forward  # noqa: E402


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda")
    for layers in (16, 64):
        config = GPU_MODELS["mamba-2.8b"]()
        config.num_hidden_layers = layers
        model = build_random_model(config, device, torch.bfloat16, 7)
        ids = prompt_ids(config.vocab_size, 8, 2048, device, 7)
        keep = slice(-256, None)
        logits = {}
        with torch.no_grad():
            logits["hf_bf16"] = model(ids).logits[:, keep].float()
            dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1, training=False))
            logits["auto"] = dm(ids)[:, keep].float()
            logits["parallel"] = with_scan_forward(lambda: dm(ids), "parallel")()[:, keep].float()
            del dm
            reference = copy.deepcopy(model).float()
            del model
            logits["hf_fp32"] = reference(ids).logits[:, keep].float()
            del reference
        torch.cuda.empty_cache()
        print({"model": "mamba-2.8b", "layers": layers, "batch": 8, "length": 2048,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               **{f"{way} vs hf_fp32": round(rel_err(logits[way], logits["hf_fp32"]), 5)
                  for way in ("hf_bf16", "parallel", "auto")},
               "auto vs parallel": round(rel_err(logits["auto"], logits["parallel"]), 5)}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
