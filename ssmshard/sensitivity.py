"""Sensitivity of a model to dropping each sync point (SPD), measured on calibration text.

``sensitivity(model, plan, calibration_ids)`` runs every candidate plan on a
:class:`~ssmshard.runtime.simulated.SimulatedMesh` (all ``plan.tp`` ranks in this process, the
values of a real run) and scores it with :func:`ssmshard.eval.perplexity` on the same windows
as the exact model (the unsharded model itself), giving per sync point:

* ``perplexity`` and ``increase`` (``perplexity / exact perplexity - 1``) with only that sync
  point dropped (the plan's own drops and quantized syncs stay as they are);
* ``kl``: the mean over predicted tokens of KL(exact || SPD) of the next-token distributions;
* ``cls``: ``ISB`` (insensitive: ``increase <= isb``), ``SB`` (sensitive: ``<= esb``) or
  ``ESB`` (extremely sensitive), with the thresholds recorded in the report.

Two orders: ``one_at_a_time`` (candidates by increasing ``increase``) and the paper's
``greedy`` order: drop sync points cumulatively from the last layers back (within a layer,
the later sync point first), measuring each prefix. ``report.choose(budget=0.01)`` returns the
largest drop set found within the budget (the longest greedy prefix within it, then every
other candidate added in one-at-a-time order and kept when the measured set stays within it)
and measures the chosen set once more on the calibration data; from a report read back from
JSON (no model) it picks from the recorded measurements only. Calibration windows are few, so a
set chosen right at the budget can exceed it on other text: ``choose(budget, validation_ids=...)``
then measures the chosen set on separate windows (disjoint from the calibration text and from any
held-out text the result is reported on) and takes back the last-chosen sync points one at a time
until the increase there is within the budget too.

Candidates: every all-reduce sync point of the forward program except statistics
(``gate_norm``), those the plan already drops, the ``spd_flush`` a drop may add, and
``x_proj`` unless ``plan.allow_approximate``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import torch
import torch.nn.functional as F

from .eval import perplexity
from .plan import PlanError

log = logging.getLogger(__name__)
DEFAULT_THRESHOLDS = (0.01, 0.05)  # (ISB upper bound, SB upper bound) of the perplexity increase


@dataclasses.dataclass
class Measurement:
    drop_syncs: list[str]
    perplexity: float
    increase: float  # perplexity / exact perplexity - 1
    kl: float  # mean KL(exact || candidate) per predicted token, nats


@dataclasses.dataclass
class SyncSensitivity:
    name: str
    layer: int | None
    block: str
    role: str
    bytes_per_token: int | None
    perplexity: float
    increase: float
    kl: float
    cls: str  # ISB | SB | ESB


@dataclasses.dataclass
class Choice:
    drop_syncs: list[str]
    measured: Measurement | None  # None: picked from recorded measurements only
    budget: float
    plan: object = None  # the base plan with these drops (None when read from JSON)
    validated: Measurement | None = None  # the final set on the validation windows, where given
    taken_back: list[str] = dataclasses.field(default_factory=list)  # chosen on calibration, over budget on validation


class SensitivityReport:
    def __init__(self, *, tp, exact_perplexity, thresholds, points, greedy, base_drop_syncs=(), windows=0,
                 window=0, measure=None, plan=None):
        self.tp = tp
        self.exact_perplexity = exact_perplexity
        self.thresholds = tuple(thresholds)
        self.points: list[SyncSensitivity] = points
        self.greedy: list[Measurement] = greedy
        self.base_drop_syncs = list(base_drop_syncs)
        self.windows, self.window = windows, window
        self._measure = measure  # (drop set[, token stream]) -> Measurement (absent after load)
        self._plan = plan

    @property
    def one_at_a_time(self) -> list[SyncSensitivity]:
        return sorted(self.points, key=lambda p: p.increase)

    def classes(self) -> dict[str, list[str]]:
        out = {"ISB": [], "SB": [], "ESB": []}
        for point in self.points:
            out[point.cls].append(point.name)
        return out

    def choose(self, budget: float = 0.01, *, validation_ids=None) -> Choice:
        """The largest drop set found whose perplexity increase stays within ``budget``; with
        ``validation_ids`` (a 1-D token stream, disjoint from the calibration text) also within
        it on those windows (module docstring)."""
        if budget < 0:
            raise ValueError(f"budget is a relative perplexity increase (0.01 = 1%), not {budget}")
        if validation_ids is not None and self._measure is None:
            raise ValueError("validation needs the model: a report read back from JSON picks from its records only")
        within = [m for m in self.greedy if m.increase <= budget]
        chosen = list(within[-1].drop_syncs) if within else []
        if self._measure is None:
            return Choice(drop_syncs=chosen, measured=None, budget=budget)
        for point in self.one_at_a_time:
            if point.name in chosen or point.increase > budget:
                continue
            trial = self._measure(chosen + [point.name])
            if trial.increase <= budget:
                chosen.append(point.name)
        measured = self._measure(chosen)  # the chosen set, measured as it will run
        if measured.increase > budget:
            raise RuntimeError(f"the chosen drop set measured {measured.increase:.4%} above the budget {budget:.4%}"
                               " although each step stayed within it")
        validated, taken_back = None, []
        if validation_ids is not None:
            validated = self._measure(chosen, validation_ids)
            while chosen and validated.increase > budget:
                taken_back.insert(0, chosen.pop())
                validated = self._measure(chosen, validation_ids)
            if taken_back:
                measured = self._measure(chosen)
        plan = dataclasses.replace(self._plan, drop_syncs=self.base_drop_syncs + chosen) if self._plan else None
        return Choice(drop_syncs=chosen, measured=measured, budget=budget, plan=plan, validated=validated,
                      taken_back=taken_back)

    # ------------------------------------------------------------- output
    def as_dict(self) -> dict:
        return {"tp": self.tp, "exact_perplexity": self.exact_perplexity, "thresholds": list(self.thresholds),
                "base_drop_syncs": self.base_drop_syncs, "windows": self.windows, "window": self.window,
                "points": [dataclasses.asdict(p) for p in self.points],
                "greedy": [dataclasses.asdict(m) for m in self.greedy]}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> "SensitivityReport":
        with open(path) as f:
            data = json.load(f)
        return cls(tp=data["tp"], exact_perplexity=data["exact_perplexity"], thresholds=data["thresholds"],
                   points=[SyncSensitivity(**p) for p in data["points"]],
                   greedy=[Measurement(**m) for m in data["greedy"]], base_drop_syncs=data["base_drop_syncs"],
                   windows=data["windows"], window=data["window"])

    def table(self) -> str:
        isb, esb = self.thresholds
        lines = [f"tp={self.tp}: exact perplexity {self.exact_perplexity:.4f} over {self.windows} windows of "
                 f"{self.window} tokens; ISB: increase <= {isb:.2%}, SB: <= {esb:.2%}, ESB above",
                 f"  {'sync point':<24} {'perplexity':>11} {'increase':>9} {'KL':>9} class"]
        for p in self.points:
            lines.append(f"  {p.name:<24} {p.perplexity:>11.4f} {p.increase:>9.2%} {p.kl:>9.2e} {p.cls}")
        lines.append("  greedy (last layers first):")
        for m in self.greedy:
            lines.append(f"    {len(m.drop_syncs):>3} dropped ({m.drop_syncs[-1]:<24}) perplexity {m.perplexity:.4f} "
                         f"increase {m.increase:.2%}")
        return "\n".join(lines)

    def plot(self, path) -> bool:
        """A PNG: each sync point's perplexity increase by layer (one-at-a-time), and the greedy
        curve. False (and a warning) where matplotlib is not installed (``pip install ssmshard[bench]``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("no plot written to %s: matplotlib is not installed (pip install 'ssmshard[bench]')", path)
            return False
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        roles = sorted({p.role for p in self.points})
        width = 0.8 / max(len(roles), 1)
        for i, role in enumerate(roles):
            mine = [p for p in self.points if p.role == role]
            left.bar([(p.layer if p.layer is not None else -1) + i * width for p in mine],
                     [max(p.increase, 1e-7) * 100 for p in mine], width=width, label=role)
        for threshold, style in zip(self.thresholds, ("--", ":")):
            left.axhline(threshold * 100, color="gray", linestyle=style)
        left.set_yscale("log")
        left.set_xlabel("layer (-1: outside the layers)")
        left.set_ylabel("perplexity increase, % (one sync point dropped)")
        left.legend()
        right.plot(range(1, len(self.greedy) + 1), [m.increase * 100 for m in self.greedy], marker="o")
        right.set_xlabel("sync points dropped, last layers first")
        right.set_ylabel("perplexity increase, %")
        fig.suptitle(f"SPD sensitivity at tp={self.tp} (exact perplexity {self.exact_perplexity:.3f})")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True


def candidates(program, plan) -> list:
    """The sync points of ``program`` (sharded under ``plan``) that may be dropped on their own."""
    from .passes.quantize_sync import STATISTIC_ROLES
    from .passes.spd import APPROXIMATE_ROLES

    return [p for p in program.sync_points
            if p.kind == "all_reduce" and p.action != "dropped" and p.role not in STATISTIC_ROLES
            and p.role != "spd_flush" and (plan.allow_approximate or p.role not in APPROXIMATE_ROLES)]


def greedy_order(points) -> list:
    """The paper's order: from the last layer back; within a layer, the later sync point first."""
    indexed = list(enumerate(points))
    return [p for _, p in sorted(indexed, key=lambda ip: (-1 if ip[1].layer is None else ip[1].layer, ip[0]),
                                 reverse=True)]


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.enabled, self.total, self.done = enabled, total, 0
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="plan", desc="sensitivity")
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            self.bar.update()
        elif self.enabled:
            print(f"sensitivity {self.done}/{self.total}: {label}", file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def sensitivity(model, plan, calibration_ids, *, window: int = 128, batch_size: int = 8,
                max_windows: int | None = None, thresholds=DEFAULT_THRESHOLDS, greedy: bool = True,
                progress: bool = True) -> SensitivityReport:
    """Measure the perplexity cost of dropping each sync point of ``model`` under ``plan`` (module
    docstring). ``calibration_ids``: a 1-D tensor of token ids, cut into windows of ``window``."""
    from .capture import capture
    from .runtime.simulated import SimulatedMesh

    isb, esb = thresholds
    if not 0 <= isb <= esb:
        raise ValueError(f"thresholds must be (isb, esb) with 0 <= isb <= esb, not {thresholds}")
    if plan.tp < 2:
        raise PlanError("sensitivity needs a plan with tp >= 2: at tp=1 there are no sync points to drop")
    program = capture(model, mode="forward")
    base = SimulatedMesh(model, plan, program=program)
    points = candidates(base.program, plan)
    if not points:
        raise PlanError(f"no sync point of this model can be dropped under {plan}")
    score = dict(window=window, batch_size=batch_size, max_windows=max_windows)

    # id of a token stream -> (its exact perplexity, per-batch log-probabilities, the stream itself:
    # kept so that its id cannot be reused by another tensor while the report lives)
    exact_cache = {}

    def exact_of(ids):
        if id(ids) not in exact_cache:
            logprobs = []

            def exact_fn(batch):
                logits = model(batch).logits
                logprobs.append(F.log_softmax(logits[:, :-1].float(), -1))
                return logits

            with torch.no_grad():
                exact_cache[id(ids)] = (perplexity(exact_fn, ids, **score), logprobs, ids)
        return exact_cache[id(ids)][:2]

    exact, _ = exact_of(calibration_ids)

    def measure(drop: list[str], ids=calibration_ids) -> Measurement:
        """The drop set's perplexity increase and KL against the exact model on ``ids``' windows."""
        reference_ppl, reference_logprobs = exact_of(ids)
        mesh = SimulatedMesh(model, dataclasses.replace(plan, drop_syncs=list(plan.drop_syncs) + list(drop)),
                             program=program)
        kl = [0.0]
        batch = iter(reference_logprobs)

        def scored(ids):
            logits = mesh(ids)
            reference = next(batch)
            kl[0] += float(F.kl_div(F.log_softmax(logits[:, :-1].float(), -1), reference, log_target=True,
                                    reduction="sum"))
            return logits

        with torch.no_grad():
            result = perplexity(scored, ids, **score)
        return Measurement(drop_syncs=list(drop), perplexity=result.perplexity,
                           increase=result.perplexity / reference_ppl.perplexity - 1, kl=kl[0] / result.predictions)

    order = greedy_order(points)
    bar = _Progress(len(points) + (len(order) - 1 if greedy else 0), progress)
    rows = []
    try:
        for point in points:
            m = measure([point.name])
            cls = "ISB" if m.increase <= isb else "SB" if m.increase <= esb else "ESB"
            rows.append(SyncSensitivity(name=point.name, layer=point.layer, block=point.block, role=point.role,
                                        bytes_per_token=point.bytes_per_token, perplexity=m.perplexity,
                                        increase=m.increase, kl=m.kl, cls=cls))
            bar.step(point.name)
        by_name = {r.name: r for r in rows}
        steps = []
        if greedy:
            first = by_name[order[0].name]
            steps.append(Measurement([first.name], first.perplexity, first.increase, first.kl))
            for k in range(2, len(order) + 1):
                steps.append(measure([p.name for p in order[:k]]))
                bar.step(f"{k} dropped")
    finally:
        bar.close()
    return SensitivityReport(tp=plan.tp, exact_perplexity=exact.perplexity, thresholds=(isb, esb), points=rows,
                             greedy=steps, base_drop_syncs=plan.drop_syncs, windows=exact.windows, window=window,
                             measure=measure, plan=plan)
