"""A batch whose rows finish at different steps (tests/finishing_rows.py), at tp = 1: eager
decode on the CPU (attention families over static key/value buffers, the step a CUDA graph
replays), and the CUDA graph itself on a GPU, replayed across the early-stopping batch."""

import pytest
import torch

import ssmshard
from ssmshard.families import family_of
from ssmshard.passes import run_pipeline
from ssmshard.runtime.cuda_graph import GraphedDecode
from ssmshard.runtime.generate import generate
from ssmshard.runtime.static_kv import StaticKVDecode

from conftest import SIX_FAMILIES, small_model
from finishing_rows import NEW_TOKENS, check_finishing_rows, finishing_rows
from generate_worker import PAD, left_padded_prompts

LENGTHS = (5, 12, 9)


def _steps(model, graphed, kernels):
    """(prefill, step_for(batch)): the decode step of each batch size, built once and reused
    (so a graph captured by one generation is replayed by the next of that batch)."""
    prefill, decode = (run_pipeline(ssmshard.capture(model, mode=mode), kernels) for mode in ("prefill", "decode"))
    static = run_pipeline(ssmshard.capture(model, mode="decode", static_kv=True), kernels) \
        if family_of(model).has_attention else None
    length = max(LENGTHS) + NEW_TOKENS + 3  # unfilled slots too
    built = {}

    def step_for(batch):
        if batch not in built:
            if graphed:
                built[batch] = GraphedDecode(static, length) if static is not None else GraphedDecode(decode)
            else:
                built[batch] = StaticKVDecode(static, length) if static is not None else decode
        return built[batch]
    return prefill, step_for


def _run(family, seed, device, graphed):
    model = small_model(family).to(device)
    try:
        kernels = [("swap_kernels", {"kernels": "triton"})] if device == "cuda" else []
        prefill, step_for = _steps(model, graphed, kernels)
        ids, mask = left_padded_prompts(model.config.vocab_size, LENGTHS, seed)

        def generate_fn(ids, mask, **options):
            return generate(prefill, step_for(ids.shape[0]), ids, mask, model=model, **options)
        return finishing_rows(generate_fn, model, ids.to(device), mask.to(device), PAD)
    finally:
        model.cpu()


# The hybrids' eager runs (static key/value buffers on the CPU) take about a minute each: make test-all.
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in ("zamba", "zamba2") else f
                                    for f in SIX_FAMILIES])
def test_rows_finishing_at_different_steps_eager(family, fresh_seed):
    check_finishing_rows(_run(family, fresh_seed, "cpu", graphed=False), f"{family} eager (seed {fresh_seed})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_rows_finishing_at_different_steps_graphed(family, fresh_seed):
    check_finishing_rows(_run(family, fresh_seed, "cuda", graphed=True), f"{family} graphed (seed {fresh_seed})")
