"""Capture by repeating the last of three traced layers (layer_repeat.py) against tracing every
layer and against Hugging Face eager."""

import logging
import re

import pytest
import torch

import ssmshard
from ssmshard.layer_repeat import TRACED_LAYERS, why_not_repeatable
from ssmshard.reference_decode import hf_incremental_logits
from ssmshard.testing import rel_err

from conftest import simulated_gpu_plan_generation, small_model
from finishing_rows import check_finishing_rows
import generate_worker

TOL = 1e-5
LAYERS = 6  # three traced, three repeated
ALIKE_LAYERS = ["mamba", "falcon_mamba", "mamba2", "llama"]


def _capture(model, mode, monkeypatch, all_layers: bool, **kwargs):
    monkeypatch.setenv("SSMSHARD_TRACE_ALL_LAYERS", "1" if all_layers else "0")
    return ssmshard.capture(model, mode=mode, **kwargs)


def _nodes(program):
    """Each op node as (op, its layer, block and role tags), in graph order."""
    rows = []
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function":
            tags = node.meta["ssmshard"]
            role = re.sub(r"lifted_tensor_\d+$", "lifted_tensor", tags["role"] or "")  # see _weights
            rows.append((str(node.target), tags["layer"], tags["block"], role, tags["module"]))
    return rows


def _weights(program):
    # Export numbers the constants it lifts over the whole graph; their names are not the model's.
    return [(i.kind, re.sub(r"lifted_tensor_\d+$", "lifted_tensor", i.target or "")) for i in program.inputs]


@pytest.mark.compat
@pytest.mark.parametrize("family", ALIKE_LAYERS)
def test_repeated_layers_give_the_graph_of_every_layer_traced_and_hf_logits(family, monkeypatch, caplog, fresh_seed):
    model = small_model(family, num_hidden_layers=LAYERS)
    assert why_not_repeatable(model) is None
    # Llama's chunk program traces each layer's key length as its own symbol and the size
    # arithmetic on them differs from layer to layer: it is traced whole (and the log says why).
    modes = ["forward", "prefill", "decode"] + (["chunk"] if family != "llama" else ["static decode"])
    programs = {}
    for mode in modes:
        kwargs = {"static_kv": True} if mode == "static decode" else {}
        mode = mode.split()[-1]
        with caplog.at_level(logging.INFO, logger="ssmshard.capture"):
            caplog.clear()
            repeated = _capture(model, mode, monkeypatch, all_layers=False, **kwargs)
        assert "tracing all" not in caplog.text, f"{family} {mode}: {caplog.text}"
        traced = _capture(model, mode, monkeypatch, all_layers=True, **kwargs)
        assert _nodes(repeated) == _nodes(traced), f"{family} {mode}"
        assert _weights(repeated) == _weights(traced)
        assert repeated.state_specs == traced.state_specs and repeated.ranges == traced.ranges
        assert {row[1] for row in _nodes(repeated)} >= set(range(LAYERS))
        programs.setdefault(mode, repeated)

    generator = torch.Generator().manual_seed(fresh_seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=generator)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    assert rel_err(programs["forward"](ids), expected) < TOL, f"seed {fresh_seed}"

    prompt = torch.randint(0, vocab, (2, 9), generator=generator)
    next_tokens = torch.randint(0, vocab, (2, 4), generator=generator)
    expected = hf_incremental_logits(model, prompt, next_tokens)
    logits, states = programs["prefill"](prompt)
    errors = [rel_err(logits, expected[0])]
    for step in range(next_tokens.shape[1]):
        logits, states = programs["decode"](next_tokens[:, step:step + 1], states)
        errors.append(rel_err(logits, expected[step + 1]))
    assert max(errors) < TOL, f"{family}: {['%.1e' % e for e in errors]} (seed {fresh_seed})"


def test_models_whose_layers_differ_trace_every_layer_and_say_why(monkeypatch):
    monkeypatch.delenv("SSMSHARD_TRACE_ALL_LAYERS", raising=False)
    zamba2 = small_model("zamba2")  # mamba layers and hybrid (shared attention) layers
    reason = why_not_repeatable(zamba2)
    assert reason is not None and "differs from layer" in reason
    assert "nothing to repeat" in why_not_repeatable(small_model("mamba"))  # two layers
    monkeypatch.setenv("SSMSHARD_TRACE_ALL_LAYERS", "1")
    assert why_not_repeatable(small_model("mamba", num_hidden_layers=LAYERS)) == "SSMSHARD_TRACE_ALL_LAYERS is set"


def test_the_model_is_left_as_it_was(monkeypatch):
    model = small_model("mamba2", num_hidden_layers=LAYERS)
    layers_before = list(model.backbone.layers)
    program = _capture(model, "decode", monkeypatch, all_layers=False)
    assert list(model.backbone.layers) == layers_before and len(layers_before) == LAYERS
    assert model.config.num_hidden_layers == LAYERS
    assert len(program.state_specs) == 2 * LAYERS > 2 * TRACED_LAYERS
    assert sorted({spec.layer for spec in program.state_specs}) == list(range(LAYERS))


@pytest.mark.parametrize("family", ["mamba2", "llama"])
def test_repeated_programs_sharded_at_tp2_generate_hf_tokens(family, monkeypatch, fresh_seed):
    """The passes (sharding, the decode rewrites a GPU plan runs) over repeated programs: tp=2
    greedy generation equals HF's."""
    monkeypatch.delenv("SSMSHARD_TRACE_ALL_LAYERS", raising=False)
    model = small_model(family, num_hidden_layers=LAYERS)
    tokens, expected, mesh = simulated_gpu_plan_generation(model, fresh_seed, monkeypatch)
    assert torch.equal(tokens, expected), f"seed {fresh_seed}"
    decode = mesh.ranks[0]._generation["decode"]
    assert len({spec.layer for spec in decode.state_specs}) == LAYERS


def test_packed_forward_repeats_layers_too(monkeypatch):
    model = small_model("mamba", num_hidden_layers=LAYERS)
    repeated = _capture(model, "forward", monkeypatch, all_layers=False, packed=True)
    traced = _capture(model, "forward", monkeypatch, all_layers=True, packed=True)
    assert _nodes(repeated) == _nodes(traced) and _weights(repeated) == _weights(traced)
    assert repeated.ranges == traced.ranges


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ALIKE_LAYERS)
def test_repeated_programs_graph_their_decode_on_a_gpu(family, tmp_path, fresh_seed):
    """The GPU plan over repeated programs (Triton kernels, decode rewrites, CUDA-graph decode):
    graphed tokens equal eager's and HF's, finishing rows included."""
    import json

    out = tmp_path / "tokens.json"
    ssmshard.launch(generate_worker.graphed_vs_eager, 1, family, fresh_seed, str(out), False, LAYERS, backend="nccl")
    tokens = json.loads(out.read_text())
    assert tokens["graphed"] == tokens["eager"] == tokens["again"] == tokens["hf"], (family, fresh_seed)
    check_finishing_rows(tokens["finishing"], f"{family} {LAYERS} layers, graphed (seed {fresh_seed})")
