"""One-process check of the shard pass on a CUDA-captured program (no process group)."""
import traceback
import torch
import ssmshard
from ssmshard.families import build_small_model
from ssmshard.passes import run_pipeline

for family in ["mamba", "llama"]:
    model = build_small_model(family).to("cuda", torch.bfloat16)
    program = ssmshard.capture(model)
    placements = ssmshard.Plan(tp=2).layout(program, model)
    try:
        run_pipeline(program, [("shard", {"placements": placements, "rank": 0, "tp": 2, "group": "unused",
                                          "training": False})])
        print(family, "shard OK")
    except Exception as exc:
        cause = exc.__cause__ or exc
        print(family, "FAILED:", type(exc).__name__)
        print("".join(traceback.format_exception(type(cause), cause, cause.__traceback__))[-6000:])
