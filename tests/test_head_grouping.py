"""``ssmshard.head_grouping``: the head permutation leaves the Hugging Face model's outputs
unchanged (attention with key/value groups, Mamba-2 with one and several SSM groups, a Zamba2
mamba layer, Mamba-1 channels), grouping lowers the SPD error where the model is built so that it must
(duplicated heads in Llama attention and a Mamba-2 mixer), the swap search is locally optimal, and the
errors name what is wrong."""

import copy

import pytest
import torch

import ssmshard
from ssmshard import head_grouping
from ssmshard.head_grouping import balanced_assignment, group_heads, partition_cost, permute_heads, unit_gram
from ssmshard.plan import PlanError
from ssmshard.testing import rel_err

from conftest import small_model

TOL = 1e-5

# (family, overrides, sync point, heads, heads per unit)
PERMUTED = {
    "llama_gqa": ("llama", {"attention_bias": True}, "layers.0.o_proj", 4, 2),
    "mamba2_groups": ("mamba2", {}, "layers.1.out_proj", 8, 4),
    "mamba2_one_group": ("mamba2", {"n_groups": 1}, "layers.0.out_proj", 8, 1),
    "zamba2_mamba": ("zamba2", {}, "layers.0.out_proj", 8, 4),
    "mamba1_channels": ("mamba", {}, "layers.1.out_proj", None, 1),  # heads: the mixer's channels
}


def _unit_permutation(heads, per_unit, gen):
    """A random permutation that moves whole units and shuffles heads within each."""
    units = torch.randperm(heads // per_unit, generator=gen).tolist()
    return [u * per_unit + int(k) for u in units for k in torch.randperm(per_unit, generator=gen)]


def _ids(model, seed, shape=(2, 11)):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(PERMUTED))
def test_permuted_model_equals_the_original(case, fresh_seed):
    family, overrides, point, heads, per_unit = PERMUTED[case]
    original = small_model(family, **overrides)
    model = copy.deepcopy(original)
    heads = heads or original.config.intermediate_size
    gen = torch.Generator().manual_seed(fresh_seed)
    permutation = _unit_permutation(heads, per_unit, gen)
    while permutation == list(range(heads)):
        permutation = _unit_permutation(heads, per_unit, gen)
    permute_heads(model, point, permutation)
    ids = _ids(model, fresh_seed)
    changed = [n for (n, p), q in zip(model.named_parameters(), original.parameters()) if not torch.equal(p, q)]
    assert changed, "the permutation changed no weight"
    with torch.no_grad():
        err = rel_err(model(ids).logits, original(ids).logits)
    assert err < TOL, f"{case} {permutation}: {err} (seed {fresh_seed})"


def test_a_permutation_that_splits_a_unit_is_refused():
    model = copy.deepcopy(small_model("llama"))  # 4 query heads, 2 key/value heads
    with pytest.raises(ValueError, match="splits a unit"):
        permute_heads(model, "layers.0.o_proj", [0, 2, 1, 3])


def test_gram_is_that_of_the_per_token_contributions(fresh_seed):
    model = small_model("mamba2")
    out_proj = model.backbone.layers[1].mixer.out_proj
    ids = _ids(model, fresh_seed, (48,)).view(-1)
    seen = []
    handle = out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().double()))
    try:
        gram, tokens = unit_gram(model, out_proj, 2, ids, window=16, batch_size=2, max_windows=None)
    finally:
        handle.remove()
    x = torch.cat([s.reshape(-1, 2, out_proj.in_features // 2) for s in seen])
    w = out_proj.weight.double().view(out_proj.out_features, 2, -1)
    contributions = torch.einsum("nuc,duc->nud", x, w)  # each unit's share of out_proj's output, per token
    assert tokens == x.shape[0] == 48
    assert rel_err(gram, torch.einsum("nud,nvd->uv", contributions, contributions)) < 1e-10


@pytest.mark.parametrize("units, tp", [(12, 2), (12, 3), (16, 4)])
def test_swap_search_is_balanced_and_locally_optimal(units, tp, fresh_seed, monkeypatch):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(40, units, 3, generator=gen, dtype=torch.float64)
    x[:, units // 2:] += x[:, :units // 2]  # correlated pairs, so the assignment matters
    gram = torch.einsum("nud,nvd->uv", x, x)
    monkeypatch.setattr(head_grouping, "EXHAUSTIVE_LIMIT", 0)
    groups, search = balanced_assignment(gram, tp)
    assert search == "greedy+swaps"
    assert sorted(u for g in groups for u in g) == list(range(units)) and {len(g) for g in groups} == {units // tp}
    cost = partition_cost(gram, groups)
    contiguous = [list(range(r * units // tp, (r + 1) * units // tp)) for r in range(tp)]
    assert cost <= partition_cost(gram, contiguous) + 1e-9 * abs(cost)
    for a in range(tp):  # no exchange of two units between two ranks lowers the cost
        for b in range(a + 1, tp):
            for u in groups[a]:
                for v in groups[b]:
                    swapped = [list(g) for g in groups]
                    swapped[a][swapped[a].index(u)], swapped[b][swapped[b].index(v)] = v, u
                    assert partition_cost(gram, swapped) >= cost - 1e-9 * abs(cost)


def _duplicated_heads_llama():
    """A 4-head Llama whose layer-0 heads 1 and 3 are copies of heads 0 and 2: with the contiguous
    split, rank 0 holds twice head 0 and rank 1 twice head 2, where {0, 2} / {1, 3} gives each
    rank exactly half of the sum."""
    model = copy.deepcopy(small_model("llama", num_key_value_heads=4))
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    with torch.no_grad():
        for src, dst in ((0, 1), (2, 3)):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight[dst * d:(dst + 1) * d] = proj.weight[src * d:(src + 1) * d]
            attn.o_proj.weight[:, dst * d:(dst + 1) * d] = attn.o_proj.weight[:, src * d:(src + 1) * d]
    return model


def _duplicated_heads_mamba2():
    """A Mamba-2 (one SSM group, 8 heads) whose layer-0 heads 1, 3, 5, 7 copy heads 0, 2, 4, 6:
    the contiguous split gives each rank two copies of two heads, where one copy of each of the
    four on each rank gives each exactly half of the sum."""
    model = copy.deepcopy(small_model("mamba2", n_groups=1))
    mixer = model.backbone.layers[0].mixer
    d, inner, n = mixer.head_dim, mixer.num_heads * mixer.head_dim, mixer.ssm_state_size
    with torch.no_grad():
        for src, dst in ((0, 1), (2, 3), (4, 5), (6, 7)):
            s, t = slice(src * d, (src + 1) * d), slice(dst * d, (dst + 1) * d)
            for offset in (0, inner):  # gate and x rows of in_proj
                mixer.in_proj.weight[offset + dst * d:offset + (dst + 1) * d] = \
                    mixer.in_proj.weight[offset + src * d:offset + (src + 1) * d]
            mixer.in_proj.weight[2 * inner + 2 * n + dst] = mixer.in_proj.weight[2 * inner + 2 * n + src]  # dt
            mixer.conv1d.weight[t] = mixer.conv1d.weight[s]
            mixer.conv1d.bias[t] = mixer.conv1d.bias[s]
            mixer.norm.weight[t] = mixer.norm.weight[s]
            mixer.out_proj.weight[:, t] = mixer.out_proj.weight[:, s]
            for param in (mixer.dt_bias, mixer.A_log, mixer.D):
                param[dst] = param[src]
    return model


DUPLICATED = {"llama": (_duplicated_heads_llama, "layers.0.o_proj", 4),
              "mamba2": (_duplicated_heads_mamba2, "layers.0.out_proj", 8)}


@pytest.mark.parametrize("case", list(DUPLICATED))
def test_grouping_lowers_the_spd_error(case, fresh_seed):
    build, point, heads = DUPLICATED[case]
    model = build()
    original = copy.deepcopy(model)
    calibration = _ids(model, fresh_seed, (64,)).view(-1)
    result = group_heads(model, 2, point, calibration, window=16, batch_size=2)
    # each rank holds one copy of each pair, so P_0 = P_1 = P / 2: sum_i ||P - P_i||^2 = ||P||^2 / 2
    for group in result.assignment:
        assert sorted(u // 2 for u in group) == list(range(heads // 2)), result.assignment
    assert abs(result.error_after - 0.5) < 1e-9, result
    assert result.error_before > result.error_after

    ids = _ids(model, fresh_seed + 1, (3, 13))  # held-out: fresh ids
    plan = ssmshard.Plan(tp=2, drop_syncs=[point])
    # The logits' error over all of them (||a - b|| / ||b||), what the grouping minimises at the
    # sync point, not the largest element's: over 16 seeds of mamba2 grouping took the first
    # from 0.39-0.44 to 0.24-0.28, while the second moved either way on single logits
    # (0.57276 -> 0.57283 with seed 2199512477).
    norm_err = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    with torch.no_grad():
        exact = original(ids).logits
        assert rel_err(model(ids).logits, exact) < TOL  # without SPD: unchanged
        before = norm_err(ssmshard.SimulatedMesh(original, plan)(ids), exact)
        after = norm_err(ssmshard.SimulatedMesh(model, plan)(ids), exact)
    assert after < before, f"{case}: SPD error with grouping {after} >= without {before} (seed {fresh_seed})"


@pytest.mark.parametrize("family, point, message", [
    ("llama", "layers.7.o_proj", "no o_proj in decoder layer 7"),
    ("llama", "lm_head", "not a sync point name"),
    ("llama", "embed", "not a sync point name"),
    ("llama", "layers.0.down_proj", "without heads"),
    ("mamba", "layers.0.x_proj", "without heads"),
    ("zamba2", "layers.1.o_proj", "shared by several layers"),
])
def test_clear_errors(family, point, message):
    model = copy.deepcopy(small_model(family))
    calibration = torch.zeros(32, dtype=torch.long)
    with pytest.raises(PlanError, match=message):
        group_heads(model, 2, point, calibration, window=16)


def test_units_must_divide_over_the_ranks():
    model = copy.deepcopy(small_model("llama"))  # 2 key/value groups
    with pytest.raises(PlanError, match="not divisible by tp=4"):
        group_heads(model, 4, "layers.0.o_proj", torch.zeros(32, dtype=torch.long), window=16)
