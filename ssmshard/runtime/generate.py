"""Token generation over captured prefill/decode programs, with Hugging Face ``generate`` semantics.

The loop is HF's greedy/sampling loop around sharded programs: left-padded prompts with an
attention mask, positions counted over real tokens only, each step's logits run through HF's own
logits processors, finished rows padded with the pad id, HF's stopping criteria and streamer,
and HF's output object on request. What ``model.generate`` would run (the model's
``generation_config`` overridden by the call's arguments) is resolved by
:func:`~ssmshard.runtime.generation_config.prepare_generation` before any collective.

In a tensor-parallel group rank 0 decides each step alone: it processes the logits, picks the
tokens, evaluates the stopping criteria and streams; then it broadcasts the tokens together with
the rows still running (and whether it failed) in the one broadcast each step needs anyway.
Every rank feeds the same ids to the next step whatever the rounding of its logits, and all
stop at the same step, even under criteria that read the clock (``max_time``) or are the
user's own. If rank 0 fails deciding, the others learn it from that broadcast and raise too.

Greedy generation stopped by length and EOS ids only, with nothing else to run on the host each
step, takes :mod:`ssmshard.runtime.device_loop` instead: the same decisions, without a host
synchronisation per step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .device_loop import device_loop_generate, uses_device_loop
from .generation_config import ConfigDefaults, GenerationSetup, prepare_generation


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


@torch.no_grad()
def generate(prefill_program, decode, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             model=None, group=None, chunk_program=None, generator: Optional[torch.Generator] = None,
             device_loop="auto", **arguments):
    """``model.generate(input_ids, attention_mask=attention_mask, **arguments)`` over captured
    programs: the prompt ids (b, l) followed by the generated ids, (b, l + n), or HF's
    ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``.

    ``arguments`` are HF's (``generation_config``, ``max_new_tokens``, ``do_sample``,
    ``stopping_criteria``, ``streamer``, ...; see :func:`prepare_generation`); the defaults come from
    ``model.generation_config``, or without ``model`` from those of a model built from the
    programs' config. ``prefill_chunk_size``: prefill prompts longer than this chunk by chunk
    through ``chunk_program`` (see :func:`prefill`). Sampling draws from ``generator`` (default:
    torch's global generator) on rank 0 only. ``device_loop``: generation without a host
    synchronisation per step where it gives the same ids (``"auto"``; ``True`` raises where it
    cannot, ``False`` never: :mod:`ssmshard.runtime.device_loop`).
    """
    setup = prepare_generation(model if model is not None else ConfigDefaults(prefill_program.config), input_ids,
                               attention_mask, **arguments)
    return run_generation(prefill_program, decode, setup, group=group, chunk_program=chunk_program,
                          generator=generator, device_loop=uses_device_loop(setup, device_loop))


@torch.no_grad()
def run_generation(prefill_program, decode, setup: GenerationSetup, *, group=None, chunk_program=None,
                   generator: Optional[torch.Generator] = None, device_loop: bool = False):
    """HF's sampling/greedy loop over ``setup`` (see the module docstring for who decides what);
    ``device_loop``: the loop without per-step host syncs (``setup`` must be eligible:
    :func:`~ssmshard.runtime.device_loop.uses_device_loop`)."""
    from transformers.generation import GenerateDecoderOnlyOutput

    channel = TokenChannel(group, setup.input_ids)
    input_ids = setup.input_ids
    attention_mask, position_ids = prompt_inputs(input_ids, setup.attention_mask)
    keep_scores = setup.returns_dict and setup.config.output_scores
    keep_logits = setup.returns_dict and setup.config.output_logits
    scores = () if keep_scores else None
    raw_logits = () if keep_logits else None
    streamer = setup.streamer if channel.decides else None  # one stream, from rank 0

    logits, states = prefill(prefill_program, chunk_program, input_ids, attention_mask, position_ids,
                             setup.prefill_chunk_size)
    if device_loop:
        sequences = device_loop_generate(logits, states, decode, setup, channel, attention_mask, position_ids,
                                         generator)
        return GenerateDecoderOnlyOutput(sequences=sequences) if setup.returns_dict else sequences
    if streamer is not None:
        streamer.put(input_ids.cpu())
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    while True:
        # A copy in fp32, as HF takes it: a graphed decode step reuses its logits buffer.
        next_logits = logits[:, -1].to(copy=True, dtype=torch.float32)
        if channel.decides:
            try:
                next_scores = setup.processors(input_ids, next_logits)
                scores = scores + (next_scores,) if keep_scores else scores
                tokens, unfinished = _decide(setup, input_ids, next_scores, scores, unfinished, generator, streamer)
            except BaseException:
                channel.send_failure()  # the other ranks raise too instead of waiting for tokens
                raise
            channel.send(tokens, unfinished)
        else:
            tokens, unfinished = channel.receive()
            if keep_scores:  # this rank's own processed logits (rank 0's up to the rounding of the reductions)
                scores += (setup.processors(input_ids, next_logits),)
        if keep_logits:
            raw_logits += (next_logits,)
        input_ids = torch.cat([input_ids, tokens[:, None].to(input_ids.dtype)], dim=-1)
        if not bool(unfinished.any()):  # the same broadcast values on every rank: all stop here
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        # The tokens were picked from the logits, so always in range: no per-step check (a host sync).
        logits, states = decode(tokens[:, None].to(input_ids.dtype), states, attention_mask=attention_mask,
                                position_ids=position_ids, check_inputs=False)
    if streamer is not None:
        streamer.end()
    if setup.returns_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits)
    return input_ids


def _decide(setup: GenerationSetup, input_ids, next_scores, scores, unfinished, generator, streamer):
    """Rank 0's step, as HF's: the next tokens (b,) and the rows still running (b,) after them."""
    if setup.config.do_sample:
        tokens = torch.multinomial(next_scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    else:
        tokens = next_scores.argmax(dim=-1)
    tokens = setup.pad_finished(tokens, unfinished)
    unfinished = unfinished & ~setup.criteria(torch.cat([input_ids, tokens[:, None]], dim=-1), scores)
    if streamer is not None:
        streamer.put(tokens.cpu())
    return tokens, unfinished


class TokenChannel:
    """Rank 0's decision each step, sent to every rank of ``group`` in one broadcast of 2b + 1
    int64 values: the next tokens (b), the rows still running (b), and whether rank 0 failed."""

    def __init__(self, group, input_ids: torch.Tensor):
        from ..comm.groups import CollectiveBackend

        # A simulated group (ssmshard.runtime.simulated.SimulatedMesh) broadcasts in memory.
        self.backend = group if isinstance(group, CollectiveBackend) and group.world() > 1 else None
        self.distributed = self.backend is not None or (
            group is not None and not isinstance(group, CollectiveBackend) and dist.is_initialized()
            and dist.get_world_size(group) > 1)
        self.group = group
        self.source = dist.get_global_rank(group, 0) if self.distributed and self.backend is None else 0
        self.decides = (not self.distributed or (self.backend.rank() if self.backend is not None
                                                 else dist.get_rank(group)) == 0)
        self.batch = input_ids.shape[0]
        self.device = input_ids.device

    def _broadcast(self, message: torch.Tensor) -> torch.Tensor:
        if self.backend is not None:
            return self.backend.broadcast(message, 0)
        dist.broadcast(message, src=self.source, group=self.group)
        return message

    def send(self, tokens: torch.Tensor, unfinished: torch.Tensor) -> None:
        if self.distributed:
            ok = torch.zeros(1, dtype=torch.long, device=self.device)
            self._broadcast(torch.cat([tokens.long(), unfinished.long(), ok]))

    def send_failure(self) -> None:
        if self.distributed:
            failed = torch.zeros(2 * self.batch + 1, dtype=torch.long, device=self.device)
            failed[-1] = 1
            self._broadcast(failed)

    def receive(self, check_failure: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tokens and the rows still running. ``check_failure=False``: no read of rank
        0's failure flag (a host sync), for a loop in which rank 0 cannot fail deciding
        (:mod:`ssmshard.runtime.device_loop`)."""
        message = self._broadcast(torch.empty(2 * self.batch + 1, dtype=torch.long, device=self.device))
        if check_failure and bool(message[-1]):
            raise RuntimeError("generate: rank 0 failed choosing the next tokens (its own error says why); "
                               "this rank stops too")
        return message[:self.batch], message[self.batch:2 * self.batch]
