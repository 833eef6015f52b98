"""Worker for the multi-process generate() tests: every rank generates, rank 0 writes results."""

import json

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.placement import Shard
from ssmshard.runtime.generate import generate

from conftest import small_model

PAD = 0


def left_padded_prompts(vocab, lengths, seed):
    """A batch of prompts of different lengths, left-padded with PAD as HF tokenizers do for generation."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def _same_on_every_rank(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(g, tensor) for g in gathered)


def _state_shares(dm, prefill_states, unsharded_states):
    """For each state tensor: its placement and local / global element counts."""
    shares = []
    for placement, local, full in zip(dm.state_placements(), prefill_states, unsharded_states):
        shares.append({"placement": str(placement), "sharded": isinstance(placement, Shard),
                       "local": local.numel(), "global": full.numel(),
                       "even": isinstance(placement, Shard) and all(s.pieces == dm.plan.tp for s in placement.segments)})
    return shares


def generate_results(rank, world, families, seed, out_path):
    results = []
    for family in families:
        model = small_model(family)
        eos = model.generation_config.eos_token_id
        ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
        ours = dm.generate(ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                eos_token_id=eos, pad_token_id=PAD)
        # Sampling: the same seed on every rank and in the unsharded (tp = 1) programs.
        options = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=40, top_p=0.9,
                       eos_token_id=eos, pad_token_id=PAD)
        torch.manual_seed(seed)
        sampled = dm.generate(ids, mask, **options)
        prefill, decode = ssmshard.capture(model, mode="prefill"), ssmshard.capture(model, mode="decode")
        torch.manual_seed(seed)
        sampled_tp1 = generate(prefill, decode, ids, mask, **options)
        # States after prefill, sharded vs unsharded.
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        local_prefill, _ = dm.generation_programs()
        _, local_states = local_prefill(ids, attention_mask=mask, position_ids=position_ids)
        _, full_states = prefill(ids, attention_mask=mask, position_ids=position_ids)
        results.append({
            "family": family, "tp": world,
            "greedy_equal_hf": torch.equal(ours, hf), "ours": ours.tolist(), "hf": hf.tolist(),
            "greedy_same_on_all_ranks": _same_on_every_rank(ours),
            "sampled_same_on_all_ranks": _same_on_every_rank(sampled),
            "sampled_equal_tp1": torch.equal(sampled, sampled_tp1),
            "sampled_differs_from_greedy": not torch.equal(sampled, ours[:, :sampled.shape[1]]),
            "states": _state_shares(dm, local_states, full_states),
            "state_kinds": [spec.kind for spec in local_prefill.state_specs],
        })
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
