"""``ssmshard.spd_recovery.recover`` on a tiny random Mamba-2 with ``layers.0.out_proj``
dropped at tp 2, the next layer trained: its gradient is that of the SPD emulation written from
the Hugging Face modules (tests/test_spd.py), distillation lowers the KL to the exact model as
measured here on a fresh mesh, and only the named parameters change."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ssmshard
from ssmshard.spd_recovery import recover
from ssmshard.testing import rel_err

from conftest import small_model
from test_spd import CASES, skip_where_the_emulation_is_no_oracle, spd_emulation

TOL = 1e-5
DROP = "layers.0.out_proj"
TRAIN = ["backbone.layers.1.*"]


def _setup(seed):
    build, name, where = CASES["mamba2_out_proj"]
    assert name == DROP
    model = copy.deepcopy(build())  # recover changes weights in place; the cached model stays
    ids = torch.randint(0, model.config.vocab_size, (4 * 12,), generator=torch.Generator().manual_seed(seed))
    return model, ids, where


class _RecordGradients(torch.optim.Optimizer):
    """Keeps each step's gradients and leaves the weights alone."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])


def test_gradient_is_that_of_the_spd_emulation(fresh_seed):
    model, ids, where = _setup(fresh_seed)
    skip_where_the_emulation_is_no_oracle("mamba2_out_proj", model)
    windows = ids.view(4, 12)[:2]
    recorded = {}

    def optimizer(params, lr):
        recorded["opt"] = _RecordGradients(params, lr)
        return recorded["opt"]

    result = recover(model, ssmshard.Plan(tp=2, drop_syncs=[DROP]), ids, train=TRAIN, window=12, batch_size=2,
                     max_windows=2, steps=1, optimizer=optimizer)
    params = dict(model.named_parameters())
    with torch.no_grad():
        exact = F.log_softmax(model(windows).logits[:, :-1], -1)
    logits = spd_emulation(model, windows, 2, *where(model))
    loss = F.kl_div(F.log_softmax(logits[:, :-1], -1), exact, log_target=True, reduction="sum") / exact[..., 0].numel()
    expected = torch.autograd.grad(loss, [params[n] for n in result.trained])
    loss = float(loss.detach())
    assert abs(result.losses[0] - loss) <= TOL * loss
    assert len(result.trained) > 3 and all(n.startswith("backbone.layers.1.") for n in result.trained)
    for n, got, want in zip(result.trained, recorded["opt"].seen[0], expected):
        assert rel_err(got, want) < TOL, f"{n}: {rel_err(got, want)} (seed {fresh_seed})"


def test_recovery_lowers_the_kl_and_changes_only_the_named_weights(fresh_seed):
    model, ids, _ = _setup(fresh_seed)
    original = copy.deepcopy(model)
    plan = ssmshard.Plan(tp=2, drop_syncs=[DROP])
    result = recover(model, plan, ids, train=TRAIN, window=12, batch_size=4, steps=30, lr=3e-3)

    windows = ids.view(4, 12)
    with torch.no_grad():  # measured here: the original model against a fresh mesh of the trained one
        exact = F.log_softmax(original(windows).logits[:, :-1], -1)

        def kl(m):
            logits = ssmshard.SimulatedMesh(m, plan)(windows)
            return float(F.kl_div(F.log_softmax(logits[:, :-1], -1), exact, log_target=True, reduction="sum")
                         / exact[..., 0].numel())

        before, after = kl(original), kl(model)
    assert before > 1e-3, "the drop must change the model for this test to say anything"
    assert after < 0.5 * before, (before, after, fresh_seed)
    assert abs(result.kl_before - before) <= 1e-4 * before and abs(result.kl_after - after) <= 1e-4 * before
    new = dict(model.named_parameters())
    for name, p in original.named_parameters():
        if name in result.trained:
            continue
        assert torch.equal(p, new[name]), name
    assert any(not torch.equal(p, new[n]) for n, p in original.named_parameters() if n in result.trained)


def test_errors():
    model = small_model("mamba2")
    ids = torch.zeros(24, dtype=torch.long)
    with pytest.raises(ssmshard.PlanError, match="drop_syncs"):
        recover(model, ssmshard.Plan(tp=2), ids, train=TRAIN, window=12)
    with pytest.raises(ValueError, match="no parameter matches"):
        recover(model, ssmshard.Plan(tp=2, drop_syncs=[DROP]), ids, train=["model.layers.9.*"], window=12)
