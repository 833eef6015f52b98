"""Read one rank's weight shards straight from a safetensors checkpoint.

No rank reads, or ever holds, more than its own part of a weight: a sharded weight is read
with ``safe_open(...).get_slice(key)[index]``, one read per segment of its placement (Mamba's
in_proj ``[x | z]`` is two row ranges per rank, Mamba-2's ``[z, x, B, C, dt]`` five), each
piece copied into its place in the local shard. A replicated weight is read whole: every rank
holds it whole anyway.

Where each graph weight comes from:
* parameters and persistent buffers: the checkpoint, found by
  1. their own name (``save_pretrained`` writes ``named_parameters`` names),
  2. another name of the same tensor in the model: tied weights (``lm_head.weight`` is the
     embedding) and Zamba2's shared transformer (one module at several layers) are stored
     once, under one of their names,
  3. either of those without the model's ``base_model_prefix`` (a checkpoint saved from the
     base model, e.g. ``MambaModel``, stores ``layers.0...`` for ``backbone.layers.0...``);
* non-persistent buffers (rotary ``inv_freq``) are never saved: taken from the model when it
  holds real values, else recomputed from the config by the model's own ``_init_weights`` on
  a CPU twin of the owning module (what ``from_pretrained`` does for them);
* lifted constants: the captured program's values.
Each tensor is converted to the dtype the model gives the weight (build the model in the
dtype you want, or use ``parallelize_from_pretrained(..., dtype=)``).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re

import torch
from safetensors import safe_open

from ..permutation import local_reads, permuted_local_slice
from ..placement import local_shape

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint does not fit the model: missing tensors, other shapes, missing files."""


class SafetensorsCheckpoint:
    """A safetensors checkpoint (one file, or shards listed in ``model.safetensors.index.json``)
    opened lazily: only the headers are read until a slice is asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._handles: dict[str, object] = {}  # file -> open safe_open handle
        self._file_of = self._map_keys_to_files()

    def _map_keys_to_files(self) -> dict[str, str]:
        path = self.path
        if os.path.isfile(path):
            if not path.endswith(".safetensors"):
                raise CheckpointError(f"{path} is not a .safetensors file")
            return {key: path for key in self._open(path).keys()}
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted({name for name in weight_map.values() if not os.path.isfile(os.path.join(path, name))})
            if missing:
                raise CheckpointError(f"{index} lists shard files that are not in {path}: {', '.join(missing[:5])}")
            return {key: os.path.join(path, name) for key, name in weight_map.items()}
        single = os.path.join(path, SINGLE_FILE)
        if os.path.isfile(single):
            return {key: single for key in self._open(single).keys()}
        present = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (it holds: {present}). Only safetensors "
            "checkpoints can be read slice by slice: re-save with save_pretrained(dir, safe_serialization=True)")

    def _open(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt", device="cpu")
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def file_of(self, key: str) -> str:
        return self._file_of[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self._file_of[key]).get_slice(key).get_shape())

    def read_into(self, out: torch.Tensor, key: str, dim: int | None = None,
                  ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Fill ``out`` with the whole tensor (``dim=None``), or with its ``(start, length)``
        ranges along ``dim`` one after the other. Each range is one read of just those elements
        from the file, copied (and converted to ``out``'s dtype and device) into its place, so
        no more than ``out`` and one range are ever held."""
        lazy = self._open(self._file_of[key]).get_slice(key)
        if dim is None:
            return out.copy_(lazy[...])
        lead = (slice(None),) * dim  # full extent on the dims before the sharded one
        offset = 0
        for start, length in ranges:
            out.narrow(dim, offset, length).copy_(lazy[(*lead, slice(start, start + length))])
            offset += length
        return out


def _names_by_tensor(model) -> dict[int, list[str]]:
    """id(tensor) -> every name the model reaches it by (tied and shared weights have several)."""
    names: dict[int, list[str]] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        names.setdefault(id(tensor), []).append(name)
    return names


def _is_non_persistent_buffer(model, fqn: str) -> bool:
    owner, _, leaf = fqn.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return leaf in module._buffers and leaf in module._non_persistent_buffers_set


def match_checkpoint(program, model, checkpoint: SafetensorsCheckpoint, *,
                     allow_unexpected_keys: bool = False) -> dict[str, str | None]:
    """Graph weight FQN -> checkpoint key (``None``: not read from the checkpoint).

    Checks every key and global shape before any tensor is read or any process-group call is
    made; raises one :class:`CheckpointError` listing every missing key, mismatched shape and
    (unless ``allow_unexpected_keys``) every checkpoint key the model has no weight for: a
    checkpoint of a deeper model than its config.json describes would otherwise load its
    first layers silently (HF reports such keys as unexpected; the model's own
    ``_keys_to_ignore_on_load_unexpected`` patterns are honoured as HF honours them).
    """
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    aliases = _names_by_tensor(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys, problems = {}, []
    for fqn, spec in program.param_specs.items():
        if spec.kind == "constant" or (spec.kind == "buffer" and _is_non_persistent_buffer(model, fqn)):
            keys[fqn] = None
            continue
        names = [fqn] + [n for n in aliases.get(id(tensors.get(fqn)), []) if n != fqn]
        candidates = names + [n[len(prefix) + 1:] for n in names if prefix and n.startswith(prefix + ".")]
        key = next((c for c in candidates if c in checkpoint), None)
        if key is None:
            near = difflib.get_close_matches(fqn, checkpoint.keys(), n=3, cutoff=0.6)
            problems.append(f"missing: model weight {fqn!r} (tried {', '.join(candidates)})"
                            + (f"; closest keys: {', '.join(near)}" if near else ""))
            continue
        if checkpoint.shape(key) != tuple(spec.shape):
            problems.append(f"shape: {key!r} is {list(checkpoint.shape(key))} in {checkpoint.file_of(key)} "
                            f"but the model's {fqn} is {list(spec.shape)}")
            continue
        keys[fqn] = key
    if not allow_unexpected_keys:
        problems += [f"unexpected: checkpoint key {key!r} is no weight of the model"
                     for key in _unexpected_keys(model, checkpoint, tensors, prefix)]
    if problems:
        shown = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise CheckpointError(
            f"checkpoint {checkpoint.path} does not fit {type(model).__name__} "
            f"({len(problems)} problem{'s' * (len(problems) > 1)}):\n  {shown}\n"
            "Check that the model was built from this checkpoint's config.json"
            + (" (or pass allow_unexpected_keys=True to ignore keys the model has no weight for)."
               if any(p.startswith("unexpected") for p in problems) else "."))
    return keys


def _unexpected_keys(model, checkpoint, tensors, prefix) -> list[str]:
    known = set(tensors) | {n[len(prefix) + 1:] for n in tensors if prefix and n.startswith(prefix + ".")}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    return sorted(k for k in checkpoint.keys() if k not in known and not any(p.search(k) for p in ignored))


def recompute_buffer(model, fqn: str) -> torch.Tensor:
    """A non-persistent buffer of a meta-device model, computed from the config.

    The owning module is copied (on meta: free), its own tensors (not its children's) get CPU
    storage filled with NaN, and the model's ``_init_weights`` fills them, as ``from_pretrained``
    does for buffers a checkpoint never holds. A value ``_init_weights`` does not set stays NaN
    and is refused rather than used.
    """
    owner_name, _, leaf = fqn.rpartition(".")
    twin = copy.deepcopy(model.get_submodule(owner_name))
    twin.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for tensor in [*twin.parameters(recurse=False), *twin.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        model._init_weights(twin)
    value = getattr(twin, leaf)
    if value.is_floating_point() and value.isnan().any():
        raise CheckpointError(
            f"buffer {fqn!r} is not saved in checkpoints and {type(model).__name__}._init_weights does not "
            "compute it; build the model on CPU (not meta) so the buffer holds its value, then pass it")
    return value


def weights_to_hold(program, named: dict, lifted: bool = True) -> dict:
    """The weight specs of ``program`` a module holds: every one, or with ``lifted=False`` all but
    the tensors export lifted that the model does not hold (``named``: its parameters and buffers
    by name), which each program binds itself (``DistributedModule._bound``)."""
    return {fqn: spec for fqn, spec in program.param_specs.items()
            if lifted or spec.kind != "constant" or fqn in named}


def read_local_weights(program, placements, model, checkpoint: SafetensorsCheckpoint, keys: dict[str, str | None],
                       rank: int, *, device, progress: bool = True, permutations: dict | None = None,
                       lifted: bool = True) -> dict[str, torch.Tensor]:
    """This rank's local tensor for every graph weight (``weights_to_hold``), reading only its own
    slices. A weight in
    ``permutations`` (``plan.weight_permutations``: a head permutation the plan carries) gets the
    rows of its slice in their permuted order, read from the unpermuted checkpoint
    (``permutation.local_reads``)."""
    permutations = permutations or {}
    from tqdm.auto import tqdm

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    weights = {}
    specs = weights_to_hold(program, tensors, lifted)
    bar = tqdm(specs.items(), total=len(specs), unit="tensor", desc=f"loading rank {rank}'s shards",
               disable=not progress)
    for fqn, spec in bar:
        placement = placements.get(fqn)
        owner = tensors.get(fqn)
        requires_grad = spec.kind == "parameter" and (owner is None or owner.requires_grad)
        # Allocated here rather than kept as the tensors safetensors returns: those sit in a
        # bytes buffer at an arbitrary alignment, where CPU matmul kernels round differently.
        local = torch.empty(local_shape(spec.shape, placement), dtype=spec.dtype, device=device)
        if keys[fqn] is not None:
            reads = local_reads(placement, rank, permutations.get(fqn))
            checkpoint.read_into(local, keys[fqn], reads.dim, reads.ranges)
            if reads.reorder is not None:  # the dimension it re-orders is whole on this rank
                local.copy_(local.index_select(reads.reorder.dim, reads.reorder.index.to(local.device)))
        else:
            value = owner if owner is not None else program.constants.get(fqn)
            if value is None or value.device.type == "meta":
                if spec.kind == "constant":
                    raise CheckpointError(f"constant {fqn!r} of the captured program is on the meta device; "
                                          "capture a model built on CPU")
                value = recompute_buffer(model, fqn)
            local.copy_(permuted_local_slice(value.detach(), placement, rank, permutations.get(fqn)))
        weights[fqn] = local.requires_grad_(requires_grad)
    return weights
