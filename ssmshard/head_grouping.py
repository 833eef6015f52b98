"""Head grouping: recovery of an extremely sensitive dropped sync point (SPD) by choosing which
heads each rank holds.

With sync point D dropped, rank i goes on with ``X + P_i`` where the exact model has
``X + P``, ``P = sum_i P_i`` and ``P_i`` the sum of the contributions ``O_u`` of the units
(attention key/value groups, Mamba-2 heads or SSM groups, Mamba-1 channels) that rank i holds. Which units a rank
holds is a free choice: tensor parallelism splits the heads into contiguous blocks, and
re-ordering the heads of a block (its input projections' output rows, its per-head parameters
and its output projection's input columns together) leaves the model's function unchanged.

``group_heads(model, tp, sync_point, calibration_ids)`` measures on calibration windows the Gram
matrix ``G[u, v] = sum_tokens <O_u, O_v>`` of the units' contributions to D's output, chooses
the balanced assignment of units to ranks that minimises the summed squared SPD error
``sum_i ||P - P_i||^2 = (tp - 2) ||P||^2 + sum_i sum_{u, v in rank i} G[u, v]``
(equivalently ``sum_i ||tp * P_i - P||^2`` up to constants: each rank's share is made as
representative of the whole as the units allow), and permutes the weights in place so that
the chosen groups are the contiguous blocks the sharding cuts. The model stays an ordinary
Hugging Face model: its outputs are unchanged without SPD, and any plan reads it. Or, with
``apply=False``, the model is left alone and the plan carries the permutation
(``Plan(head_permutations=grouping)``): each rank's slices are re-ordered on their way to it, from
the model in memory or from the unpermuted checkpoint (``weight_permutations`` says which weights
move and how, for both).

Search: every balanced partition when there are at most ``EXHAUSTIVE_LIMIT`` of them (8 units
at tp 2 have 35), otherwise best-improvement pair swaps until none lowers the objective, from
two starts (greedy: units by decreasing energy, each to the rank where it adds least; and the
contiguous split, so the result is never worse than no grouping on the calibration data).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import torch

from .eval import windows as cut_windows
from .permutation import WeightPermutation
from .plan import PlanError

EXHAUSTIVE_LIMIT = 200_000


@dataclasses.dataclass
class HeadGrouping:
    sync_point: str
    kind: str  # "attention" | "mamba2" | "mamba"
    module: str  # the block's module path in the model
    tp: int
    unit: str  # what is assigned to ranks: "kv_group" (attention), "head" or "ssm_group" (Mamba-2), "channel" (Mamba-1)
    heads_per_unit: int
    assignment: list[list[int]]  # per rank: the original units it holds after the permutation
    head_permutation: list[int]  # new head j is original head head_permutation[j]
    search: str  # "exhaustive" | "greedy+swaps"
    # calibration objective sum_i ||P - P_i||^2 over ||P||^2 summed over tokens (tp-relative error)
    error_before: float
    error_after: float
    tokens: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- locating the block
def _block(model, sync_point: str):
    """(kind, module path, module) of the block whose output ``sync_point`` reduces."""
    match = re.fullmatch(r"layers\.(\d+)\.(\w+)", sync_point)
    supported = _supported_points(model)
    if match is None or match.group(2) not in ("o_proj", "out_proj", "down_proj", "x_proj"):
        raise PlanError(f"head grouping: {sync_point!r} is not a sync point name of the form layers.<i>.<role>; "
                        f"this model's sync points with heads are {supported}")
    layer, role = match.groups()
    if role not in ("o_proj", "out_proj"):
        raise PlanError(f"head grouping: {sync_point!r} reduces a {role}, an op without heads (only attention "
                        f"o_proj and the SSM mixers' out_proj have heads or channels to group); choose one of "
                        f"{supported}")
    pattern = re.compile(rf"(.*\.)?layers\.{layer}\.(.*\.)?{role}")
    paths = [path for path, _ in model.named_modules() if pattern.fullmatch(path)]
    if not paths:
        raise PlanError(f"head grouping: no {role} in decoder layer {layer} of this model ({sync_point!r} is not one "
                        f"of its sync points); sync points with heads: {supported}")
    if len(paths) > 1:
        raise PlanError(f"head grouping: {sync_point!r} matches several modules {paths}")
    parent_path = paths[0].rsplit(".", 1)[0]
    parent = model.get_submodule(parent_path)
    shared = [p for p, m in model.named_modules(remove_duplicate=False) if m is parent]
    if len(shared) > 1 or hasattr(parent, "linear_q_adapter_list"):
        raise PlanError(f"head grouping: {sync_point!r} is the output of a block shared by several layers "
                        f"({shared}); its drop is unrepaired (docs/spd.md) and a permutation would apply to "
                        "every caller: not supported")
    kind = _kind(parent)
    if kind is None:
        raise PlanError(f"head grouping: {parent_path} ({type(parent).__name__}) is not a Llama-style attention "
                        "(q/k/v/o_proj), a Mamba-2 mixer or a Mamba-1 mixer")
    return kind, parent_path, parent


def _kind(module):
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
        return "attention"
    if all(hasattr(module, a) for a in ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj")):
        return "mamba"
    if all(hasattr(module, a) for a in ("in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj",
                                        "n_groups", "num_heads", "head_dim")):
        return "mamba2"
    return None


def _supported_points(model) -> list[str]:
    names = []
    for path, module in model.named_modules():
        match = re.fullmatch(r"(.*\.)?layers\.(\d+)\.(.*\.)?(o_proj|out_proj)", path)
        if match and _kind(model.get_submodule(path.rsplit(".", 1)[0])) is not None:
            names.append(f"layers.{match.group(2)}.{match.group(4)}")
    return names


def _heads(kind, module):
    """(heads, heads per unit, unit name, output projection) of a block."""
    if kind == "attention":
        heads = module.q_proj.out_features // module.head_dim
        kv_heads = module.k_proj.out_features // module.head_dim
        return heads, heads // kv_heads, "kv_group", module.o_proj
    if kind == "mamba":  # Mamba-1: every channel is its own SSM, dt/B/C come from x_proj over all of them
        return module.out_proj.in_features, 1, "channel", module.out_proj
    if module.n_groups == 1:  # B and C are shared by every head: each head may go anywhere
        return module.num_heads, 1, "head", module.out_proj
    return module.num_heads, module.num_heads // module.n_groups, "ssm_group", module.out_proj


# ----------------------------------------------------------------------------- calibration
@torch.no_grad()
def unit_gram(model, out_proj, units: int, calibration_ids, *, window: int, batch_size: int,
              max_windows: int | None) -> tuple[torch.Tensor, int]:
    """Gram matrix (units x units, fp64) of the units' contributions to ``out_proj``'s output,
    summed over the calibration tokens, and the number of tokens. With ``X`` the projection's
    input (tokens x channels) and ``W`` its weight, ``G[u, v] = sum over u's channels c and v's
    channels c' of (X^T X)[c, c'] (W^T W)[c, c']``: only a channels x channels matrix is kept,
    never the per-token contributions."""
    weight = out_proj.weight.detach().double()
    channels = weight.shape[1]
    second_moment = torch.zeros(channels, channels, dtype=torch.float64)
    tokens = 0

    def hook(_module, args):
        nonlocal tokens
        x = args[0].detach().double().reshape(-1, channels)
        second_moment.addmm_(x.T, x)
        tokens += x.shape[0]

    all_windows = cut_windows(calibration_ids, window)
    if max_windows is not None:
        all_windows = all_windows[:max_windows]
    handle = out_proj.register_forward_pre_hook(hook)
    try:
        for i in range(0, all_windows.shape[0], batch_size):
            model(all_windows[i:i + batch_size].long())
    finally:
        handle.remove()
    width = channels // units
    gram = (second_moment * (weight.T @ weight)).view(units, width, units, width).sum((1, 3))
    return gram, tokens


# ----------------------------------------------------------------------------- the assignment
def partition_cost(gram: torch.Tensor, groups) -> float:
    """sum over groups of sum_{u, v in group} G[u, v]: the ranks' summed partial energies."""
    return float(sum(gram[g][:, g].sum() for g in (list(g) for g in groups)))


def spd_error(gram: torch.Tensor, groups) -> float:
    """sum_i ||P - P_i||^2 / ||P||^2 for the ranks' groups (the relative squared SPD error summed over ranks)."""
    total = float(gram.sum())
    return ((len(groups) - 2) * total + partition_cost(gram, groups)) / total


def _balanced_partitions(units: list[int], size: int):
    """Every partition of ``units`` into groups of ``size`` (unordered groups)."""
    if not units:
        yield []
        return
    first, rest = units[0], units[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [u for u in rest if u not in others]
        for tail in _balanced_partitions(remaining, size):
            yield [[first, *others], *tail]


def _partition_count(units: int, tp: int) -> int:
    size = units // tp
    return math.factorial(units) // (math.factorial(size) ** tp * math.factorial(tp))


def balanced_assignment(gram: torch.Tensor, tp: int) -> tuple[list[list[int]], str]:
    """The groups of ``units / tp`` units (ranks in order) minimising ``partition_cost``, and the search used."""
    units = gram.shape[0]
    if units % tp:
        raise PlanError(f"head grouping: {units} units cannot be split evenly over tp={tp}")
    size = units // tp
    if _partition_count(units, tp) <= EXHAUSTIVE_LIMIT:
        best = min(_balanced_partitions(list(range(units)), size), key=lambda p: partition_cost(gram, p))
        return sorted(sorted(g) for g in best), "exhaustive"
    # two starts, each improved by swaps; the contiguous one guarantees never doing worse than no grouping
    greedy: list[list[int]] = [[] for _ in range(tp)]  # the most energetic units first, each where it adds least
    for u in sorted(range(units), key=lambda u: -float(gram[u, u])):
        open_ranks = [r for r in range(tp) if len(greedy[r]) < size]
        greedy[min(open_ranks, key=lambda r: float(gram[u, greedy[r]].sum()) if greedy[r] else 0.0)].append(u)
    contiguous = [list(range(r * size, (r + 1) * size)) for r in range(tp)]
    best = min((_swap_search(gram, start) for start in (greedy, contiguous)), key=lambda g: partition_cost(gram, g))
    return sorted(sorted(g) for g in best), "greedy+swaps"


def _swap_search(gram: torch.Tensor, groups: list[list[int]]) -> list[list[int]]:
    """Best-improvement exchanges of two units between two ranks until none lowers the cost.
    Exchanging u (rank a) and v (rank b) changes it by 2 * delta,
    delta = S_b(u) - S_a(u) + G_uu + S_a(v) - S_b(v) + G_vv - 2 G_uv (S_r(w): w's sum with rank r)."""
    groups = [list(g) for g in groups]
    size = len(groups[0])
    diagonal = gram.diagonal()
    tolerance = 1e-12 * float(diagonal.sum())
    while True:
        sums = torch.stack([gram[:, g].sum(1) for g in groups])  # (tp, units)
        best_delta, best_swap = -tolerance, None
        for a, b in itertools.combinations(range(len(groups)), 2):
            ga, gb = torch.tensor(groups[a]), torch.tensor(groups[b])
            delta = ((sums[b] - sums[a] + diagonal)[ga][:, None] + (sums[a] - sums[b] + diagonal)[gb][None, :]
                     - 2 * gram[ga][:, gb])
            i = int(delta.argmin())
            if float(delta.flatten()[i]) < best_delta:
                best_delta, best_swap = float(delta.flatten()[i]), (a, b, groups[a][i // size], groups[b][i % size])
        if best_swap is None:
            return groups
        a, b, u, v = best_swap
        groups[a][groups[a].index(u)] = v
        groups[b][groups[b].index(v)] = u


# ----------------------------------------------------------------------------- the permutation
def _block_index(permutation: list[int], width: int) -> torch.Tensor:
    """Element index that moves blocks of ``width`` as ``permutation`` moves their positions."""
    return torch.cat([torch.arange(p * width, (p + 1) * width) for p in permutation])


def weight_permutations(model, sync_point: str, head_permutation: list[int]) -> dict[str, WeightPermutation]:
    """What re-ordering the heads of the block ``sync_point`` reduces does to its weights: for each
    weight it moves (its FQN in ``model``), the dimension and the index (new position j holds the
    original ``index[j]``). New head j is original head ``head_permutation[j]``. Read on the meta
    device too (shapes only). ``PlanError`` for a name that is no such block (``_block``), a list
    that is not a permutation of the block's heads, or one that splits a unit (an attention
    key/value group's query heads; a Mamba-2 SSM group's heads with its B and C rows)."""
    kind, path, module = _block(model, sync_point)
    heads, per_unit, unit, _ = _heads(kind, module)
    if (not isinstance(head_permutation, (list, tuple)) or not all(type(h) is int for h in head_permutation)
            or sorted(head_permutation) != list(range(heads))):
        raise PlanError(f"head permutation of {sync_point!r}: must be a permutation of range({heads}) (the block's "
                        f"{heads} heads), not {head_permutation!r}")
    head_permutation = list(head_permutation)
    blocks = [head_permutation[u * per_unit:(u + 1) * per_unit] for u in range(heads // per_unit)]
    if any(len({h // per_unit for h in block}) != 1 for block in blocks):
        raise PlanError(f"head permutation of {sync_point!r}: {head_permutation} splits a unit (a {unit} of "
                        f"{per_unit} heads) across positions; each run of {per_unit} new positions must hold the heads of one "
                        f"original {unit}")
    units = [block[0] // per_unit for block in blocks]  # new unit u is original unit units[u]
    heads_t = torch.tensor(head_permutation)
    moves: dict[str, tuple[int, torch.Tensor]] = {}  # parameter name in the block -> (dim, index)

    def rows(name, index, dim=0):  # a bias that is None is left out
        owner, _, leaf = name.rpartition(".")
        if getattr(module.get_submodule(owner) if owner else module, leaf) is not None:
            moves[name] = (dim, index)

    if kind == "attention":
        d = module.head_dim
        q = _block_index(head_permutation, d)
        kv = _block_index(units, d)
        for proj, index in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            rows(f"{proj}.weight", index)
            rows(f"{proj}.bias", index)
        rows("o_proj.weight", q, dim=1)
    elif kind == "mamba":
        # Mamba-1 mixer: in_proj rows [x (I), gate (I)]; conv, dt_proj, A_log, D per channel; x_proj reads them
        inner = module.out_proj.in_features
        for name in ("in_proj.weight", "in_proj.bias"):
            rows(name, torch.cat([heads_t, inner + heads_t]))
        for name in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
            rows(name, heads_t)
        rows("x_proj.weight", heads_t, dim=1)
        rows("out_proj.weight", heads_t, dim=1)
    else:
        # Mamba-2 mixer: in_proj rows [gate (I), x (I), B (G*N), C (G*N), dt (H)], conv over [x, B, C]
        inner, d, n = module.num_heads * module.head_dim, module.head_dim, module.ssm_state_size
        channels = _block_index(head_permutation, d)
        # with one SSM group B and C are shared and stay; with several, units are groups and move theirs
        bc = torch.arange(n) if module.n_groups == 1 else _block_index(units, n)
        bc_width = module.n_groups * n
        xbc = torch.cat([channels, inner + bc, inner + bc_width + bc])
        extra = module.in_proj.out_features - (2 * inner + 2 * bc_width + heads)
        if extra:
            raise PlanError(f"head grouping: {type(module).__name__}'s in_proj has {extra} rows beyond gate, xBC and "
                            "dt (an MLP part): not supported")
        in_rows = torch.cat([channels, inner + xbc, 2 * inner + 2 * bc_width + heads_t])
        for name in ("in_proj.weight", "in_proj.bias"):
            rows(name, in_rows)
        for name in ("conv1d.weight", "conv1d.bias"):
            rows(name, xbc)
        for name in ("dt_bias", "A_log", "D"):
            rows(name, heads_t)
        rows("norm.weight", channels)
        rows("out_proj.weight", channels, dim=1)
    return {f"{path}.{name}": WeightPermutation(dim, index) for name, (dim, index) in moves.items()}


@torch.no_grad()
def permute_heads(model, sync_point: str, head_permutation: list[int]) -> None:
    """Re-order the heads of the block ``sync_point`` reduces, in place: new head j is original
    head ``head_permutation[j]``. The model's function is unchanged. The permutation must move
    whole units (an attention key/value group's query heads with it; a Mamba-2 SSM group's heads
    with its B and C rows). ``Plan(head_permutations=...)`` applies the same re-ordering on the way
    to the ranks instead, leaving the model (and its checkpoint) as they are."""
    for name, permutation in weight_permutations(model, sync_point, head_permutation).items():
        weight = model.get_parameter(name)
        weight.data.copy_(weight.data.index_select(permutation.dim, permutation.index))


# ----------------------------------------------------------------------------- carried by a plan
def normalize_head_permutations(value, tp: int) -> dict[str, list[int]]:
    """``Plan(head_permutations=...)`` as ``{sync point: head permutation}`` (JSON-serialisable).

    Accepted: ``{sync point: [new head j's original head, ...]}``; a :class:`HeadGrouping` or its
    ``as_dict()``; a list of those (what ``json.load`` gives back for a saved list of groupings).
    A grouping chosen for another ``tp`` is refused: its assignment was optimised for that split.
    Only the form is checked here; the model (``plan_weight_permutations``) checks the rest."""
    if value is None:
        return {}
    entries = value if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, dict) and not _is_grouping_dict(value):
        entries = [{"sync_point": k, "head_permutation": v} for k, v in value.items()]
    chosen: dict[str, list[int]] = {}
    for entry in entries:
        if isinstance(entry, HeadGrouping):
            entry = entry.as_dict()
        if not _is_grouping_dict(entry) or not isinstance(entry["sync_point"], str):
            raise PlanError("head_permutations must be {sync point name: [head, ...]}, a HeadGrouping (what "
                            "group_heads returns), its as_dict(), or a list of those; got " + repr(entry)[:200])
        point, permutation = entry["sync_point"], entry["head_permutation"]
        if "tp" in entry and entry["tp"] != tp:
            raise PlanError(f"head_permutations: the grouping of {point!r} was chosen for tp={entry['tp']} but the "
                            f"plan has tp={tp}; run group_heads at tp={tp} (or pass {{{point!r}: permutation}} to "
                            "use its permutation anyway)")
        if not isinstance(permutation, (list, tuple)) or not all(type(h) is int for h in permutation):
            raise PlanError(f"head_permutations[{point!r}] must be a list of head indices, not {permutation!r}")
        if point in chosen and chosen[point] != list(permutation):
            raise PlanError(f"head_permutations gives {point!r} two different permutations")
        chosen[point] = list(permutation)
    return chosen


def _is_grouping_dict(entry) -> bool:
    return isinstance(entry, dict) and "sync_point" in entry and "head_permutation" in entry


def plan_weight_permutations(model, head_permutations: dict[str, list[int]]) -> dict[str, WeightPermutation]:
    """Every weight the plan's head permutations re-order (FQN in ``model``), checked against
    ``model`` (``weight_permutations``'s errors) before any distributed work."""
    permutations: dict[str, WeightPermutation] = {}
    for point, head_permutation in head_permutations.items():
        permutations.update(weight_permutations(model, point, head_permutation))
    return permutations


# ----------------------------------------------------------------------------- the entry point
def group_heads(model, tp: int, sync_point: str, calibration_ids, *, window: int = 128, batch_size: int = 8,
                max_windows: int | None = None, apply: bool = True) -> HeadGrouping:
    """Choose the head-to-rank assignment of the block ``sync_point`` reduces that minimises its
    SPD error at ``tp`` on ``calibration_ids`` (1-D token ids, cut into windows) and, with
    ``apply``, apply it to ``model``'s weights in place (module docstring). ``apply=False`` leaves
    the model as it is: pass the result to ``Plan(head_permutations=...)``, which applies it on the
    way to the ranks (in memory or from the unpermuted checkpoint). Returns what was chosen and
    the calibration error before and after."""
    if tp < 2:
        raise PlanError(f"head grouping needs tp >= 2 (at tp={tp} nothing is dropped)")
    kind, path, module = _block(model, sync_point)
    heads, per_unit, unit, out_proj = _heads(kind, module)
    units = heads // per_unit
    if units % tp:
        raise PlanError(f"head grouping: {sync_point!r} has {units} {unit}s, not divisible by tp={tp} (each rank "
                        f"must hold whole {unit}s)")
    gram, tokens = unit_gram(model, out_proj, units, calibration_ids, window=window, batch_size=batch_size,
                             max_windows=max_windows)
    size = units // tp
    before = [list(range(r * size, (r + 1) * size)) for r in range(tp)]
    assignment, search = balanced_assignment(gram, tp)
    unit_order = [u for group in assignment for u in group]
    head_permutation = [u * per_unit + k for u in unit_order for k in range(per_unit)]
    if apply:
        permute_heads(model, sync_point, head_permutation)
    return HeadGrouping(sync_point=sync_point, kind=kind, module=path, tp=tp, unit=unit, heads_per_unit=per_unit,
                        assignment=assignment, head_permutation=head_permutation, search=search,
                        error_before=spd_error(gram, before), error_after=spd_error(gram, assignment), tokens=tokens)
