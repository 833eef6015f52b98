"""Plan(allreduce='symm_mem'): the one-shot peer-memory all-reduce. Plan checks on CPU; on two
or more GPUs, its results against NCCL's (eager and in a CUDA graph) and generation with it."""

import json

import pytest
import torch

import ssmshard
from ssmshard.plan import PlanError
from ssmshard.runtime.launch import LaunchError

import symmetric_worker

# 2 and 4 ranks, one GPU each, where the machine has them (tp 4 is what decode scaling needs).
worlds = pytest.mark.parametrize("world", [
    pytest.param(n, id=f"tp{n}", marks=pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs"))
    for n in (2, 4)])


@pytest.mark.parametrize("bad", [dict(allreduce="custom"), dict(allreduce="symm_mem", allreduce_max_bytes=0)])
def test_plan_rejects_unknown_all_reduce_settings(bad):
    with pytest.raises(PlanError, match="allreduce"):
        ssmshard.Plan(tp=2, **bad)


def _parallelize_with_symm_mem(rank, world):
    from conftest import small_model
    ssmshard.parallelize(small_model("mamba"), ssmshard.Plan(tp=world, allreduce="symm_mem"))


def test_symm_mem_on_gloo_is_a_plan_error_before_any_collective():
    with pytest.raises(LaunchError, match=r"PlanError: Plan\(allreduce='symm_mem'\) needs (CUDA GPUs|an NCCL)"):
        ssmshard.launch(_parallelize_with_symm_mem, 2, backend="gloo", timeout=60)


@worlds
def test_one_shot_all_reduce_equals_nccl_eagerly_and_in_a_cuda_graph(tmp_path, world, fresh_seed):
    out = tmp_path / "symm.json"
    ssmshard.launch(symmetric_worker.collective_results, world, fresh_seed, str(out), backend="nccl")
    result = json.loads(out.read_text())
    for row in result["rows"]:
        # Integer-valued operands: any summation order gives the same bits.
        assert row["equal_to_nccl"] and row["same_on_every_rank"], row
        size = row["numel"] * (4 if "float32" in row["dtype"] else 2)
        assert row["path"] == ("symm_mem" if size <= 1 << 20 and size % 4 == 0 else "nccl"), row
    # A sum of N bf16 terms, rounded at most once per term: within N bf16 units of its magnitude.
    assert result["bf16_random_max_rel_err"] <= world * 2 ** -8, result
    assert all(result["graph_replays_equal_nccl"]), result


@worlds
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_generation_with_the_one_shot_all_reduce_gives_nccls_tokens(tmp_path, world, family, fresh_seed):
    out = tmp_path / "gen.json"
    ssmshard.launch(symmetric_worker.generation_results, world, family, fresh_seed, str(out), backend="nccl")
    result = json.loads(out.read_text())
    assert result["symm_calls"] > 0, result
    assert result["logits_rel_diff"] < 1e-5, result  # fp32; the summation orders differ
    nccl, symm = result["tokens"]["nccl"], result["tokens"]["symm_mem"]
    assert symm["eager"] == nccl["eager"] and symm["graphed"] == symm["eager"], result
