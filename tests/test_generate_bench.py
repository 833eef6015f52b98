"""benchmarks/generate_gpu.py end to end in its CPU smoke mode (2 gloo ranks, a tiny Mamba).

The GPU run gets one short call: this checks, before it, that every configuration writes its
rows, that tp = 2 and dp = 2 generate tp = 1's greedy ids, and that the summary reads the rows.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "generate_gpu.py")


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate_bench")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh weights and prompts; printed on failure
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          SCRIPT, "--smoke", "--models", "tiny-mamba", "--seed", str(seed), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"seed {seed}\n" + run.stdout[-3000:] + run.stderr[-3000:]
    rows = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".jsonl"):
            rows += [json.loads(line) for line in (out / name).read_text().splitlines()]
    return out, rows


def test_every_configuration_writes_its_rows(smoke_rows):
    _, rows = smoke_rows
    kinds = {r["kind"] for r in rows}
    assert {"environment", "build", "gen", "hf", "longest", "profile", "done"} <= kinds, kinds
    gen = {(r["layout"], r["batch"], r["prompt"]): r for r in rows if r["kind"] == "gen"}
    for batch in (1, 4):
        for prompt in (16, 40):
            for layout in ("tp1", "tp2") + (("dp2",) if batch % 2 == 0 else ()):
                r = gen.get((layout, batch, prompt))
                assert r is not None, (layout, batch, prompt, sorted(gen))
                assert r["ttft_s"] > 0 and r["generate_s"] > 0 and r["throughput_tok_s"] > 0, r  # values only: timings are noisy on CPU
                assert len(r["new_ids"]) == batch and all(len(ids) == r["new_tokens"] for ids in r["new_ids"]), r
                assert not r["recaptured_while_timed"], r
    skipped = {(r["what"], r.get("layout"), r.get("batch")) for r in rows if r["kind"] == "skipped"}
    assert ("layout", "tp4", None) in skipped and ("layout", "dp4", None) in skipped, skipped  # 2 ranks only
    assert ("cell", "dp2", 1) in skipped, skipped  # batch 1 does not split over 2 replicas
    longest = {(r["tp"], r["chunk"]) for r in rows if r["kind"] == "longest"}
    assert {(1, None), (2, None), (1, 32), (2, 32)} <= longest, longest
    profile = next(r for r in rows if r["kind"] == "profile")
    assert profile["decode_step"]["kernel_ms"] > 0 and profile["prefill"]["kernel_ms"] > 0, profile
    assert next(r for r in rows if r["kind"] == "hf")["hf_path"]["path"], "HF baseline must say which path it took"


def test_tp2_and_dp2_generate_the_greedy_ids_of_tp1(smoke_rows):
    _, rows = smoke_rows
    seed = next(r for r in rows if r["kind"] == "environment")["seed"]
    gen = {(r["layout"], r["batch"], r["prompt"]): r["new_ids"] for r in rows if r["kind"] == "gen"}
    for (layout, batch, prompt), ids in gen.items():
        if layout != "tp1":
            assert ids == gen[("tp1", batch, prompt)], (layout, batch, prompt, f"seed {seed}")
    hf = next(r for r in rows if r["kind"] == "hf")
    assert hf["new_ids"] == gen[("tp1", hf["batch"], hf["prompt"])], f"seed {seed}"  # same random weights


def test_summary_reads_the_rows(smoke_rows):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from generate_plots import summarize

    out, _ = smoke_rows
    summary, _ = summarize(str(out))
    assert summary["finished"]
    assert {(s["layout"], s["batch"], s["prompt"]) for s in summary["scaling_vs_tp1"]} >= {("tp2", 1, 16), ("dp2", 4, 40)}
    assert all(s["same_ids_as_tp1"] for s in summary["greedy_ids_vs_tp1"])
    assert json.loads((out / "summary.json").read_text())["versus_hf"][0]["same_ids_as_hf"]
