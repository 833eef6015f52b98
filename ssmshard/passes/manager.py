"""Pass registry, pipeline runner and the verifier that runs after every pass."""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Any, Callable, Iterable

import torch.fx

from .fake_values import ALIKE_VALUES, propagate_fake_values

PassFn = Callable[["Program", "PassContext"], "Program"]  # noqa: F821
_REGISTRY: dict[str, PassFn] = {}
# Passes registered with analysis_only=True promise not to change the graph's computation
# (they only annotate); after them the verifier checks tags and skips fake re-propagation.
_ANALYSIS_ONLY: set[str] = set()
# Passes registered with repropagate=False: local rewrites known to keep every value's shape,
# verified by lint and tags only (capture runs them on models of any size).
_NO_REPROPAGATION: set[str] = set()
REQUIRED_TAGS = ("module", "call_site", "layer", "block", "role")


class PassVerificationError(RuntimeError):
    """The graph a pass returned is broken; the message names the pass."""


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the program: its options and pipeline-wide settings."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    debug_dir: str | None = None  # write before/after graphs here when set
    skip: frozenset[str] = frozenset()
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)  # scratch space across passes


def register(name: str, fn: PassFn | None = None, *, replace: bool = False, analysis_only: bool = False,
             repropagate: bool = True):
    """Register ``fn`` as pass ``name``; usable as ``register(name, fn)`` or ``@register(name)``."""
    def decorator(f: PassFn) -> PassFn:
        if name in _REGISTRY and not replace and _REGISTRY[name] is not f:
            raise ValueError(f"a pass named {name!r} is already registered; pass replace=True to override")
        _REGISTRY[name] = f
        (_ANALYSIS_ONLY.add if analysis_only else _ANALYSIS_ONLY.discard)(name)
        (_NO_REPROPAGATION.discard if repropagate and not analysis_only else _NO_REPROPAGATION.add)(name)
        return f

    return decorator(fn) if fn is not None else decorator


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    _ANALYSIS_ONLY.discard(name)
    _NO_REPROPAGATION.discard(name)


def get(name: str) -> PassFn:
    if name not in _REGISTRY:
        raise KeyError(f"no pass named {name!r}; registered passes: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered() -> list[str]:
    return sorted(_REGISTRY)


def verify(program, *, pass_name: str = "<input>", check_tags: bool = True,
           propagate: bool = True) -> None:
    """Lint the graph, re-propagate fake tensors through it, and check every node's tags."""
    gm = program.graph_module
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises a bare RuntimeError/AssertionError
        raise PassVerificationError(f"pass {pass_name!r} produced a malformed graph: {exc}") from exc
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    missing = [n.name for n, v in zip(placeholders, vals) if v is None]
    if missing:
        raise PassVerificationError(f"pass {pass_name!r} left placeholders without meta['val']: {missing[:5]}")
    try:
        if propagate:
            propagate_fake_values(gm, vals)
    except Exception as exc:
        raise PassVerificationError(
            f"pass {pass_name!r} broke the graph: fake-tensor propagation failed: {type(exc).__name__}: {exc}"
        ) from exc
    if check_tags:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            tags = node.meta.get("ssmshard")
            if not isinstance(tags, dict) or any(k not in tags for k in REQUIRED_TAGS):
                raise PassVerificationError(
                    f"pass {pass_name!r} left node {node.name} ({node.target}) without complete "
                    f"ssmshard tags (need {', '.join(REQUIRED_TAGS)}); copy them from the node it replaces"
                )


def _normalise(steps: Iterable[str | tuple[str, dict] | PassFn]):
    for step in steps:
        if isinstance(step, str):
            yield step, get(step), {}
        elif isinstance(step, tuple):
            name_or_fn, options = step
            if callable(name_or_fn):
                yield getattr(name_or_fn, "__name__", "anonymous"), name_or_fn, dict(options)
            else:
                yield name_or_fn, get(name_or_fn), dict(options)
        elif callable(step):
            yield getattr(step, "__name__", "anonymous"), step, {}
        else:
            raise TypeError(f"pipeline step must be a name, (name, options) or a function, got {step!r}")


def _graph_state(graph_module) -> list:
    """What the generated code is made from, for the graph and every nested graph: each node
    with its name, op, target and argument objects (a pass that changes a node replaces them)."""
    return [(module, [(node, node.name, node.op, node.target, node.args, node.kwargs) for node in module.graph.nodes])
            for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)]


def _changed_modules(before: list, after: list) -> list:
    """The graph modules of ``after`` whose nodes a pass touched (new modules included):
    ``recompile`` regenerates a module's Python code, which for a 64-layer program costs more than
    many passes do (docs/startup.md), so only these are regenerated."""
    old = {id(module): nodes for module, nodes in before}
    changed = []
    for module, nodes in after:
        previous = old.get(id(module))
        if (previous is None or len(previous) != len(nodes)
                or any(x is not y for a, b in zip(previous, nodes) for x, y in zip(a, b))):
            changed.append(module)
    return changed


def _op_diff(before: Counter, after: Counter) -> dict[str, int]:
    return {op: after[op] - before[op] for op in sorted(set(before) | set(after)) if after[op] != before[op]}


def run_pipeline(program, steps, *, skip: Iterable[str] = (), debug_dir: str | None = None,
                 verify_each: bool = True, shared: dict | None = None, recompile: bool = True):
    """Run passes in order on ``program``; verify after each; record op-count diffs.

    Passes edit graphs; the Python code of a graph module a pass changed is regenerated once,
    at the end (nested graphs at once: the verifier's propagation calls them). With
    ``recompile=False`` the top-level module's code is left stale and the program says so
    (``program.code_stale``), for a caller that runs several pipelines and regenerates once."""
    program.require_values("running passes")
    skip = frozenset(skip)
    debug_dir = debug_dir or os.environ.get("SSMSHARD_DUMP_DIR")
    shared = {} if shared is None else shared
    for index, (name, fn, options) in enumerate(_normalise(steps)):
        if name in skip:
            program.history.append({"pass": name, "skipped": True})
            continue
        ctx = PassContext(options=options, debug_dir=debug_dir, skip=skip, shared=shared)
        before = program.op_counts()
        if debug_dir:
            _dump(program, debug_dir, f"{index:02d}_{name}_before.txt")
        started = time.perf_counter()
        graph_before = _graph_state(program.graph_module)
        result = fn(program, ctx)
        if result is None:
            raise PassVerificationError(f"pass {name!r} returned None; a pass must return the program")
        program = result
        for module in program.graph_module.modules():
            if isinstance(module, torch.fx.GraphModule):
                module.graph.__dict__.pop(ALIKE_VALUES, None)
        changed = _changed_modules(graph_before, _graph_state(program.graph_module))
        for module in changed:
            if module is program.graph_module:
                program.code_stale = True
            else:
                module.recompile()
        seconds = time.perf_counter() - started
        if verify_each:
            verify(program, pass_name=name, propagate=name not in _NO_REPROPAGATION,
                   check_tags=getattr(program, "tagged", True))
        after = program.op_counts()
        program.history.append({"pass": name, "fn": fn, "options": options, "seconds": seconds,
                                "op_diff": _op_diff(before, after)})
        if debug_dir:
            _dump(program, debug_dir, f"{index:02d}_{name}_after.txt")
    if recompile:
        regenerate_code(program)
    return program


def regenerate_code(program) -> None:
    """Regenerate the program's top-level Python code if a pipeline left it stale."""
    if program.code_stale:
        program.graph_module.recompile()
        program.code_stale = False


# What capture runs on every program it makes (a sibling capture included): not replayed.
CAPTURE_PASSES = (
    "drop_tensor_asserts", "pad_as_cat", "gqa_attention", "whole_tensor_splits", "clones_copied_back",
    "causal_attention", "tag")


def replay(program, history):
    """Run on ``program`` the passes recorded in another program's ``history`` (bucket siblings)."""
    steps = [((h["pass"] if _REGISTRY.get(h["pass"]) is h["fn"] else h["fn"]), h["options"])
             for h in history if not h.get("skipped") and h["pass"] not in CAPTURE_PASSES]
    return run_pipeline(program, steps)


def _dump(program, directory: str, filename: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, filename), "w") as f:
        f.write(program.graph_module.print_readable(print_output=False))
