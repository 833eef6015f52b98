"""Worker for tests/test_inputs.py: every rank feeds bad ids to every entry point and records
what each raised (the same ids reach every rank, so every rank must raise alike)."""

import json

import torch

import ssmshard

from conftest import small_model


def _outcome(fn):
    try:
        fn()
    except (IndexError, ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None, None


def bad_id_outcomes(rank, world, families, out_path, paths=("forward", "generate", "packed")):
    results = []
    for family in families:
        model = small_model(family)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), packed="packed" in paths)
        vocab = model.config.vocab_size
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for bad in (vocab, vocab + 7, -1):
            ids = torch.randint(0, vocab, (2, 5))
            ids[1, 3] = bad
            packed = ssmshard.pack([ids[0], ids[1]])
            calls = {"forward": lambda: dm(ids), "generate": lambda: dm.generate(ids, max_new_tokens=2),
                     "packed": lambda: dm(packed)}
            for path in paths:
                kind, message = _outcome(calls[path])
                results.append({"family": family, "tied": tied, "bad": bad, "path": path, "kind": kind,
                                "message": message})
        # The good ids still run after the refusals: no rank was left inside a collective.
        results.append({"family": family, "after": dm(torch.randint(0, vocab, (1, 4))).shape[-1] == vocab})
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
