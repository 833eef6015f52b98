"""Worker for the multi-process generate() tests: every rank generates, rank 0 writes results."""

import json

import torch
import torch.distributed as dist

import ssmshard
from ssmshard.capture import flatten_states
from ssmshard.hf_compat import cache_kwarg
from ssmshard.placement import Shard
from ssmshard.runtime import distributed
from ssmshard.runtime.generate import generate
from ssmshard.testing import rel_err

from conftest import small_model
from generate_hf_arguments import argument_results, early_eos, error_of, gathered, hf_reference, seeded

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


class CapturedModes:
    """Records the mode of every program ``parallelize`` and its module capture, in this process."""

    def __init__(self):
        self.modes = []
        self._capture = distributed.capture

    def __enter__(self):
        def recorded(model, **options):
            self.modes.append(options.get("mode", "forward"))
            return self._capture(model, **options)
        distributed.capture = recorded
        return self

    def __exit__(self, *exc):
        distributed.capture = self._capture


def generate_results(rank, world, families, seed, out_path, argument_families=(),
                     sampling_families=("mamba2", "zamba2"), chunked_families=("mamba", "zamba", "zamba2"),
                     forward_families=("mamba2", "llama")):
    """Built with ``lazy_forward=True`` (generation needs no forward program); for
    ``forward_families`` the forward program is then built on first use and checked against HF."""
    results = []
    for family in families:
        with CapturedModes() as captured:
            results.append(_generate_family(world, family, seed, argument_families, sampling_families,
                                            chunked_families, family in forward_families, captured))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _generate_family(world, family, seed, argument_families, sampling_families, chunked_families, check_forward,
                     captured):
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True)
    # The model's own generation config (its EOS and pad ids) on both sides.
    ours = dm.generate(ids, mask, max_new_tokens=20)
    hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=20))
    result = {"family": family, "tp": world, "greedy_equal_hf": torch.equal(ours, hf), "ours": ours.tolist(),
              "hf": hf.tolist(), "greedy_same_on_all_ranks": _same_on_every_rank(ours)}
    with early_eos(model, hf.tolist(), ids.shape[1]) as eos:
        # EOS ids the model emits within 4 steps, set in its generation_config: rows stop and
        # are padded as in HF, and generation ends before max_new_tokens.
        early = dm.generate(ids, mask, max_new_tokens=12)
        hf_early = hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=12))
        result.update(early_eos=eos, early_equal_hf=torch.equal(early, hf_early), early=early.tolist(),
                      hf_early=hf_early.tolist(), early_same_on_all_ranks=_same_on_every_rank(early))
    if model.generation_config.eos_token_id != PAD:
        # No mask passed: HF takes the PAD ids for padding (PAD is not EOS here), so must we.
        unmasked = dm.generate(ids, max_new_tokens=6, pad_token_id=PAD)
        hf_unmasked = hf_reference(lambda: model.generate(ids, max_new_tokens=6, pad_token_id=PAD))
        result["unmasked_equal_hf"] = torch.equal(unmasked, hf_unmasked)
        result["unmasked"], result["hf_unmasked"] = unmasked.tolist(), hf_unmasked.tolist()
    if family in argument_families:
        result["arguments"] = gathered(argument_results(dm, model, ids, mask, hf.tolist(), seed))
        if world == 1:
            # The captured programs without their model: the defaults of a model built from
            # their config (this model's, unmodified).
            programs_only = generate(*dm.generation_programs(), ids, mask, max_new_tokens=8)
            result["programs_only_equal_hf"] = torch.equal(
                programs_only, hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=8)))
        result["hf_error_unknown"] = hf_reference(lambda: error_of(
            lambda: model.generate(ids, attention_mask=mask, max_new_tokens=3, not_an_argument=1)))
    # States after prefill: each rank's share of the global state tensors.
    local_prefill, _ = dm.generation_programs()
    _, local_states = dm.prefill(ids, mask)
    with torch.no_grad():  # the unsharded states: HF's own cache after the same prefill
        out = model(ids, attention_mask=mask, use_cache=True)
    global_shapes = [t.numel() for t in flatten_states(getattr(out, cache_kwarg(model)))]
    assert len(global_shapes) == len(local_states)
    result["states"] = [{"placement": str(p), "sharded": isinstance(p, Shard), "local": t.numel(),
                         "global": g, "even": isinstance(p, Shard) and all(s.pieces == world for s in p.segments)}
                        for t, p, g in zip(local_states, dm.state_placements(), global_shapes)]
    result["state_kinds"] = [spec.kind for spec in local_prefill.state_specs]
    if family in chunked_families:
        # Chunked prefill on this rank's shards: the same logits and local states as one
        # shot, and the same generated tokens.
        whole_logits, whole_states = dm.prefill(ids, mask)
        logits, states = dm.prefill(ids, mask, chunk_size=4)
        kinds = [spec.kind for spec in local_prefill.state_specs]
        real = mask.bool()[:, None, :, None]  # keys/values of pads are never read
        result["chunked_logits_err"] = rel_err(logits, whole_logits)
        result["chunked_state_errs"] = [
            rel_err(a[real.expand_as(a)], b[real.expand_as(b)]) if kind in ("key", "value") else rel_err(a, b)
            for a, b, kind in zip(states, whole_states, kinds)]
        chunked = dm.generate(ids, mask, max_new_tokens=20, prefill_chunk_size=4)
        result["chunked_generate_equal"] = torch.equal(chunked, ours)
    if family in sampling_families:
        # Sampling with a seed: the same tokens on every rank, and HF's own sampled tokens
        # (one multinomial draw per step from the same stream, after the same warpers).
        options = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
        torch.manual_seed(seed)
        sampled = dm.generate(ids, mask, **options)
        hf_sampled = hf_reference(lambda: seeded(seed, lambda: model.generate(ids, attention_mask=mask, **options)))
        result.update(sampled_same_on_all_ranks=_same_on_every_rank(sampled),
                      sampled_equal_hf=torch.equal(sampled, hf_sampled),
                      sampled=sampled.tolist(), hf_sampled=hf_sampled.tolist())
    result["captured_generating"] = list(captured.modes)
    if check_forward:
        # The forward program, built on this first call over the weights laid out from prefill.
        unpadded = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            result["lazy_forward_err"] = rel_err(dm(unpadded), hf_reference(lambda: model(unpadded).logits))
        result["captured_with_forward"] = list(captured.modes)
    return result


_KEPT_ALIVE = []  # modules a worker leaves alive, as a user script's globals would be at its end


def graphed_vs_eager(rank, world, family, seed, out_path, leave_alive=False, layers=None, add_passes=(),
                     lazy_forward=False, program_cache=None):
    """Greedy tokens of eager and CUDA-graph decoding (twice: capture, then replay) on GPUs, and
    HF's; then the graph replayed across a batch whose rows finish at different steps.
    ``leave_alive``: return with the module (and its graphs) still alive, as a script's globals
    are at its end: ``launch``'s teardown must release the graphs (NCCL's would wait forever).
    ``layers``: a model of that many decoder layers instead of the small model's own count, or a
    dict of config overrides (a hybrid's layer layout).
    ``add_passes``: opt-in passes the plan runs too (``Plan(add_passes=...)``). ``lazy_forward``:
    ``parallelize``'s, the weights laid out from the prefill program. ``program_cache``:
    ``parallelize``'s too (with ``lazy_forward``); what the module loaded and stored is recorded."""
    from finishing_rows import finishing_rows

    overrides = {} if layers is None else layers if isinstance(layers, dict) else {"num_hidden_layers": layers}
    model = small_model(family, **overrides).cuda()
    try:
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, add_passes=list(add_passes)),
                                  lazy_forward=lazy_forward, program_cache=program_cache)
        ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
        ids, mask = ids.cuda(), mask.cuda()
        eager = dm.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD, cuda_graph=False)
        graphed = dm.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD, cuda_graph=True)
        again = dm.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD, cuda_graph=True)
        hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=PAD,
                                                 do_sample=False))
        finishing = finishing_rows(lambda i, m, **options: dm.generate(i, m, cuda_graph=True, **options),
                                   model, ids, mask, PAD, reference=hf_reference)
        if leave_alive:
            _KEPT_ALIVE.append(dm)
    finally:
        model.cpu()  # the model object is shared by the tests of this process
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"eager": eager.tolist(), "graphed": graphed.tolist(), "again": again.tolist(),
                       "hf": hf.tolist(), "finishing": finishing,
                       # Attention models graph the step over static key/value buffers.
                       "static_graph": all(g.static is not None for g in dm._decode_graphs.values()),
                       "cache": None if dm.program_cache is None else
                       {"loaded": sorted(dm.program_cache.loaded), "stored": sorted(dm.program_cache.stored)}}, f)


def lazy_forward_from_a_checkpoint(rank, world, family, directory, seed, out_path):
    """``parallelize(meta model, checkpoint=..., lazy_forward=True)``: HF's greedy tokens, the
    forward program captured only on the first forward call, then HF's logits."""
    from ssmshard.families import build_meta_model

    model = small_model(family)  # the model saved in ``directory``: the reference
    meta = build_meta_model(directory)
    with CapturedModes() as captured:
        dm = ssmshard.parallelize(meta, ssmshard.Plan(tp=world), checkpoint=directory, progress=False,
                                  lazy_forward=True)
        ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
        ours = dm.generate(ids, mask, max_new_tokens=10, pad_token_id=PAD)
        hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=PAD,
                                                 do_sample=False))
        generating = list(captured.modes)
        unpadded = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            forward_err = rel_err(dm(unpadded), hf_reference(lambda: model(unpadded).logits))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"equal_hf": torch.equal(ours, hf), "ours": ours.tolist(), "hf": hf.tolist(),
                       "captured_generating": generating, "captured": captured.modes, "forward_err": forward_err}, f)


def graphed_bf16_states(rank, world, family, seed, out_path):
    """``Plan(ssm_state_dtype=torch.bfloat16)`` on GPUs: greedy tokens of eager and CUDA-graph
    decoding (capture, then replay) at batch 2 and 1, the dtypes of the states the prefill returns,
    and each step's top-2 logits of HF eager decoding over those tokens with its SSM states cast
    to bfloat16 (``hf_incremental_logits``), for the greedy check against them."""
    from ssmshard.reference_decode import hf_incremental_logits

    model = small_model(family).cuda()
    results = []
    try:
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, ssm_state_dtype=torch.bfloat16))
        prompt = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))
        prompt = prompt.cuda()
        state_dtypes = sorted({str(s.dtype) for s in dm.prefill(prompt)[1]})
        # min_new_tokens keeps every row generating: the EOS ids are then never chosen (HF's
        # processor sets their logits to -inf), so they are left out of HF's top two as well.
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        for ids in (prompt, prompt[:1]):
            options = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
            eager = dm.generate(ids, cuda_graph=False, **options)
            graphed = dm.generate(ids, cuda_graph=True, **options)
            again = dm.generate(ids, cuda_graph=True, **options)
            new = eager[:, ids.shape[1]:]
            hf = hf_incremental_logits(model, ids, new[:, :-1], ssm_state_dtype=torch.bfloat16)
            top2 = [logits[:, -1].float().index_fill(-1, torch.tensor(eos, dtype=torch.long, device=logits.device),
                                                     float("-inf")).topk(2, dim=-1) for logits in hf]
            results.append({"eager": eager.tolist(), "graphed": graphed.tolist(), "again": again.tolist(),
                            "new": new.tolist(), "hf_top": [t.indices[:, 0].tolist() for t in top2],
                            "hf_margin": [(t.values[:, 0] - t.values[:, 1]).tolist() for t in top2],
                            "hf_scale": [logits[:, -1].float().abs().amax(-1).tolist() for logits in hf]})
    finally:
        model.cpu()  # the model object is shared by the tests of this process
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"state_dtypes": state_dtypes, "batches": results}, f)
