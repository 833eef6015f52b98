"""Decode over static key/value buffers: the step of attention models that a CUDA graph can replay.

A dynamic cache grows every key/value state by one token per step, so no two steps share
shapes. A static-K/V decode program (``capture(model, mode="decode", static_kv=True)``) takes
each key/value state as a buffer of ``length`` positions, ``(b, kv_heads, length, head_dim)``,
the attention mask over all of them ``(b, length)``, and the cache position (the slot the new
token's key/value is written to, as a 0-d tensor): every input keeps its shape and can keep
its address. :class:`StaticKV` turns what the generation loop passes a decode step (the
prefill's states, then the step's growing mask) into those inputs; :class:`StaticKVDecode`
runs the step eagerly (CPU, or CUDA without graphs) and ``cuda_graph.GraphedDecode`` replays
it. docs/static_kv.md has the design.
"""

from __future__ import annotations

import torch

KV_KINDS = ("key", "value")
KV_POSITIONS = 2  # (b, kv_heads, positions, head_dim)


def has_growing_states(program) -> bool:
    """Whether ``program``'s states include attention keys/values (which a dynamic cache grows)."""
    return any(spec.kind in KV_KINDS for spec in program.state_specs)


def positions_needed(prompt_length: int, max_length: int) -> int:
    """Key/value slots a generation of ``max_length`` tokens writes: the prompt's and one per fed
    back token (the last generated token is never fed back)."""
    return max(prompt_length, max_length - 1)


def check_static_length(length: int, prompt_length: int, max_length: int) -> None:
    """A clear error, before any work, when generation would run past the buffers."""
    needed = positions_needed(prompt_length, max_length)
    if needed > length:
        raise ValueError(f"static key/value buffers of {length} positions cannot hold this generation: a prompt of "
                         f"{prompt_length} tokens generating up to max_length={max_length} writes {needed} positions; "
                         f"pass static_kv={needed} (or more), fewer max_new_tokens, or static_kv=False")


class StaticKV:
    """The static inputs of one static-K/V decode program at one buffer length: the mask and
    cache-position buffers, and the conversion of prefill's states into static ones."""

    def __init__(self, program, length: int):
        if not program.static_kv:
            raise ValueError(f"this {program.family} decode program takes growing key/value states; capture it with "
                             "static_kv=True")
        if length < 1:
            raise ValueError(f"static key/value buffers need at least 1 position, got {length}")
        self.program = program
        self.length = length
        self.is_kv = [spec.kind in KV_KINDS for spec in program.state_specs]
        self.mask = self.cache_position = None

    def new_states(self, states) -> list[torch.Tensor]:
        """Fresh static states holding ``states`` (prefill's, or a static step's)."""
        out = []
        for tensor, is_kv in zip(states, self.is_kv):
            if is_kv:
                shape = list(tensor.shape)
                shape[KV_POSITIONS] = self.length
                out.append(tensor.new_zeros(shape))
            else:
                out.append(torch.empty_like(tensor))
        self.load(out, states)
        return out

    def load(self, buffers, states) -> None:
        """Copy ``states`` into the static ``buffers``: a key/value state into its first positions
        (the rest zeroed: slots the mask hides hold no stale values), any other state whole."""
        if len(states) != len(buffers):
            raise ValueError(f"this decode step takes {len(buffers)} state tensors, got {len(states)}")
        for buffer, state, is_kv in zip(buffers, states, self.is_kv):
            if not is_kv or state.shape[KV_POSITIONS] == self.length:
                buffer.copy_(state)
                continue
            filled = state.shape[KV_POSITIONS]
            if filled > self.length:
                raise ValueError(f"a prompt of {filled} positions does not fit static key/value buffers of "
                                 f"{self.length}; pass a larger static_kv")
            buffer.narrow(KV_POSITIONS, 0, filled).copy_(state)
            buffer.narrow(KV_POSITIONS, filled, self.length - filled).zero_()

    def step_inputs(self, token, states, attention_mask, position_ids) -> list[torch.Tensor]:
        """The program's user inputs for one step whose mask covers ``attention_mask.shape[1]``
        tokens (the new one last), written into this object's mask and position buffers."""
        seen = attention_mask.shape[1]
        if seen > self.length:
            raise ValueError(f"decode step {seen} runs past static key/value buffers of {self.length} positions; "
                             "size them for the whole generation (static_kv=)")
        batch = token.shape[0]
        if self.mask is None or self.mask.shape[0] != batch or self.mask.device != token.device:
            self.mask = torch.zeros(batch, self.length, dtype=torch.long, device=token.device)
            self.cache_position = torch.zeros((), dtype=torch.long, device=token.device)
        # The whole mask each step: a row's earlier slots may be padding, later ones unfilled.
        self.mask.narrow(1, 0, seen).copy_(attention_mask)
        self.mask.narrow(1, seen, self.length - seen).zero_()
        self.cache_position.fill_(seen - 1)
        return [token, self.mask, position_ids, *states, self.cache_position]


class StaticKVDecode:
    """``decode(token (b, 1), states, attention_mask=, position_ids=) -> (logits, states)`` run
    eagerly over static key/value buffers of ``length`` positions: the generation loop's decode
    interface, so it replaces the dynamic step as it is. The first call takes prefill's states
    and copies them into the buffers; later calls take the states the previous one returned."""

    def __init__(self, program, length: int):
        self.static = StaticKV(program, length)
        self.program = program
        self._returned = None

    @property
    def length(self) -> int:
        return self.static.length

    def __call__(self, token, states, *, attention_mask, position_ids, check_inputs=False):
        # ``check_inputs``: accepted for the dynamic step's interface; the loop's own tokens are in range.
        if states is not self._returned:
            states = self.static.new_states(states)
        inputs = self.static.step_inputs(token, states, attention_mask, position_ids)
        logits, self._returned = self.program.run(inputs)
        return logits, self._returned
