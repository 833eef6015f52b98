"""Tensor parallelism against Hugging Face eager, in real processes over gloo."""

import json

import pytest
import torch

import ssmshard
from ssmshard.plan import PlanError

import tp_worker
from conftest import small_model

TOL = 1e-5
FORWARD_CASES = [
    ("mamba", {}, {}),
    ("mamba", {}, {"vocab_parallel": False}),
    ("falcon_mamba", {}, {}),
    ("mamba2", {}, {}),  # n_groups = 2: split at tp 2, two ranks per group at tp 4
    ("mamba2", {"n_groups": 1}, {}),
    ("mamba2", {"n_groups": 4}, {}),
    ("llama", {}, {}),  # 2 kv heads: replicated at tp 4
    ("llama", {"num_key_value_heads": 1}, {"vocab_parallel": False}),
    ("mistral", {}, {}),  # Llama-style decoders: Mistral (no sliding window here) and Qwen2
    ("qwen2", {}, {}),  # (biased q/k/v projections: their biases split with the heads)
    ("zamba", {}, {}),  # 2 Mamba heads, each split by channel; shared attention at two call sites
    ("zamba2", {}, {}),  # shared attention block at two call sites, with adapters
    # A reduce policy supplied by the test: reduce_scatter + all_gather instead of all_reduce.
    ("mamba2", {"n_groups": 1}, {"policy": "reduce_scatter_then_gather"}),
    ("zamba2", {}, {"policy": "reduce_scatter_then_gather"}),
]


# At tp = 1 nothing is split, so the cases that differ only in how they split (group and head
# counts, reduce policies) run the same program: one case per family.
TP1_CASES = [case for i, case in enumerate(FORWARD_CASES) if case[0] not in {c[0] for c in FORWARD_CASES[:i]}]
# At tp = 2 by default, less three cases whose path another case takes there: Mamba without a
# vocab-parallel head (Llama's second case has none either), four B/C groups (two a rank, split
# as the default two are), the reduce policy on Zamba2 (Mamba-2 has it). All of them in the slow
# set and at tp = 4.
REPEATS_AT_TP2 = [("mamba", {}, {"vocab_parallel": False}), ("mamba2", {"n_groups": 4}, {}),
                  ("zamba2", {}, {"policy": "reduce_scatter_then_gather"})]
assert all(case in FORWARD_CASES for case in REPEATS_AT_TP2)
TP2_CASES = [case for case in FORWARD_CASES if case not in REPEATS_AT_TP2]


@pytest.mark.parametrize("tp, cases", [(1, TP1_CASES), pytest.param(2, TP2_CASES, marks=pytest.mark.compat),
                                       pytest.param(2, FORWARD_CASES, marks=pytest.mark.slow),
                                       pytest.param(4, FORWARD_CASES, marks=pytest.mark.slow)],
                         ids=["1", "2", "2-all", "4"])
def test_logits_match_hf_eager(tp, cases, tmp_path, fresh_seed):
    out = tmp_path / "results.json"
    ssmshard.launch(tp_worker.forward_errors, tp, cases, fresh_seed, str(out), backend="gloo")
    results = json.loads(out.read_text())
    assert len(results) == len(cases)
    for r in results:
        assert r["err"] < TOL, f"tp={tp} {r} (seed {fresh_seed})"
        # Every op carries a placement, and every edge and collective agrees with them.
        assert not r["unplaced"] and not r["placement_problems"], r
        if tp > 1:
            assert r["collectives"] > 0
            if "reduce_scatter_then_gather" in r["plan"]:
                assert "all_reduce" not in r["collective_kinds"], r


@pytest.mark.parametrize("tp, cases", [
    (2, [("mamba", {}), ("llama", {}), ("mamba2", {"n_groups": 1}), ("zamba", {})]),
    # Rows shared by a subset of ranks: B/C groups and key/value heads held by two ranks each,
    # summed by sync_replicated_grads.
    (4, [("mamba2", {"n_groups": 2}), ("llama", {"num_key_value_heads": 2}),
         ("llama", {"num_key_value_heads": 1})]),
])
def test_gradients_are_slices_of_the_unsharded_gradients(tp, cases, tmp_path, fresh_seed):
    """Each rank's gradients against the matching slices of the unsharded captured program's
    (same ops, so any difference is the sharding) at 1e-5, and of HF eager's at 1e-4 (its
    per-token float32 scan rounds differently). Errors are over the whole gradient vector; see
    tp_worker.gradient_errors."""
    out = tmp_path / "grads.json"
    ssmshard.launch(tp_worker.gradient_errors, tp, cases, fresh_seed, str(out), backend="gloo")
    for rank_results in json.loads(out.read_text()):
        for r in rank_results:
            assert r["logits_err"] < TOL, r
            assert r["err"] < TOL, f"{r} (seed {fresh_seed})"
            assert r["err_vs_hf"] < 1e-4, f"{r} (seed {fresh_seed})"


def test_invalid_plan_names_the_parameter_and_numbers_before_any_process_group():
    assert not torch.distributed.is_initialized()
    model = small_model("llama")  # 4 attention heads
    program = ssmshard.capture(model)
    with pytest.raises(PlanError) as info:
        ssmshard.Plan(tp=3).layout(program, model)
    message = str(info.value)
    assert "q_proj" in message and "4" in message and "tp=3" in message
    odd_groups = small_model("mamba2", hidden_size=48, num_heads=12, head_dim=8, n_groups=3)
    with pytest.raises(PlanError, match=r"3 SSM groups \(n_groups\).*tp=4"):
        ssmshard.Plan(tp=4).layout(ssmshard.capture(odd_groups), odd_groups)
    zamba = small_model("zamba", n_mamba_heads=4)  # 4 heads of 32 channels
    with pytest.raises(PlanError, match=r"32 channels of each of the 4 Mamba heads.*tp=3"):
        ssmshard.Plan(tp=3).layout(ssmshard.capture(zamba), zamba)
    with pytest.raises(PlanError):
        ssmshard.parallelize(model, ssmshard.Plan(tp=3))  # fails before asking for a process group


def test_op_without_a_rule_fails_in_the_pass_naming_op_and_source():
    from ssmshard.passes import run_pipeline
    from ssmshard.passes.shard import ShardingError, sharding_steps

    model = small_model("mamba")
    program = ssmshard.capture(model)
    placements = ssmshard.Plan(tp=2).layout(program, model)
    # Feed the channel-sharded conv output into an op the rule table does not know.
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.ssmshard.causal_conv1d.default:
            with program.graph.inserting_after(node):
                odd = program.graph.call_function(torch.ops.aten.cumsum.default, (node, 1))
            odd.meta.update(node.meta)
            for user in list(node.users):
                if user is not odd:
                    user.replace_input_with(node, odd)
            break
    options = {"placements": placements, "rank": 0, "tp": 2, "group": "unused"}
    with pytest.raises(ShardingError, match=r"cumsum.*modeling_mamba.py"):
        run_pipeline(program, sharding_steps(options))


def test_plan_explain_lists_rules_and_placements():
    model = small_model("mamba2", n_groups=1)
    program = ssmshard.capture(model)
    text = ssmshard.Plan(tp=2).explain(program, model)
    line = next(l for l in text.splitlines() if "layers.0.mixer.in_proj.weight" in l)
    # [z, x] split by heads, B and C (one group) whole on both ranks, dt split by heads.
    assert "mamba2_in_proj" in line and line.endswith("S(0:128/2,128/2,16/1@2,16/1@2,8/2)")
    assert "lm_head.weight" in text and "vocab" in text
