"""SPD (sync-point drop, the ``spd`` pass) against an emulation written from the unsharded
Hugging Face model's own modules.

The oracle (``spd_emulation``) knows nothing of the pass: it runs the HF model with forward
hooks on the row-parallel linears. Rank r's partial of a row-parallel linear is its input's
r-th contiguous chunk of features times the matching columns of the weight (heads, MLP or SSM
channels are split evenly and in order at these sizes); the bias is added once to a sum.
For a dropped sync point D followed by the kept all-reduces K_1 .. K_m (K_m the first one
whose sum is added to the residual stream), rank r runs the model with D returning
``bias + P_r`` (its stream continues with ``X + b + P_r``) and the earlier K_j returning their
sums, and gives its partial of K's input; the exact run then returns ``bias + sum P`` at D and
``sum of the ranks' partials of K_m`` at K_m, so the stream after K_m is
``X + b + sum P + sum Q``. Everything else is the HF model computing.

Ranks run in one process on ``ssmshard.SimulatedMesh`` (tests/test_simulated_mesh.py checks
it against real gloo processes).
"""

import pytest
import torch

import ssmshard
from ssmshard.placement import Shard, local_slice
from ssmshard.plan import PlanError
from ssmshard.passes.shard import check_placements
from ssmshard.testing import rel_err

from conftest import gated_norm_has_groups, small_model

TOL = 1e-5


# ----------------------------------------------------------------------------- the oracle
def _partial(linear, x, rank, tp):
    n = linear.in_features // tp
    cols = slice(rank * n, (rank + 1) * n)
    return x[..., cols] @ linear.weight[:, cols].T


def _biased(linear, y):
    return y if linear.bias is None else y + linear.bias


def _run_with(model, ids, overrides, capture=None):
    """Logits of ``model(ids)`` with ``overrides[(module, call)](input)`` replacing those calls'
    outputs; with ``capture=(module, call)``, also that call's input."""
    counts, captured = {}, {}

    def hook(module, args, out):
        key = (module, counts.get(module, 0))
        counts[module] = key[1] + 1
        if key == capture:
            captured["x"] = args[0]
        if key in overrides:
            return overrides[key](args[0])
        return None

    modules = {m for m, _ in overrides} | ({capture[0]} if capture else set())
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        logits = model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, captured.get("x")


def spd_emulation(model, ids, tp, dropped, chain):
    """Logits of the SPD model: ``dropped`` = (linear, call) of the dropped sync point, ``chain`` =
    the kept row-parallel (linear, call)s after it, the last one absorbing its partials."""
    linear = dropped[0]

    def rank_stream(rank):
        return {dropped: lambda x: _biased(linear, _partial(linear, x, rank, tp))}

    sums = {}
    for key in chain:
        parts = []
        for rank in range(tp):
            overrides = rank_stream(rank) | {k: (lambda x, v=v: v) for k, v in sums.items()}
            _, x = _run_with(model, ids, overrides, capture=key)
            parts.append(_partial(key[0], x, rank, tp))
        sums[key] = _biased(key[0], sum(parts))
    exact = {dropped: lambda x: _biased(linear, sum(_partial(linear, x, r, tp) for r in range(tp))),
             chain[-1]: lambda x: sums[chain[-1]]}
    return _run_with(model, ids, exact)[0]


# ----------------------------------------------------------------------------- cases
def _llama(**overrides):
    return small_model("llama", attention_bias=True, mlp_bias=True, **overrides)  # biases: added once


def _llama_layers(model):
    return model.model.layers


CASES = {
    # name: (model builder, sync point, (dropped, chain) from the model)
    "llama_o_proj": (_llama, "layers.0.o_proj",
                     lambda m: ((_llama_layers(m)[0].self_attn.o_proj, 0), [(_llama_layers(m)[0].mlp.down_proj, 0)])),
    "llama_down_proj": (_llama, "layers.0.down_proj",
                        lambda m: ((_llama_layers(m)[0].mlp.down_proj, 0), [(_llama_layers(m)[1].self_attn.o_proj, 0)])),
    "mamba2_out_proj": (lambda: small_model("mamba2"), "layers.0.out_proj",
                        lambda m: ((m.backbone.layers[0].mixer.out_proj, 0), [(m.backbone.layers[1].mixer.out_proj, 0)])),
    # Mamba-1: the next layer's x_proj sums partials the ranks computed from different inputs.
    "mamba_out_proj": (lambda: small_model("mamba"), "layers.0.out_proj",
                       lambda m: ((m.backbone.layers[0].mixer.out_proj, 0),
                                  [(m.backbone.layers[1].mixer.x_proj, 0), (m.backbone.layers[1].mixer.out_proj, 0)])),
    # Falcon-Mamba: as Mamba-1, with B, C and dt normalised after the next layer's x_proj sum.
    "falcon_mamba_out_proj": (lambda: small_model("falcon_mamba"), "layers.0.out_proj",
                              lambda m: ((m.backbone.layers[0].mixer.out_proj, 0),
                                         [(m.backbone.layers[1].mixer.x_proj, 0),
                                          (m.backbone.layers[1].mixer.out_proj, 0)])),
    # Zamba2: layer 1 runs the shared transformer (o_proj, down_proj) on the stream, then its mamba.
    "zamba2_out_proj": (lambda: small_model("zamba2"), "layers.0.out_proj",
                        lambda m: ((m.model.layers[0].mamba.out_proj, 0),
                                   [(m.model.layers[1].shared_transformer.self_attn.o_proj, 0),
                                    (m.model.layers[1].shared_transformer.feed_forward.down_proj, 0),
                                    (m.model.layers[1].mamba_decoder.mamba.out_proj, 0)])),
    # Unrepaired: the shared transformer has no residual around attention; its MLP reads the
    # rank's partial, and the MLP's kept all-reduce sums what the ranks made of their own.
    "zamba2_shared_o_proj": (lambda: small_model("zamba2"), "layers.1.o_proj",
                             lambda m: ((m.model.layers[1].shared_transformer.self_attn.o_proj, 0),
                                        [(m.model.layers[1].shared_transformer.feed_forward.down_proj, 0)])),
    # Zamba's shared block, the same way; its first call (layer 2) of two (layers 2 and 4).
    "zamba_shared_o_proj": (lambda: small_model("zamba"), "layers.2.o_proj",
                            lambda m: ((m.model.layers[2].shared_transf.self_attn.o_proj, 0),
                                       [(m.model.layers[2].shared_transf.feed_forward.down_proj, 0)])),
}


def _ids(model, seed, shape=(2, 11)):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _all_reduces(mesh):
    return mesh.program.op_counts()["ssmshard.all_reduce"]


def skip_where_the_emulation_is_no_oracle(case, model):
    if case == "mamba2_out_proj" and not gated_norm_has_groups(model):
        pytest.skip("this transformers' Mamba-2 gated RMSNorm spans all channels (transformers 5.17; newer ones "
                    "normalise each group): its statistic is summed over the ranks, so each rank's channels depend "
                    "on the other ranks' streams, which the per-rank emulation from HF modules cannot reproduce")


@pytest.mark.parametrize("case, tp", [("llama_o_proj", 2), pytest.param("llama_o_proj", 4, marks=pytest.mark.slow), ("llama_down_proj", 2),
                                      ("mamba2_out_proj", 2), ("mamba_out_proj", 2), ("zamba2_out_proj", 2),
                                      ("zamba2_shared_o_proj", 2), ("falcon_mamba_out_proj", 2),
                                      ("zamba_shared_o_proj", 2)])
def test_spd_matches_the_emulation_from_hf_modules(case, tp, fresh_seed):
    """Logits equal the emulation (1e-5) and differ from exact TP; one all-reduce fewer; the
    placements stay consistent; every rank returns the same logits."""
    build, name, where = CASES[case]
    model = build()
    skip_where_the_emulation_is_no_oracle(case, model)
    ids = _ids(model, fresh_seed)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp, drop_syncs=[name]))
    exact = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
    with torch.no_grad():
        logits = mesh.run(lambda dm: dm(ids))
        expected = spd_emulation(model, ids, tp, *where(model))
        tp_logits = exact(ids)
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    err = rel_err(logits[0], expected)
    assert err < TOL, f"{case} tp={tp}: {err} (seed {fresh_seed})"
    assert rel_err(logits[0], tp_logits) > 100 * TOL, "dropping the sync point changed nothing"
    assert rel_err(tp_logits, model(ids).logits) < TOL
    assert _all_reduces(mesh) == _all_reduces(exact) - 1
    assert not check_placements(mesh.program)
    assert [p.name for p in mesh.program.sync_points if p.action == "dropped"] == [name]


def test_empty_drop_set_is_tp_and_hf(fresh_seed):
    model = _llama()
    ids = _ids(model, fresh_seed)
    with torch.no_grad():
        plain = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2))(ids)
        empty = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=[]))(ids)
        assert torch.equal(plain, empty)
        assert rel_err(empty, model(ids).logits) < TOL
        # At tp=1 there is nothing to drop: any drop set is eager.
        one = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1, drop_syncs=["layers.*.o_proj"]))(ids)
        assert rel_err(one, model(ids).logits) < TOL


def test_last_layer_drops_are_flushed_before_the_head(fresh_seed):
    """Dropping the last layer's syncs leaves partials no kept all-reduce absorbs: one spd_flush
    all-reduce sums them before the final norm. Dropping only the last down_proj is then TP."""
    model = _llama()
    ids = _ids(model, fresh_seed)
    with torch.no_grad():
        tp = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2))
        last = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["layers.1.down_proj"]))
        both = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["layers.1.*"]))
        assert rel_err(last(ids), tp(ids)) < TOL
        assert rel_err(both(ids), tp(ids)) > 100 * TOL
    names = [p.name for p in both.program.sync_points]
    assert names.count("spd_flush") == 1 and names.index("spd_flush") == len(names) - 2, names
    assert _all_reduces(both) == _all_reduces(tp) - 1
    assert not check_placements(both.program)


@pytest.mark.parametrize("family, drop", [pytest.param("llama", "layers.0.o_proj", marks=pytest.mark.slow),
                                          ("mamba2", "layers.0.out_proj")])
def test_generate_under_spd_equals_the_spd_forward_step_by_step(family, drop, fresh_seed):
    """Greedy tokens of generate (prefill + decode, and chunked prefill) are the argmax of the SPD
    forward's last logits over the growing prefix."""
    model = small_model(family)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=[drop]))
    prompt = _ids(model, fresh_seed, (1, 9))
    for chunk in (None, 5):  # chunks of 5 and 4 tokens (Mamba-2: no chunk shorter than the conv kernel)
        extra = {} if chunk is None else {"prefill_chunk_size": chunk}
        # An explicit mask: a prompt id equal to the pad token would otherwise be masked as padding
        # (HF's rule for generate), which the forward does not do.
        out = mesh.generate(prompt, torch.ones_like(prompt), max_new_tokens=5, do_sample=False, **extra)
        new = out[:, prompt.shape[1]:]
        assert new.shape[1] >= 1
        prefix = prompt
        with torch.no_grad():
            for step in range(new.shape[1]):
                token = mesh(prefix)[:, -1].argmax(-1, keepdim=True)
                assert torch.equal(token, new[:, step:step + 1]), f"{family} chunk={chunk} step {step}"
                prefix = torch.cat([prefix, token], 1)


def test_gradients_are_those_of_the_emulation(fresh_seed):
    """Training through SPD: each rank's weight gradients equal its slices of the emulation's
    autograd gradients (replicated weights, e.g. the norms read by the rank-local input: whole)."""
    model = _llama()
    build, name, where = CASES["llama_o_proj"]
    ids = _ids(model, fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    upstream = torch.randn(*ids.shape, model.config.vocab_size, generator=gen)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=[name]))

    def rank_grads(dm):
        logits = dm(ids)
        names = [fqn for fqn in dm.program.param_specs if dm.local_weight(fqn).requires_grad]
        grads = torch.autograd.grad((logits * upstream).sum(), [dm.local_weight(f) for f in names])
        return dict(zip(names, grads))

    per_rank = mesh.run(rank_grads)
    params = dict(model.named_parameters())
    logits = spd_emulation(model, ids, 2, *where(model))
    full = dict(zip(params, torch.autograd.grad((logits * upstream).sum(), list(params.values()))))
    for rank, grads in enumerate(per_rank):
        for fqn, grad in grads.items():
            placement = mesh.ranks[rank].program.param_specs[fqn].placement
            expected = local_slice(full[fqn], placement, rank) if isinstance(placement, Shard) else full[fqn]
            assert rel_err(grad, expected) < TOL, f"{fqn} rank {rank}: {rel_err(grad, expected)} (seed {fresh_seed})"


def test_errors_name_the_sync_points():
    model = small_model("mamba")
    with pytest.raises(PlanError, match=r"'layers.9.\*' matches no sync point .*embed, layers.0.x_proj"):
        ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["layers.9.*"]))
    with pytest.raises(PlanError, match="'lm_head', a all_gather"):
        ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["lm_head"]))
    with pytest.raises(PlanError, match="allow_approximate=True"):
        ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["layers.*"]))
    with pytest.raises(PlanError, match="sequence_parallel"):
        ssmshard.Plan(tp=2, drop_syncs=["layers.0.out_proj"], sequence_parallel=True)
    with pytest.raises(PlanError, match="list of sync point names"):
        ssmshard.Plan(tp=2, drop_syncs="layers.0.out_proj")
    # Opted in: x_proj is dropped (unrepaired), and the report says so.
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=["layers.*"], allow_approximate=True))
    assert mesh.program.unrepaired_syncs == ["layers.0.x_proj", "layers.1.x_proj"]
    assert "[dropped]" in mesh.program.report()


@pytest.mark.parametrize("case", ["mamba2_out_proj", "llama_o_proj"])
def test_fused_norms_under_spd_keep_the_emulations_logits(monkeypatch, case, fresh_seed):
    """An inference plan on CUDA fuses every norm with its residual add (kernels="triton": the
    adapters run the reference ops on CPU tensors), also where the add reads SPD's pending
    partials: as many fused adds as without the drop, and still the emulation's logits."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    build, name, where = CASES[case]
    model = build()
    skip_where_the_emulation_is_no_oracle(case, model)
    ids = _ids(model, fresh_seed)
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, drop_syncs=[name], training=False))
    exact = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, training=False))
    with torch.no_grad():
        logits = mesh(ids)
        expected = spd_emulation(model, ids, 2, *where(model))
    assert rel_err(logits, expected) < TOL
    fused_adds = [sum(r["residual_add"] for r in m.program.norm_fusion_report) for m in (mesh, exact)]
    assert fused_adds[0] == fused_adds[1] > 0, fused_adds
