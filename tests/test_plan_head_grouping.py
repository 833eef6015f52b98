"""Head grouping carried by the plan (``Plan(head_permutations=...)``, docs/spd.md).

Without a drop the permutation changes no value: the plan's logits equal Hugging Face eager.
With a drop it is the same SPD model as the one whose weights ``permute_heads`` re-ordered in
place, run under the plain SPD plan: the same local weights, hence the same logits, from the model
in memory (``SimulatedMesh``) and from the unpermuted checkpoint (2 gloo processes, each reading
only its own, permuted, slices). The model itself is never changed; every mistake is a
``PlanError`` before any distributed work.
"""

import copy
import json
import os

import pytest
import torch

import ssmshard
from ssmshard.head_grouping import group_heads, permute_heads
from ssmshard.plan import PlanError
from ssmshard.spd_recovery import recover
from ssmshard.testing import rel_err

import head_grouping_worker
from conftest import small_model
from test_head_grouping import _unit_permutation

TOL_VS_HF = 1e-5
TOL_SAME = 1e-6

# family, config overrides, sync point (a drop there is repaired by a later kept sync), heads, heads per unit
CASES = {
    "llama": ("llama", {}, "layers.0.o_proj", 4, 2),  # 2 key/value groups of 2 query heads
    "mamba2": ("mamba2", {}, "layers.0.out_proj", 8, 4),  # 2 SSM groups of 4 heads, B/C rows move with them
}
SLOW_CASES = {"mamba2_one_group": ("mamba2", {"n_groups": 1}, "layers.0.out_proj", 8, 1)}  # heads move alone


def _permutation(heads, per_unit, seed):
    """A random permutation of whole units (heads shuffled within each), never the identity."""
    gen = torch.Generator().manual_seed(seed)
    permutation = _unit_permutation(heads, per_unit, gen)
    while permutation == list(range(heads)):
        permutation = _unit_permutation(heads, per_unit, gen)
    return permutation


def _ids(model, seed, shape=(2, 9)):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed + 1))


def _check_plan_carried(case, tp, seed):
    family, overrides, point, heads, per_unit = case
    model = small_model(family, **overrides)
    before = {n: p.clone() for n, p in model.named_parameters()}
    permutation = _permutation(heads, per_unit, seed)
    program = ssmshard.capture(model, mode="forward")
    ids = _ids(model, seed)
    label = f"{family} {overrides} tp={tp} {permutation} (seed {seed})"

    # (a) no drop: only which heads each rank holds changes, not a value
    exact = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp, head_permutations={point: permutation}),
                                   program=program)
    with torch.no_grad():
        err = rel_err(exact(ids), model(ids).logits)
    assert err < TOL_VS_HF, (err, label)
    assert f"{point}  [heads permuted]" in exact.program.report(), label

    # (b) with the drop: the plan-carried permutation is the in-place one under the plain SPD plan
    carried = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp, drop_syncs=[point],
                                                          head_permutations={point: permutation}), program=program)
    permuted = copy.deepcopy(model)
    permute_heads(permuted, point, permutation)
    in_place = ssmshard.SimulatedMesh(permuted, ssmshard.Plan(tp=tp, drop_syncs=[point]), program=program)
    with torch.no_grad():
        ours, want = carried(ids), in_place(ids)
    assert rel_err(ours, want) < TOL_SAME, (rel_err(ours, want), label)
    for rank in range(tp):  # the same local weights on every rank
        for fqn in carried.program.param_specs:
            assert torch.equal(carried.ranks[rank].local_weight(fqn), in_place.ranks[rank].local_weight(fqn)), \
                (fqn, rank, label)
    assert f"{point}  [dropped, heads permuted]" in carried.program.report(), label
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), f"the model was changed: {label}"


# (name, tp) pairs of the default suite; the rest are slow (each pair builds three meshes)
DEFAULT = [("llama", 2), ("mamba2", 4)]


@pytest.mark.parametrize("name, tp", [pytest.param(name, tp, marks=() if (name, tp) in DEFAULT else pytest.mark.slow)
                                      for name in [*CASES, *SLOW_CASES] for tp in (2, 4)])
def test_plan_carried_permutation(name, tp, fresh_seed):
    _check_plan_carried({**CASES, **SLOW_CASES}[name], tp, fresh_seed)


@pytest.mark.slow  # two processes start and import torch: the slowest case here
def test_checkpoint_is_read_through_the_permutation(tmp_path, fresh_seed):
    """(c): 2 gloo processes load the unpermuted checkpoint on a meta model; their logits are those
    of the model permuted in place under the plain SPD plan, and each rank reads only its slices."""
    cases, expected = [], []
    for index, (name, (family, overrides, point, heads, per_unit)) in enumerate(CASES.items()):
        model = small_model(family, **overrides)
        directory = tmp_path / name
        model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": "20KB"} if index else {}))
        permutation = _permutation(heads, per_unit, fresh_seed + index)
        ids = _ids(model, fresh_seed + index)
        permuted = copy.deepcopy(model)
        permute_heads(permuted, point, permutation)
        with torch.no_grad():
            expected.append(ssmshard.SimulatedMesh(permuted, ssmshard.Plan(tp=2, drop_syncs=[point]))(ids))
        cases.append({"family": family, "overrides": overrides, "point": point, "permutation": permutation,
                      "dir": str(directory), "ids": ids.tolist()})
    out = tmp_path / "results.json"
    ssmshard.launch(head_grouping_worker.run_all, 2, cases, str(out), backend="gloo")
    ranks = json.loads(out.read_text())
    for rank, results in enumerate(ranks):
        for case, want, got in zip(cases, expected, results):
            label = f"{case['family']} {case['permutation']} rank {rank} (seed {fresh_seed})"
            err = rel_err(torch.tensor(got["logits"]), want)
            assert err < TOL_SAME, (err, label)
            assert got["elements_read"] == got["local_elements"], (got["elements_read"], got["local_elements"], label)
            assert f"{case['point']}  [dropped, heads permuted]" in got["report"], label


def test_group_heads_result_plugs_into_the_plan(fresh_seed):
    """group_heads(apply=False) leaves the model alone; its result, directly or through JSON, is the
    plan's permutation, and gives the logits of the grouping applied in place."""
    model = small_model("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    calibration = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(fresh_seed))
    grouping = group_heads(model, 2, "layers.0.o_proj", calibration, window=16, apply=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    saved = json.loads(json.dumps([grouping.as_dict()]))
    plans = [ssmshard.Plan(tp=2, drop_syncs=["layers.0.o_proj"], head_permutations=form)
             for form in (grouping, grouping.as_dict(), saved, {"layers.0.o_proj": grouping.head_permutation})]
    assert all(p.head_permutations == {"layers.0.o_proj": grouping.head_permutation} for p in plans)
    assert json.loads(json.dumps(plans[2].head_permutations)) == plans[2].head_permutations
    applied = copy.deepcopy(model)
    group_heads(applied, 2, "layers.0.o_proj", calibration, window=16)
    ids = _ids(model, fresh_seed)
    program = ssmshard.capture(model, mode="forward")
    with torch.no_grad():
        ours = ssmshard.SimulatedMesh(model, plans[2], program=program)(ids)
        want = ssmshard.SimulatedMesh(applied, ssmshard.Plan(tp=2, drop_syncs=["layers.0.o_proj"]),
                                      program=program)(ids)
    assert rel_err(ours, want) < TOL_SAME
    assert "head_permutations at ['layers.0.o_proj']" in plans[2].explain(program, model)


# ----------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def llama():
    model = small_model("llama")
    return model, ssmshard.capture(model, mode="forward")


@pytest.mark.parametrize("point, permutation, message", [
    ("layers.9.o_proj", [0, 1, 2, 3], "no o_proj in decoder layer 9"),
    ("o_proj", [0, 1, 2, 3], "not a sync point name"),
    ("layers.0.down_proj", [0, 1], "an op without heads"),
    ("layers.0.o_proj", [0, 1, 2], r"must be a permutation of range\(4\)"),
    ("layers.0.o_proj", [0, 0, 1, 2], r"must be a permutation of range\(4\)"),
    ("layers.0.o_proj", [0, 2, 1, 3], r"splits a unit \(a kv_group of 2 heads\)"),
])
def test_wrong_permutations_are_plan_errors(llama, point, permutation, message):
    model, program = llama
    plan = ssmshard.Plan(tp=2, head_permutations={point: permutation})
    with pytest.raises(PlanError, match=message):
        plan.weight_permutations(program, model)


def test_a_permutation_that_splits_an_ssm_group_is_refused():
    model = small_model("mamba2")  # 2 groups of 4 heads
    plan = ssmshard.Plan(tp=2, head_permutations={"layers.0.out_proj": [0, 1, 2, 4, 3, 5, 6, 7]})
    with pytest.raises(PlanError, match=r"splits a unit \(a ssm_group of 4 heads\)"):
        plan.weight_permutations(None, model)


def test_a_shared_transformer_is_refused():
    model = small_model("zamba2")
    shared = next(f"layers.{i}.o_proj" for i, layer in enumerate(model.model.layers)
                  if getattr(layer, "shared_transformer", None) is not None)
    plan = ssmshard.Plan(tp=2, head_permutations={shared: [0, 1, 2, 3]})
    with pytest.raises(PlanError, match="shared by several layers"):
        plan.weight_permutations(None, model)


def test_errors_come_before_any_process_group(llama):
    model, _ = llama
    with pytest.raises(PlanError, match="splits a unit"):  # no process group exists in this process
        ssmshard.parallelize(model, ssmshard.Plan(tp=2, head_permutations={"layers.0.o_proj": [0, 2, 1, 3]}))


@pytest.mark.parametrize("value, message", [
    ("layers.0.o_proj", "head_permutations must be"),
    ({"layers.0.o_proj": "0123"}, "must be a list of head indices"),
    ({"sync_point": "layers.0.o_proj", "head_permutation": [2, 3, 0, 1], "tp": 4}, "chosen for tp=4"),
    ([{"sync_point": "layers.0.o_proj", "head_permutation": [2, 3, 0, 1]},
      {"sync_point": "layers.0.o_proj", "head_permutation": [0, 1, 2, 3]}], "two different permutations"),
])
def test_malformed_head_permutations(value, message):
    with pytest.raises(PlanError, match=message):
        ssmshard.Plan(tp=2, head_permutations=value)


def test_what_does_not_combine_with_it(llama):
    with pytest.raises(PlanError, match="head_permutations"):
        ssmshard.Plan(tsp=2, head_permutations={"layers.0.o_proj": [2, 3, 0, 1]})
    model, _ = llama
    plan = ssmshard.Plan(tp=2, drop_syncs=["layers.0.o_proj"], head_permutations={"layers.0.o_proj": [2, 3, 0, 1]})
    with pytest.raises(PlanError, match="apply the grouping to the model first"):
        recover(model, plan, torch.zeros(64, dtype=torch.long), train=["model.layers.1.*"])
