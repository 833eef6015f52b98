"""Attention over a causal-only mask runs unmasked (``is_causal=True``), against Hugging Face
eager: forward programs always, prefill programs on unpadded batches (passes/causal_attention.py)."""

import pytest
import torch

import ssmshard
from ssmshard.testing import rel_err

from conftest import small_model

TOL = 1e-5
ATTENTION_FAMILIES = ["zamba", "zamba2", "llama"]
sdpa = torch.ops.aten.scaled_dot_product_attention.default


def attention_calls(graph):
    calls = [n for n in graph.nodes if n.target is sdpa]
    assert calls, "the program has no attention call"
    return calls


def unmasked(node) -> bool:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask is None and node.kwargs.get("is_causal") is True


def counted(program):
    """The list that gets one item per call reaching ``program``'s graph module."""
    calls = []
    module = program.graph_module
    run = module.forward
    module.forward = lambda *args: calls.append(1) or run(*args)
    return calls


@pytest.mark.compat
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_forward_attention_is_causal_and_equals_hf(family, fresh_seed):
    model = small_model(family)
    program = ssmshard.capture(model, mode="forward")
    assert all(unmasked(n) for n in attention_calls(program.graph))
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    err = rel_err(program(ids), expected)
    assert err < TOL, f"{family}: rel err {err:.2e} (seed {fresh_seed})"


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_prefill_runs_unmasked_attention_only_on_unpadded_batches(family, fresh_seed):
    model = small_model(family)
    program = ssmshard.capture(model, mode="prefill")
    assert not any(unmasked(n) for n in attention_calls(program.graph))  # padded batches need the mask
    masked_calls = counted(program)
    ids = torch.randint(1, model.config.vocab_size, (3, 10))
    mask = torch.ones_like(ids)
    logits, _ = program(ids, attention_mask=mask)
    assert isinstance(program.unpadded, ssmshard.Program) and not masked_calls
    assert all(unmasked(n) for n in attention_calls(program.unpadded.graph))
    unpadded_calls = counted(program.unpadded)
    mask[0, :4] = 0  # a left-padded row
    padded_logits, _ = program(ids, attention_mask=mask)
    assert masked_calls == [1] and not unpadded_calls
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits[:, -1]
        expected_padded = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
    for name, got, want in (("unpadded", logits, expected), ("padded", padded_logits, expected_padded)):
        err = rel_err(got[:, -1], want)
        assert err < TOL, f"{family} {name}: rel err {err:.2e} (seed {fresh_seed})"


def test_a_sliding_window_keeps_its_mask(fresh_seed):
    model = small_model("mistral", sliding_window=4)
    program = ssmshard.capture(model, mode="forward")
    assert not any(unmasked(n) for n in attention_calls(program.graph))
    prefill = ssmshard.capture(model, mode="prefill")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))  # longer than the window
    logits, _ = prefill(ids, attention_mask=torch.ones_like(ids))
    assert prefill.unpadded is False
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    err = max(rel_err(program(ids), expected), rel_err(logits[:, -1], expected[:, -1]))
    assert err < TOL, f"rel err {err:.2e} (seed {fresh_seed})"
