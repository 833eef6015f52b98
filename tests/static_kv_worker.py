"""Worker for the multi-process static-K/V decode tests: every rank generates, rank 0 writes results."""

import json

import torch

import ssmshard

from conftest import small_model
from generate_hf_arguments import error_of, hf_reference
from generate_worker import PAD, _same_on_every_rank, left_padded_prompts

NEW_TOKENS = 10
# Two left-padded batches of different widths: every row's prompt has its own length.
PROMPT_LENGTHS = ((5, 12, 9), (3, 7))


def static_kv_results(rank, world, families, seed, out_path):
    results = []
    for family in families:
        model = small_model(family)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True)  # generation only
        # min_new_tokens: every row generates all NEW_TOKENS (an EOS early on would end HF's batch short of
        # filling the buffers); rows that finish early are tests/test_finishing_rows.py's.
        options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        result = {"family": family, "batches": []}
        for index, lengths in enumerate(PROMPT_LENGTHS):
            ids, mask = left_padded_prompts(model.config.vocab_size, lengths, seed + index)
            if index == 0:
                # Generation too long for the buffers: refused before any program is built.
                too_short = ids.shape[1] + 4
                result["too_long_error"] = error_of(lambda: dm.generate(ids, mask, static_kv=too_short, **options))
                # No program captured since parallelize's prefill program (lazy_forward)
                result["built_after_error"] = sorted(dm._generation) != ["prefill"]
            hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
            sized = dm.generate(ids, mask, static_kv=True, **options)  # buffers of exactly the positions needed
            if index == 0:  # a static-K/V generate builds no decode program of the growing cache
                result["built_for_static"] = sorted(dm._generation)
            batch = {"hf": hf.tolist(), "sized": sized.tolist(), "same_on_all_ranks": _same_on_every_rank(sized)}
            if index == 0:  # buffers with unfilled slots for the mask to hide
                roomy = dm.generate(ids, mask, static_kv=ids.shape[1] + 3 * NEW_TOKENS, **options)
                batch.update(roomy=roomy.tolist(), same_on_all_ranks=batch["same_on_all_ranks"] and
                             _same_on_every_rank(roomy))
            result["batches"].append(batch)
        # Each rank's static key/value buffers hold its own key/value heads.
        program = dm.static_decode_program()
        prefill = dm.prefill_program()
        result["kv_placements_equal_prefill"] = [str(p) for p in program.shard["outputs"][1:]] == \
            [str(p) for p in prefill.shard["outputs"][1:]]
        result["kv_heads"] = sorted({spec.kind for spec in program.state_specs})
        results.append(result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
