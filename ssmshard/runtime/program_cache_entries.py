"""What a program cache folder holds, read from the ``<key>.json`` beside each entry: why a lookup
missed, which entries this installation can still load, and the listing ``ssmshard programs DIR``
prints (docs/startup.md, "The program cache").

A key is a digest, so a miss by itself says nothing. Each entry's parts are kept in clear for that
reason: a miss is explained by the parts in which the closest stored entry of the same kind
differs (``plan.tp: 1 -> 2``, ``code.versions.torch: 2.11.0 -> 2.13.0``), and an entry stored by
other code (another ssmshard, torch or transformers) can never be found again and may be pruned.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

_ABSENT = "(absent)"
KEY_LENGTH = 40  # hex digits of a key (ProgramCache.key)
SHOWN_DIFFERENCES = 3  # a miss's log line names this many differing parts, then counts the rest


@dataclasses.dataclass
class Entry:
    directory: Path
    key: str
    parts: dict          # what the key digests (ProgramCache.key's second value)
    bytes: int           # the program file's size; 0 when only the .json is there
    stored: float        # the program file's modification time (seconds since the epoch)

    @property
    def kind(self) -> str:
        return self.parts["kind"]  # entries() admits only parts with a kind, code, plan and model

    @property
    def files(self) -> list[Path]:
        return [self.directory / f"{self.key}.{suffix}" for suffix in ("pt", "json")]


def entries(directory) -> list[Entry]:
    """The folder's entries, newest first. Only ``<key>.json`` files that hold a key's parts count:
    any other file (unreadable, or not the cache's) is left alone, by ``--prune`` too."""
    directory = Path(directory)
    found = []
    for sidecar in directory.glob("*.json"):
        if not re.fullmatch(f"[0-9a-f]{{{KEY_LENGTH}}}", sidecar.stem):
            continue
        try:
            parts = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            continue
        if not (isinstance(parts, dict) and {"kind", "code", "plan", "model"} <= parts.keys()):
            continue
        program = sidecar.with_suffix(".pt")
        stat = program.stat() if program.exists() else sidecar.stat()
        found.append(Entry(directory, sidecar.stem, parts, stat.st_size if program.exists() else 0, stat.st_mtime))
    return sorted(found, key=lambda entry: -entry.stored)


def differences(stored, current, path: str = "") -> list[tuple[str, object, object]]:
    """(path, stored value, current value) for every leaf in which two keys' parts differ."""
    stored, current = _as_mapping(stored), _as_mapping(current)
    if isinstance(stored, dict) and isinstance(current, dict):
        found = []
        for name in sorted(set(stored) | set(current), key=str):
            found += differences(stored.get(name, _ABSENT), current.get(name, _ABSENT), _join(path, name))
        return found
    if isinstance(stored, list) and isinstance(current, list) and len(stored) == len(current):
        found = []
        for index, (a, b) in enumerate(zip(stored, current)):
            found += differences(a, b, f"{path}[{index}]")
        return found
    return [] if stored == current else [(path, stored, current)]


def describe(found: list[tuple[str, object, object]], shown: int = SHOWN_DIFFERENCES) -> str:
    """``a.b: x -> y; c: ...; and N more`` for a list ``differences`` returned."""
    text = "; ".join(f"{path}: {_short(a)} -> {_short(b)}" for path, a, b in found[:shown])
    return text + (f"; and {len(found) - shown} more" if len(found) > shown else "")


def closest(directory, parts: dict) -> tuple[Entry, list] | None:
    """The stored entry of ``parts``'s kind with the fewest differing parts, and those parts."""
    candidates = [(entry, differences(entry.parts, parts)) for entry in entries(directory)
                  if entry.kind == parts.get("kind")]
    return min(candidates, key=lambda item: len(item[1]), default=None)


def unloadable_here(entry: Entry) -> list[tuple[str, object, object]]:
    """The parts of ``entry``'s code that this installation no longer matches (its ssmshard sources,
    the versions of Python and the packages, the model's source files). A non-empty answer means
    no process here can find the entry again. The GPU is left out: a shared folder may hold
    entries for other GPUs."""
    from .program_cache import _file_digest, installation_parts

    code = entry.parts["code"]
    found = differences({name: code.get(name) for name in ("ssmshard", "versions")}, installation_parts(), "code")
    for module, digest in code.get("model files", {}).items():
        try:
            current = _file_digest(inspect.getsourcefile(importlib.import_module(module)))
        except (ImportError, TypeError, OSError):
            current = "(not importable)"
        if current != digest:
            found.append((f"code.model files.{module}", digest, current))
    return found


def summary(entry: Entry) -> dict:
    """What ``ssmshard programs`` shows of an entry: its kind, rank, model, plan (fields that differ
    from ``Plan()``'s), size, time, GPU."""
    from ..plan import Plan
    from .program_cache import _canonical

    model = entry.parts["model"]
    config = _as_mapping(model.get("config", []))
    config = config if isinstance(config, dict) else {}
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    plan = [(path, value) for path, _, value in differences(_canonical(Plan()), entry.parts["plan"])
            if path != "type"]
    options = _as_mapping(entry.parts.get("options", []))
    return {"kind": entry.kind,
            "rank": options.get("rank") if isinstance(options, dict) else None,
            "model": model.get("class", "?").rsplit(".", 1)[-1] + (f", {layers} layers" if layers else ""),
            "plan": " ".join(f"{path}={_short(value)}" for path, value in plan) or "Plan()",
            "megabytes": entry.bytes / 1e6, "stored": entry.stored, "gpu": entry.parts["code"].get("gpu")}


def _as_mapping(value):
    """A canonical dict (``program_cache._canonical``: a list of [key, value] pairs) with string keys
    as a dict, so that paths read by name (``model.config.rms_norm_eps``)."""
    if isinstance(value, list) and value and all(isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)
                                                 for row in value):
        names = [row[0] for row in value]
        if len(set(names)) == len(names):
            return dict(value)
    return value


def _join(path: str, name) -> str:
    return f"{path}.{name}" if path else str(name)


def _short(value, limit: int = 48) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
