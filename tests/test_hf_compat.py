"""The contract with the installed transformers release (run on the newest and the oldest supported).

The oracle here does not depend on how ssmshard passes the cache: Hugging Face's full-sequence
forward. A cache passed under a name the model no longer takes is not an error in HF (the model
quietly starts a new cache), so only a comparison with the uncached forward catches it.
"""

import copy
import logging

import pytest
import torch

import ssmshard
from ssmshard.hf_compat import CACHE_KWARGS, cache_kwarg
from ssmshard.reference_decode import hf_incremental_logits, program_incremental_logits
from ssmshard.testing import rel_err

from conftest import SIX_FAMILIES, small_model

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_cached_steps_under_our_cache_keyword_equal_the_uncached_forward(family, fresh_seed):
    """In float64, with float32's 1e-5 bound: in float32 HF's own stepwise and chunked scans round
    differently (Zamba2's by 1e-4 relative), and in a float64 model HF's Mamba mixers still
    compute A and their scans in float32 (typically 1e-7 to 4e-7 here; our prefill and decode
    programs of the small Mamba-2 drawn with seed 2227630481 reach 1.0e-6 at the second step, HF's
    steps 2e-7: float32-level either way). Zamba2's cached decode drifts from
    its own uncached forward even in float64, by 1e-4 at the first step to 1e-3 at the fourth
    (measured on transformers 5.17 and 5.24, with and without rotary embeddings: HF's, not
    ours; test_capture checks our programs against HF's steps), so its bound is 1e-2. A cache
    HF ignores gives errors of 1e-2 to 1 (one token decoded without its context)."""
    model = copy.deepcopy(small_model(family)).double()
    assert cache_kwarg(model) in CACHE_KWARGS
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=gen)
    prompt, rest = ids[:, :7], ids[:, 7:]
    with torch.no_grad():
        full = model(ids).logits
        steps = hf_incremental_logits(model, prompt, rest[:, :-1])
        programs = [ssmshard.capture(model, mode=m) for m in ("prefill", "decode")]
        ours = program_incremental_logits(*programs, prompt, rest[:, :-1])
    bound = 1e-2 if family == "zamba2" else 1e-5
    for step, (theirs, mine) in enumerate(zip(steps, ours)):
        expected = full[:, 6 + step:7 + step]
        assert rel_err(theirs, expected) < bound, (family, step, fresh_seed)
        assert rel_err(mine, expected) < bound, (family, step, fresh_seed)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("family", ["mamba", "zamba2"])
def test_capture_uses_no_deprecated_hf_argument(family):
    """A deprecated keyword works today and breaks on removal (5.40 for the cache aliases)."""
    import warnings

    model = small_model(family)
    handler = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for mode in ("prefill", "decode", "chunk"):
                ssmshard.capture(model, mode=mode)
    finally:
        hf_logger.removeHandler(handler)
    deprecated = [m for m in handler.messages + [str(w.message) for w in caught] if "deprecat" in m.lower()]
    assert not deprecated, deprecated


@pytest.mark.parametrize("version", ["5.16.2", "4.57.6"])
def test_a_release_older_than_the_oldest_supported_is_a_clear_error_before_capture(version, monkeypatch):
    from packaging.version import Version
    from ssmshard import hf_compat

    monkeypatch.setattr(hf_compat, "transformers_version", lambda: Version(version))
    with pytest.raises(ImportError, match=rf"found {version}: pip install 'transformers>=5.17.0'"):
        ssmshard.capture(small_model("mamba"))
