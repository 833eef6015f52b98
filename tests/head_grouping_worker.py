"""Worker for the multi-process (gloo) test of a plan's head permutation read from a checkpoint.

Each rank builds the model on the meta device, loads its slices of the unpermuted safetensors
checkpoint through ``Plan(head_permutations=...)`` while a wrapper around ``safe_open`` counts the
elements read, and returns its logits; rank 0 writes every rank's result to a JSON file.
"""

import json

import torch
import torch.distributed as dist

import ssmshard
import ssmshard.runtime.checkpoint as checkpoint_module

from checkpoint_worker import _counting_safe_open
from conftest import small_model


def _load_case(world, case):
    saved = small_model(case["family"], **case["overrides"])
    with torch.device("meta"):
        meta = type(saved)(saved.config).eval()
    plan = ssmshard.Plan(tp=world, drop_syncs=[case["point"]], head_permutations={case["point"]: case["permutation"]})
    reads = []
    real, opener = _counting_safe_open(reads)
    checkpoint_module.safe_open = opener
    try:
        loaded = ssmshard.parallelize(meta, plan, checkpoint=case["dir"], progress=False)
    finally:
        checkpoint_module.safe_open = real
    with torch.no_grad():
        logits = loaded(torch.tensor(case["ids"]))
    persistent = set(saved.state_dict())  # non-persistent buffers (rotary inv_freq) are computed, not read
    local = sum(loaded.local_weight(fqn).numel() for fqn in loaded.program.param_specs if fqn in persistent)
    return {"logits": logits.tolist(), "elements_read": sum(n for _, n in reads), "local_elements": local,
            "report": loaded.program.report()}


def run_all(rank, world, cases, out_path):
    results = [_load_case(world, case) for case in cases]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
