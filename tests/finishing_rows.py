"""Rows that finish at different steps: what a batch generation must give each row.

A greedy generation of a left-padded batch without EOS, then the same batch with an EOS id
that makes its rows stop at different steps (``staggering_eos``): a row's tokens up to and
including its EOS are the full run's, every later position holds the pad id, and the
generation ends when the last row stops (or at ``NEW_TOKENS``). Each row's tokens are also
those of its prompt generated alone (batch 1, no padding), so neither the padding nor the finished rows' steps reach an unfinished row's state.

``generate_fn(ids, mask, **options)`` is the generation under test (eager, static key/value or
a CUDA graph, at any tp); it must read its defaults from ``model.generation_config`` (the EOS
id is set there, for Hugging Face's own ``generate`` too).
"""

from __future__ import annotations

from contextlib import contextmanager

NEW_TOKENS = 12


def first_eos_step(row_new_tokens: list[int], eos: list[int]) -> int:
    """The step at which a row emits its first EOS id (NEW_TOKENS: it never does)."""
    return next((step for step, token in enumerate(row_new_tokens) if token in eos), NEW_TOKENS)


def staggering_eos(new_tokens: list[list[int]]) -> list[int]:
    """One EOS id, among the generated tokens, at whose first emission the most rows stop at
    distinct steps (a row that never emits it runs to the end); ties: the earliest stops."""
    candidates = sorted({token for row in new_tokens for token in row[:NEW_TOKENS - 1]})

    def spread(token):
        stops = [first_eos_step(row, [token]) for row in new_tokens]
        return len(set(stops)), -sum(stops), -token
    return [max(candidates, key=spread)]


@contextmanager
def eos_in_generation_config(model, eos):
    """``model.generation_config.eos_token_id = eos`` for the block (the model object is shared)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        yield eos
    finally:
        model.generation_config.eos_token_id = saved


def finishing_rows(generate_fn, model, ids, mask, pad, reference=lambda call: call()) -> dict:
    """The full, early-stopped and one-row-alone generations, as lists (see the module docstring),
    and Hugging Face's early-stopped one, computed through ``reference`` (multi-process workers
    pass ``hf_reference``: rank 0 computes it for all)."""
    prompt = ids.shape[1]
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=pad)
    with eos_in_generation_config(model, None):
        full = generate_fn(ids, mask, **options)
    with eos_in_generation_config(model, staggering_eos([row[prompt:] for row in full.tolist()])) as eos:
        early = generate_fn(ids, mask, **options)
        hf_early = reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
    alone = []
    with eos_in_generation_config(model, None):
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            alone.append(generate_fn(ids[row:row + 1, real], mask[row:row + 1, real], **options)[0, real.sum():].tolist())
    return {"prompt": prompt, "eos": eos, "pad": pad, "full": full.tolist(), "early": early.tolist(),
            "hf_early": hf_early.tolist(), "alone": alone}


def check_finishing_rows(result: dict, where: str) -> None:
    """Assert what ``finishing_rows`` promises about its ``result``."""
    prompt, eos, pad = result["prompt"], result["eos"], result["pad"]
    full_new = [row[prompt:] for row in result["full"]]
    stops = [first_eos_step(row, eos) for row in full_new]
    assert len(set(stops)) > 1 and min(stops) < NEW_TOKENS - 1, \
        f"{where}: no EOS id stops the rows at different steps ({full_new}); stops {stops} with EOS {eos}"
    assert result["early"] == result["hf_early"], f"{where}: ours {result['early']} vs HF {result['hf_early']}"
    assert len(result["early"][0]) == prompt + min(max(stops) + 1, NEW_TOKENS), (where, stops, result["early"])
    for row, (stop, tokens) in enumerate(zip(stops, result["early"])):
        new = tokens[prompt:]
        assert new[:stop + 1] == full_new[row][:stop + 1], f"{where} row {row}: {new} vs unstopped {full_new[row]}"
        assert all(t == pad for t in new[stop + 1:]), f"{where} row {row} finished at step {stop}: {new}"
        assert result["alone"][row] == full_new[row], f"{where} row {row}: alone {result['alone'][row]} vs " \
                                                      f"in the batch {full_new[row]}"
