"""Mechanics of ``ssmshard.sensitivity`` on a tiny random model (random weights say nothing about
accuracy): the orders, the classes from the thresholds, ``choose`` within the budget by a
measurement made here, JSON, plot, the command line."""

import math

import pytest
import torch

import ssmshard
from ssmshard.eval import perplexity
from ssmshard.sensitivity import SensitivityReport

from conftest import small_model


@pytest.fixture(scope="module")
def calibrated():
    model = small_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (4 * 16,), generator=torch.Generator().manual_seed(7))
    report = ssmshard.sensitivity(model, ssmshard.Plan(tp=2), ids, window=16, batch_size=2, thresholds=(0.02, 0.2),
                                  progress=False)
    return model, ids, report


def test_orders_and_classes(calibrated):
    _, _, report = calibrated
    names = [p.name for p in report.points]
    assert names == ["layers.0.o_proj", "layers.0.down_proj", "layers.1.o_proj", "layers.1.down_proj"]
    isb, esb = report.thresholds
    for p in report.points:
        assert p.cls == ("ISB" if p.increase <= isb else "SB" if p.increase <= esb else "ESB"), p
        assert p.kl >= -1e-6 and math.isfinite(p.perplexity)  # KL is 0 up to rounding where nothing changed
    increases = [p.increase for p in report.one_at_a_time]
    assert increases == sorted(increases)
    # Last layers first, the later sync point of a layer first; each step adds one.
    assert [m.drop_syncs[-1] for m in report.greedy] == names[::-1]
    assert [len(m.drop_syncs) for m in report.greedy] == [1, 2, 3, 4]
    # Dropping only the last layer's down_proj is flushed before the head: the exact TP logits.
    assert abs(report.greedy[0].increase) < 1e-5


@pytest.mark.parametrize("quantile", [0.0, 0.5, 1.0])
def test_choose_stays_within_the_budget_measured_independently(calibrated, quantile):
    model, ids, report = calibrated
    increases = sorted(max(p.increase, 0.0) for p in report.points)
    budget = increases[round(quantile * (len(increases) - 1))]
    choice = report.choose(budget=budget)
    assert choice.measured.drop_syncs == choice.drop_syncs
    exact = perplexity(lambda x: model(x).logits, ids, window=16).perplexity
    mesh = ssmshard.SimulatedMesh(model, choice.plan)
    with torch.no_grad():
        measured = perplexity(mesh, ids, window=16).perplexity
    assert measured / exact - 1 <= budget + 1e-6
    assert abs(measured - choice.measured.perplexity) <= 1e-6 * measured
    # Its members: the longest greedy prefix within the budget, then sync points within it alone.
    prefix = [m for m in report.greedy if m.increase <= budget]
    allowed = set(prefix[-1].drop_syncs if prefix else []) | {p.name for p in report.points if p.increase <= budget}
    assert set(choice.drop_syncs) <= allowed
    assert len(choice.drop_syncs) >= (len(prefix[-1].drop_syncs) if prefix else 0)


def test_validation_keeps_the_chosen_set_within_the_budget_on_other_text(calibrated):
    """``choose(validation_ids=...)``: the final set's increase on the validation windows,
    measured here against the unsharded model, is within the budget (and equals what the choice
    reports); every sync point taken back was among the calibration choice's last ones."""
    model, ids, report = calibrated
    other = torch.randint(0, model.config.vocab_size, (4 * 16,), generator=torch.Generator().manual_seed(11))
    budget = sorted(max(p.increase, 0.0) for p in report.points)[-2]
    plain = report.choose(budget=budget)
    choice = report.choose(budget=budget, validation_ids=other)
    assert plain.drop_syncs == choice.drop_syncs + choice.taken_back  # taken back from the end
    exact = perplexity(lambda x: model(x).logits, other, window=16).perplexity
    with torch.no_grad():
        measured = perplexity(ssmshard.SimulatedMesh(model, choice.plan), other, window=16).perplexity
    assert measured / exact - 1 <= budget + 1e-6
    assert abs(measured - choice.validated.perplexity) <= 1e-6 * measured
    assert choice.validated.drop_syncs == choice.drop_syncs == choice.measured.drop_syncs


def test_validation_takes_back_the_last_chosen_sync_points():
    """The take-back rule on recorded increases: calibration within the budget for every set,
    validation over it for sets of more than one sync point."""
    from ssmshard.sensitivity import Measurement, SyncSensitivity

    names = ["layers.1.down_proj", "layers.1.o_proj", "layers.0.down_proj"]
    calibration, validation = object(), object()

    def measure(drop, ids=calibration):
        increase = 0.001 * len(drop) if ids is calibration else (0.0 if len(drop) <= 1 else 0.5)
        return Measurement(list(drop), 10 * (1 + increase), increase, 0.0)

    points = [SyncSensitivity(name=n, layer=1, block="b", role="o_proj", bytes_per_token=1, perplexity=10.01,
                              increase=0.001, kl=0.0, cls="ISB") for n in names]
    greedy = [measure(names[:k]) for k in range(1, 4)]
    report = SensitivityReport(tp=2, exact_perplexity=10.0, thresholds=(0.01, 0.05), points=points, greedy=greedy,
                               measure=measure)
    choice = report.choose(budget=0.01, validation_ids=validation)
    assert choice.drop_syncs == names[:1] and choice.taken_back == names[1:]
    assert choice.validated.increase == 0.0 and choice.measured.drop_syncs == names[:1]
    with pytest.raises(ValueError, match="read back from JSON"):
        SensitivityReport(tp=2, exact_perplexity=10.0, thresholds=(0.01, 0.05), points=points,
                          greedy=greedy).choose(budget=0.01, validation_ids=validation)


def test_json_plot_and_choose_from_records(calibrated, tmp_path):
    _, _, report = calibrated
    report.save(tmp_path / "s.json")
    loaded = SensitivityReport.load(tmp_path / "s.json")
    assert loaded.as_dict() == report.as_dict()
    choice = loaded.choose(budget=1e9)
    assert choice.measured is None and choice.drop_syncs == report.greedy[-1].drop_syncs
    pytest.importorskip("matplotlib")
    assert report.plot(tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "layers.1.down_proj" in report.table()


def test_command_line(tmp_path, capsys):
    from ssmshard.cli import main

    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3))
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids.tolist())))
    status = main(["sensitivity", "mamba2", "--tp", "2", "--calibration", str(tmp_path / "ids.txt"), "--window", "16",
                   "--json", str(tmp_path / "s.json"), "--budget", "0.5", "-q"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "layers.0.out_proj" in out and "chosen within 50.00%" in out
    assert SensitivityReport.load(tmp_path / "s.json").tp == 2
    assert main(["sensitivity", "mamba2", "--tp", "2", "--calibration", str(tmp_path / "missing.txt")]) == 2
