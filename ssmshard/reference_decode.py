"""Hugging Face incremental decoding, the reference that prefill/decode programs are checked against.

The model's own cache does the work: one prefill call over the prompt, then one call per
next token with the cache passed back, under the keyword this transformers release uses
(``hf_compat.cache_kwarg``).
"""

from __future__ import annotations

import torch

from .hf_compat import cache_kwarg


@torch.no_grad()
def hf_incremental_logits(model, prompt_ids: torch.Tensor, next_tokens: torch.Tensor,
                          ssm_state_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Logits of HF eager decoding: ``[prefill's last-token logits (b, 1, v), step 1 (b, 1, v), ...]``.

    ``prompt_ids`` is ``(b, l)``; ``next_tokens`` is ``(b, n)``, fed one column per step
    (teacher forcing, so the result does not depend on sampling). ``ssm_state_dtype``: the
    cache's SSM states are cast to it after the prefill, and HF's decode steps keep them so.
    """
    kw = cache_kwarg(model)
    out = model(prompt_ids, use_cache=True)
    cache = getattr(out, kw)
    if ssm_state_dtype is not None:
        from .capture import cast_ssm_states

        cast_ssm_states(cache, ssm_state_dtype)
    logits = [out.logits[:, -1:]]
    for step in range(next_tokens.shape[1]):
        out = model(next_tokens[:, step, None], use_cache=True, **{kw: cache})
        cache = getattr(out, kw)
        logits.append(out.logits)
    return logits


@torch.no_grad()
def program_incremental_logits(prefill_program, decode_program, prompt_ids: torch.Tensor,
                               next_tokens: torch.Tensor) -> list[torch.Tensor]:
    """The same sequence of logits from captured prefill and decode programs."""
    logits, states = prefill_program(prompt_ids)
    out = [logits]
    for step in range(next_tokens.shape[1]):
        logits, states = decode_program(next_tokens[:, step, None], states)
        out.append(logits)
    return out
