"""The decode step as a CUDA graph over static per-rank state buffers.

A decode step of a small batch is launch-bound: a few hundred kernels (and, under tensor
parallelism, one all-reduce per block) of a few microseconds each. Replaying the step as one
CUDA graph removes the per-kernel launch cost. The graph needs every input at a fixed address
with a fixed shape, so each rank preallocates its state buffers (its shard of every layer's
conv/SSM state, the shapes prefill returns) and the token/position buffers once per batch
size; the graph reads them and writes the new states back into the same buffers, so the state
cache never leaves them between steps. NCCL all-reduces inside the graph are captured with it
(NCCL >= 2.9.6); every rank replays the same graph in the same order.

Graphable decode programs: every state has a fixed shape and the attention mask (which grows
by one token per step) is not read. That holds for SSM-only models (Mamba, Falcon-Mamba,
Mamba-2), whose decode step drops the mask. Attention keys/values grow each step: static K/V
buffers up to a maximum length are not implemented, so hybrids and Llama decode eagerly, and
``why_not_graphable`` says so.
"""

from __future__ import annotations

from typing import Optional

import torch


def why_not_graphable(program) -> Optional[str]:
    """None if ``program`` (a decode program) can be replayed as a CUDA graph, else the reason."""
    if program.mode != "decode":
        return f"only decode programs are graphed, not {program.mode}"
    growing = sorted({spec.kind for spec in program.state_specs if spec.kind in ("key", "value")})
    if growing:
        return (f"its attention {'/'.join(growing)} states grow by one token per step (static K/V buffers "
                "are not implemented)")
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder"]
    user = [node for node, spec in zip(placeholders, program.inputs) if spec.kind == "user"]
    mask = user[1]  # (input_ids, attention_mask, position_ids, *states)
    if mask.users:
        return "its decode step reads the attention mask, whose length grows by one token per step"
    return None


class GraphedDecode:
    """``decode(token (b, 1), states, attention_mask=, position_ids=) -> (logits, states)`` of one
    program at one batch size, replayed from a CUDA graph.

    The returned ``logits`` and ``states`` are the graph's static buffers: read them before the
    next call. States passed in that are not those buffers (the prefill's) are copied into them.
    """

    def __init__(self, program):
        reason = why_not_graphable(program)
        if reason is not None:
            raise ValueError(f"this {program.family} decode program cannot be replayed as a CUDA graph: {reason}")
        self.program = program
        self.graph = None

    def _capture(self, token, states, attention_mask, position_ids):
        program = self.program
        # The sibling graph serving these shapes (the mask is not read, so its length is free).
        target = program.for_shapes([token, attention_mask, position_ids, *states])
        self.weights = target.weight_args()
        self.token, self.positions = token.clone(), position_ids.clone()
        self.mask = attention_mask.clone()
        self.states = [s.clone() for s in states]
        step = target.graph_module

        def run():
            return step(*self.weights, self.token, self.mask, self.positions, *self.states)

        # Warm up on a side stream (allocator pools, Triton compilation, NCCL communicators)
        # before capture, as torch.cuda.graph requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = run()
            for buffer, new in zip(self.states, outputs[1:]):
                buffer.copy_(new)
        self.logits = outputs[0]

    def reads_weights(self, weights: dict) -> bool:
        """Whether the graph still reads the tensors bound in ``weights`` (FQN -> tensor): a
        module whose parameters were replaced (``.to()``, ``load_state_dict(assign=True)``)
        needs a new graph."""
        if self.graph is None:
            return True
        bound = {id(w) for w in weights.values()}
        return all(id(w) in bound for w in self.weights)

    def __call__(self, token, states, *, attention_mask, position_ids, check_inputs=False):
        # ``check_inputs``: the tokens come from the generation loop, always in range (and a check
        # would sync the host each step); accepted for the eager step's interface.
        if self.graph is None:
            self._capture(token, states, attention_mask, position_ids)
        if token.shape != self.token.shape:
            raise ValueError(f"this graph decodes batch {self.token.shape[0]}, got {token.shape[0]}")
        self.token.copy_(token)
        self.positions.copy_(position_ids)
        if states is not self.states:
            for buffer, state in zip(self.states, states):
                buffer.copy_(state)
        self.graph.replay()
        return self.logits, self.states
