"""Helpers for checking programs against the Hugging Face model (tests, demo, benchmarks)."""

from __future__ import annotations

import math
import re

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the error measure every check here uses.

    The two may live on different devices (a kernel's CUDA output against a CPU float64
    reference): the comparison runs on the CPU.
    """
    actual, expected = _cpu_float64(actual), _cpu_float64(expected)
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def _cpu_float64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().double().cpu()


def joint_rel_err(pairs) -> float:
    """:func:`rel_err` of many tensors taken as one vector (``pairs``: ``(actual, expected)``):
    max |actual - expected| over all of them, over max |expected| over all of them.

    The measure for a whole gradient: a parameter whose gradient is a long cancelling sum
    (A_log's) moves by ~1e-5 of its own size when a reduction adds in another order, while a
    wrong shard or reduction moves gradients by O(1) of the model's largest.
    """
    diff = scale = 0.0
    for actual, expected in pairs:
        actual, expected = _cpu_float64(actual), _cpu_float64(expected)
        diff = max(diff, (actual - expected).abs().max().item())
        scale = max(scale, expected.abs().max().item())
    return diff / (scale if scale > 0 else 1.0)


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every weight so that each block moves the residual stream by O(1).

    HF's initialisers make SSM mixers nearly silent at small sizes (outputs ~1e-4), so a
    comparison against them could pass with the mixer broken. Here projections are scaled
    by 1/sqrt(fan_in), norms jitter around one, A spans decay rates 1..16 and time steps span
    1e-3..0.5, so scans carry real state across many tokens.

    Values are drawn on the device the weights live on (a billion-parameter model on a GPU is
    redrawn in well under a second; on the CPU the values are those of earlier versions).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, std=1.0):
        return torch.randn(shape, generator=gen, device=device) * std

    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = param.shape
        if leaf == "A_log":
            value = torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen))
        elif leaf in ("dt_bias", "dt_proj_bias") or name.endswith("dt_proj.bias"):
            dt = torch.exp(torch.empty(shape, device=device).uniform_(math.log(1e-3), math.log(0.5), generator=gen))
            value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif leaf == "D":
            value = randn(shape)
        elif "norm" in name.lower() and leaf == "weight":
            value = 1.0 + randn(shape, 0.1)
        elif leaf == "bias":
            value = randn(shape, 0.1)
        elif param.dim() >= 2:
            fan_in = shape[-1] if "conv1d" not in name else shape[-1]
            std = 1.0 if ("embed" in name) else 1.0 / math.sqrt(fan_in)
            value = randn(shape, std)
        else:
            value = randn(shape, 0.5)
        param.copy_(value.to(param.dtype))
    return model


class _PeakActivationBytes(torch.fx.Interpreter):
    """Runs a program's graph and records the peak bytes of live activations, as the interpreter
    frees each value after its last use. An activation is a value computed from the ids (weights,
    whole weights gathered for one op and other values of weights alone are not); ``skip``: nodes
    left out (the user-facing logits gather)."""

    def __init__(self, gm, skip=()):
        super().__init__(gm)
        self.peak = 0
        self.activations = set()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.activations.add(placeholders[-1])  # the ids: the one user input, after the weights
        for node in gm.graph.nodes:
            if node.op == "call_function" and any(a in self.activations for a in node.all_input_nodes):
                self.activations.add(node)
        self.activations -= set(skip) | set(placeholders)

    def run_node(self, n):
        out = super().run_node(n)
        live = 0
        for node, value in self.env.items():
            if node not in self.activations:
                continue
            values = value if isinstance(value, (tuple, list)) else [value]
            live += sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        self.peak = max(self.peak, live)
        return out


def peak_activation_bytes(program, ids) -> int:
    """Peak bytes of live activations of one call of ``program``'s graph on ``ids`` (weights bound),
    the program's outputs left out (a forward program's logits, gathered whole for the user)."""
    outputs = [n for n in program.graph.nodes if n.op == "output"][0].all_input_nodes
    interpreter = _PeakActivationBytes(program.graph_module, skip=outputs)
    with torch.no_grad():
        interpreter.run(*program.weight_args(), ids)
    return interpreter.peak


def masked_decode_attention(seed: int, batch: int, grouped: bool, device: str = "cuda"):
    """One decode step's attention inputs, bf16, and its left-padding mask in both forms: query
    ``[batch, 32, 1, 128]``, keys and values ``[batch, 8 or 32, 200, 128]`` (``grouped``: 8 key/value
    heads), up to 150 leading keys masked per row; the boolean mask (True: attend) and the additive
    one ``hoist_attention_mask`` builds (0, ``-inf`` where masked). Drawn on the CPU from ``seed``,
    so a seed names the same inputs on every machine."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 32, 1, 128, generator=generator).to(device, torch.bfloat16)
    k, v = (torch.randn(batch, 8 if grouped else 32, 200, 128, generator=generator).to(device, torch.bfloat16)
            for _ in range(2))
    pad = torch.randint(0, 150, (batch,), generator=generator)
    mask = (torch.arange(200)[None, :] >= pad[:, None]).to(device)[:, None, None, :]
    additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
    return q, k, v, mask, additive


def _without_lift_number(name: str | None) -> str:
    # Export numbers the constants it lifts over the whole graph (``lifted_tensor_<i>``): the
    # number says where in the trace a constant was lifted, not which of the model's it is.
    return re.sub(r"lifted_tensor_\d+$", "lifted_tensor", name or "")


def program_signature(program) -> dict:
    """What two captures of one model must share to be the same program (``layer_repeat.py``'s
    copies against tracing every layer): each op node as (op, layer, block, role, module) in graph
    order, the graph inputs as (kind, target) in order, the state specs and the symbols' ranges."""
    nodes = []
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function":
            tags = node.meta["ssmshard"]
            nodes.append((str(node.target), tags["layer"], tags["block"], _without_lift_number(tags["role"]),
                          tags["module"]))
    inputs = [(spec.kind, _without_lift_number(spec.target)) for spec in program.inputs]
    return {"nodes": nodes, "inputs": inputs, "states": program.state_specs, "ranges": program.ranges}
