"""Worker for the multi-process device-loop test: greedy generation with and without EOS ids,
and sampling with EOS ids, on every rank, against HF; rank 0 writes the results."""

import json

import torch

import ssmshard
from ssmshard.runtime.device_loop import STOP_CHECK_INTERVAL

from conftest import small_model

from finishing_rows import NEW_TOKENS, eos_in_generation_config, first_eos_step
from generate_hf_arguments import hf_reference, seeded
from generate_worker import PAD, _same_on_every_rank, left_padded_prompts


# Where the later of two rows stops by EOS (steps counted from 0), so that the loop runs past
# HF's end and must cut its output back: before the first stop check (the loop stops at that
# check), or after it and before the last step (the loop runs to the end).
LATE_STOPS = {"before_check": range(1, STOP_CHECK_INTERVAL - 1),
              "across_check": range(STOP_CHECK_INTERVAL, NEW_TOKENS - 1)}


def eos_stops(new_tokens: list[list[int]], eos: list[int]) -> list[int]:
    return [first_eos_step(row, eos) for row in new_tokens]


def stopping_eos(new_tokens: list[list[int]], late_stops: range) -> list[int]:
    """EOS ids, among two rows' greedy new tokens, at which one row stops before the first stop
    check and the other later, at a step in ``late_stops`` (the latest one found). When no pair
    qualifies, the tokens at the ends of the ranges (the test then reports the stops)."""
    for late in reversed(late_stops):
        for early in range(min(late, STOP_CHECK_INTERVAL)):
            for first, second in ((0, 1), (1, 0)):
                eos = sorted({new_tokens[first][early], new_tokens[second][late]})
                low, high = sorted(eos_stops(new_tokens, eos))
                if low < high == late:
                    return eos
    return sorted({new_tokens[0][0], new_tokens[1][late_stops[-1]]})


def device_loop_results(rank, world, family, seed, out_path):
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (6, 10), seed)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True)  # generation only
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    results = {}
    with eos_in_generation_config(model, None):
        results["length_only"] = _compare(dm, model, ids, mask, options)
    full_new = [row[ids.shape[1]:] for row in results["length_only"]["hf"]]
    for layout, late_stops in LATE_STOPS.items():
        with eos_in_generation_config(model, stopping_eos(full_new, late_stops)) as eos:
            results[layout] = dict(_compare(dm, model, ids, mask, options), eos=eos,
                                   stops=eos_stops(full_new, eos))
    # Sampling from a seeded global generator (rank 0 draws), EOS stopping a row after the first check.
    sampling = dict(options, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    with eos_in_generation_config(model, None):
        full = hf_reference(lambda: seeded(seed, lambda: model.generate(ids, attention_mask=mask, **sampling)))
    sampled_new = [row[ids.shape[1]:] for row in full.tolist()]
    with eos_in_generation_config(model, stopping_eos(sampled_new, LATE_STOPS["across_check"])) as eos:
        ours = seeded(seed, lambda: dm.generate(ids, mask, **sampling))
        hf = hf_reference(lambda: seeded(seed, lambda: model.generate(ids, attention_mask=mask, **sampling)))
        results["sampled"] = {"ours": ours.tolist(), "hf": hf.tolist(), "same_on_all_ranks": _same_on_every_rank(ours),
                              "loop": dm.last_generation_loop, "eos": eos, "stops": eos_stops(sampled_new, eos)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _compare(dm, model, ids, mask, options):
    ours = dm.generate(ids, mask, **options)
    hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
    return {"ours": ours.tolist(), "hf": hf.tolist(), "same_on_all_ranks": _same_on_every_rank(ours),
            "loop": dm.last_generation_loop}
