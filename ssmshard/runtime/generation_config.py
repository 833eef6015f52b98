"""Hugging Face ``generate`` arguments, resolved exactly as ``model.generate`` resolves them.

``model.generate`` starts from the model's own ``generation_config`` (eos, pad, max_length,
sampling settings, ...), lets a ``generation_config=`` argument and then keyword arguments
override it, infers the prompt's attention mask, fixes the final lengths, and builds the logits
processors (repetition penalty, minimum length, temperature, top-k, top-p, ...) and the stopping
criteria (max length, EOS, max time, the user's own). The sharded loop
(:mod:`ssmshard.runtime.generate`) runs exactly these objects, so its tokens and scores are HF's.

They are built by the HF model's own preparation methods, called in ``generate``'s order, not
re-derived here: their semantics move between releases (5.24's repetition penalty skips each
row's left padding, 5.17's penalises the pad id too), and calling them is what gives HF's
result on every supported release. Those methods are private to transformers; the ones used
are listed in ``HF_PREPARATION``, and a release without one fails here with a clear error.

Everything here is a pure function of the arguments and the model's configs, and runs before
any collective: every rank reaches the same setup, or raises the same error, without
communicating.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from transformers import GenerationConfig
from transformers.generation import GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxLengthCriteria

HF_PREPARATION = ("_prepare_generation_config", "_prepare_special_tokens", "_prepare_attention_mask_for_generation",
                  "_prepare_generated_length", "_validate_generated_length", "_get_logits_processor",
                  "_get_stopping_criteria")

# Arguments of HF's generate() that ask for work this loop does not do.
REFUSED_ARGUMENTS = {
    "assistant_model": "assisted (speculative) decoding",
    "assistant_tokenizer": "assisted (speculative) decoding",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "custom_generate": "a custom decoding loop",
}

# The generation config fields that select each of HF's other decoding modes (greedy and
# sampling are the two this loop runs).
MODE_FIELDS = {
    "contrastive_search": ("penalty_alpha", "top_k"),
    "beam_search": ("num_beams",),
    "beam_sample": ("num_beams", "do_sample"),
    "group_beam_search": ("num_beams", "num_beam_groups"),
    "constrained_beam_search": ("constraints", "force_words_ids"),
    "assisted_generation": ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"),
    "dola_generation": ("dola_layers",),
}

# Generation config fields this loop cannot honour: (is it set?, why not).
REFUSED_SETTINGS = {
    "guidance_scale": (lambda v: v is not None and v != 1,
                       "classifier-free guidance runs a second, unconditional forward of the model"),
    "output_attentions": (bool, "the sharded programs return logits and states, not attention weights"),
    "output_hidden_states": (bool, "the sharded programs return logits and states, not hidden states"),
    "token_healing": (bool, "token healing re-tokenizes the prompt"),
}


@dataclasses.dataclass
class GenerationSetup:
    """What the generation loop runs: HF's prepared config, processors and criteria, and the
    prompt as HF feeds it (rows repeated ``num_return_sequences`` times, the mask inferred)."""

    input_ids: torch.Tensor  # (b, l)
    attention_mask: torch.Tensor  # (b, l)
    config: GenerationConfig
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    streamer: Any = None

    @property
    def pads_finished_rows(self) -> bool:
        """HF pads a finished row only when a stopping criterion knows EOS ids."""
        return any(hasattr(criterion, "eos_token_id") for criterion in self.criteria)

    def pad_finished(self, tokens: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
        """HF's pad id in place of the tokens (b,) of rows already finished (``unfinished`` 0)."""
        if self.pads_finished_rows:
            return tokens * unfinished + self.pad_token_id * (1 - unfinished)
        return tokens

    @property
    def pad_token_id(self) -> Optional[torch.Tensor]:
        return self.config._pad_token_tensor

    @property
    def stops_by_length_only(self) -> bool:
        """Nothing but the length can stop a row: the loop needs no per-step stop check."""
        return all(isinstance(criterion, MaxLengthCriteria) for criterion in self.criteria)

    @property
    def returns_dict(self) -> bool:
        return bool(self.config.return_dict_in_generate)

    @property
    def prefill_chunk_size(self) -> Optional[int]:
        return getattr(self.config, "prefill_chunk_size", None)


class ConfigDefaults(GenerationMixin):
    """HF's generate preparation for programs used without their model: the defaults a model
    built from ``config`` has (``GenerationConfig.from_model_config``)."""

    def __init__(self, config):
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)


def prepare_generation(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                       generation_config: Optional[GenerationConfig] = None, *, logits_processor=None,
                       stopping_criteria=None, prefix_allowed_tokens_fn=None, streamer=None, tokenizer=None,
                       synced_gpus=None, **kwargs) -> GenerationSetup:
    """The :class:`GenerationSetup` of ``model.generate(input_ids, attention_mask=..., generation_config, **kwargs)``.

    ``model``: the HF model whose ``generation_config`` gives the defaults (it may be on the meta
    device: only its configs are read). ``synced_gpus`` is accepted and has nothing to do: the
    ranks of a tensor-parallel group always step together. Raises ``ValueError`` for anything
    HF accepts that this loop does not do, naming the argument, and HF's own errors for invalid
    values and unknown arguments.
    """
    missing = [name for name in HF_PREPARATION if not hasattr(model, name)]
    if missing:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} has no {missing} on {type(model).__name__}: "
                           "ssmshard builds generate's settings with them; please report the version")
    refused = [name for name in REFUSED_ARGUMENTS if kwargs.pop(name, None) is not None]
    if refused:
        raise ValueError(f"generate: {', '.join(refused)} asks for {REFUSED_ARGUMENTS[refused[0]]}, which ssmshard's "
                         "generate does not do (greedy and sampling only); leave it out")
    if isinstance(attention_mask, GenerationConfig):  # HF's second positional argument
        attention_mask, generation_config = None, attention_mask
    _check_input_ids(input_ids)
    # Whether the lengths are HF's global defaults, decided before any merging, as HF does: a
    # default max_length counts new tokens (20), a set one counts the prompt too.
    has_default_max_length = _unset("max_length", kwargs, generation_config, model)
    has_default_min_length = _unset("min_length", kwargs, generation_config, model)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _refuse_unsupported(config)
    _refuse_model_inputs(model, model_kwargs)

    prompt = input_ids
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device,
                                  batch_size=input_ids.shape[0])
    if attention_mask is None:  # ids equal to the pad id are padding, unless the pad id is also EOS
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    if config.num_return_sequences > 1:  # each prompt row repeated, as HF expands the batch
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
    length = input_ids.shape[1]
    config = model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                             model_input_name="input_ids", input_ids_length=length,
                                             inputs_tensor=prompt)
    model._validate_generated_length(config, length, has_default_max_length)
    # HF hands its processors no mask when there is no padding (it drops an all-ones mask).
    padded = None if bool((attention_mask == 1).all()) else attention_mask
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=length, encoder_input_ids=prompt,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=input_ids.device, model_kwargs={"attention_mask": padded})
    criteria = model._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer)
    setup = GenerationSetup(input_ids, attention_mask, config, processors, criteria, streamer)
    if setup.pads_finished_rows and setup.pad_token_id is None:
        raise ValueError("generate: a stopping criterion with EOS ids needs a pad id for finished rows; "
                         "pass pad_token_id=")
    return setup


def _unset(field, kwargs, generation_config, model) -> bool:
    return (kwargs.get(field) is None and (generation_config is None or getattr(generation_config, field) is None)
            and getattr(model.generation_config, field) is None)


def _check_input_ids(input_ids):
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"generate: input_ids must be a 2-D tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"generate: input_ids must be a 2-D tensor of token ids (batch, length), got "
                         f"{tuple(input_ids.shape)} of {input_ids.dtype}")


def _refuse_unsupported(config: GenerationConfig) -> None:
    """A ValueError naming the setting when the merged config asks for more than greedy or sampling."""
    mode = config.get_generation_mode()
    mode = getattr(mode, "value", mode)
    if mode not in ("greedy_search", "sample"):
        fields = [f"{name}={getattr(config, name)!r}" for name in MODE_FIELDS.get(mode, ())
                  if getattr(config, name, None) not in (None, False)]
        raise ValueError(f"generate: {', '.join(fields) or 'the generation config'} selects {mode.replace('_', ' ')}, "
                         "which ssmshard's generate does not do (greedy and sampling only: num_beams=1)")
    for name, (is_set, why) in REFUSED_SETTINGS.items():
        value = getattr(config, name, None)
        if is_set(value):
            raise ValueError(f"generate: {name}={value!r} is not supported by ssmshard's generate: {why}")


def _refuse_model_inputs(model, model_kwargs: dict) -> None:
    """HF passes keyword arguments it does not know to the model's forward; ssmshard's programs
    take input ids, the mask and positions only."""
    given = {name: value for name, value in model_kwargs.items() if value is not None}  # HF ignores None too
    if not given:
        return
    if hasattr(model, "forward"):
        model._validate_model_kwargs(dict(given))  # HF's own error for arguments no model takes (typos)
    raise ValueError(f"generate: {sorted(given)} are model inputs that ssmshard's generate does not take: it "
                     "builds positions and states itself from input_ids and attention_mask")


def load_generation_defaults(model, path) -> None:
    """Give ``model`` (built from a checkpoint's ``config.json`` alone) the generation config
    ``from_pretrained`` would: the checkpoint's ``generation_config.json`` (its EOS ids, sampling
    settings), else one derived from ``config.json``. HF's own loader, from local files only."""
    model.adjust_generation_fn(None, from_auto_class=False, from_pipeline=False,
                               pretrained_model_name_or_path=str(path), cache_dir=None, force_download=False,
                               proxies=None, local_files_only=True, token=None, revision="main", subfolder="",
                               trust_remote_code=False)
