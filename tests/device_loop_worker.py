"""Worker for the multi-process device-loop test: greedy generation with and without EOS ids
on every rank, against HF; rank 0 writes the results."""

import json

import torch

import ssmshard

from conftest import small_model
from finishing_rows import NEW_TOKENS, eos_in_generation_config
from generate_hf_arguments import hf_reference
from generate_worker import PAD, _same_on_every_rank, left_padded_prompts


# Row r's greedy token at new step EOS_STEPS[r] is an EOS id: the first row stops by step 3, the
# second by step 10, past one stop check (step 8) and before the last step (11), so the output
# is cut below the length the loop ran to.
EOS_STEPS = (3, 10)


def stopping_eos(new_tokens: list[list[int]]) -> list[int]:
    """EOS ids that stop row r of a greedy generation (its new tokens) by step EOS_STEPS[r]."""
    return sorted({row[step] for row, step in zip(new_tokens, EOS_STEPS)})


def device_loop_results(rank, world, family, seed, out_path):
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (6, 10), seed)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    results = {}
    with eos_in_generation_config(model, None):
        results["length_only"] = _compare(dm, model, ids, mask, options)
    full_new = [row[ids.shape[1]:] for row in results["length_only"]["hf"]]
    with eos_in_generation_config(model, stopping_eos(full_new)) as eos:
        results["eos"] = dict(_compare(dm, model, ids, mask, options), eos=eos)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _compare(dm, model, ids, mask, options):
    ours = dm.generate(ids, mask, **options)
    hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
    return {"ours": ours.tolist(), "hf": hf.tolist(), "same_on_all_ranks": _same_on_every_rank(ours),
            "loop": dm.last_generation_loop}
