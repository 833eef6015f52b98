"""The ssmshard command: inspect on the meta device, argument checks, output and the demo."""

import json
import os
import re
import subprocess
import sys

import pytest

import ssmshard
from ssmshard.cli import main
from ssmshard.passes.shard import ShardingError


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


def test_inspect_decode_with_tp_reports_the_decode_program(capsys):
    # Decode takes the states as prefill shards them (the runtime's pipeline, on meta).
    assert main(["inspect", "mamba", "--tp", "2", "--mode", "decode", "-q"]) == 0
    captured = capsys.readouterr()
    assert "rank 0 of tp=2" in captured.out and captured.err == ""
    # Mamba-1: x_proj (dt_rank + 2 * state_size = 40 values) and out_proj (hidden 64) per layer, fp32.
    assert len(re.findall(r"after x_proj +float32 +160 B/token", captured.out)) == 2
    assert len(re.findall(r"after out_proj +float32 +256 B/token", captured.out)) == 2


def _error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    return errors[0]


@pytest.mark.parametrize("argv, message", [
    (["inspect", "mamba", "--tp", "0"], "argument --tp: must be a positive integer, got '0'"),
    (["inspect", "mamba", "--tp", "-2"], "argument --tp: must be a positive integer, got '-2'"),
    (["inspect", "mamba", "--tp", "two"], "argument --tp: must be a positive integer, got 'two'"),
    (["inspect", "mamba", "--tp", "2", "--rank", "5"], "--rank 5 is not a rank of --tp 2 (ranks 0 to 1)"),
    (["inspect", "mamba", "--rank", "1"], "--rank 1 is not a rank of --tp 1"),
    (["inspect", "mamba", "--rank", "-1"], "argument --rank: must be a rank"),
    (["inspect", "mamba", "--mode", "train"], "argument --mode: invalid choice: 'train'"),
    (["inspect", "mamba", "--bogus"], "unrecognized arguments: --bogus"),
    (["inspect", "no_such_family"], "'no_such_family' is neither a family name"),
    (["inspect"], "the following arguments are required: model"),
    (["inspect", "llama", "--tp", "3"], "4 attention heads cannot be split over tp=3"),
    (["demo", "--nproc", "0"], "argument --nproc: must be a positive integer"),
    (["demo", "--tokens", "-1"], "argument --tokens: must be a positive integer"),
    (["demo", "--family", "gpt2"], "argument --family: invalid choice: 'gpt2'"),
    (["train"], "argument command: invalid choice: 'train'"),
])
def test_invalid_arguments_are_one_error_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_unreadable_and_unsupported_models_are_one_error_line(capsys, tmp_path):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is a directory without a config.json" in _error_line(capsys)
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    assert main(["inspect", str(broken)]) == 2
    assert f"cannot read a model config from {broken}" in _error_line(capsys)
    gpt2 = tmp_path / "gpt2" / "config.json"
    gpt2.parent.mkdir()
    gpt2.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["inspect", str(gpt2.parent)]) == 2
    assert "ssmshard does not support GPT2LMHeadModel" in _error_line(capsys)


def test_an_unsupported_sharding_is_one_error_line_and_verbose_adds_the_traceback(capsys, monkeypatch):
    def unsupported(*args, **kwargs):
        raise ShardingError("no sharding rule for aten.fft_rfft.default at fft (op has no rule);\nsource: x.py:1")

    monkeypatch.setattr("ssmshard.cli._shard_for_report", unsupported)
    assert main(["inspect", "mamba", "--tp", "2", "-q"]) == 2
    assert _error_line(capsys) == ("error: no sharding rule for aten.fft_rfft.default at fft (op has no rule); "
                                   "source: x.py:1")
    assert main(["inspect", "mamba", "--tp", "2", "-v"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_version_and_log_levels(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"ssmshard {ssmshard.__version__} (torch ")
    assert main(["inspect", "mamba"]) == 0
    assert "captured MambaForCausalLM (forward):" in capsys.readouterr().err  # progress, on stderr
    assert main(["inspect", "mamba", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_summary_names_no_torch_internals_as_call_sites(capsys):
    assert main(["inspect", "mamba2", "-q"]) == 0
    assert "_empty_nn_module_stack" not in capsys.readouterr().out


def test_demo_prints_a_short_result_without_warnings():
    # `make demo` runs `ssmshard demo`; what the user sees is stdout and stderr together.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(ssmshard.__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "ssmshard.cli", "demo"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = (run.stdout + run.stderr).splitlines()
    assert len(lines) <= 40, "\n".join(lines)
    noisy = [line for line in lines if re.search(r"warn|deprecat|^[WE]\d{4} ", line, re.IGNORECASE)]
    assert not noisy, noisy
    assert run.stdout.splitlines()[-1] == "demo OK" and "tolerance 1e-05" in run.stdout


def test_inspect_placements_lists_every_op_with_its_placement(capsys):
    assert main(["inspect", "mamba2", "--tp", "2", "--placements", "-q"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\S+ +(aten|ssmshard)\.", line)]
    scans = [row for row in rows if " ssmshard.ssd_scan " in row]
    assert len(scans) == 2 and all("S(2:8/2)" in row for row in scans), scans  # 8 heads, 4 per rank
    assert any(" ssmshard.all_reduce " in row and " R " in row for row in rows)
