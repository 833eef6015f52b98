"""HF generate arguments on the distributed module, against model.generate, inside a launched worker.

Run by ``generate_worker.generate_results`` on every rank (one launch per tp for all the
generate checks). Each case returns plain values; the test asserts on every rank's.
"""

import contextlib

import torch
import torch.distributed as dist
from transformers import GenerationConfig
from transformers.generation import (BaseStreamer, LogitsProcessorList, NoRepeatNGramLogitsProcessor,
                                     StoppingCriteria, StoppingCriteriaList)

from ssmshard.testing import rel_err


class RecordingStreamer(BaseStreamer):
    """Every ``put`` and ``end`` it receives, as plain lists."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


class StopOnMultipleOf(StoppingCriteria):
    """Stops each row whose newest token is a multiple of ``k`` (a per-row decision)."""

    def __init__(self, k):
        self.k = k

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % self.k == 0


def _fails_on_call(input_ids, scores):
    raise KeyError("this stopping criterion fails")


@contextlib.contextmanager
def early_eos(model, generated, prompt_length, steps=(1, 3, 2)):
    """The model's generation_config with EOS ids it emits early: row r's greedy token at new step
    ``steps[r]`` (from ``generated``, HF's greedy ids under the model's own config), so every row
    stops by then. The model's own EOS ids stay in the set: a row that ended on one of them before
    its step (its later ids are padding) stops there again. Restored afterwards (the model object
    is shared)."""
    config = model.generation_config
    saved = config.eos_token_id
    own = [] if saved is None else [saved] if isinstance(saved, int) else list(saved)
    eos = sorted({generated[row][prompt_length + step] for row, step in enumerate(steps)} | set(own))
    config.eos_token_id = eos
    try:
        yield eos
    finally:
        config.eos_token_id = saved


def scores_err(ours, hf):
    """Largest relative error over steps of the finite scores; inf if the filtered tokens
    (-inf scores) differ or the step counts do."""
    if ours is None or hf is None or len(ours) != len(hf):
        return float("inf")
    errs = []
    for a, b in zip(ours, hf):
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], b[~finite]):
            return float("inf")
        errs.append(rel_err(a[finite], b[finite]))
    return max(errs)


def hf_reference(call):
    """``call()`` (a Hugging Face reference) run on rank 0 alone, its result sent to every rank:
    the ranks would all compute the same, and on the 2-core CI machine they share the cores."""
    result = [None]
    if dist.get_rank() == 0:
        with torch.no_grad():
            result[0] = call()
    dist.broadcast_object_list(result, src=0)
    return result[0]


def seeded(seed, call):
    if seed is not None:
        torch.manual_seed(seed)
    return call()


def _compare(dm, model, ids, mask, seed=None, **options):
    """dm.generate against model.generate with the same arguments (and sampling seed)."""
    ours = seeded(seed, lambda: dm.generate(ids, mask, **options))
    hf = hf_reference(lambda: seeded(seed, lambda: model.generate(ids, attention_mask=mask, **options)))
    if not options.get("return_dict_in_generate"):
        return {"equal": torch.equal(ours, hf), "ours": ours.tolist(), "hf": hf.tolist()}
    result = {"equal": torch.equal(ours.sequences, hf.sequences), "ours": ours.sequences.tolist(),
              "hf": hf.sequences.tolist(), "scores_err": scores_err(ours.scores, hf.scores)}
    if options.get("output_logits"):
        result["logits_err"] = scores_err(ours.logits, hf.logits)
    return result


def error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and message are the result
        return f"{type(error).__name__}: {error}"
    return None


def argument_results(dm, model, ids, mask, hf_greedy, seed):
    """Each HF argument through dm.generate and model.generate; refused ones as errors."""
    prompt = ids.shape[1]
    results = {
        # Errors first: every rank must raise the same and stay in step for the cases after.
        "error_num_beams": error_of(lambda: dm.generate(ids, mask, num_beams=2)),
        "error_unknown": error_of(lambda: dm.generate(ids, mask, max_new_tokens=3, not_an_argument=1)),
        "error_assistant": error_of(lambda: dm.generate(ids, mask, assistant_model=model)),
        "error_attentions": error_of(lambda: dm.generate(ids, mask, return_dict_in_generate=True,
                                                          output_attentions=True)),
        # Fails on rank 0 after prefill: the other ranks must raise too, not wait for tokens.
        "error_failing_criterion": error_of(lambda: dm.generate(ids, mask, max_new_tokens=4,
                                                                 stopping_criteria=[_fails_on_call])),
        # A generation_config of its own (HF fills its unset fields from the model's) and a
        # keyword overriding it.
        "generation_config": _compare(dm, model, ids, mask, max_new_tokens=6,
                                      generation_config=GenerationConfig(max_new_tokens=9, repetition_penalty=1.3)),
        "max_length": _compare(dm, model, ids, mask, max_length=prompt + 5),
        "repetition_penalty": _compare(dm, model, ids, mask, max_new_tokens=8, repetition_penalty=1.5),
        "logits_processor": _compare(dm, model, ids, mask, max_new_tokens=8,
                                     logits_processor=LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)])),
        "stopping_criteria": _compare(dm, model, ids, mask, max_new_tokens=10,
                                      stopping_criteria=StoppingCriteriaList([StopOnMultipleOf(3)])),
        "stopping_callables": _compare(dm, model, ids, mask, max_new_tokens=10,
                                       stopping_criteria=[lambda input_ids, scores: input_ids.shape[1] >= prompt + 4]),
        "scores_greedy": _compare(dm, model, ids, mask, max_new_tokens=6, repetition_penalty=1.2,
                                  return_dict_in_generate=True, output_scores=True, output_logits=True),
        "scores_sampled": _compare(dm, model, ids, mask, seed=seed, max_new_tokens=6, do_sample=True,
                                   temperature=0.8, top_k=30, top_p=0.9, num_return_sequences=2,
                                   return_dict_in_generate=True, output_scores=True),
    }
    ours_stream = RecordingStreamer()
    dm.generate(ids, mask, max_new_tokens=5, streamer=ours_stream)

    def hf_stream():
        streamer = RecordingStreamer()
        model.generate(ids, attention_mask=mask, max_new_tokens=5, streamer=streamer)
        return [streamer.puts, streamer.ends]

    # Rank 0 streams exactly HF's puts; no other rank streams at all.
    results["streamer"] = {"ours": [ours_stream.puts, ours_stream.ends], "hf": hf_reference(hf_stream)}
    with early_eos(model, hf_greedy, prompt):
        # The early EOS ids are suppressed until each row has 6 new tokens.
        results["min_new_tokens"] = _compare(dm, model, ids, mask, max_new_tokens=10, min_new_tokens=6)
    return results


def gathered(value):
    """``value`` from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
