"""Chunked prefill: a prompt prefilled chunk by chunk (``mode="chunk"`` programs carrying the
states) gives the logits and every state tensor of one-shot prefill, on every family."""

import inspect

import pytest
import torch

import ssmshard
from ssmshard.capture import flatten_states
from ssmshard.hf_compat import cache_kwarg
from ssmshard.runtime.generate import chunk_bounds, prefill, prompt_inputs
from ssmshard.testing import rel_err

from conftest import SIX_FAMILIES, small_model
from generate_worker import left_padded_prompts

TOLERANCE = 1e-5  # fp32; chunking only changes where each scan is cut


@pytest.mark.compat
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_chunked_prefill_equals_one_shot(family, fresh_seed):
    model = small_model(family)
    programs = {mode: ssmshard.capture(model, mode=mode) for mode in ("prefill", "chunk")}
    gen = torch.Generator().manual_seed(fresh_seed)
    lengths = torch.randint(9, 18, (3,), generator=gen).tolist()
    ids, mask = left_padded_prompts(model.config.vocab_size, lengths, fresh_seed)
    mask, positions = prompt_inputs(ids, mask)
    with torch.no_grad():
        whole_logits, whole_states = prefill(programs["prefill"], None, ids, mask, positions)
        # HF generate's prefill call: positions count real tokens only (pads sit at 0).
        extra = {"position_ids": positions} if "position_ids" in inspect.signature(model.forward).parameters else {}
        hf = model(ids, attention_mask=mask, use_cache=True, **extra)
        hf_states = flatten_states(getattr(hf, cache_kwarg(model)))
    where = f"{family}, prompt lengths {lengths} (seed {fresh_seed})"
    # The oracle: one-shot prefill is HF's forward.
    assert rel_err(whole_logits, hf.logits[:, -1:]) < TOLERANCE, where
    assert len(whole_states) == len(hf_states), where
    for chunk_size in (3, 4, 5):  # pads in the first chunk only, or over several
        with torch.no_grad():
            logits, states = prefill(programs["prefill"], programs["chunk"], ids, mask, positions, chunk_size)
        assert rel_err(logits, whole_logits) < TOLERANCE, (where, chunk_size)
        for i, (ours, theirs, spec) in enumerate(zip(states, hf_states, programs["chunk"].state_specs)):
            assert ours.shape == theirs.shape, (where, chunk_size, i)
            if spec.kind in ("key", "value"):
                # Keys/values of pad positions are never read (masked for every query), and HF
                # itself gives pads different positions in one-shot and stepwise calls.
                real = mask.bool()[:, None, :, None].expand_as(ours)
                ours, theirs = ours[real], theirs[real]
            assert rel_err(ours, theirs) < TOLERANCE, (where, chunk_size, i, rel_err(ours, theirs))


def test_chunk_bounds_cover_the_prompt_once():
    for length in range(1, 40):
        for size in (2, 3, 7):
            bounds = chunk_bounds(length, size)
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert (length < 2 or 2 <= bounds[0][1] <= size + 1) and all(e - s == size for s, e in bounds[1:])


def test_chunk_size_must_be_two_tokens_or_more():
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        prefill(None, None, torch.zeros(1, 5, dtype=torch.long), None, None, chunk_size=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_on_the_kernels(family, dtype, fresh_seed):
    """On the GPU with the Triton kernels: chunked == one shot (the scans and convs continued
    from states), fp32 at 1e-4 (kernel reduction order), bf16 at 2e-2."""
    import copy

    from ssmshard.passes import run_pipeline

    model = copy.deepcopy(small_model(family)).to("cuda", dtype)
    swap = [("swap_kernels", {"kernels": "triton"})]
    programs = {mode: run_pipeline(ssmshard.capture(model, mode=mode), swap) for mode in ("prefill", "chunk")}
    assert all(r["kernel"] == "triton" for r in programs["chunk"].kernel_report), programs["chunk"].kernel_report
    ids, mask = left_padded_prompts(model.config.vocab_size, (37, 64, 50), fresh_seed)
    mask, positions = prompt_inputs(ids.cuda(), mask.cuda())
    ids = ids.cuda()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        whole_logits, whole_states = prefill(programs["prefill"], None, ids, mask, positions)
        logits, states = prefill(programs["prefill"], programs["chunk"], ids, mask, positions, 16)
    where = f"{family} {dtype} (seed {fresh_seed})"
    assert rel_err(logits.float(), whole_logits.float()) < tolerance, where
    for i, (a, b) in enumerate(zip(states, whole_states)):
        assert rel_err(a.float(), b.float()) < tolerance, (where, i, rel_err(a.float(), b.float()))


def test_prompts_within_one_chunk_need_no_chunk_program():
    """A chunk size at least the prompt's length is one-shot prefill (no chunk program is
    captured for it); a longer prompt without a chunk program is refused by name."""
    calls = []

    def one_shot(ids, attention_mask, position_ids):
        calls.append(ids.shape[1])
        return "logits", ["states"]

    ids = torch.zeros(2, 6, dtype=torch.long)
    mask, positions = prompt_inputs(ids, None)
    assert prefill(one_shot, None, ids, mask, positions, chunk_size=6) == ("logits", ["states"])
    assert calls == [6]
    with pytest.raises(ValueError, match="needs a chunk program"):
        prefill(one_shot, None, ids, mask, positions, chunk_size=4)
