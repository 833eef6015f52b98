"""Generation without a host synchronisation per step.

The host loop of :mod:`ssmshard.runtime.generate` reads a device value every step (whether
any row is still running, and at tp > 1 whether rank 0 failed). Each read makes the host wait
for the GPU to finish the step, so the host's work for the next step (the tokens' bookkeeping,
the next launch or CUDA-graph replay) cannot overlap the GPU's: with a decode step of well under
a millisecond the host time adds to every token, and under tensor parallelism (one more
broadcast and read per step) a sharded model decoded slower per token than one GPU.

For greedy decoding or sampling, with logits processors that are device arithmetic only
(``DEVICE_PROCESSORS``: temperature, top-k, top-p, min-p, repetition penalty, minimum
length), no streamer or per-step outputs, and only the length and EOS ids to stop it, every
step's decision stays on the device: the processors, the argmax or the draw (HF's
``torch.multinomial``; its input checks are device-side asserts in recent torch,
pytorch/pytorch#134818, where an older torch checks on the host that draw waits for the step),
HF's padding of finished rows, and the EOS test. The output ids are preallocated and written column by column,
positions and the mask advance as device tensors and views, and the host learns whether all
rows finished only every ``STOP_CHECK_INTERVAL`` steps. Each step records whether any row was
still running, so the output is cut at the step where HF's loop would have stopped; the steps
run after that are discarded. When sampling, the random generator's state after each step is
kept (a host value on CUDA, no device read) and the generator is set back to where HF's loop
would have left it, so the draws that follow a generate are HF's too. The result equals the host
loop's (and HF's) exactly; anything else runs the host loop, and :func:`why_not_device_loop`
says why.

At tp > 1 rank 0 picks the tokens and broadcasts them with the rows still running, through
:class:`~ssmshard.runtime.generate.TokenChannel` as the host loop does, so every rank feeds the
same ids whatever the rounding of its logits (only rank 0 draws). The receivers skip the host
loop's per-step read of rank 0's failure flag: here rank 0's decision is device arithmetic, with
no user code (custom processors, criteria, streamer) that could raise between steps.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .generation_config import GenerationSetup

# Steps between host reads of "is any row still running" when EOS can stop rows. Each read
# waits for the GPU, so reading every step serializes host and GPU; reading every 8 steps
# bounds the discarded steps after the last row finishes to 7 while the wait is paid once
# per 8 tokens.
STOP_CHECK_INTERVAL = 8


# HF's logits processors whose __call__ is tensor arithmetic on the scores and ids (and host
# ints such as the ids' length): no read of a device value, no Python loop over tokens.
DEVICE_PROCESSORS = tuple(getattr(logits_process, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"))


def why_not_device_loop(setup: GenerationSetup) -> Optional[str]:
    """None if :func:`device_loop_generate` gives ``setup``'s result, else why the host loop runs it."""
    host = [type(p).__name__ for p in setup.processors if type(p) not in DEVICE_PROCESSORS]
    if host:
        return f"the logits processors {', '.join(host)} run on the host each step"
    others = [type(c).__name__ for c in setup.criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if others:
        return f"the stopping criteria {', '.join(others)} are evaluated on the host each step"
    if not any(isinstance(c, MaxLengthCriteria) for c in setup.criteria):
        return "no max_length bounds the number of steps"
    if setup.streamer is not None:
        return "a streamer receives each step's tokens on the host"
    if setup.returns_dict and (setup.config.output_scores or setup.config.output_logits):
        return "output_scores/output_logits keep each step's scores"
    return None


def new_token_count(setup: GenerationSetup) -> int:
    """The steps HF runs when no EOS stops them: until the shortest max_length, at least one."""
    max_length = min(c.max_length for c in setup.criteria if isinstance(c, MaxLengthCriteria))
    return max(1, max_length - setup.input_ids.shape[1])


@torch.no_grad()
def device_loop_generate(logits, states, decode, setup: GenerationSetup, channel, attention_mask, position_ids,
                         generator: Optional[torch.Generator] = None):
    """The ids (b, l + n) HF's loop gives from the prefill's ``logits`` and ``states``, reading
    the device only every ``STOP_CHECK_INTERVAL`` steps (with EOS) or not at all, and once at the
    end to cut the output where HF stops. Sampling draws from ``generator`` (default: the
    device's default generator), as the host loop does."""
    prompt = setup.input_ids
    batch, length = prompt.shape
    steps = new_token_count(setup)
    ids = torch.cat([prompt, prompt.new_zeros(batch, steps)], dim=-1)
    # The mask of every step is a view of this one: real prompt tokens, then every new token.
    full_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, steps)], dim=-1)
    stops_by_eos = not setup.stops_by_length_only
    running = torch.ones(steps, dtype=torch.bool, device=prompt.device)  # any row running after each step
    unfinished = torch.ones(batch, dtype=torch.long, device=prompt.device)
    done = steps
    draws = _Draws(setup, generator, prompt.device) if channel.decides else None
    for step in range(steps):
        end = length + step + 1
        if channel.decides:
            tokens = setup.pad_finished(draws.next_tokens(ids[:, :end - 1], logits[:, -1]), unfinished)
            ids[:, end - 1] = tokens
            if stops_by_eos:  # MaxLengthCriteria reads the host-known length only
                unfinished = unfinished & ~setup.criteria(ids[:, :end], None)
            channel.send(tokens, unfinished)
        else:
            tokens, unfinished = channel.receive(check_failure=False)
            ids[:, end - 1] = tokens
        if stops_by_eos:
            running[step] = unfinished.any()
            if (step + 1) % STOP_CHECK_INTERVAL == 0 and not bool(running[step]):
                done = step + 1
                break
        if step + 1 == steps:
            break
        position_ids = position_ids[:, -1:] + 1
        logits, states = decode(ids[:, end - 1:end], states, attention_mask=full_mask[:, :end],
                                position_ids=position_ids, check_inputs=False)
    if stops_by_eos:
        # HF stops right after the first step at which no row runs: there is one, the last
        # step run at the latest (where the max-length criterion stops every row).
        done = int(running[:done].long().argmin()) + 1
        if draws is not None:
            draws.rewind_to(done)
    return ids[:, :length + done].contiguous()


class _Draws:
    """Rank 0's choice of each step's tokens, as the host loop's ``_decide``: the processors on an
    fp32 copy of the logits, then the argmax or one ``torch.multinomial`` draw. When sampling,
    the generator's state after each draw is kept, for :meth:`rewind_to`."""

    def __init__(self, setup: GenerationSetup, generator, device):
        self.setup = setup
        self.sample = setup.config.do_sample
        self.generator = generator
        self.after_draw = []
        if self.sample and generator is None:  # multinomial's default: the device's generator
            self.generator = (torch.cuda.default_generators[device.index if device.index is not None
                                                            else torch.cuda.current_device()]
                              if device.type == "cuda" else torch.default_generator)

    def next_tokens(self, ids_so_far, last_logits):
        if not self.sample and not len(self.setup.processors):
            return last_logits.float().argmax(dim=-1)
        # A copy, as the host loop takes: a graphed decode step reuses its logits buffer.
        scores = self.setup.processors(ids_so_far, last_logits.to(copy=True, dtype=torch.float32))
        if not self.sample:
            return scores.argmax(dim=-1)
        tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=self.generator).squeeze(1)
        if not self.setup.stops_by_length_only:
            self.after_draw.append(self.generator.get_state())  # host-side on CUDA (seed, offset)
        return tokens

    def rewind_to(self, steps: int):
        """The generator as HF leaves it after ``steps`` draws (the loop may have drawn more)."""
        if self.after_draw and len(self.after_draw) > steps:
            self.generator.set_state(self.after_draw[steps - 1])


def uses_device_loop(setup: GenerationSetup, device_loop) -> bool:
    """Whether generation runs this loop: ``device_loop`` ``"auto"`` where it is eligible,
    ``True`` raises ``ValueError`` naming why not where it is not, ``False`` never."""
    if device_loop not in (True, False, "auto"):
        raise ValueError(f"device_loop must be True, False or 'auto', got {device_loop!r}")
    reason = why_not_device_loop(setup) if device_loop is not False else "device_loop=False"
    if reason is not None and device_loop is True:
        raise ValueError(f"device_loop=True: this generation needs the host loop: {reason}; pass device_loop='auto'")
    return reason is None
