"""Bad input is an error before anything runs, on every rank and every path.

The oracle for out-of-range ids is what ``nn.Embedding`` (and so HF eager) does: raise
``IndexError``. A vocab-parallel lookup would otherwise embed such ids as zeros and return
finite, plausible logits.
"""

import json

import pytest
import torch

import ssmshard

import inputs_worker
from conftest import small_model

# Mamba ties lm_head to the embedding (a masked vocab-parallel lookup at tp > 1); Llama does not.
FAMILIES = ["mamba", "llama"]


def test_hf_raises_index_error_for_these_ids():
    model = small_model("mamba")
    for bad in (model.config.vocab_size, -1):
        with pytest.raises(IndexError):
            model(torch.tensor([[1, bad]]))


# tp = 4 repeats the riskiest case only (the tied, vocab-parallel masked lookup on the forward
# path): four processes on the 2-core CI machine cost a minute per family and path.
@pytest.mark.parametrize("tp, families, paths", [
    (1, FAMILIES, ("forward", "generate", "packed")),
    (2, FAMILIES, ("forward", "generate", "packed")),
    (4, ["mamba"], ("forward",)),
])
def test_out_of_range_ids_raise_index_error_on_every_rank_and_path(tp, families, paths, tmp_path):
    out = tmp_path / "outcomes.json"
    ssmshard.launch(inputs_worker.bad_id_outcomes, tp, families, str(out), paths, backend="gloo")
    per_rank = [json.loads((tmp_path / f"outcomes.json.{r}").read_text()) for r in range(tp)]
    assert all(rank == per_rank[0] for rank in per_rank)  # every rank raised alike
    rows = per_rank[0]
    assert {r["tied"] for r in rows if "tied" in r} >= {True}
    checked = [r for r in rows if "path" in r]
    assert len(checked) == len(families) * 3 * len(paths)
    for r in checked:
        assert r["kind"] == "IndexError", r
        assert str(r["bad"]) in r["message"] and "256 entries" in r["message"], r
    assert all(r["after"] for r in rows if "after" in r)


@pytest.mark.parametrize("mode", ["forward", "prefill", "decode"])
def test_malformed_ids_are_named(mode):
    model = small_model("mamba2")
    program = ssmshard.capture(model, mode=mode)
    states = None
    if mode == "decode":
        _, states = ssmshard.capture(model, mode="prefill")(torch.tensor([[1, 2, 3]]))
    run = (lambda ids: program(ids)) if states is None else (lambda ids: program(ids, states))
    cases = [
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer token ids"),
        (torch.tensor([1, 2]), ValueError, r"\(batch, sequence\).*ids\[None\]"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
        (torch.zeros(1, 2, dtype=torch.long, device="meta"), ValueError, "meta device"),
        ([[1, 2]], TypeError, "torch.Tensor"),
    ]
    if mode == "decode":  # one new token per row
        cases[2] = (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty")
    for ids, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            run(ids)
