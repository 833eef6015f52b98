"""``parallelize(model, plan)``: this rank's executable module of a tensor-parallel model."""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings

import torch
import torch.distributed as dist

from ..capture import capture
from ..packing import PackedBatch
from ..comm import all_reduce, register_group
from ..comm.groups import backends_by_device
from ..families import build_meta_model, family_of
from ..permutation import permuted_local_slice
from ..placement import Shard, local_slice
from ..plan import Plan, PlanError
from ..token_layout import TokenLayout
from .checkpoint import SafetensorsCheckpoint, match_checkpoint, read_local_weights, weights_to_hold
from .pipeline import shard_program
from .program_cache import ProgramCache

_group_ids = itertools.count()


class DistributedModule(torch.nn.Module):
    """One rank's part of the model: local weight shards (as parameters) and the local program.

    ``forward(input_ids)`` returns the full logits on every rank and is differentiable: each
    local parameter's ``.grad`` is this rank's slice of the unsharded model's gradient.
    Built with ``parallelize(..., packed=True)`` it also runs packed batches: ``forward`` of a
    :class:`~ssmshard.packing.PackedBatch` (or ``input_ids`` (1, T) with ``cu_seqlens=``)
    returns (1, T, vocab) logits, every sequence computed on its own. Under
    ``Plan(tsp=D, tsp_logits="local")`` it returns the logits of this rank's own tokens only, at
    the global positions ``token_positions(L)`` names.

    The ``program`` it is built from is the sharded program its local weights were laid out
    from: the forward program, or (``parallelize(..., lazy_forward=True)``) the prefill program,
    the forward program (the ``program`` attribute) then captured and sharded on first use. Either
    gives the same placements (``Plan.layout`` reads which weights a program has and their roles,
    the same in every program of a model).
    """

    def __init__(self, program, weights: dict[str, torch.Tensor], plan: Plan, rank: int, *, model=None,
                 shard_options=None, packed_program=None, captures=None, decode_graphs=None, program_cache=None):
        super().__init__()
        if program.mode not in ("forward", "prefill"):
            raise ValueError(f"a DistributedModule is built from its forward or prefill program, not {program.mode}")
        # The program the weights were laid out from: it names the process group, the vocabulary
        # and the placement of every weight, whichever program is built later.
        self._layout = program
        self._forward = program if program.mode == "forward" else None  # else built on first use
        # callable(model, **capture options) -> Program: where the other programs come from
        # (default: ``capture``; a SimulatedMesh captures once for all its ranks).
        self._captures = captures
        # Where generation programs are looked up before they are built (``program_cache.py``).
        self.program_cache = program_cache
        self.packed_program = packed_program  # sharded like ``program``, over the same local weights
        self.plan = plan
        self.rank = rank
        self._model = model  # captured again (prefill/decode) on the first generate(); may be on meta
        self._shard_options = shard_options
        self._generation = None if program.mode == "forward" else {"prefill": program}
        self._decode_graphs = {}  # batch size -> GraphedDecode
        # callable(decode program, static_length) -> the decode step as a CUDA graph (default:
        # ``GraphedDecode``; the ranks of a SimulatedMesh share one graph, runtime/joint_graph.py).
        self._new_decode_graph = decode_graphs
        self._warned_eager_decode = False
        self.last_generation_loop = None  # "device" or "host": which loop the last generate ran
        self._names = {}
        self._views_without_grad = {}  # fqn -> (weight, its detached view): see _bound
        for index, (fqn, tensor) in enumerate(weights.items()):
            name = f"w{index}"
            self._names[fqn] = name
            if program.param_specs[fqn].kind == "parameter":
                self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad))
            else:
                self.register_buffer(name, tensor, persistent=False)
        local = {fqn: getattr(self, name) for fqn, name in self._names.items()}
        self._bound(program)
        if packed_program is not None:
            missing = sorted(set(packed_program.param_specs) - set(local))
            if missing:
                raise RuntimeError(f"the packed program reads weights the forward program does not: {missing[:3]}")
            packed_program.bind(local)

    @property
    def program(self):
        """This rank's forward program (``report()``, ``sync_points``, ...); captured and sharded
        on first use where ``parallelize(..., lazy_forward=True)`` built the module."""
        if self._forward is None:
            self._forward = self._build_forward()
        return self._forward

    def _build_forward(self):
        """Capture and shard the forward program, over the weights laid out from the prefill program."""
        if self._model is None:
            raise RuntimeError("this DistributedModule was built without its model; its forward program needs it")
        program = shard_program(self._capture(mode="forward"), self._model, self.plan, **self._shard_options)
        unread = sorted(fqn for fqn, spec in program.param_specs.items()
                        if spec.kind != "constant" and fqn not in self._names)
        if unread:
            raise RuntimeError(f"the forward program reads weights the prefill program does not: {unread[:3]}; "
                               "build this module with parallelize(..., lazy_forward=False)")
        return self._bound(program)

    def local_weight(self, fqn: str) -> torch.Tensor:
        return getattr(self, self._names[fqn])

    @torch.no_grad()
    def sync_replicated_grads(self) -> None:
        """Sum the gradients of weight rows that several ranks share (call after backward).

        Mamba-2's B/C rows when n_groups < tp, and key/value heads when n_kv_heads < tp, are
        held by tp / pieces ranks each: each rank's gradient for them is a partial sum over its
        own heads (the shard pass deliberately puts no ``tp_copy`` on them, so the gradient
        reaching the shared input is not counted once per rank). Each such segment is placed at
        its chunk's offset in a zero buffer of the full segment and all-reduced, so ranks
        holding the same chunk add up and nothing else mixes in.
        """
        group = self._layout.shard["group"]
        for fqn, name in self._names.items():
            placement = self._layout.param_specs[fqn].placement
            param = getattr(self, name)
            if not isinstance(placement, Shard) or param.grad is None:
                continue
            start = 0
            for seg in placement.segments:
                if seg.pieces < self.plan.tp:
                    local = param.grad.narrow(placement.dim, start, seg.local)
                    shape = list(local.shape)
                    shape[placement.dim] = seg.size
                    full = local.new_zeros(shape)
                    full.narrow(placement.dim, seg.offset(self.rank), seg.local).copy_(local)
                    full = all_reduce(full, group)
                    local.copy_(full.narrow(placement.dim, seg.offset(self.rank), seg.local))
                start += seg.local

    def _local_weights(self):
        # Read from the module's own dicts: every call of a program binds these, and getattr
        # through nn.Module.__getattr__ was most of a 64-layer model's binding time.
        parameters, buffers = self._parameters, self._buffers
        return {fqn: parameters[name] if name in parameters else buffers[name] for fqn, name in self._names.items()}

    def forward(self, input_ids, *, cu_seqlens=None, position_ids=None):
        program = self.program
        if isinstance(input_ids, PackedBatch) or cu_seqlens is not None:
            if self.packed_program is None:
                raise ValueError("this DistributedModule was built without packing and would run packed "
                                 "sequences as one: use ssmshard.parallelize(model, plan, packed=True)")
            program = self.packed_program
        if torch.is_grad_enabled():
            # Re-bind so parameters replaced by .to()/load_state_dict are the ones used.
            self._bound(program)
            return program(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids)
        with self._reading_weights_without_grad(program):
            return program(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids)

    def token_positions(self, length: int, device=None) -> torch.Tensor:
        """The global positions (along the sequence of ``length`` tokens; of a packed row, its
        ``T``) of the rows ``forward`` returns on this rank under ``Plan(tsp=D,
        tsp_logits="local")``, in the order it returns them: e.g. ``labels[:, positions]`` are
        this rank's labels. Every position is on exactly one rank."""
        if self.plan.tsp == 1 or self.plan.tsp_logits != "local":
            raise ValueError(f"token_positions names the rows of a Plan(tsp=D, tsp_logits='local') forward; this "
                             f"module's plan has tsp={self.plan.tsp}, tsp_logits={self.plan.tsp_logits!r}, so "
                             "forward returns every token's logits")
        return TokenLayout(self.rank, self.plan.tsp, self.plan.tsp_order).real_positions(length, device)

    # ----------------------------------------------------------------- generation
    def generation_programs(self):
        """This rank's (prefill, decode) programs, captured and sharded on first use.

        Prefill returns each state sharded like the channels or heads that produce it; decode
        takes the states with exactly those placements and must return them unchanged, so the
        state cache never crosses ranks. Under ``Plan(tsp=...)`` prefill splits the prompt's tokens
        over the ranks and hands decode its states in that same layout (``tsp_prefill.py``).
        ``generate`` builds only what it runs: decoding over static key/value buffers, it never
        builds the decode program of the growing cache.
        """
        return self.prefill_program(), self.decode_program()

    def decode_program(self):
        """This rank's decode program (the growing cache), captured and sharded on first use."""
        return self._stateful_program("decode", "decode")

    def _build_prefill(self):
        """Capture and shard the prefill program (under TSP its sequence-sharded twin too), once."""
        generation = self._generation or {}
        if "prefill" in generation and (self.plan.tsp == 1 or "tsp_prefill" in generation):
            return
        if self._model is None:
            raise RuntimeError("this DistributedModule was built without its model; generation needs it")
        if "prefill" not in generation:
            generation["prefill"] = self._sharded("prefill", {"mode": "prefill"})
        if self.plan.tsp > 1:
            # Traced at 8 tokens per chunk: the tsp pass propagates shapes over the local chunks,
            # and where HF branches on the conv kernel (the conv state of a prefill shorter than
            # it is padded) a chunk's traced length must take the branch long prompts take.
            chunks = TokenLayout(0, self.plan.tsp, self.plan.tsp_order).chunks
            generation["tsp_prefill"] = self._sharded("tsp_prefill", {"mode": "prefill", "example_seq": 8 * chunks},
                                                      sequence_sharded=True)
        self._generation = generation

    def prefill_program(self):
        """This rank's prefill program, captured and sharded on first use: what generation prefills
        with (under TSP the sequence-sharded one, its states re-laid for the tensor-parallel decode
        program)."""
        self._build_prefill()
        if self.plan.tsp == 1:
            return self._bound(self._generation["prefill"])
        from .tsp_prefill import SequenceShardedPrefill

        return SequenceShardedPrefill(self._bound(self._generation["tsp_prefill"]), self._generation["prefill"],
                                      self.rank)

    def chunk_program(self):
        """This rank's chunked-prefill program (prefill continued from states), on first use."""
        return self._stateful_program("chunk", "chunk")

    def static_decode_program(self):
        """This rank's decode program over static key/value buffers (``runtime/static_kv.py``),
        on first use: the keys/values sharded by heads as prefill returns them."""
        return self._stateful_program("static_decode", "decode", static_kv=True)

    def _stateful_program(self, name, mode, **capture_options):
        """The generation program ``name``, captured in ``mode`` and sharded on first use: it takes
        the states as prefill places them and is checked to return them alike."""
        self._build_prefill()
        if name not in self._generation:
            self._generation[name] = self._sharded(name, {"mode": mode, **capture_options},
                                                   prefill=self._generation["prefill"])
        return self._bound(self._generation[name])

    def _sharded(self, kind, capture_options, **shard_options):
        """Generation program ``kind``, captured with ``capture_options`` and sharded (with
        ``shard_options`` besides the module's own), or read from the program cache."""
        def build():
            return shard_program(self._capture(**capture_options), self._model, self.plan,
                                 **shard_options, **self._shard_options)

        if self.program_cache is None or self._captures is not None:
            return build()
        return self.program_cache.program(kind, self._model, self.plan,
                                          _cache_options(capture_options, shard_options, self._shard_options, self.plan),
                                          self._shard_options["group"], build)

    def _capture(self, **options):
        """A fresh captured program of this module's model, for this rank to shard (a generation
        program's SSM states in the plan's ``ssm_state_dtype``)."""
        options.update(self.plan.capture_options(options["mode"]))
        if self._captures is not None:
            return self._captures(self._model, **options)
        return capture(self._model, **options)

    def _bound(self, program, without_grad: bool = False):
        """``program`` reading this module's current local weights, its factory ops on their device.

        ``without_grad`` (a call under ``torch.no_grad``, see ``_reading_weights_without_grad``):
        the program reads views of the weights that do not require grad. ATen's matmul treats a
        3-D input whose tokens are not its rows (Mamba's ``out_proj`` input and ``dt_proj``
        output, transposed from the scan's layout) differently by whether the weight requires
        grad: then it copies the input into rows (so that the backward needs no batch-expanded
        weight gradient), else it reads it in place through a batched GEMM. The copy is ATen's strided elementwise kernel, 0.53-0.56 ms a
        layer for Mamba-2.8B at 8 x 2048 on an H200 (benchmarks/results/compile/, "Eager
        Mamba-1's transposing copies")."""
        weights = self._local_weights()
        if without_grad:
            weights = {fqn: self._view_without_grad(fqn, weight) for fqn, weight in weights.items()}
        device = next(iter(weights.values())).device
        bound = {}
        for fqn, spec in program.param_specs.items():
            if fqn in weights:
                bound[fqn] = weights[fqn]
                continue
            # Constants lifted by export belong to each program itself (e.g. the empty key/value
            # tensors an HF cache starts from). A model on the meta device gives meta constants:
            # an empty one loses nothing, any other would compute garbage.
            constant = program.constants[fqn]
            if constant.device.type == "meta":
                if constant.numel():
                    raise RuntimeError(f"the {program.mode} program of this meta-device model lifted the constant "
                                       f"{fqn!r} {tuple(constant.shape)}, whose values a meta model does not have; "
                                       "build the model with real weights to generate")
                constant = torch.empty(constant.shape, dtype=constant.dtype, device=device)
            elif constant.device != device:  # e.g. read from the program cache onto another device: moved once
                constant = program.constants[fqn] = constant.to(device)
            bound[fqn] = _local_part(constant, spec.placement, self.rank)
        program.weights = bound
        if program.capture_device != device:
            # Factory ops captured from a meta model create meta tensors (the states a cache
            # starts from) until they are pointed at the weights' device.
            program.retarget(device)
        return program

    @contextlib.contextmanager
    def _reading_weights_without_grad(self, *programs):
        """Inside: ``programs``, run under ``torch.no_grad`` only, read the weights as views that do
        not require grad (see ``_bound``); on the way out they read the parameters again, so that
        a caller holding one of them (``dm.program``, ``dm.prefill_program()``) still gets
        gradients through it. ``None`` (no chunk program) is skipped; a sequence-sharded prefill
        stands for the program it runs."""
        from .tsp_prefill import SequenceShardedPrefill

        programs = [p.program if isinstance(p, SequenceShardedPrefill) else p for p in programs if p is not None]
        for program in programs:
            self._bound(program, without_grad=True)
        try:
            yield
        finally:
            for program in programs:
                self._bound(program)

    def _view_without_grad(self, fqn, weight):
        # One view per weight, kept while the weight and its data are the same: programs that
        # check their weights by identity see the same tensor call after call. The data is
        # compared too: ``module.to()`` and ``.data =`` give a parameter new data in place of the
        # old, which a view taken before would go on reading.
        if not weight.requires_grad:
            return weight
        held = self._views_without_grad.get(fqn)
        if held is None or held[0] is not weight or not _same_data(held[1], weight):
            held = self._views_without_grad[fqn] = (weight, weight.detach())
        return held[1]

    def state_placements(self):
        """Placement of each state tensor of the cache (see ``generation_programs``)."""
        self._build_prefill()
        return self._generation["prefill"].shard["outputs"][1:]

    def prefill(self, input_ids, attention_mask=None, *, chunk_size=None):
        """``(last-token logits, states)`` of a (left-padded) prompt batch; with ``chunk_size``,
        chunk by chunk (see :func:`ssmshard.runtime.generate.prefill`)."""
        from .generate import prefill, prompt_inputs

        self._check_ids(input_ids)  # before the programs are captured on first use
        prefill_program = self.prefill_program()
        chunk_program = self._chunk_program_for(input_ids, chunk_size)
        mask, positions = prompt_inputs(input_ids, attention_mask)
        with torch.no_grad(), self._reading_weights_without_grad(prefill_program, chunk_program):
            return prefill(prefill_program, chunk_program, input_ids, mask, positions, chunk_size)

    def generate(self, input_ids, attention_mask=None, *, cuda_graph="auto", static_kv="auto", device_loop="auto",
                 generator=None, **arguments):
        """``model.generate(input_ids, attention_mask=attention_mask, **arguments)`` on this rank:
        every rank returns the same ids (or HF's output object with ``return_dict_in_generate``).

        The defaults are the model's own ``generation_config`` (eos, pad, max_length, sampling
        settings), overridden by ``generation_config=`` and then by keyword arguments, as in HF;
        ``stopping_criteria`` and ``streamer`` are used on rank 0, which decides each step (see
        :mod:`ssmshard.runtime.generate`). What HF does that ssmshard does not (beam search,
        assisted decoding, attentions or hidden states in the output, ...) raises ``ValueError``
        naming the argument, on every rank, before any collective. Pass the same arguments on
        every rank.

        ``prefill_chunk_size`` (HF's setting too): prefill longer prompts chunk by chunk,
        bounding activation memory by the chunk. ``cuda_graph``: replay the decode step as a
        CUDA graph over static per-rank state buffers (``ssmshard.runtime.cuda_graph``);
        ``"auto"`` does where the weights are on CUDA (attention models over static key/value
        buffers, see ``static_kv``), and warns once where it cannot; ``True`` raises instead.
        ``static_kv``: decode attention models (Zamba, Zamba2, Llama) over key/value buffers of
        a fixed number of positions instead of a growing cache (``ssmshard.runtime.static_kv``):
        ``True`` sizes them for this generation (the prompt plus ``max_new_tokens``), an int
        fixes their positions (a ``ValueError`` before any work if the generation could need
        more), ``False`` keeps the growing cache, ``"auto"`` uses them where the decode step is
        a CUDA graph. Without CUDA the static step runs eagerly, with the same tokens.
        ``device_loop``: greedy or sampled generation stopped by length and EOS ids only, with
        device-only logits processors (temperature, top-k/p, min-p, repetition penalty, minimum
        length) and no streamer or scores, runs without a host synchronisation per step
        (``ssmshard.runtime.device_loop``; ``why_not_device_loop`` names what keeps a generation
        on the host loop); ``"auto"`` where it applies, ``True`` raises ``ValueError`` where it
        does not, ``False`` keeps the host loop. ``last_generation_loop`` says which ran last
        (``"device"`` or ``"host"``).
        ``generator``: the random stream sampling draws from on rank 0 (default: torch's global one).
        """
        from .device_loop import uses_device_loop
        from .generate import run_generation
        from .generation_config import prepare_generation

        self._check_ids(input_ids)  # before the programs are captured on first use
        if self._model is None:
            raise RuntimeError("this DistributedModule was built without its model; generation needs it")
        setup = prepare_generation(self._model, input_ids, attention_mask, **arguments)
        static_length = self._static_kv_length(setup, cuda_graph, static_kv)  # before any program is built
        on_device = uses_device_loop(setup, device_loop)
        prefill = self.prefill_program()
        step = self._decode_step(setup, cuda_graph, static_length)
        chunk_program = self._chunk_program_for(setup.input_ids, setup.prefill_chunk_size)
        self.last_generation_loop = "device" if on_device else "host"
        # The decode step keeps the parameters: its CUDA graph checks the weights it captured by identity.
        with self._reading_weights_without_grad(prefill, chunk_program):
            return run_generation(prefill, step, setup, group=_group_of(self._layout), generator=generator,
                                  chunk_program=chunk_program, device_loop=on_device)

    def _check_ids(self, input_ids):
        from ..inputs import check_input_ids

        check_input_ids(input_ids, self._layout.vocab_size, self._layout.weights_device)

    def _chunk_program_for(self, input_ids, chunk_size):
        """The chunk program when this prompt is longer than ``chunk_size`` (captured only then)."""
        return self.chunk_program() if chunk_size is not None and input_ids.shape[1] > chunk_size else None

    def _static_kv_length(self, setup, cuda_graph, static_kv):
        """Positions of the static key/value buffers ``generate`` decodes over for ``setup``, or
        None for the growing cache: every argument and size checked before any work."""
        from .static_kv import check_static_length, positions_needed

        if cuda_graph not in (True, False, "auto"):
            raise ValueError(f"cuda_graph must be True, False or 'auto', got {cuda_graph!r}")
        fixed_length = type(static_kv) is int
        if not (static_kv in (True, False, "auto") or (fixed_length and static_kv > 0)):
            raise ValueError(f"static_kv must be True, False, 'auto' or a positive number of positions, "
                             f"got {static_kv!r}")
        on_cuda = all(w.is_cuda for w in self._local_weights().values())
        if cuda_graph is True and not on_cuda:  # here, before the decode programs are built
            raise ValueError("cuda_graph=True: the decode step cannot be a CUDA graph: the weights are not on a "
                             "CUDA device; pass cuda_graph=False")
        family = family_of(self._model)
        if not family.has_attention:
            if static_kv not in (False, "auto"):
                raise ValueError(f"static_kv={static_kv!r}: {family.class_name} has no attention keys/values; its "
                                 "decode states have fixed shapes already (leave static_kv unset)")
            return None
        wants_graph = cuda_graph is True or (cuda_graph == "auto" and on_cuda)
        if static_kv is False or (static_kv == "auto" and not wants_graph):
            return None
        prompt, max_length = setup.input_ids.shape[1], setup.config.max_length
        length = static_kv if fixed_length else positions_needed(prompt, max_length)
        check_static_length(length, prompt, max_length)
        return length

    def _decode_step(self, setup, cuda_graph, length):
        """The decode step ``generate`` runs for ``setup``: the decode program, the static-K/V step
        over buffers of ``length`` positions (eager), or a CUDA graph of either."""
        from .cuda_graph import GraphedDecode, why_not_graphable
        from .static_kv import StaticKVDecode

        weights = self._local_weights()
        on_cuda = all(w.is_cuda for w in weights.values())
        decode = self.static_decode_program() if length is not None else self.decode_program()
        eager = StaticKVDecode(decode, length) if length is not None else decode
        if cuda_graph is False:
            return eager
        reason = why_not_graphable(decode) if on_cuda else "the weights are not on a CUDA device"
        if reason is not None:
            if cuda_graph is True:
                raise ValueError(f"cuda_graph=True: the decode step cannot be a CUDA graph: {reason}; "
                                 "pass cuda_graph=False")
            if on_cuda and not self._warned_eager_decode:
                warnings.warn(f"decoding eagerly (one kernel launch at a time): {reason}", stacklevel=3)
                self._warned_eager_decode = True
            return eager
        # One graph per batch size: a new buffer length replaces it (its buffers go with it).
        batch = setup.input_ids.shape[0]
        graphed = self._decode_graphs.get(batch)
        if (graphed is None or not graphed.reads_weights(weights) or graphed.program is not decode
                or (length is not None and graphed.static.length != length)):
            graphed = self._decode_graphs[batch] = (self._new_decode_graph or GraphedDecode)(decode, length)
        return graphed

    def decode_graph(self, batch: int):
        """The decode step's CUDA graph the last ``generate`` of batch size ``batch`` replayed
        (a ``runtime.cuda_graph.GraphedDecode``; ``.graph.replay()`` runs one step), or None where
        that batch decoded eagerly."""
        graphed = self._decode_graphs.get(batch)
        return graphed if graphed is not None and graphed.graph is not None else None

    def release_cuda_graphs(self) -> None:
        """Free this module's decode CUDA graphs (the next ``generate`` captures again). Call it,
        or ``ssmshard.release_cuda_graphs()``, before ``dist.destroy_process_group()``: a live
        graph holding NCCL kernels makes that teardown wait forever (pytorch/pytorch#115388)."""
        from .cuda_graph import release as release_graphs

        release_graphs(self._decode_graphs.values())
        self._decode_graphs.clear()


def parallelize(model, plan: Plan, *, group=None, device_mesh=None, checkpoint=None, device=None,
                progress: bool = True, packed: bool = False, allow_unexpected_keys: bool = False,
                lazy_forward: bool = False, program_cache=None) -> DistributedModule:
    """Shard ``model`` for this process's rank of ``group`` (default: the world).

    ``device_mesh``: a 1-D ``DeviceMesh`` whose ranks form the tensor-parallel group (instead
    of ``group``). ``checkpoint``: a safetensors checkpoint directory (one file or shards with
    ``model.safetensors.index.json``) or file; each rank then reads only its own slices of it,
    and ``model`` only gives the shapes and dtypes, so it is best built on the meta device
    (see :func:`parallelize_from_pretrained`). ``device``: where checkpoint weights are put
    (default: the current CUDA device under NCCL, else the CPU). ``progress``: a progress bar
    over the tensors read, on rank 0.

    The plan and the checkpoint's keys and shapes are validated against the model before any
    collective call: an impossible split raises :class:`~ssmshard.plan.PlanError`, a missing
    key, mismatched shape or key the model has no weight for (unless ``allow_unexpected_keys``)
    :class:`~ssmshard.runtime.checkpoint.CheckpointError`, in every process at once.
    ``packed=True`` also captures and shards the packed forward program, so ``forward`` accepts
    packed batches (:func:`ssmshard.pack`).

    ``lazy_forward=True``, for a module that generates: the weights are laid out from the prefill
    program, which the first ``generate`` runs anyway, and the forward program (``forward``,
    ``program``) is captured and sharded on first use. ``parallelize`` then exports one program
    fewer before the first token (docs/startup.md).

    ``program_cache``: a folder (default: ``$SSMSHARD_PROGRAM_CACHE``; unset: none) where the
    generation programs are stored once built, and from where a later process with the same
    model, plan and code loads them instead of capturing and sharding them again
    (``runtime/program_cache.py`` says what the key covers). With ``lazy_forward=True`` (and no
    TSP) that includes the prefill program ``parallelize`` lays the weights out from; the forward
    program is not cached.
    ``module.program_cache.loaded`` and ``.stored`` list what this process found and wrote.
    """
    if packed and plan.tsp_order != "contiguous":
        raise PlanError(f"packed=True runs packed rows under Plan(tsp_order='contiguous') only, not "
                        f"{plan.tsp_order!r}: drop packed=True or tsp_order")
    if packed and lazy_forward:
        raise ValueError("packed=True builds the packed forward program beside the forward program; "
                         "lazy_forward=True defers the forward: pass one of them")
    # The program the weights are laid out from; a lazy forward's module starts from prefill's.
    plan.check_model(model)  # PlanError here, before any process-group work
    mode = "prefill" if lazy_forward else "forward"
    cache = ProgramCache.of(program_cache)
    name = f"ssmshard_tp{next(_group_ids)}"
    stored = prefill_options = None
    if cache is not None and lazy_forward and plan.tsp == 1:
        # The prefill program the weights are laid out from may be a stored one, looked up by the
        # rank and the kernels: what the group gives without any collective.
        rank_group = _tensor_parallel_group(group, device_mesh)
        prefill_options = _cache_options({"mode": "prefill"}, {}, {
            "rank": dist.get_rank(rank_group),
            "kernels": plan.kernel_choice(_weights_device(model, checkpoint, device, rank_group))}, plan)
        stored = cache.load("prefill", model, plan, prefill_options, name)
    program = stored if stored is not None else capture(model, mode=mode, **plan.capture_options(mode))
    # Captured before any process-group work too: a model packing cannot serve fails here.
    packed_program = capture(model, mode="forward", packed=True) if packed else None
    # likewise (a stored program was laid out by the process that built it)
    placements = plan.layout(program, model) if stored is None else {f: s.placement for f, s in program.param_specs.items()}
    permutations = plan.weight_permutations(program, model)  # likewise
    source = keys = None
    if checkpoint is not None:
        source = SafetensorsCheckpoint(checkpoint)
        keys = match_checkpoint(program, model, source, allow_unexpected_keys=allow_unexpected_keys)  # likewise
    elif any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("the model is on the meta device (shapes only): pass checkpoint=DIR to read its "
                         "weights, or use ssmshard.parallelize_from_pretrained(DIR, plan)")
    group = _tensor_parallel_group(group, device_mesh)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.tp:
        raise PlanError(f"Plan(tp={plan.tp}) but the process group has {world} ranks; set tp={world}")
    register_group(name, _collective_backend(plan, group))
    weights_device = _weights_device(model, checkpoint, device, group)
    device = weights_device if source is not None else device
    check_backend_carries(group, weights_device)
    options = {"rank": rank, "group": name, "kernels": plan.kernel_choice(torch.device(weights_device))}
    if stored is None:
        program = shard_program(program, model, plan, placements=placements, **options)
        if prefill_options is not None:
            cache.store("prefill", model, plan, prefill_options, program, name)
    if packed_program is not None:
        # The same placements: both programs read one set of local weights.
        packed_program = shard_program(packed_program, model, plan, placements=placements, **options)
    module = functools.partial(DistributedModule, plan=plan, rank=rank, model=model, shard_options=options,
                               packed_program=packed_program, program_cache=cache)
    # A lazy forward's module holds the model's own tensors only, which every program reads under
    # the same names; what export lifted into the prefill program beyond them (the empty key/value
    # tensors a cache starts from) stays that program's own (``DistributedModule._bound``), as the
    # other generation programs' do.
    if source is not None:
        weights = read_local_weights(program, placements, model, source, keys, rank, device=device,
                                     progress=progress and rank == 0, permutations=permutations,
                                     lifted=not lazy_forward)
    else:
        weights = local_weights(program, placements, model, rank, permutations, lifted=not lazy_forward)
    return module(program, weights)


def _weights_device(model, checkpoint, device, group) -> torch.device:
    """Where this rank's weights will live: for a checkpoint ``device``, else this rank's GPU under
    an NCCL group (the CPU otherwise); without one, the model's own device."""
    if checkpoint is None:
        return next(model.parameters()).device
    if device is not None:
        return torch.device(device)
    gpu_only = "cpu" not in backends_by_device(group)  # an NCCL group: the slices go to this rank's GPU
    return torch.device("cuda", torch.cuda.current_device()) if gpu_only else torch.device("cpu")


def _cache_options(capture_options, shard_options, module_options, plan) -> dict:
    """What, besides the model and the plan, decides a generation program: how it is captured
    (the plan's capture options included) and sharded. The group's name is the loading module's
    own; the prefill program a stateful one follows is decided by the same key."""
    options = {**capture_options, **plan.capture_options(capture_options["mode"])}
    options.update({k: v for k, v in {**shard_options, **module_options}.items() if k not in ("group", "prefill")})
    return options


def check_backend_carries(group, device) -> None:
    """A ``ValueError`` before any collective where ``group`` has no backend for tensors on
    ``device``: NCCL carries CUDA tensors only (torch's own error comes from inside the first
    collective and names neither). A group started without naming a backend on a machine with a
    GPU is such a group (:func:`backends_by_device`)."""
    backends, kind = backends_by_device(group), torch.device(device).type
    if kind not in backends:
        carried = ", ".join(f"{backend} for {each}" for each, backend in backends.items())
        raise ValueError(f"the process group's backends ({carried}) carry no {kind} tensors, "
                         f"but this rank's weights are on {device}: move the model to this rank's GPU "
                         "(model.to('cuda:<local rank>')), or start the group with gloo "
                         "(ssmshard.launch(..., backend='gloo'), dist.init_process_group('gloo'); a group started "
                         "without a backend on a machine with a GPU has NCCL only)")


def _same_data(view: torch.Tensor, weight: torch.Tensor) -> bool:
    # is_set_to: the same storage, offset, sizes and strides (one call; the storage fixes the device).
    return view.is_set_to(weight) and view.dtype is weight.dtype


def local_weights(program, placements, model, rank: int, permutations=None, lifted: bool = True) -> dict:
    """Rank ``rank``'s slices of ``model``'s weights (fresh leaf tensors) for the weights of
    ``program`` a module holds (``weights_to_hold``); a weight in ``permutations``
    (``plan.weight_permutations``) re-ordered on the way, ``model`` untouched."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    permutations = permutations or {}
    weights = {}
    for fqn, spec in weights_to_hold(program, named, lifted).items():
        full = named.get(fqn, program.constants.get(fqn))
        local = permuted_local_slice(full.detach(), placements.get(fqn), rank, permutations.get(fqn))
        weights[fqn] = local.clone().requires_grad_(spec.kind == "parameter" and full.requires_grad)
    return weights


def _local_part(tensor, placement, rank):
    return local_slice(tensor, placement, rank) if isinstance(placement, Shard) else tensor


def _group_of(program):
    from ..comm import resolve_group

    return resolve_group(program.shard["group"])


def parallelize_from_pretrained(path, plan: Plan, *, dtype=None, **kwargs) -> DistributedModule:
    """Build the model of checkpoint directory ``path`` on the meta device from its
    ``config.json`` and :func:`parallelize` it with weights read slice by slice from ``path``.

    ``dtype``: the weights' dtype (``torch.bfloat16``, ...; ``"auto"``: the config's; ``None``:
    torch's default), chosen as ``from_pretrained(dtype=...)`` does (rotary ``inv_freq`` stays
    float32); the checkpoint's tensors are converted to it as they are read.
    """
    from .generation_config import load_generation_defaults

    model = build_meta_model(str(path), dtype=dtype)
    load_generation_defaults(model, path)  # generate's defaults, as from_pretrained loads them
    return parallelize(model, plan, checkpoint=path, **kwargs)


def _collective_backend(plan, group):
    """What carries the program's collectives: the process group, or for ``Plan(allreduce=
    'symm_mem')`` a backend whose small all-reduces run over peer memory (every rank builds it
    here together: it exchanges buffer handles)."""
    if plan.allreduce == "nccl":
        return group
    from ..comm.symmetric import SymmetricMemoryBackend, SymmetricMemoryError

    try:
        return SymmetricMemoryBackend(group, plan.allreduce_max_bytes)
    except SymmetricMemoryError as exc:
        raise PlanError(str(exc)) from None


def _tensor_parallel_group(group, device_mesh):
    if device_mesh is not None:
        if group is not None:
            raise ValueError("pass either group= or device_mesh=, not both")
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh has {device_mesh.ndim} dims {tuple(device_mesh.shape)}; parallelize "
                             "needs the 1-D tensor-parallel axis: pass mesh['tp'] (a 1-D slice of it)")
        return device_mesh.get_group()
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs an initialised process group: run under torchrun or "
                           "ssmshard.launch (or call torch.distributed.init_process_group)")
    return group or dist.group.WORLD
