"""benchmarks/train_packed.py --smoke: the whole flow in-process on tiny CPU models.

The three modes must compute one step loss: packed equals one-at-a-time and padded (fp32,
1e-5 relative), each equals a float64 reference computed here by Hugging Face eager, one
sequence at a time, and the first timed step (same initial weights) reports that loss too.
"""

import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from ssmshard.testing import randomize_weights

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "train_packed.py")
_spec = importlib.util.spec_from_file_location("train_packed", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["train_packed"] = bench  # dataclasses look their module up while the file runs
_spec.loader.exec_module(bench)

FP32_RTOL = 1e-5  # fp32 sums of a few hundred O(1..50) token losses, against float64


def float64_step_loss(name, args):
    """Sum over sequences of next-token cross-entropy, HF eager in float64, / number of targets."""
    model = randomize_weights(bench.build_model(name, True, "cpu", torch.float64, args.seed), seed=args.seed)
    lengths = bench.draw_lengths(args.tokens_per_step, args.min_len, args.max_len, args.seed)
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids in bench.draw_sequences(lengths, model.config.vocab_size, args.seed):
            logits = model(ids[None], use_cache=False).logits[0]  # (1, L, V) -> (L, V)
            total += F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
            targets += ids.numel() - 1
    return float(total / targets), lengths


@pytest.fixture
def one_thread():
    """Tiny models: intra-op threads only spin against the other processes of a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smoke_modes_agree_with_a_float64_reference(tmp_path, fresh_seed, one_thread):
    seed = fresh_seed % 10_000
    argv = ["--smoke", "--seed", str(seed), "--out", str(tmp_path)]
    returned = bench.main(argv)
    with open(tmp_path / "train_packed.json") as f:
        report = json.load(f)
    assert report["loss_checks_passed"] and returned["loss_checks_passed"]
    args = bench.parse_args(argv)
    for name in ("mamba", "mamba2"):
        entry = report["models"][name]
        assert set(entry["modes"]) == set(bench.MODES)
        losses = entry["loss_check"]["losses"]
        expected, lengths = float64_step_loss(name, args)
        assert entry["lengths"] == lengths and min(lengths) >= args.min_len and max(lengths) <= args.max_len
        for mode in bench.MODES:
            assert abs(losses[mode] - losses["one"]) <= FP32_RTOL * abs(losses["one"]), (name, mode, losses)
            assert abs(losses[mode] - expected) <= FP32_RTOL * abs(expected), (name, mode, losses[mode], expected)
            row = entry["modes"][mode]
            # The first timed step starts from the checked weights: the same loss.
            assert abs(row["step_losses"][0] - expected) <= FP32_RTOL * abs(expected), (name, mode, row)
            assert row["tokens_per_s"] > 0 and len(row["measured_step_s"]) == args.steps
        assert entry["modes"]["packed"]["pad_fraction"] == 0 and entry["modes"]["one"]["pad_fraction"] == 0
        assert entry["packed_vs_one"] > 0 and entry["packed_vs_padded"] > 0


@pytest.mark.parametrize("multiple", [1, 16])
def test_micro_batches_hold_every_token_once_within_the_cap(multiple, fresh_seed):
    lengths = bench.draw_lengths(3000, 5, 400, fresh_seed)
    sequences = bench.draw_sequences(lengths, 100, fresh_seed)
    for batches in (bench.packed_micro_batches(sequences, 512, multiple, 3),
                    bench.padded_micro_batches(sequences, 512, "sorted", 3, multiple),
                    bench.padded_micro_batches(sequences, 512, "random", 3, multiple),
                    bench.one_at_a_time_micro_batches(sequences, multiple, 3)):
        assert all(b.input_ids.numel() <= 512 for b in batches)  # lengths <= 400: every mode fits the cap
        assert all(b.input_ids.shape[1] % multiple == 0 for b in batches)
        assert sum(b.real_tokens for b in batches) == sum(lengths)
        assert sum(int((b.targets != bench.IGNORE).sum()) for b in batches) == sum(lengths) - len(lengths)
        # Every (token, next token) pair of every sequence, once; nothing across sequences or pads.
        got = sorted(pair for b in batches for pair in zip(b.input_ids[b.targets != bench.IGNORE].tolist(),
                                                           b.targets[b.targets != bench.IGNORE].tolist()))
        assert got == sorted(pair for s in sequences for pair in zip(s[:-1].tolist(), s[1:].tolist()))
