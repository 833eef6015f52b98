"""Capture a Hugging Face model as an ATen-level FX program.

``capture(model, mode=...)`` runs ``torch.export`` (non-strict) over a thin wrapper of the
model, with the modeling file's kernel functions swapped for ssmshard custom ops
(``hf_shims``), batch and sequence length dynamic, and tags every node (``passes.tag``).

Three modes, each a pure function of its inputs (weights are graph inputs too):

* ``forward``:  ``input_ids -> logits``                      (scoring / training)
* ``prefill``:  ``(input_ids, attention_mask, position_ids) -> (last logits, states)``
                 (states: per-layer conv/SSM/KV)
* ``decode``:   ``(input_ids[b, 1], attention_mask[b, past+1], position_ids[b, 1], states)
                 -> (logits, states)``
* ``chunk``:    ``(input_ids[b, l], attention_mask[b, past+l], position_ids[b, l], states)
                 -> (last logits, states)``: prefill continued from states, so a long prompt
                 can be prefilled chunk by chunk (``runtime.generate.prefill``)

``capture(model, mode="decode", static_kv=True)`` gives a decode step over static key/value
buffers: ``(input_ids[b, 1], attention_mask[b, max_len], position_ids[b, 1], states,
cache_position[]) -> (logits, states)``, each key/value state (b, kv_heads, max_len, head_dim)
whatever the past, the new token's key/value written at ``cache_position`` and attention run
over the whole buffer (``runtime/static_kv.py``, docs/static_kv.md). Every input keeps its
shape from step to step, so the step can be a CUDA graph.

Prefill and decode see the inputs Hugging Face ``generate`` builds for each step (left
padding masks, position ids), so they decode token for token like it.

``capture(model, packed=True)`` gives a packed forward program,
``(input_ids (1, T), cu_seqlens (S+1,)) -> logits (1, T, V)``, that runs S sequences laid end
to end as if each ran alone (``packing.py``, ``packed_capture.py``).

Decode rebuilds a Hugging Face cache object from the state tensors inside the traced
function, so the model's own cache logic is what gets captured, version by version, and
returns the updated tensors: no hidden mutation survives in the graph.

Export traces a prefix of the decoder layers (three where all are alike; more for hybrids, to
see every pair of consecutive layer kinds twice) and ``layer_repeat.py`` copies traced layers
for the rest, after checking on the traced graph that a copy is what tracing would give; capture
time then does not grow with depth.

The model may live on the meta device: export only needs shapes, so capture never touches
weights. The graph then records ``device=meta`` for factory ops; ``Program.bind`` retargets
them to the device of the real weights.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import time
import warnings

import torch
from torch.export import Dim

from .families import family_of
from .hf_compat import cache_kwarg, check_transformers_version
from .hf_shims import continued_scans, swapped_kernel_functions
from .layer_repeat import (TRACED_LAYERS, NotRepeatable, decoder_layers, layer_lists, repeat_layers, repetitions,
                           truncated)
from .packed_capture import PackedForward, check_packable, example_cu_seqlens, verify_packed_graph
from .program import Program, StateSpec, unpadded_mask_and_positions

log = logging.getLogger(__name__)

MODES = ("forward", "prefill", "decode", "chunk")
# Modes whose programs take the state tensors as inputs.
STATEFUL_MODES = ("decode", "chunk")
# Attributes of HF cache layers that hold state tensors, in the order states are flattened.
# A tensor or an {index: tensor} dict (linear-attention layers keep several numbered states).
_STATE_ATTRS = (("keys", "key"), ("values", "value"), ("conv_states", "conv"), ("recurrent_states", "ssm"))


class _Forward(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


def _generation_inputs(model, input_ids, attention_mask, position_ids, first: bool, **extra):
    """The model inputs Hugging Face ``generate`` would build for this step.

    ``prepare_inputs_for_generation`` is each family's own logic (Mamba drops the mask after
    prefill, Zamba keeps only the last logits, ...), so capturing it keeps decoding
    token-for-token identical to HF generate. ``position_ids`` reach only models that take them.
    """
    kwargs = dict(attention_mask=attention_mask, use_cache=True, is_first_iteration=first, **extra)
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        kwargs["position_ids"] = position_ids
    inputs = model.prepare_inputs_for_generation(input_ids, **kwargs)
    inputs["return_dict"] = True
    if "logits_to_keep" in parameters:
        # Generation reads the last position only: a long prompt's (l, vocab) logits would
        # otherwise be the largest activation of the prefill.
        inputs["logits_to_keep"] = 1
    return inputs


def _states_like(cache, template) -> list[torch.Tensor]:
    """``cache``'s state tensors in the dtypes of ``template``'s (``Plan(ssm_state_dtype=...)``:
    HF's scans return float32 states; a program hands them on as the decode program holds them)."""
    return [state if state.dtype == like.dtype else state.to(like.dtype)
            for state, like in zip(flatten_states(cache), flatten_states(template))]


class _Prefill(torch.nn.Module):
    """``(input_ids, attention_mask, position_ids) -> (last-token logits, *states)``."""

    def __init__(self, model, cache_kwarg, template):
        super().__init__()
        self.model = model
        self.cache_kwarg = cache_kwarg
        self.template = template

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.model(**_generation_inputs(self.model, input_ids, attention_mask, position_ids, True))
        cache = getattr(out, self.cache_kwarg)
        return out.logits[:, -1:], *_states_like(cache, self.template)


class _Decode(torch.nn.Module):
    """``(input_ids[b, 1], attention_mask[b, past + 1], position_ids[b, 1], states) -> (logits, *states)``."""

    def __init__(self, model, cache_kwarg, template):
        super().__init__()
        self.model = model
        self.cache_kwarg = cache_kwarg
        self.template = template

    def forward(self, input_ids, attention_mask, position_ids, states):
        cache = rebuild_cache(self.template, states)
        inputs = _generation_inputs(self.model, input_ids, attention_mask, position_ids, False,
                                    next_sequence_length=1, **{self.cache_kwarg: cache})
        out = self.model(**inputs)
        return out.logits, *_states_like(cache, self.template)


class _StaticDecode(_Decode):
    """``(input_ids[b, 1], attention_mask[b, max_len], position_ids[b, 1], states, cache_position[])
    -> (logits, *states)`` over a Hugging Face ``StaticCache``.

    The cache's own static layers do the work (``index_copy_`` of the new key/value at the
    cache position, a mask over all ``max_len`` slots), version by version; only their two
    host-side facts become inputs: the position (a tensor every layer counts from) and the
    buffer length (read from the key states, so one graph serves every ``max_len``).
    """

    def forward(self, input_ids, attention_mask, position_ids, states, cache_position):
        cache = rebuild_cache(self.template, states)
        for layer in cache.layers:
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and hasattr(layer, "cumulative_length"):
                layer.cumulative_length = cache_position.clone()  # the layer advances it in place
                layer.max_cache_len = layer.keys.shape[2]
        # The model reads the tokens seen so far (before any layer runs) from the input, which no
        # layer advances, not from its first attention layer's counter: that layer then traces as
        # every later one does, so capture may take it as an example of its kind (layer_repeat.py).
        cache.get_seq_length = lambda layer_idx=0: cache_position
        inputs = _generation_inputs(self.model, input_ids, attention_mask, position_ids, False,
                                    next_sequence_length=1, **{self.cache_kwarg: cache})
        out = self.model(**inputs)
        return out.logits, *_states_like(cache, self.template)


class _Chunk(_Decode):
    """``(input_ids[b, l], attention_mask[b, past + l], position_ids[b, l], states) -> (last logits, *states)``.

    Prefill continued from the states of the tokens before it. HF's own step logic covers
    attention (keys/values appended to the cache), the conv (its cache prepends the previous
    inputs) and Mamba-2 scans (which take the recurrent state); Mamba-1 scans are handed their
    state through ``hf_shims.continued_scans``.
    """

    def __init__(self, model, cache_kwarg, template, scans_need_states: bool, own_mask: bool):
        super().__init__(model, cache_kwarg, template)
        self.own_mask = own_mask
        slots = list(_state_slots(template))
        self.ssm_slots = [i for i, (_, kind, _, _) in enumerate(slots) if kind == "ssm"] if scans_need_states else []

    def forward(self, input_ids, attention_mask, position_ids, states):
        cache = rebuild_cache(self.template, states)
        inputs = _generation_inputs(self.model, input_ids, attention_mask, position_ids, False,
                                    next_sequence_length=input_ids.shape[1], **{self.cache_kwarg: cache})
        if self.own_mask:
            # SSM-only models drop the mask after the first step (a decode token is never a
            # pad), but a chunk can hold pads: their mixers zero them with the chunk's own mask.
            inputs["attention_mask"] = attention_mask[:, -input_ids.shape[1]:]
        # One new token takes HF's decode-step path, which reads the states itself.
        scanned = [] if input_ids.shape[1] == 1 else [states[i] for i in self.ssm_slots]
        with continued_scans(scanned):
            out = self.model(**inputs)
        return out.logits[:, -1:], *_states_like(cache, self.template)


def _state_slots(cache):
    """(layer index, kind, attribute, key) for every state tensor of an HF cache, in order."""
    for layer_idx, layer in enumerate(cache.layers):
        for attr, kind in _STATE_ATTRS:
            value = getattr(layer, attr, None)
            if isinstance(value, torch.Tensor):
                yield layer_idx, kind, attr, None
            elif isinstance(value, dict):
                for key in sorted(value):
                    if isinstance(value[key], torch.Tensor):
                        yield layer_idx, kind, attr, key


def flatten_states(cache) -> list[torch.Tensor]:
    out = []
    for layer_idx, _, attr, key in _state_slots(cache):
        value = getattr(cache.layers[layer_idx], attr)
        out.append(value if key is None else value[key])
    return out


def rebuild_cache(template, states):
    """A fresh cache shaped like ``template`` whose state tensors are (copies of) ``states``.

    Copies, because HF updates some states in place; cloning inside the graph keeps the
    caller's tensors untouched and lets functionalisation see plain data flow.
    """
    cache = copy.copy(template)
    cache.layers = []
    for layer in template.layers:
        fresh = copy.copy(layer)
        # Shallow-copy dict attributes (flags and state dicts) so nothing is shared with the template.
        for name, value in vars(layer).items():
            if isinstance(value, dict):
                setattr(fresh, name, dict(value))
        cache.layers.append(fresh)
    slots = list(_state_slots(template))
    if len(slots) != len(states):
        raise ValueError(f"decode expects {len(slots)} state tensors, got {len(states)}")
    for (layer_idx, _, attr, key), tensor in zip(slots, states):
        layer = cache.layers[layer_idx]
        if key is None:
            setattr(layer, attr, tensor.clone())
        else:
            getattr(layer, attr)[key] = tensor.clone()
    return cache


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# torch.export reports, as warnings, facts the Program's shape ranges already record (a
# length specialised to 0/1, a narrowed range): at capture they only alarm users.
_EXPORT_LOGGERS = ("torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes", "torch._dynamo")
PROGRESS_EVERY_S = 5.0  # at most one progress line per this many seconds of tracing


@contextlib.contextmanager
def _quiet_export_logs():
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _capture_context(model, family):
    """Eval mode (training-only fused paths off), swapped kernels, quiet HF fallbacks and export notes.

    The fake-tensor cache is off for the trace (and so for the passes, which propagate under
    the fake mode export made): with symbolic batch and lengths, rebuilding a cached output's
    sizes and strides costs more symbolic arithmetic than running the op's meta function
    again (timings with and without: docs/startup.md)."""
    was_training = model.training
    model.eval()
    try:
        with swapped_kernel_functions(family.modeling_module), warnings.catch_warnings(), _quiet_export_logs(), \
                torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            warnings.simplefilter("ignore")
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _layer_progress(model, what: str):
    """Log (INFO, every ``PROGRESS_EVERY_S``) which decoder layer export is tracing: a large model
    takes tens of seconds. Forward pre-hooks only read a clock; nothing enters the graph."""
    layers = [m for _, m in layer_lists(model)]
    count = sum(len(m) for m in layers)
    started = last = time.perf_counter()
    handles = []

    def hook(index):
        def report(module, args):
            nonlocal last
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                log.info("capturing %s: layer %d of %d after %.0fs", what, index + 1, count, now - started)
        return report

    index = 0
    for modules in layers:
        for layer in modules:
            handles.append(layer.register_forward_pre_hook(hook(index)))
            index += 1
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _example_ids(model, batch, seq, device):
    # Fixed example ids from a private generator: capturing (also a lazy shape-bucket sibling
    # in the middle of sampling) must not move the user's random number stream.
    vocab = model.config.vocab_size
    if device.type == "meta":
        return torch.zeros(batch, seq, dtype=torch.long, device=device)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return ids.to(device)


def _state_template(model, cache_kwarg, device, static_kv_length=None, ssm_state_dtype=None):
    """A populated HF cache from a tiny eager prefill (meta tensors when the model is on meta).

    It tells which state tensors exist, in which order, and is the object decode rebuilds.
    With ``static_kv_length``, a ``StaticCache`` of that many positions: its layers hold the same
    states in the same order (static key/value layers where the dynamic cache grows them).
    With ``ssm_state_dtype``, its SSM states are of that dtype: the programs then hold them so.
    """
    ids = _example_ids(model, 1, 2, device)
    extra = {}
    if static_kv_length is not None:
        from transformers import StaticCache

        extra[cache_kwarg] = StaticCache(config=model.config, max_cache_len=static_kv_length)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, return_dict=True, **extra)
    cache = getattr(out, cache_kwarg)
    if ssm_state_dtype is not None:
        cast_ssm_states(cache, ssm_state_dtype)
    return cache


def cast_ssm_states(cache, dtype: torch.dtype) -> None:
    """Replace the SSM states of an HF cache by copies in ``dtype``. HF's cache writes each new
    state into the tensor it holds (``copy_``), so from then on it keeps them in ``dtype``."""
    for layer_idx, kind, attr, key in _state_slots(cache):
        if kind != "ssm":
            continue
        layer = cache.layers[layer_idx]
        if key is None:
            setattr(layer, attr, getattr(layer, attr).to(dtype))
        else:
            getattr(layer, attr)[key] = getattr(layer, attr)[key].to(dtype)


def capture(model, *, mode: str = "forward", packed: bool = False, static_kv: bool = False,
            example_batch: int = 2, example_seq: int = 8, verbose: bool = False,
            ssm_state_dtype: torch.dtype | None = None) -> Program:
    """Capture ``model`` (a supported HF ``*ForCausalLM``) as a tagged :class:`Program`.

    Batch and sequence (decode: past) lengths are symbolic: one graph serves every shape in
    ``program.ranges``. Where the model branches on a length (HF pads a prefill shorter than
    the conv kernel; attention treats a one-token past specially), export narrows the range,
    and the program's shape-bucket cache captures a sibling graph the first time a shape
    outside it arrives, replaying the same pass pipeline on it. ``example_*`` size the trace
    (``example_seq`` is the past length for decode; for chunk, both the new and the past length).

    ``packed=True`` (forward only) captures a program over packed sequences: called with a
    :class:`~ssmshard.packing.PackedBatch` from ``ssmshard.pack`` (or ``input_ids`` (1, T) and
    ``cu_seqlens=``), it returns the logits of every sequence as if each ran alone.

    ``static_kv=True`` (decode only) captures the decode step over static key/value buffers
    (see the module docstring): the step a CUDA graph replays for attention models.

    ``ssm_state_dtype`` (generation programs): the dtype the program takes and returns SSM states
    in, instead of HF's float32 (``Plan(ssm_state_dtype=...)``); conv and key/value states keep
    the model's dtype.
    """
    check_transformers_version()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if static_kv and mode != "decode":
        raise ValueError(f"static key/value buffers are for decode programs, not {mode!r}")
    family = family_of(model)
    if ssm_state_dtype is not None and (mode == "forward" or not family.has_ssm):
        raise ValueError(f"ssm_state_dtype is the dtype of the SSM states a generation program (prefill, decode, "
                         f"chunk) takes or returns; a {mode} program of {family.class_name} has none")
    if packed:
        if mode != "forward":
            raise NotImplementedError(f"packed sequences are supported by forward programs only, not {mode!r}")
        check_packable(model, family)
    started = time.perf_counter()
    what = f"{family.class_name} ({mode}{', packed' if packed else ''})"
    log.debug("capturing %s", what)
    program = _capture_one(model, family, mode, example_batch, example_seq, packed, static_kv=static_kv,
                           ssm_state_dtype=ssm_state_dtype)
    program.capture_seconds = time.perf_counter() - started
    log.info("captured %s: %d ops in %.1fs", what, program.node_count(), program.capture_seconds)
    program.recapture = Recapture(model, family)
    if _model_device(model).type != "meta":
        program.bind(model)
    if verbose:
        what = f"{mode}, packed" if packed else mode
        print(f"captured {family.class_name} ({what}) in {program.capture_seconds:.2f}s: "
              f"{program.node_count()} nodes")
    return program


class Recapture:
    """``program.recapture``: captures a sibling of a program for shapes outside its ranges.

    Called with the program itself, so that a copy of a program (``SimulatedMesh`` shards one
    copy per rank) replays its own passes, not those of the program it was copied from. It holds
    the model, which a copy of the program shares rather than copies.
    """

    def __init__(self, model, family):
        self.model, self.family = model, family

    def __call__(self, program, user_inputs) -> Program:
        return _recapture(self.model, self.family, program, user_inputs)

    def __deepcopy__(self, memo):
        return self


def _recapture(model, family, program, user_inputs) -> Program:
    """A sibling of ``program`` for the shapes of ``user_inputs``, with the same passes applied."""
    ids = user_inputs[0]
    # Batch 1 would make export specialise the batch dim; every program serves batch >= 1
    # already, so lengths are what a sibling is traced for.
    batch, seq = max(2, ids.shape[0]), ids.shape[1]
    past = user_inputs[1].shape[1] - seq if program.mode in STATEFUL_MODES else 0  # the mask covers past + seq
    if program.mode == "decode":
        seq = past  # decode's example length is its past
    log.debug("capturing a %s program for shapes %s", program.mode, [tuple(t.shape) for t in user_inputs[:3]])
    static_length = None
    if program.static_kv:  # the mask spans the buffers: trace buffers of its length
        static_length = user_inputs[1].shape[1]
        seq = max(1, static_length // 2)
    sibling = _capture_one(model, family, program.mode, batch, seq, program.packed, example_past=past,
                           static_kv=program.static_kv, static_length=static_length,
                           ssm_state_dtype=program.ssm_state_dtype)
    from .passes import replay

    sibling = replay(sibling, program.history)
    sibling.compile = program.compile
    if program.weights is not None:
        sibling.weights = program.weights
        sibling.retarget(program.capture_device)
    return sibling


def _capture_one(model, family, mode, example_batch, example_seq, packed=False, example_past=None,
                 static_kv=False, static_length=None, ssm_state_dtype=None) -> Program:
    """Trace a prefix of the decoder layers and copy its layers for the rest where the traced
    graph shows that copying gives what tracing would (``layer_repeat.py``), else every layer."""
    shapes = (example_batch, example_seq, packed, example_past, static_kv, static_length, ssm_state_dtype)
    found = decoder_layers(model)
    try:
        plans = repetitions(model)
    except NotRepeatable as error:
        plans, reason = [], str(error)
    for plan in plans:
        try:
            return _trace(model, family, mode, *shapes, repeat=plan)
        except NotRepeatable as error:
            reason = str(error)
            log.info("%s: copying layers after a prefix of %d failed its check: %s", family.class_name, plan.traced,
                     reason)
    if found is not None and len(found[1]) > TRACED_LAYERS:
        log.info("tracing all %d layers of %s: %s", len(found[1]), family.class_name, reason)
    return _trace(model, family, mode, *shapes)


def _trace(model, family, mode, example_batch, example_seq, packed=False, example_past=None,
           static_kv=False, static_length=None, ssm_state_dtype=None, repeat=None) -> Program:
    full_model = model
    if static_kv and not family.has_attention:
        raise ValueError(f"{family.class_name} has no attention: its decode states have fixed shapes already, "
                         "so it needs no static key/value buffers (capture mode='decode' without static_kv)")
    cache_kw = cache_kwarg(model)
    device = _model_device(model)
    with _capture_context(model, family):
        if repeat is not None:  # after eval(): the view copies the modules' training flags
            model = truncated(model, repeat.traced)
        # Batch is one named dim shared by every input. Sequence and past lengths are AUTO:
        # export narrows their range where the model branches on them, and the Program
        # records the range it serves.
        batch = Dim("batch", min=1)
        # A static decode's example (unless a sibling's length is given): buffers of
        # 2 * example_seq slots, example_seq of them filled.
        if static_kv and static_length is None:
            static_length = 2 * example_seq
        state_template = None if mode == "forward" else _state_template(model, cache_kw, device, static_length,
                                                                         ssm_state_dtype)
        if packed:
            # Batch is 1 by definition; the packed length and the number of sequences vary.
            wrapper = PackedForward(model, family.has_attention)
            args = (_example_ids(model, 1, example_seq, device), example_cu_seqlens(example_seq, device))
            dynamic = ({1: Dim("tokens", min=1)}, {0: Dim("offsets", min=2)})
        elif mode == "forward":
            wrapper = _Forward(model)
            args = (_example_ids(model, example_batch, example_seq, device),)
            # Forward graphs do not branch on length, so ask for every length >= 1 (AUTO would
            # start at 2).
            dynamic = ({0: batch, 1: Dim("seq", min=1)},)
        elif mode == "prefill":
            # Prefill branches on length (short prompts are padded to the conv kernel): AUTO.
            wrapper = _Prefill(model, cache_kw, state_template)
            ids = _example_ids(model, example_batch, example_seq, device)
            args = (ids, *unpadded_mask_and_positions(ids, 0))
            seq = Dim.AUTO
            dynamic = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq})
        else:
            # decode: one new token after example_seq; chunk: example_seq new tokens after example_past.
            new_tokens, past = (1, example_seq) if mode == "decode" else (example_seq, example_past or example_seq)
            if static_kv:
                wrapper = _StaticDecode(model, cache_kw, state_template)
            elif mode == "decode":
                wrapper = _Decode(model, cache_kw, state_template)
            else:
                wrapper = _Chunk(model, cache_kw, state_template, family.scans_need_states,
                                 own_mask=not family.has_attention)
            states, dynamic_states = [], []
            for tensor, (_, kind, _, _) in zip(flatten_states(state_template), _state_slots(state_template)):
                shape = list(tensor.shape)
                shape[0] = example_batch
                dims = {0: batch}
                if kind in ("key", "value"):  # (b, kv_heads, past or buffer length, head_dim)
                    shape[2] = static_length or past
                    dims[2] = Dim.AUTO  # a named Dim trips an unprovable stride guard in HF attention
                states.append(torch.zeros(shape, dtype=tensor.dtype, device=device))
                dynamic_states.append(dims)
            ids = _example_ids(model, example_batch, new_tokens, device)
            args = (ids, *unpadded_mask_and_positions(ids, past), states)
            new = {0: batch} if mode == "decode" else {0: batch, 1: Dim.AUTO}
            dynamic = (new, {0: batch, 1: Dim.AUTO}, new, dynamic_states)
            if static_kv:
                mask, positions = unpadded_mask_and_positions(ids, past)
                mask = torch.cat([mask, mask.new_zeros(example_batch, static_length - past - 1)], dim=1)
                args = (ids, mask, positions, states, torch.tensor(past, device=device))
                dynamic = (*dynamic, None)
        with _layer_progress(model, f"{family.class_name} ({mode})"):
            try:
                exported = torch.export.export(wrapper, args, dynamic_shapes=dynamic, strict=False)
            except torch._dynamo.exc.UserError as refusal:
                if mode != "forward":
                    raise
                # This model branches on length after all (or export cannot prove a guard for
                # every length, as torch 2.11 for Llama at length 1): let export choose the ranges.
                log.info("%s (forward): export refused every length (%s); capturing with the range "
                         "export chooses, other lengths get a sibling graph on first use",
                         family.class_name, str(refusal).splitlines()[0])
                dynamic = ({1: Dim.AUTO}, {0: Dim.AUTO}) if packed else ({0: batch, 1: Dim.AUTO},)
                exported = torch.export.export(wrapper, args, dynamic_shapes=dynamic, strict=False)

    state_specs = []
    if state_template is not None:
        for (layer_idx, kind, _, _), tensor in zip(_state_slots(state_template), flatten_states(state_template)):
            state_specs.append(StateSpec(layer=layer_idx, kind=kind, dtype=tensor.dtype, ndim=tensor.dim()))
    program = Program.from_exported(
        exported, mode=mode, family=family.name, model=full_model, state_specs=state_specs,
        capture_device=device, wrapper_prefix="model.", packed=packed,
    )
    if repeat is not None:
        repeat_layers(program, full_model, repeat, family.repeat_path)
    program.static_kv = static_kv
    program.ssm_state_dtype = ssm_state_dtype
    if packed:
        verify_packed_graph(program)
    from .passes import CAPTURE_PASSES, run_pipeline  # late import: passes import Program

    return run_pipeline(program, list(CAPTURE_PASSES))
