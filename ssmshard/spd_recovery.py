"""Recovery of a dropped sync point (SPD) by distillation: train a chosen set of the model's
weights, through the SPD program, to give the exact model's next-token distributions.

``recover(model, plan, calibration_ids, train=[...])`` runs ``plan`` (its ``drop_syncs``) on a
:class:`~ssmshard.runtime.simulated.SimulatedMesh` and minimises the mean KL(exact || SPD) of
the next-token distributions over calibration windows, where "exact" is ``model`` itself before
training (its logits are computed once, up front). Only the parameters named by ``train``
(names or globs over ``model.named_parameters()``) change; they are updated in place in
``model``, which stays a Hugging Face model: ``model.save_pretrained(dir)`` writes a checkpoint
that ``from_pretrained`` and ``parallelize_from_pretrained`` read.

One optimizer step: every rank runs its SPD program forward and backward on the same batch
(each rank's logits, hence its loss, are the full ones: the gradient each rank gets for a local
weight is its slice of the SPD model's gradient, tests/test_spd.py); the slices are put back
together into the full gradient of each trained weight (pieces several ranks hold, such as
Mamba-2's B/C rows when ``n_groups < tp``, are partial sums and add up), a torch optimizer steps
the full weight, and every rank's slice is refreshed from it. The mesh is built once.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging

import torch
import torch.nn.functional as F

from .eval import windows as cut_windows
from .placement import Shard, local_ranges, local_slice
from .plan import PlanError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Recovery:
    drop_syncs: list[str]
    trained: list[str]  # the model's parameter names that were trained
    trained_numel: int
    steps: int
    losses: list[float]  # each step's batch loss: mean KL(exact || SPD) per predicted token, nats
    kl_before: float  # mean KL over the calibration windows before the first step
    kl_after: float  # ... and after the last
    windows: int
    window: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def trainable_names(model, train) -> list[str]:
    """The parameter names of ``model`` matched by ``train`` (names or globs), in model order."""
    names = [name for name, _ in model.named_parameters()]
    unmatched = [pattern for pattern in train if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]
    if not train or unmatched:
        raise ValueError(f"train must name parameters of the model; no parameter matches {unmatched or train}. "
                         f"Some names: {names[:4]} ... {names[-2:]}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in train)]


def _kl(logits, exact_logprobs):
    """Mean KL(exact || logits' distribution) per predicted token."""
    logprobs = F.log_softmax(logits[:, :-1].float(), -1)
    return F.kl_div(logprobs, exact_logprobs, log_target=True, reduction="sum") / exact_logprobs[..., 0].numel()


def _full_gradient(param, placement, rank_grads):
    """The full gradient of one weight from the ranks' gradients of their slices."""
    if not isinstance(placement, Shard):
        return rank_grads[0]  # a replicated weight's gradient is whole on every rank
    full = torch.zeros_like(param)
    for rank, grad in enumerate(rank_grads):
        offset = 0
        for start, length in local_ranges(placement, rank):
            full.narrow(placement.dim, start, length).add_(grad.narrow(placement.dim, offset, length))
            offset += length
    return full


def recover(model, plan, calibration_ids, *, train, window: int = 128, batch_size: int = 4,
            max_windows: int | None = None, steps: int = 50, lr: float = 1e-3, optimizer=None) -> Recovery:
    """Distil the SPD model of ``plan`` towards ``model`` by training the parameters ``train``
    names (module docstring). ``calibration_ids``: 1-D token ids cut into windows of ``window``
    (the first ``max_windows``), visited in order in batches of ``batch_size``, cycling, for
    ``steps`` steps of ``optimizer`` (a ``torch.optim`` class, default Adam) at ``lr``."""
    from .capture import capture
    from .runtime.simulated import SimulatedMesh

    if plan.tp < 2 or not plan.drop_syncs:
        raise PlanError(f"recover needs a plan with tp >= 2 and drop_syncs (the SPD model to train), not {plan}")
    if plan.head_permutations:  # the ranks' slices would be re-ordered ones, the full weights trained here not
        raise PlanError("recover trains the model's own weights and puts the ranks' gradient slices back in their "
                        "places, which a plan's head_permutations re-order: apply the grouping to the model first "
                        "(head_grouping.permute_heads, or group_heads(..., apply=True)) and recover with the plan "
                        "without head_permutations")
    names = trainable_names(model, train)
    params = dict(model.named_parameters())
    all_windows = cut_windows(calibration_ids, window)
    if max_windows is not None:
        all_windows = all_windows[:max_windows]
    batches = [all_windows[i:i + batch_size].long() for i in range(0, all_windows.shape[0], batch_size)]
    with torch.no_grad():  # the exact model's distributions, before any weight changes
        targets = [F.log_softmax(model(ids).logits[:, :-1].float(), -1) for ids in batches]

    # Only the trained weights need gradients: the ranks' local copies follow requires_grad.
    saved = {n: p.requires_grad for n, p in params.items()}
    try:
        for n, p in params.items():
            p.requires_grad_(n in names)
        mesh = SimulatedMesh(model, plan, program=capture(model, mode="forward"))
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
    for n in names:
        if n not in mesh.program.param_specs:
            raise ValueError(f"{n} is not read by the forward program (tied or unused), so it cannot be trained")
    placements = {n: mesh.program.param_specs[n].placement for n in names}
    trained = [params[n] for n in names]
    opt = (optimizer or torch.optim.Adam)(trained, lr=lr)

    def mean_kl() -> float:
        with torch.no_grad():
            total = sum(float(_kl(mesh(ids), target)) * ids.shape[0] for ids, target in zip(batches, targets))
        return total / all_windows.shape[0]

    def rank_step(dm, ids, target):
        loss = _kl(dm(ids), target)
        grads = torch.autograd.grad(loss, [dm.local_weight(n) for n in names])
        return float(loss.detach()), grads

    kl_before, losses = mean_kl(), []
    for step in range(steps):
        ids, target = batches[step % len(batches)], targets[step % len(batches)]
        with torch.enable_grad():
            results = mesh.run(rank_step, ids, target)
        losses.append(results[0][0])
        opt.zero_grad(set_to_none=True)
        for i, n in enumerate(names):
            params[n].grad = _full_gradient(params[n], placements[n], [grads[i] for _, grads in results])
        opt.step()
        with torch.no_grad():
            for dm in mesh.ranks:
                for n in names:
                    dm.local_weight(n).copy_(local_slice(params[n].detach(), placements[n], dm.rank))
        log.info("recover step %d/%d: KL %.5f", step + 1, steps, losses[-1])
    opt.zero_grad(set_to_none=True)
    return Recovery(drop_syncs=list(plan.drop_syncs), trained=names, trained_numel=sum(p.numel() for p in trained),
                    steps=steps, losses=losses, kl_before=kl_before, kl_after=mean_kl(),
                    windows=all_windows.shape[0], window=window)
