"""Prefill and chunk programs called with an attention mask of all ones run a copy without what
the mask does (passes/unpadded.py): the Mamba mixers' mask multiplies dropped. Against Hugging
Face eager, and bit for bit against the masked program where nothing else changes."""

import inspect

import pytest
import torch

import ssmshard
from ssmshard.capture import flatten_states
from ssmshard.hf_compat import cache_kwarg
from ssmshard.passes.unpadded import mask_values
from ssmshard.runtime.generate import prefill, prompt_inputs
from ssmshard.testing import rel_err

from conftest import small_model
from generate_worker import left_padded_prompts
from test_causal_attention import counted

TOL = 1e-5
MAMBA_MIXER_FAMILIES = ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2"]
ATTENTION = {"zamba", "zamba2"}  # their copies also rewrite attention (numerics change within TOL)
mul = torch.ops.aten.mul.Tensor


def mask_multiplies(program) -> int:
    mask_input = [i.name for i in program.inputs if i.kind == "user"][1]
    mask = mask_values(program.graph, mask_input)
    return sum(1 for n in program.graph.nodes if n.target is mul and any(a in mask for a in n.args))


@pytest.mark.compat
@pytest.mark.parametrize("family", MAMBA_MIXER_FAMILIES)
def test_unpadded_prefill_and_chunks_drop_the_mask_multiplies(family, fresh_seed):
    model = small_model(family)
    programs = {mode: ssmshard.capture(model, mode=mode) for mode in ("prefill", "chunk")}
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(1, model.config.vocab_size, (3, 11), generator=gen)
    mask, positions = prompt_inputs(ids, None)
    where = f"{family} (seed {fresh_seed})"
    masked_calls = {mode: counted(p) for mode, p in programs.items()}
    with torch.no_grad():
        logits, states = programs["prefill"](ids, attention_mask=mask, position_ids=positions)
        chunked_logits, chunked_states = prefill(programs["prefill"], programs["chunk"], ids, mask, positions, 4)
        hf = model(ids, attention_mask=mask, use_cache=True)
    hf_states = flatten_states(getattr(hf, cache_kwarg(model)))

    # The copies ran, not the masked programs, and they multiply by the mask nowhere.
    assert not masked_calls["prefill"] and not masked_calls["chunk"], where
    layers = model.config.num_hidden_layers
    for mode, program in programs.items():
        assert isinstance(program.unpadded, ssmshard.Program), (where, mode)
        assert mask_multiplies(program) >= 2 * min(layers, 2), (where, mode, mask_multiplies(program))
        assert mask_multiplies(program.unpadded) == 0, (where, mode)

    # The oracle: HF eager's last logits and states, one shot and chunk by chunk.
    for name, got, got_states in (("one shot", logits, states), ("chunked", chunked_logits, chunked_states)):
        assert rel_err(got[:, -1], hf.logits[:, -1]) < TOL, (where, name)
        for i, (ours, theirs) in enumerate(zip(got_states, hf_states)):
            assert rel_err(ours, theirs) < TOL, (where, name, i, rel_err(ours, theirs))
    if family not in ATTENTION:  # x * 1 == x: the masked program's outputs, bit for bit
        prefill_program = programs["prefill"]
        masked = prefill_program.executable(*prefill_program.weight_args(), ids, mask, positions)
        assert torch.equal(masked[0], logits), where
        assert all(torch.equal(a, b) for a, b in zip(masked[1:], states)), where

    # A padded batch runs the masked program (and still equals HF).
    padded_ids, padded_mask = left_padded_prompts(model.config.vocab_size, [11, 7, 9], fresh_seed)
    padded_mask, padded_positions = prompt_inputs(padded_ids, padded_mask)
    copy_calls, masked_before = counted(programs["prefill"].unpadded), len(masked_calls["prefill"])
    with torch.no_grad():
        padded_logits, _ = programs["prefill"](padded_ids, attention_mask=padded_mask, position_ids=padded_positions)
        extra = {"position_ids": padded_positions} if "position_ids" in inspect.signature(model.forward).parameters else {}
        hf_padded = model(padded_ids, attention_mask=padded_mask, use_cache=False, **extra)
    assert len(masked_calls["prefill"]) == masked_before + 1 and not copy_calls, where
    assert rel_err(padded_logits[:, -1], hf_padded.logits[:, -1]) < TOL, where


def test_a_mask_of_other_nonzero_values_runs_the_masked_program(fresh_seed):
    """``x * mask`` drops only where every entry is 1: a mask of 2s (nonzero, not one) keeps it."""
    program = ssmshard.capture(small_model("mamba"), mode="prefill")
    ids = torch.randint(1, program.vocab_size, (2, 6))
    calls = counted(program)
    with torch.no_grad():
        program(ids, attention_mask=torch.full_like(ids, 2))
    assert calls == [1]
