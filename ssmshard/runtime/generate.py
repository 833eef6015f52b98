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


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk: the first takes the remainder (2..chunk_size + 1
    tokens), every later one exactly ``chunk_size``, so continued chunks share one shape. No
    chunk is a single token: HF runs one token through its decode-step path, and its padding
    mask skips one-token inputs."""
    first = length - chunk_size * ((length - 1) // chunk_size)
    if first == 1 and length > 1:
        first += chunk_size
    return [(0, first)] + [(start, start + chunk_size) for start in range(first, length, chunk_size)]


def prefill(prefill_program, chunk_program, input_ids, attention_mask, position_ids, chunk_size=None):
    """``(last-token logits, states)`` of a prompt, in one call or chunk by chunk.

    With ``chunk_size``, the prompt runs as a first chunk through ``prefill_program`` and the
    rest through ``chunk_program`` carrying the states, so activation memory is bounded by
    the chunk instead of the prompt (attention keys/values still grow with it).
    """
    if chunk_size is not None and chunk_size < 2:
        raise ValueError(f"prefill_chunk_size must be >= 2 tokens, got {chunk_size}")
    if chunk_size is None or input_ids.shape[1] <= chunk_size:
        return prefill_program(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    if chunk_program is None:
        raise ValueError(f"a prompt of {input_ids.shape[1]} tokens with chunk size {chunk_size} needs a chunk "
                         "program (capture(model, mode='chunk'))")
    (start, end), *rest = chunk_bounds(input_ids.shape[1], chunk_size)
    logits, states = prefill_program(input_ids[:, :end], attention_mask=attention_mask[:, :end],
                                     position_ids=position_ids[:, :end])
    for start, end in rest:
        logits, states = chunk_program(input_ids[:, start:end], states, attention_mask=attention_mask[:, :end],
                                       position_ids=position_ids[:, start:end])
    return logits, states


def prompt_inputs(input_ids, attention_mask):
    """HF's prompt inputs: a long mask (ones if None) and positions counting real tokens only
    (pads sit at position 0)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    if attention_mask.dtype == torch.bool:
        attention_mask = attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    return attention_mask, position_ids


def inferred_attention_mask(input_ids, pad_token_id, eos):
    """HF ``generate``'s mask when none is passed: ids equal to ``pad_token_id`` are padding,
    unless the pad id is also an EOS id (then nothing can be told apart and the mask is all ones).
    Without this, a prompt that contains the pad id would be read whole here and with that token
    masked out by HF, and the generated ids would differ."""
    if pad_token_id is None or pad_token_id in eos or not bool((input_ids == pad_token_id).any()):
        return None
    return input_ids.ne(pad_token_id).long()


@torch.no_grad()
def generate(prefill_program, decode, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, group=None, chunk_program=None,
             prefill_chunk_size: Optional[int] = None) -> torch.Tensor:
    """Prompt ids (b, l), left-padded where ``attention_mask`` (b, l) is 0, followed by up to
    ``max_new_tokens`` generated ids: (b, l + n), like ``model.generate``.

    With no ``attention_mask``, ids equal to ``pad_token_id`` are taken for padding, as HF does
    (not when the pad id is also an EOS id). Sampling draws from ``generator`` (default: torch's
    global generator) on rank 0 only.
    ``prefill_chunk_size``: prefill prompts longer than this chunk by chunk through
    ``chunk_program`` (see :func:`prefill`).
    """
    _check_options(max_new_tokens, temperature, top_k, top_p)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if attention_mask is None:
        attention_mask = inferred_attention_mask(input_ids, pad_token_id, eos)
    attention_mask, position_ids = prompt_inputs(input_ids, attention_mask)
    if eos and pad_token_id is None:
        pad_token_id = eos[0]  # what HF does when the model defines no pad token
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    source = dist.get_global_rank(group, 0) if distributed else 0
    picks_tokens = not distributed or dist.get_rank(group) == 0

    logits, states = prefill(prefill_program, chunk_program, input_ids, attention_mask, position_ids,
                             prefill_chunk_size)
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
