"""The decode step as a CUDA graph over static per-rank state buffers.

A decode step of a small batch is launch-bound: a few hundred kernels (and, under tensor
parallelism, one all-reduce per block) of a few microseconds each. Replaying the step as one
CUDA graph removes the per-kernel launch cost. The graph needs every input at a fixed address
with a fixed shape, so each rank preallocates its state buffers (its shard of every layer's
conv/SSM state, the shapes prefill returns) and the token/position buffers once per batch
size; the graph reads them and writes the new states back into the same buffers, so the state
cache never leaves them between steps. NCCL all-reduces inside the graph are captured with it
(NCCL >= 2.9.6); every rank replays the same graph in the same order.

Graphable decode programs: every input keeps its shape from step to step. That holds for
SSM-only models (Mamba, Falcon-Mamba, Mamba-2), whose states have fixed shapes and whose decode
step drops the mask, and for static-K/V decode programs (``capture(..., static_kv=True)``,
``runtime/static_kv.py``): attention models (Zamba, Zamba2, Llama) with their keys/values in
buffers of a maximum length, the mask over all of them and the cache position as inputs.
A dynamic-cache decode step of an attention model grows its keys/values each step, and
``why_not_graphable`` says so.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .static_kv import StaticKV

# Every captured decode graph of this process, so that all can be released before the process
# group is destroyed (``release_cuda_graphs``).
_CAPTURED: "weakref.WeakSet[GraphedDecode]" = weakref.WeakSet()


def release_cuda_graphs() -> int:
    """Release every decode CUDA graph this process captured; returns how many.

    A live CUDA graph that captured NCCL kernels keeps its communicator in use, and NCCL's
    teardown of that communicator (``dist.destroy_process_group()``) then waits for it forever
    (pytorch/pytorch#115388): call this (or ``DistributedModule.release_cuda_graphs()``) before
    destroying the process group. ``ssmshard.launch`` does it for its ranks. A released graph is
    captured again by the next ``generate``."""
    return release(list(_CAPTURED))


def release(graphs) -> int:
    """Release ``graphs`` (``GraphedDecode``s) once the device has finished replaying them;
    returns how many held a graph."""
    graphs = [graph for graph in graphs if graph.graph is not None]
    if graphs:
        torch.cuda.synchronize()
    for graph in graphs:
        graph.release()
    return len(graphs)


def why_not_graphable(program) -> Optional[str]:
    """None if ``program`` (a decode program) can be replayed as a CUDA graph, else the reason."""
    if program.mode != "decode":
        return f"only decode programs are graphed, not {program.mode}"
    if program.static_kv:
        return None
    growing = sorted({spec.kind for spec in program.state_specs if spec.kind in ("key", "value")})
    if growing:
        return (f"its attention {'/'.join(growing)} states grow by one token per step (capture the decode "
                "program with static_kv=True for static key/value buffers)")
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder"]
    user = [node for node, spec in zip(placeholders, program.inputs) if spec.kind == "user"]
    mask = user[1]  # (input_ids, attention_mask, position_ids, *states)
    if mask.users:
        return "its decode step reads the attention mask, whose length grows by one token per step"
    return None


def warm_up(run, stream) -> None:
    """Run ``run()`` twice on ``stream`` (allocator pools, Triton compilation, NCCL communicators)
    before a capture, as torch.cuda.graph requires; the current stream then waits for it."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)


class GraphedDecode:
    """``decode(token (b, 1), states, attention_mask=, position_ids=) -> (logits, states)`` of one
    program at one batch size, replayed from a CUDA graph.

    The returned ``logits`` and ``states`` are the graph's static buffers: read them before the
    next call. States passed in that are not those buffers (the prefill's) are copied into them.
    A static-K/V program needs ``static_length``, its buffers' positions: prefill's keys/values
    fill their first positions, and each step's growing mask is written into the graph's mask
    buffer (``static_kv.StaticKV``).
    """

    def __init__(self, program, static_length: Optional[int] = None):
        reason = why_not_graphable(program)
        if reason is not None:
            raise ValueError(f"this {program.family} decode program cannot be replayed as a CUDA graph: {reason}")
        if program.static_kv and static_length is None:
            raise ValueError("a static key/value decode program is graphed at one buffer length: pass static_length")
        self.program = program
        self.static = StaticKV(program, static_length) if program.static_kv else None
        self.graph = None

    def _capture(self, token, states, attention_mask, position_ids):
        self._record(self._bind(token, states, attention_mask, position_ids))

    def _bind(self, token, states, attention_mask, position_ids):
        """Allocate the input buffers the graph reads; returns ``run()``, one step over them."""
        self.token, self.positions = token.clone(), position_ids.clone()
        if self.static is not None:
            self.states = self.static.new_states(states)
            # The mask and cache-position buffers live in self.static; each call rewrites them.
            inputs = self.static.step_inputs(self.token, self.states, attention_mask, self.positions)
        else:
            self.states = [s.clone() for s in states]
            inputs = [self.token, attention_mask.clone(), self.positions, *self.states]
        # The sibling graph serving these shapes (an SSM step does not read the mask, so its
        # length is free; a static-K/V step's inputs keep their shapes).
        target = self.program.for_shapes(inputs)
        self.target = target
        self.weights = target.weight_args()
        step = target.executable

        def run():
            return step(*self.weights, *inputs)

        return run

    def _record(self, run):
        """Capture ``run`` as this object's graph: warm-up, capture, and the states copied back."""
        warm_up(run, torch.cuda.Stream())
        self.graph = torch.cuda.CUDAGraph()
        _CAPTURED.add(self)
        with torch.cuda.graph(self.graph):
            self._run_and_keep(run)

    def _run_and_keep(self, run):
        """One step under capture, its new states written into the state buffers."""
        outputs = run()
        # A program that writes its states in place (``inplace_decode_states``) returns the
        # buffers themselves: nothing to copy back for those.
        for buffer, new in zip(self.states, outputs[1:]):
            if new is not buffer:
                buffer.copy_(new)
        self.logits = outputs[0]

    def _replay(self):
        self.graph.replay()

    def release(self) -> None:
        """Free the graph and its buffers (the next call captures again)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        for name in ("token", "positions", "states", "logits", "target", "weights"):
            self.__dict__.pop(name, None)

    def reads_weights(self, weights: dict) -> bool:
        """Whether the graph still reads the tensors bound in ``weights`` (FQN -> tensor): a
        module whose parameters were replaced (``.to()``, ``load_state_dict(assign=True)``)
        needs a new graph."""
        if self.graph is None:
            return True
        bound = {id(w) for w in weights.values()}
        kinds = [i.kind for i in self.target.inputs if i.kind != "user"]
        if not all(id(w) in bound for w, kind in zip(self.weights, kinds) if kind != "derived"):
            return False
        # Values folded from the weights (``fold_weights``) are recomputed, as new tensors, when a
        # weight they read was modified in place: the graph would read the old ones.
        return all(now is then for now, then in zip(self.target.weight_args(), self.weights))

    def __call__(self, token, states, *, attention_mask, position_ids, check_inputs=False):
        # ``check_inputs``: the tokens come from the generation loop, always in range (and a check
        # would sync the host each step); accepted for the eager step's interface.
        if self.graph is None:
            self._capture(token, states, attention_mask, position_ids)
        if token.shape != self.token.shape:
            raise ValueError(f"this graph decodes batch {self.token.shape[0]}, got {token.shape[0]}")
        self.token.copy_(token)
        self.positions.copy_(position_ids)
        if self.static is not None:
            if states is not self.states:
                self.static.load(self.states, states)
            self.static.step_inputs(self.token, self.states, attention_mask, self.positions)
        elif states is not self.states:
            for buffer, state in zip(self.states, states):
                buffer.copy_(state)
        self._replay()
        return self.logits, self.states
