"""``Plan(ssm_state_dtype=...)``: generation programs holding the SSM states in bfloat16, against
Hugging Face eager decoding with its cache's SSM states cast to bfloat16 after the prefill (HF's
cache then writes each new state into them, rounded, as ssmshard's step does).

Tolerance: every step rounds each new state to bfloat16 (8 bits of mantissa). ssmshard's float32
state differs from HF's by float32 rounding (about 1e-7 relative, more at tp 2 where partial sums
are reduced in another order), and where that difference straddles a bfloat16 rounding boundary
the two stored states differ by one bfloat16 step (2^-8 relative) in that element. Over 25 inputs
of Zamba2 at tp 2 (the widest case) that put the logits up to 9.8e-5 from HF's rounded-state ones,
at most 0.11 of the distance between HF's bfloat16-state and float32-state logits (6.6e-4 to
3.0e-3). One more input (seed 102) put a single step 5.8e-4 away (0.42 of that step's distance),
its other steps within 3.0e-5: where such flips add up, one step's logits show them. So the test
asks for the median step within 3e-4 (over 15 further inputs at most 3.2e-5), and for the steps'
distances to HF's rounded-state logits to sum to at most 0.3 of the distances between HF's two
(at most 0.12 over those 16 inputs): the logits follow HF's rounded states, not its float32 ones.
"""

import statistics

import pytest
import torch

import ssmshard
from ssmshard.plan import PlanError
from ssmshard.reference_decode import hf_incremental_logits
from ssmshard.testing import rel_err

from conftest import small_model

TOL = 3e-4  # the median step's distance to HF's rounded-state logits
CLOSER = 0.3  # the steps' distances, summed, at most this fraction of those between HF's two
# Each Mamba-1 and Mamba-2 split and hybrid once; the other SSM families in the slow set.
CASES = [pytest.param(1, "mamba", marks=pytest.mark.compat), pytest.param(2, "mamba2"), pytest.param(2, "zamba2"),
         pytest.param(2, "mamba", marks=pytest.mark.slow), pytest.param(1, "falcon_mamba", marks=pytest.mark.slow),
         pytest.param(2, "zamba", marks=pytest.mark.slow)]


def _programs(mesh):
    """Every rank's generation programs, built one rank after another (export is not thread-safe)."""
    for dm in mesh.ranks:
        dm.generation_programs()


def _teacher_forced(dm, prompt, next_tokens):
    """Rank ``dm``'s logits of the prompt and each next token, and the dtypes of the states it returns."""
    prefill, decode = dm.generation_programs()
    logits, states = prefill(prompt)
    out, dtypes = [logits], [[s.dtype for s in states]]
    for step in range(next_tokens.shape[1]):
        logits, states = decode(next_tokens[:, step, None], states)
        out.append(logits)
        dtypes.append([s.dtype for s in states])
    return out, dtypes


@pytest.mark.parametrize("tp, family", CASES)
def test_generation_programs_hold_bf16_states_and_follow_hf_with_its_states_rounded(tp, family, fresh_seed):
    model = small_model(family)
    generator = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(0, model.config.vocab_size, (3, 16), generator=generator)
    next_tokens = torch.randint(0, model.config.vocab_size, (3, 8), generator=generator)
    rounded = hf_incremental_logits(model, prompt, next_tokens, ssm_state_dtype=torch.bfloat16)
    full = hf_incremental_logits(model, prompt, next_tokens)

    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp, ssm_state_dtype="bfloat16"))
    _programs(mesh)
    results = mesh.run(lambda dm: _teacher_forced(dm, prompt, next_tokens))
    where = f"{family} tp={tp} (seed {fresh_seed})"
    for rank, (logits, dtypes) in enumerate(results):
        specs = mesh.ranks[rank].generation_programs()[1].state_specs
        expected = [torch.bfloat16 if spec.kind == "ssm" else torch.float32 for spec in specs]
        assert torch.bfloat16 in expected, where
        assert all(step == expected for step in dtypes), (where, rank, dtypes[0])
        errors = [rel_err(ours, hf) for ours, hf in zip(logits, rounded)]
        apart = [rel_err(a, b) for a, b in zip(rounded, full)]
        assert statistics.median(errors) < TOL, (where, rank, ["%.1e" % e for e in errors])
        assert sum(errors) < CLOSER * sum(apart), (where, rank, ["%.1e" % e for e in errors], ["%.1e" % a for a in apart])


def test_generate_is_greedy_over_hf_logits_with_rounded_states(fresh_seed):
    """mesh.generate (prefill, decode loop, and a chunked prefill that continues from bfloat16
    states) at tp 2: each new token is the argmax of HF's logits with its states rounded alike,
    wherever its top two (EOS left out: ``min_new_tokens`` forbids it) are further apart than the
    rounding could move them. A chunked prefill also rounds the states at each chunk's end, which
    HF's one-shot prefill does not: up to 3e-3 of the largest logit (HF's own logits with bfloat16
    and with float32 states differ by that much), so ties are judged at 1e-2 of it."""
    model = small_model("mamba2")
    generator = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(3, model.config.vocab_size, (2, 11), generator=generator)
    eos = torch.tensor([model.generation_config.eos_token_id]).flatten()
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, ssm_state_dtype=torch.bfloat16))
    for chunk_size in (None, 4):
        out = mesh.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                            prefill_chunk_size=chunk_size)
        new = out[:, prompt.shape[1]:]
        hf = hf_incremental_logits(model, prompt, new[:, :-1], ssm_state_dtype=torch.bfloat16)
        checked = 0
        for step, logits in enumerate(hf):
            last = logits[:, -1].float().index_fill(-1, eos, float("-inf"))
            top2 = last.topk(2, dim=-1)
            clear = top2.values[:, 0] - top2.values[:, 1] > 1e-2 * logits[:, -1].abs().amax(-1)
            assert torch.equal(top2.indices[clear, 0], new[clear, step]), (chunk_size, step, fresh_seed)
            checked += int(clear.sum())
        assert checked >= new.numel() // 2, (chunk_size, checked)  # most tokens checked


def test_plan_errors_before_any_distributed_work():
    with pytest.raises(PlanError, match="ssm_state_dtype must be"):
        ssmshard.Plan(ssm_state_dtype="int8")
    with pytest.raises(PlanError, match="ssm_state_dtype"):
        ssmshard.Plan(tsp=2, ssm_state_dtype="bfloat16")
    with pytest.raises(PlanError, match="LlamaForCausalLM has none"):
        ssmshard.SimulatedMesh(small_model("llama"), ssmshard.Plan(tp=2, ssm_state_dtype=torch.bfloat16))
    assert ssmshard.Plan(ssm_state_dtype="torch.float16").ssm_state_dtype is torch.float16
    with pytest.raises(ValueError, match="forward program"):
        ssmshard.capture(small_model("mamba"), mode="forward", ssm_state_dtype=torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton decode kernels need a GPU")
@pytest.mark.parametrize("family", ["mamba", "mamba2", "zamba2"])
def test_graphed_decode_with_bf16_states_on_the_gpu(family, tmp_path, fresh_seed):
    """The GPU plan (Triton state update and fused decode kernels, a static-K/V graph for Zamba2)
    with bfloat16 states: graphed decode gives the eager tokens at batch 2 and 1, and each token is
    HF's greedy choice with its states rounded alike wherever HF's top two logits are further apart
    than 1e-2 of the largest (the near-tie bound of the CPU tests above)."""
    import json

    import generate_worker

    out = tmp_path / "tokens.json"
    ssmshard.launch(generate_worker.graphed_bf16_states, 1, family, fresh_seed, str(out), backend="nccl")
    result = json.loads(out.read_text())
    where = f"{family} (seed {fresh_seed})"
    assert "torch.bfloat16" in result["state_dtypes"], (where, result["state_dtypes"])
    for batch in result["batches"]:
        assert batch["graphed"] == batch["eager"] and batch["again"] == batch["eager"], where
        checked = 0
        for step, (top, margin, scale) in enumerate(zip(batch["hf_top"], batch["hf_margin"], batch["hf_scale"])):
            for row, (token, gap, largest) in enumerate(zip(top, margin, scale)):
                if gap > 1e-2 * largest:  # a near tie, as in the CPU tests above
                    assert batch["new"][row][step] == token, (where, row, step)
                    checked += 1
        assert checked >= len(batch["hf_top"]) * len(batch["new"]) // 2, (where, checked)  # most tokens checked
