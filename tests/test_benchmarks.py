"""The product benchmarks: each answers --help and runs its --smoke mode on the CPU.

A smoke run checks the script end to end at tiny sizes (the Triton kernels on the CPU
interpreter, processes on gloo): it writes its JSON, and its plot where matplotlib is installed
(the `bench` extra). Its timings mean nothing. generate_gpu.py, train_packed.py and
train_small_models.py have their own smoke tests (tests/test_generate_bench.py,
tests/test_train_packed_bench.py, tests/test_train_small_models.py); static_kv_decode_gpu.py's
smoke mode (the eager decode variants of tiny Zamba2 and Llama) takes minutes on the CPU and is
only checked to answer --help here; decode_gpu.py's smoke runs one tiny model (Mamba-2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
SCRIPTS = ["allreduce_gpu.py", "bench_capture.py", "capture_copied_layers.py", "compile_gpu.py",
           "decode_gpu.py", "greedy_agreement_gpu.py", "bench_selective_scan.py", "bench_ssd_scan.py", "bench_causal_conv1d.py",
           "bench_decode_attention.py", "bench_gemv.py", "bench_state_update.py", "decode_profile.py",
           "generate_gpu.py", "scaling_gpu.py", "spd_accuracy.py", "spd_recovery.py", "startup.py",
           "static_kv_decode_gpu.py", "tp_gpu.py", "train_packed.py", "train_small_models.py",
           "tsp_memory.py"]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


NOT_SCRIPTS = ("bench_common.py", "profiling.py", "generate_plots.py", "small_corpus.py", "small_models.py")


# Runs each script as ``__main__`` with ``--help`` in one interpreter: 23 interpreters importing
# torch at once took 44-53 s of a 2-core machine, one takes a few. Each script still parses its
# own command line, and the smoke runs below start scripts on their own.
HELP_DRIVER = """
import contextlib, io, json, os, runpy, sys
answers = {}
sys.path.insert(0, "")
for path in sys.argv[1:]:
    sys.argv, printed, code = [path, "--help"], io.StringIO(), None
    sys.path[0] = os.path.dirname(path)  # as `python path` would
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    answers[path] = {"code": code, "help": printed.getvalue()}
print(json.dumps(answers))
"""


def test_every_product_benchmark_answers_help_and_has_a_smoke_mode():
    assert sorted(n for n in os.listdir(BENCH) if n.endswith(".py") and n not in NOT_SCRIPTS) == sorted(SCRIPTS)
    paths = [os.path.join(BENCH, name) for name in SCRIPTS]
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, *paths], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.splitlines()[-1])
    for name, path in zip(SCRIPTS, paths):
        assert answers[path]["code"] in (0, None), (name, answers[path])
        assert "--smoke" in answers[path]["help"], name


def test_capture_copied_layers_smoke_finds_the_same_program():
    """The script's smoke model has layers to copy, and its check says the copied program is the
    one traced whole (it exits 1 where they differ)."""
    run = subprocess.run([sys.executable, os.path.join(BENCH, "capture_copied_layers.py"), "--smoke"], env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "prefixes traced: [5]" in run.stdout and "same program: True" in run.stdout, run.stdout


# (script and arguments, the JSON it writes, the plot beside it, a check of the JSON)
SMOKES = {
    "capture": (["bench_capture.py", "--out", "{out}/capture.json"], "capture.json", "capture.png",
                lambda r: {row["family"] for row in r["rows"]} == {"mamba", "mamba2"}
                and all(row["seconds_median"] > 0 for row in r["rows"])),
    "selective_scan": (["bench_selective_scan.py", "--out", "{out}/scan.json"], "scan.json", "scan.png",
                       lambda r: r["correctness"]["forward"]["rel_err"] < 1e-2 and len(r["scan"]) == 2
                       and all(row["ours_fwd_ms"] > 0 and row["ours_fwd_bwd_ms"] > 0 for row in r["scan"])),
    "ssd_scan": (["bench_ssd_scan.py", "--out", "{out}/ssd.json"], "ssd.json", "ssd.png",
                 lambda r: len(r["cases"]) == 2 and all(c["errors"]["out"] < 5e-2 for c in r["cases"])),
    "causal_conv1d": (["bench_causal_conv1d.py", "--out", "{out}/conv.json"], "conv.json", "conv.png",
                      lambda r: len(r["conv"]) == 2 and r["packed"]["fwd_ms"] > 0
                      and all(e["state_exact"] for e in r["update"])),
    "gemv": (["bench_gemv.py", "--out", "{out}/gemv.json"], "gemv.json", "gemv.png",
             lambda r: len(r["rows"]) == 4 and all(row["err_gemv"] < 1e-5 and row["gemv_us"] > 0 for row in r["rows"])),
    "decode_attention": (["bench_decode_attention.py", "--sweep", "--out", "{out}/da.json"], "da.json", "da.png",
                         lambda r: {row["batch"] for row in r["rows"]} == {1, 3}
                         and all(row["rel_err"] < 1e-5 and row["us"] > 0 for row in r["rows"])),
    "state_update": (["bench_state_update.py", "--out", "{out}/su.json"], "su.json", "su.png",
                     lambda r: len(r["rows"]) == 4 and all(row["err_ssmshard"] < 1e-5 and row["ssmshard_us"] > 0
                                                           for row in r["rows"])),
    "allreduce": (["allreduce_gpu.py", "--out", "{out}"], "allreduce_tp2.json", "allreduce_tp2.png",
                  lambda r: r["tp"] == 2 and all(row["nccl_eager"] > 0 for row in r["rows"])),
    "decode_profile": (["decode_profile.py", "--out", "{out}"], "decode_profile.json", "decode_profile.png",
                       lambda r: list(r["results"]) == ["tp1", "tp1_unoptimised"]
                       and r["results"]["tp1_unoptimised"]["skipped_passes"]
                       and all(c["kernels_per_step"] > 0 and c["kernels"]
                               for row in r["results"].values() for c in row["batches"].values())),
    "spd_accuracy": (["spd_accuracy.py", "--out", "{out}/spd.json"], "spd.json", "spd.png",
                     lambda r: [(c["model"], c["tp"]) for c in r["cases"]] == [("llama", 2)] and r["complete"]
                     and all(set(c["heldout"]["variants"]) == {"tp", "spd", "int8", "fp8", "spd+int8"}
                             and c["heldout"]["variants"]["int8"]["all_reduces"]["quantized"] > 0
                             and c["heldout"]["variants"]["spd"]["all_reduces"]["dropped"] == c["dropped"]
                             for c in r["cases"])),
    "spd_recovery": (["spd_recovery.py", "--out", "{out}/rec.json"], "rec.json", "rec.png",
                     lambda r: r["recovery"]["steps"] == len(r["recovery"]["losses"]) == 3
                     and set(r["heldout"]["perplexity"]) == {"eager", "tp", "spd_before", "spd_after"}
                     and r["recovery"]["trained"] and all(n.startswith("backbone.layers.1.")
                                                          for n in r["recovery"]["trained"])),
    "spd_recovery_grouped": (["spd_recovery.py", "--group-heads", "--out", "{out}/rec.json"], "rec.json", "rec.png",
                             lambda r: set(r["heldout"]["perplexity"]) == {"eager", "tp", "spd_before", "grouped_eager",
                                                                             "spd_grouped", "spd_after"}
                             and abs(r["heldout"]["relative_change_vs_tp"]["grouped_eager"]) < 1e-5
                             and r["head_grouping"]["error_after"] <= r["head_grouping"]["error_before"]),
    "tp_forward": (["tp_gpu.py", "throughput", "--out", "{out}"], "throughput_tp2.json", "throughput.png",
                   lambda r: r["tp"] == 2 and r["tokens_per_s"] > 0),
    "tsp_memory": (["tsp_memory.py", "--out", "{out}"], "tsp_memory.json", "tsp_memory.png",
                   lambda r: {row["plan"] for row in r["rows"]} == {"tp", "tp+sp", "tsp", "tsp-local"}
                   and all(row["peak_activation_bytes"] > 0 and row["forward_s"] > 0 for row in r["rows"])),
}


# The SPD accuracy smoke run (sensitivity, choice, four variants) takes over a minute on the CI
# machine; the analysis itself is tested in tests/test_sensitivity.py.
SLOW_SMOKES = {"spd_accuracy"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMOKES else n
                                  for n in sorted(SMOKES)])
def test_smoke_run_writes_json_and_plot(name, tmp_path):
    argv, json_name, png_name, check = SMOKES[name]
    argv = [a.format(out=tmp_path) for a in argv]
    run = subprocess.run([sys.executable, os.path.join(BENCH, argv[0]), *argv[1:], "--smoke"], env=_env(),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / json_name) as f:
        assert check(json.load(f))
    assert (tmp_path / png_name).exists() == HAVE_MATPLOTLIB, run.stdout[-2000:]


@pytest.mark.slow  # two smoke runs
def test_spd_recovery_saved_grouping_is_read_back_by_the_plan(tmp_path):
    """--save-grouping writes the grouping --group-heads chose; --grouping reads it into the SPD plan
    (the model untouched): exact TP under it is the exact model, SPD the grouped model's."""
    results = []
    for name, extra in (("chosen", ["--group-heads", "--save-grouping", str(tmp_path / "grouping.json")]),
                        ("read", ["--grouping", str(tmp_path / "grouping.json")])):
        run = subprocess.run([sys.executable, os.path.join(BENCH, "spd_recovery.py"), "--smoke", *extra,
                              "--out", str(tmp_path / f"{name}.json")], env=_env(), cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        with open(tmp_path / f"{name}.json") as f:
            results.append(json.load(f))
    chosen, read = results
    with open(tmp_path / "grouping.json") as f:
        assert json.load(f) == [chosen["head_grouping"]] == read["head_grouping"]
    assert abs(read["heldout"]["relative_change_vs_tp"]["tp_grouped"]) < 1e-5
    spd = chosen["heldout"]["perplexity"]["spd_grouped"], read["heldout"]["perplexity"]["spd_grouped"]
    assert abs(spd[0] - spd[1]) <= 1e-6 * spd[0], spd


def test_decode_smoke_writes_rows_as_measured_and_plots(tmp_path):
    """decode_gpu.py --smoke on tiny Mamba-2: every kind of row (time to start, TPOT of ssmshard
    with its floor and of HF at each batch, TTFT beside the forward), then --plot's figure and table."""
    run = subprocess.run([sys.executable, os.path.join(BENCH, "decode_gpu.py"), "--smoke", "--out", str(tmp_path),
                          "--models", "tiny-mamba2"], env=_env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "rows_rank0.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["kind"] for r in rows][0] == "environment" and rows[-1]["kind"] == "done"
    assert rows[0]["copy_gb_s"] > 0
    start = next(r for r in rows if r["kind"] == "start")
    assert start["parallelize_s"] >= start["parallelize_capture_s"] + start["parallelize_passes_s"] > 0
    tpot = {(r["variant"], r["batch"]): r for r in rows if r["kind"] == "tpot"}
    assert set(tpot) == {(v, b) for v in ("ssmshard", "hf") for b in (1, 4)}
    for batch in (1, 4):
        ours = tpot["ssmshard", batch]
        assert ours["floor_ms"] > 0 and ours["recurrent_state_bytes"] > 0 and ours["kv_bytes"] == 0
        assert ours["step_bytes"] == ours["weight_bytes"] + ours["recurrent_state_bytes"]
    assert tpot["ssmshard", 4]["recurrent_state_bytes"] == 4 * tpot["ssmshard", 1]["recurrent_state_bytes"]
    assert {r["variant"] for r in rows if r["kind"] == "ttft"} == {"ssmshard", "hf"}
    assert "importable" in next(r for r in rows if r["kind"] == "hf_path")
    plot = subprocess.run([sys.executable, os.path.join(BENCH, "decode_gpu.py"), "--plot", str(tmp_path)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert "| tiny-mamba2 | 4 |" in (tmp_path / "decode_summary.md").read_text()
    assert (tmp_path / "decode_tpot_tiny-mamba2.png").exists() == HAVE_MATPLOTLIB


@pytest.mark.slow
def test_scaling_smoke_measures_every_variant_and_plots(tmp_path):
    """scaling_gpu.py --smoke under torchrun (2 CPU ranks, gloo): one row per variant, then --plot."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(BENCH, "scaling_gpu.py"), "--smoke", "--profile", "--out", str(tmp_path)],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "scaling.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["variant"] for r in rows] == ["tp1", "tp2", "tp2_symm", "tp2_symm_spd", "tp2_int8", "tp2_fp8", "tp2_sp"]
    assert all(r["tpot_ms_b1"] > 0 for r in rows[:-1]) and "tpot_ms_b1" not in rows[-1]  # sp: prefill only
    assert all(r["prefill_tok_s"] > 0 for r in rows)
    assert rows[3]["syncs_dropped"] == 1  # 7/15 of the tiny model's 2 layers, rounded
    assert all(0 < r["prefill_profile"]["kernel_ms"] for r in rows)
    plot = subprocess.run([sys.executable, os.path.join(BENCH, "scaling_gpu.py"), "--plot", str(tmp_path)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0 and "tp2_symm_spd" in plot.stdout, plot.stderr[-2000:]
    assert "one prefill forward on rank 0" in plot.stdout


@pytest.mark.slow  # compiles eight tiny programs
def test_compile_benchmark_smoke_run_writes_both_variants(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(BENCH, "compile_gpu.py"), "--smoke", "--profile",
                          "--out", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
    for kind in ("forward", "tpot"):
        variants = {(r["model"], r["variant"]) for r in rows if r["kind"] == kind}
        assert variants == {(m, v) for m in ("tiny-mamba", "tiny-mamba2") for v in ("eager", "compiled")}, kind
    compiled = [r for r in rows if r["kind"] == "start" and r["variant"] == "compiled"]
    assert all(r["compile_s"]["forward"] and r["compile_s"]["decode"] for r in compiled), compiled
    assert all(r["logits_rel_err"] < 1e-5 for r in rows if r["kind"] == "forward" and r["variant"] == "compiled")
    profiled = {(r["model"], r["variant"]) for r in rows if r["kind"] == "forward_profile"}
    assert profiled == {(m, v) for m in ("tiny-mamba", "tiny-mamba2") for v in ("eager", "compiled")}, profiled
    assert all(r["by_category_ms"]["matmul"] > 0 for r in rows if r["kind"] == "forward_profile" and r["variant"] == "eager")
    assert (tmp_path / "summary.md").exists()


def test_compile_benchmark_files_forward_kernels_by_category():
    sys.path.insert(0, BENCH)
    try:
        import compile_gpu
    finally:
        sys.path.remove(BENCH)
    names = {"nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTT": "matmul", "triton_tem_fused_addmm_3": "matmul",
             "scan_fwd_parallel_kernel": "scan", "ssd_chunk_output_kernel": "scan", "_conv_forward_kernel": "conv",
             "_rms_norm_kernel": "norm", "triton_poi_fused_add_mul_silu_0": "fused glue (Inductor)",
             "Memcpy DtoD (Device -> Device)": "copies", "void at::native::vectorized_elementwise_kernel": "other"}
    assert {n: compile_gpu.category(n, compile_gpu.FORWARD_CATEGORIES) for n in names} == names
    base = {"kind": "forward_profile", "model": "m", "batch": 8, "length": 2048, "matmul_floor_ms": 100.0,
            "scan_floor_ms": 20.0}
    rows = [dict(base, variant="eager", device_ms=300.0, by_category_ms={"matmul": 150.0, "scan": 90.0, "other": 60.0}),
            dict(base, variant="compiled", device_ms=250.0, by_category_ms={"matmul": 150.0, "scan": 90.0,
                                                                            "fused glue (Inductor)": 10.0})]
    table = compile_gpu.profile_table(rows)
    assert "| matmul | 150.0 | 150.0 | 100.0 |" in table
    assert "| scan | 90.0 | 90.0 | 20.0 |" in table
    assert "| fused glue (Inductor) | 0.0 | 10.0 |  |" in table
    assert "| all kernels | 300.0 | 250.0 | 120.0 |" in table
