"""The program cache: sharded generation programs kept on disk, so that a later process skips
their capture and passes (docs/startup.md, "The program cache").

``parallelize(model, plan, program_cache=DIR)`` (or ``SSMSHARD_PROGRAM_CACHE=DIR``) looks each
generation program (prefill, decode, the static-K/V decode, chunk) up in ``DIR`` before
capturing it, and stores what it builds. An entry is found only by a key over everything that
decides the program:

- what is built: the program's kind, its capture options, the rank and the kernels chosen;
- the plan, every field (a callable in it by its importable name; one defined outside ssmshard
  by its source too);
- the model: its class, its config (every field, the attention implementation included), the
  name, shape, dtype, device type and ties of every parameter and buffer, and training or eval;
- the code: ssmshard's own source files, the files defining the model and config classes, the
  versions of Python, torch, transformers, Triton and the kernel packages HF may call, the GPU's
  name, the passes registered (user passes by their source) and every ``SSMSHARD_*`` variable.

Weights are not in the key: a program reads whatever weights the module holds. What it does not
see is a change in code the key does not name (an edited file of transformers installed in place,
a helper a user pass calls): delete the folder then. Entries are pickles; read only a folder you
trust. Each entry is ``<key>.pt`` with ``<key>.json`` beside it, the key's parts in clear: a miss
logs where the closest entry differs, and ``ssmshard programs DIR`` lists and prunes the folder
(``program_cache_entries.py``).

The forward program is not cached: it is the program ``dm.program.report()`` and the sharding
tools inspect, and a stored program keeps no fake values (``program_store.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..program_store import load_program, save_program
from .program_cache_entries import KEY_LENGTH, closest, describe

log = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "SSMSHARD_PROGRAM_CACHE"
# Packages whose presence or version changes what HF's modeling code calls while it is traced.
_KERNEL_PACKAGES = ("triton", "kernels", "mamba-ssm", "causal-conv1d", "flash-attn")


class Uncacheable(Exception):
    """Something a key would need cannot be named (a lambda in the plan): build without the cache."""


class ProgramCache:
    """One folder of stored programs; ``loaded`` and ``stored`` list what this process found and
    wrote (``"<kind> rank <r>"``)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.loaded: list[str] = []
        self.stored: list[str] = []

    @classmethod
    def of(cls, argument) -> "ProgramCache | None":
        """The cache ``parallelize(program_cache=...)`` names: a folder, a ProgramCache, or None for
        ``$SSMSHARD_PROGRAM_CACHE`` (unset or empty: no cache)."""
        if isinstance(argument, ProgramCache):
            return argument
        folder = argument if argument is not None else os.environ.get(ENVIRONMENT_VARIABLE)
        if folder is not None and not str(folder):
            folder = None  # an empty name would be the working directory
        return None if folder is None else cls(folder)

    def load(self, kind: str, model, plan, options: dict, group: str):
        """The stored program for this key, its collectives over ``group``; None if there is none."""
        try:
            key, parts = self.key(kind, model, plan, options)
        except Uncacheable as exc:
            log.warning("program cache: the %s program is built, not looked up: %s", kind, exc)
            return None
        path = self.directory / f"{key}.pt"
        if not path.exists():
            self._explain_miss(kind, parts)
            return None
        started = time.perf_counter()
        try:
            program = load_program(path.read_bytes(), group)
        except Exception as exc:  # a truncated or foreign file: say so, and build the program
            log.warning("program cache: %s could not be loaded (%s: %s); building the %s program instead",
                        path, type(exc).__name__, exc, kind)
            return None
        from ..capture import Recapture
        from ..families import family_of

        program.recapture = Recapture(model, family_of(model))
        self.loaded.append(f"{kind} rank {options.get('rank')}")
        log.info("program cache: loaded the %s program from %s in %.2fs", kind, path, time.perf_counter() - started)
        return program

    def _explain_miss(self, kind: str, parts: dict) -> None:
        """Log why nothing was found: the parts in which the closest stored entry of this kind
        differs (an upgraded torch, another plan), so that a miss that should have been a hit
        can be told from one that could not be."""
        found = closest(self.directory, parts) if self.directory.is_dir() else None
        if found is None:
            log.info("program cache: no %s program stored in %s yet", kind, self.directory)
        else:
            log.info("program cache: no %s program for this key in %s; the closest stored one (%s) differs in %s",
                     kind, self.directory, found[0].key, describe(found[1]))

    def store(self, kind: str, model, plan, options: dict, program, group: str) -> None:
        """Write ``program`` under its key (atomically: a reader sees the whole file or none)."""
        try:
            key, parts = self.key(kind, model, plan, options)
            data = save_program(program, group)
        except Exception as exc:  # no key, or something in the program pickle refuses: it runs unstored
            log.warning("program cache: the %s program is not stored: %s: %s", kind, type(exc).__name__, exc)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, content in ((f"{key}.json", json.dumps(parts, indent=1).encode()), (f"{key}.pt", data)):
            partial = self.directory / f"{name}.{os.getpid()}.partial"
            partial.write_bytes(content)
            os.replace(partial, self.directory / name)
        self.stored.append(f"{kind} rank {options.get('rank')}")
        log.info("program cache: stored the %s program as %s (%.1f MB)", kind, key, len(data) / 1e6)

    def program(self, kind: str, model, plan, options: dict, group: str, build):
        """The stored program, or ``build()``'s, stored."""
        program = self.load(kind, model, plan, options, group)
        if program is None:
            program = build()
            self.store(kind, model, plan, options, program, group)
        return program

    @staticmethod
    def key(kind: str, model, plan, options: dict) -> tuple[str, dict]:
        """(hex digest, the parts it digests)."""
        parts = {"kind": kind, "options": _canonical(options), "plan": _canonical(plan), "model": _model_parts(model),
                 "code": _code_parts(model), "passes": _registered_passes(),
                 "environment": {name: value for name, value in sorted(os.environ.items())
                                 if name.startswith("SSMSHARD_") and name != ENVIRONMENT_VARIABLE}}
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:KEY_LENGTH]
        return digest, parts


def _canonical(value):
    """``value`` as JSON that is the same in every process for the same value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__qualname__,
                **{f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return [[_canonical(k), _canonical(v)] for k, v in sorted(value.items(), key=lambda item: repr(item[0]))]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype),
                "sha256": hashlib.sha256(value.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()}
    if callable(value):
        return _callable_name(value)
    text = repr(value)
    if " at 0x" in text:
        raise Uncacheable(f"{type(value).__name__} {text[:80]} has no name that outlives this process")
    return text


def _callable_name(fn) -> str:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module is None or name is None or "<lambda>" in name or "<locals>" in name:
        raise Uncacheable(f"{fn!r} has no importable name")
    if module == "ssmshard" or module.startswith("ssmshard."):
        return f"{module}.{name}"  # its source is in the package digest
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        raise Uncacheable(f"{module}.{name}: its source cannot be read") from None
    return f"{module}.{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def _registered_passes() -> dict:
    from ..passes import get, registered

    return {name: _callable_name(get(name)) for name in registered()}


def _model_parts(model) -> dict:
    from .checkpoint import _names_by_tensor

    config = model.config
    aliases = _names_by_tensor(model)  # a tied tensor: first name first
    tensors = {}  # by name, so that a miss reads "model.tensors.<name>.dtype: ..." (program_cache_entries.py)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        first = aliases[id(tensor)][0]
        tensors[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "device": tensor.device.type,
                         "requires_grad": bool(tensor.requires_grad), "tied to": None if first == name else first}
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": _canonical(config.to_dict()),
            "attention": str(getattr(config, "_attn_implementation", None)),
            "training": model.training, "tensors": tensors}


def installation_parts() -> dict:
    """The part of the code a key covers that does not depend on the model: ssmshard's sources
    and the versions of Python and the packages."""
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for package in ("transformers", *_KERNEL_PACKAGES):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"ssmshard": _package_digest(), "versions": versions}


def _code_parts(model) -> dict:
    files = {cls.__module__: _file_digest(inspect.getsourcefile(cls)) for cls in (type(model), type(model.config))}
    gpu = None
    if any(p.is_cuda for p in model.parameters()):
        gpu = torch.cuda.get_device_name(next(p for p in model.parameters() if p.is_cuda).device)
    return {**installation_parts(), "model files": files, "gpu": gpu}


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    """A digest of every Python file of the ssmshard package, by path and content."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
