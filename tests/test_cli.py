"""The ssmshard command: inspect on the meta device, with and without a tensor-parallel plan."""

from ssmshard.cli import main


def test_inspect_reports_placements_and_collectives_for_a_rank(capsys):
    assert main(["inspect", "mamba2", "--tp", "4", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "rank 3 of tp=4" in out
    in_proj = next(line for line in out.splitlines() if line.startswith("backbone.layers.0.mixer.in_proj.weight "))
    # [z, x] split by heads (32 rows each), B and C (2 groups of 16) shared by rank pairs, dt (8) split:
    # 32 + 32 + 16 + 16 + 2 local rows.
    assert "S(0:128/4,128/4,32/2@2,32/2@2,8/4)" in in_proj and in_proj.endswith("(98, 64)")
    # Two groups over four ranks: the gated norm needs its per-group all-reduce in every layer.
    assert out.count("after gate_norm") == 2 and out.count("after out_proj") == 2


def test_inspect_rejects_an_impossible_plan(capsys):
    assert main(["inspect", "llama", "--tp", "3"]) == 2
    assert "4 attention heads cannot be split over tp=3" in capsys.readouterr().err
