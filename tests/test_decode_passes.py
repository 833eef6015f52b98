"""The inference passes of decode programs: ``inplace_decode_states`` (each new state written into
its state input, no clone or copy of it left) and ``fold_weights`` (weight-only subgraphs
computed once per binding of the weights). Tokens and logits against the unchanged program and
Hugging Face generate, at tp=1 for the six families and at tp=2 over gloo."""

import json
import weakref

import pytest
import torch

import ssmshard
from ssmshard.passes import run_pipeline
from ssmshard.program import op_name
from ssmshard.runtime.generate import generate
from ssmshard.runtime.static_kv import StaticKVDecode

from conftest import SIX_FAMILIES, small_model
from generate_worker import PAD, left_padded_prompts

INFERENCE_PASSES = ["inplace_decode_states", "fold_weights"]
STEPS = 6

# Each model's captured prefill program, captured once per test process: the helpers below only
# run it (the programs under test are decode programs), and a capture is most of such a test's time.
_PREFILL = weakref.WeakKeyDictionary()


def captured_prefill(model):
    if model not in _PREFILL:
        _PREFILL[model] = ssmshard.capture(model, mode="prefill")
    return _PREFILL[model]


def _decode_programs(model, **capture_options):
    plain = ssmshard.capture(model, mode="decode", **capture_options)
    passed = run_pipeline(ssmshard.capture(model, mode="decode", **capture_options), INFERENCE_PASSES)
    return plain, passed


def _state_placeholders(program):
    user = [n for n, spec in zip((n for n in program.graph.nodes if n.op == "placeholder"), program.inputs)
            if spec.kind == "user"]
    return user[3:3 + len(program.state_specs)]


def _weight_only_nodes(program):
    """call_function nodes reading nothing but weight placeholders and other such nodes."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    found = {n for n, spec in zip(placeholders, program.inputs) if spec.kind in ("parameter", "buffer", "constant")}
    weights = set(found)
    nodes = []
    for node in program.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(i in found for i in node.all_input_nodes):
            found.add(node)
            nodes.append(node)
    return [n for n in nodes if n not in weights]


def _ops(program, name):
    return program.op_counts()[name]


def _copies_of_states(program, ops=("clone", "copy_", "index_copy_")):
    """Nodes that clone a state input or copy into one."""
    states = set(_state_placeholders(program))
    return [n for n in program.graph.nodes if n.op == "call_function" and n.args and n.args[0] in states
            and op_name(n) in ops]


def decode_step_by_step(model, plain, passed, seed):
    """Logits of STEPS greedy decode steps of both programs from one prefill, and whether the
    passed program returned its state inputs themselves."""
    prefill = captured_prefill(model)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 9), seed)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        _, states = prefill(ids, attention_mask=mask, position_ids=positions)
        ours, theirs = [s.clone() for s in states], [s.clone() for s in states]
        token = ids[:, -1:]
        same_objects = True
        results = []
        for _ in range(STEPS):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
            expected, theirs = plain(token, theirs, attention_mask=mask, position_ids=positions)
            given = list(ours)
            got, ours = passed(token, ours, attention_mask=mask, position_ids=positions)
            same_objects &= all(a is b for i, (a, b) in enumerate(zip(given, ours)) if i in passed.states_in_place)
            results.append((got, expected))
            token = expected[:, -1].argmax(-1, keepdim=True)
    return results, same_objects


def greedy_tokens_and_hf(model, decode, seed, max_new_tokens=10):
    """Greedy tokens of the captured prefill and ``decode`` from left-padded prompts of three
    lengths, and HF generate's for the same prompts."""
    prefill = captured_prefill(model)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
    tokens = generate(prefill, decode, ids, mask, max_new_tokens=max_new_tokens, pad_token_id=PAD)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                            pad_token_id=PAD)
    return tokens, hf


def assert_same_logits_and_hf_tokens(model, plain, passed, seed, where: str) -> None:
    """``passed``'s decode logits equal ``plain``'s step by step, and its greedy tokens HF's."""
    for got, expected in decode_step_by_step(model, plain, passed, seed)[0]:
        assert torch.equal(got, expected), where
    tokens, hf = greedy_tokens_and_hf(model, passed, seed)
    assert torch.equal(tokens, hf), where


# Zamba's program is the largest of the six and its decode states are rewritten as Zamba2's are:
# in the slow set, to keep the default suite under its time budget.
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "zamba" else f
                                    for f in SIX_FAMILIES])
def test_decode_passes_keep_logits_and_hf_tokens(family, fresh_seed):
    model = small_model(family)
    plain, passed = _decode_programs(model)
    results, same_objects = decode_step_by_step(model, plain, passed, fresh_seed)
    where = f"{family} (seed {fresh_seed})"
    for got, expected in results:
        assert torch.equal(got, expected), where
    assert same_objects, where
    tokens, hf = greedy_tokens_and_hf(model, passed, fresh_seed)
    assert torch.equal(tokens, hf), where


@pytest.mark.parametrize("family", SIX_FAMILIES)
def test_decode_passes_leave_no_state_copy_and_no_weight_only_node(family):
    plain, passed = _decode_programs(small_model(family))
    recurrent = [i for i, spec in enumerate(plain.state_specs) if spec.kind in ("conv", "ssm")]
    # Every recurrent state is written in place by its op; growing keys/values are new tensors.
    assert passed.states_in_place == recurrent, family
    assert set(passed.states_written_by_op) <= set(recurrent), family
    states = {_state_placeholders(passed)[i] for i in recurrent}
    # Growing dynamic-cache keys/values are not rewritten (their clones stay): recurrent states only.
    assert not [n for n in _copies_of_states(passed) if n.args[0] in states], family
    assert not [n for n in passed.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                and n.args[0] in states], family
    before, after = _weight_only_nodes(plain), _weight_only_nodes(passed)
    assert after == [], (family, after)
    if recurrent:  # A = -exp(A_log.float()) per SSM layer: folded
        ssm_layers = sum(1 for spec in plain.state_specs if spec.kind == "ssm")
        assert len(_copies_of_states(plain)) >= len(recurrent), family
        assert _ops(plain, "exp") >= ssm_layers and _ops(passed, "exp") == _ops(plain, "exp") - ssm_layers, family
        assert len(before) >= 3 * ssm_layers, (family, len(before))
        assert len(passed.folded.names) > 0


@pytest.mark.parametrize("family", ["zamba2", "llama"])
def test_static_kv_decode_writes_keys_and_values_in_place(family, fresh_seed):
    model = small_model(family)
    plain, passed = _decode_programs(model, static_kv=True)
    assert passed.states_in_place == list(range(len(plain.state_specs))), passed.states_in_place
    # The step's keys and values are written into the buffers at their positions (index_copy_);
    # no whole buffer is cloned or copied.
    assert not _copies_of_states(passed, ops=("clone", "copy_"))
    assert _copies_of_states(passed, ops=("index_copy_",))
    prefill = captured_prefill(model)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), fresh_seed)
    options = dict(max_new_tokens=10, pad_token_id=PAD)
    length = ids.shape[1] + 16
    ours = generate(prefill, StaticKVDecode(passed, length), ids, mask, **options)
    unchanged = generate(prefill, StaticKVDecode(plain, length), ids, mask, **options)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    assert torch.equal(ours, unchanged) and torch.equal(ours, hf), f"{family} (seed {fresh_seed})"


def test_folded_weights_follow_replaced_and_modified_weights(fresh_seed):
    """A weight modified in place or replaced by another tensor: the folded values are recomputed."""
    model = small_model("mamba2")
    plain, passed = _decode_programs(model)
    weights = {fqn: w.detach().clone() for fqn, w in plain.weights.items()}
    a_log = next(fqn for fqn in weights if fqn.endswith("A_log"))
    for program in (plain, passed):
        program.weights = weights
    first = decode_step_by_step(model, plain, passed, fresh_seed)[0][0]
    assert torch.equal(*first)
    with torch.no_grad():
        weights[a_log].add_(torch.rand_like(weights[a_log]))
    for program in (plain, passed):  # the same dict: only the tensor's values changed
        assert program.weights[a_log] is weights[a_log]
    modified = decode_step_by_step(model, plain, passed, fresh_seed)[0][0]
    assert torch.equal(*modified) and not torch.equal(modified[1], first[1])
    replaced = dict(weights, **{a_log: torch.rand_like(weights[a_log])})
    for program in (plain, passed):
        program.weights = replaced
    again = decode_step_by_step(model, plain, passed, fresh_seed)[0][0]
    assert torch.equal(*again) and not torch.equal(again[1], modified[1])


def test_plan_runs_the_inference_passes_where_they_are_safe():
    plan = ssmshard.Plan(tp=1)
    assert plan.inference_steps("decode") == INFERENCE_PASSES
    assert plan.inference_steps("prefill") == [] and plan.inference_steps("forward") == []  # training plan
    inference = ssmshard.Plan(tp=1, training=False)
    assert inference.inference_steps("prefill") == ["fold_weights"] == inference.inference_steps("chunk")
    assert inference.inference_steps("forward") == []
    off = ssmshard.Plan(tp=1, skip_passes=["inplace_decode_states", "fold_weights"])
    steps = [s if isinstance(s, str) else s[0] for s in off.pipeline("decode", placements={}, rank=0, group="g")]
    assert not set(INFERENCE_PASSES) & set(steps) and steps
    with pytest.raises(ValueError, match="forward"):
        run_pipeline(ssmshard.capture(small_model("mamba"), mode="forward"), ["fold_weights"])


def _tp_results(rank, world, family, seed, out_path):
    model = small_model(family)
    ids, mask = left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed)
    # Generation only: neither module captures a forward program (lazy_forward).
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True)
    off = ssmshard.parallelize(model, ssmshard.Plan(tp=world, skip_passes=["inplace_decode_states", "fold_weights"]),
                               lazy_forward=True)
    ours = dm.generate(ids, mask, max_new_tokens=10)
    unchanged = off.generate(ids, mask, max_new_tokens=10)
    _, decode = dm.generation_programs()
    _, plain = off.generation_programs()
    if rank == 0:
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
        with open(out_path, "w") as f:
            json.dump({"ours": ours.tolist(), "unchanged": unchanged.tolist(), "hf": hf.tolist(),
                       "passes": [h["pass"] for h in decode.history][-2:],
                       "plain_passes": [h["pass"] for h in plain.history][-2:],
                       "state_copies": len(_copies_of_states(decode)),
                       "plain_state_copies": len(_copies_of_states(plain)),
                       "weight_only": len(_weight_only_nodes(decode)),
                       "plain_weight_only": len(_weight_only_nodes(plain))}, f)


def test_decode_passes_at_tp2(tmp_path, fresh_seed):
    out = tmp_path / "tp2.json"
    ssmshard.launch(_tp_results, 2, "mamba2", fresh_seed, str(out), backend="gloo")  # CPU tensors, also on GPU machines
    result = json.loads(out.read_text())
    assert result["ours"] == result["hf"] == result["unchanged"], fresh_seed
    assert result["passes"] == INFERENCE_PASSES and result["plain_passes"] != INFERENCE_PASSES
    assert result["state_copies"] == 0 and result["plain_state_copies"] > 0
    assert result["weight_only"] == 0 and result["plain_weight_only"] > 0
