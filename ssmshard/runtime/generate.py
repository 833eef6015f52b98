"""Token generation over captured prefill/decode programs, with Hugging Face ``generate`` semantics.

The loop is HF's greedy/sampling loop: left-padded prompts with an attention mask, position
ids counted over real tokens only, finished rows padded with ``pad_token_id``. Logits
processing follows HF's warpers (temperature, then top-k, then top-p). In a tensor-parallel
group, rank 0 picks each token and broadcasts it, so every rank feeds the same ids to the next
step whatever the rounding of its logits.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist


def next_token_scores(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                      top_p: Optional[float] = None) -> torch.Tensor:
    """HF's sampling warpers on fp32 scores (b, v): tokens filtered out get -inf."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    return scores


def _check_options(max_new_tokens, temperature, top_k, top_p):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use do_sample=False for greedy)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")


@torch.no_grad()
def generate(prefill, decode, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, group=None) -> torch.Tensor:
    """Prompt ids (b, l), left-padded where ``attention_mask`` (b, l) is 0, followed by up to
    ``max_new_tokens`` generated ids: (b, l + n), like ``model.generate``.

    Sampling draws from ``generator`` (default: torch's global generator) on rank 0 only.
    """
    _check_options(max_new_tokens, temperature, top_k, top_p)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    if attention_mask.dtype == torch.bool:
        attention_mask = attention_mask.long()
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if eos and pad_token_id is None:
        pad_token_id = eos[0]  # what HF does when the model defines no pad token
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    source = dist.get_global_rank(group, 0) if distributed else 0
    picks_tokens = not distributed or dist.get_rank(group) == 0

    # HF: positions count real tokens; pads sit at position 0.
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    logits, states = prefill(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        token = torch.empty(input_ids.shape[0], dtype=input_ids.dtype, device=input_ids.device)
        if picks_tokens:
            scores = logits[:, -1].float()
            if do_sample:
                probs = next_token_scores(scores, temperature, top_k, top_p).softmax(dim=-1)
                token.copy_(torch.multinomial(probs, 1, generator=generator).squeeze(1))
            else:
                token.copy_(scores.argmax(dim=-1))
        if distributed:
            dist.broadcast(token, src=source, group=group)
        if eos:
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        if eos:
            unfinished &= ~torch.isin(token, eos_ids)
            if not unfinished.any():
                break
        if step == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        logits, states = decode(token[:, None], states, attention_mask=attention_mask, position_ids=position_ids)
    return input_ids
