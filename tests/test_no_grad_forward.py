"""A forward under ``torch.no_grad`` reads the weights through views that do not require grad
(``DistributedModule._bound``), so that ATen's matmul reads Mamba's transposed ``out_proj``
input and computes ``dt_proj``'s transposed output in place instead of copying them into rows;
with grad enabled, the same module still gives the weights their gradients. Checked against
Hugging Face eager on a tiny Mamba (CPU: the matmul's choice is the same on every device)."""

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ssmshard
from ssmshard.testing import rel_err

from conftest import small_model


class _Copies(TorchDispatchMode):
    """Counts the layout copies an op sequence makes (``clone`` and ``contiguous``'s copies)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _forward(dm, ids):
    copies = _Copies()
    with copies:
        logits = dm(ids)
    return logits, copies.count, dict(dm.program.weights)


def test_no_grad_forward_reads_transposed_matmul_operands_in_place(fresh_seed):
    torch.manual_seed(fresh_seed)
    model = small_model("mamba")
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1))
    with torch.no_grad():
        expected = model(ids).logits
        logits, copies, bound = mesh.run(_forward, ids)[0]
        again = mesh.run(_forward, ids)[0][2]
    assert rel_err(logits, expected) < 1e-5, fresh_seed
    assert copies == 0, f"{copies} layout copies in a no-grad forward (seed {fresh_seed})"
    assert not any(w.requires_grad for w in bound.values())
    # The same view objects call after call: programs that check weights by identity keep them.
    assert all(again[fqn] is w for fqn, w in bound.items())

    # With grad enabled the program reads the parameters themselves: ATen copies the transposed
    # operands again (what the views avoid), and the gradients reach the weights.
    logits, copies, bound = mesh.run(_forward, ids)[0]
    assert copies > 0 and all(w.requires_grad for w in bound.values() if w.is_floating_point())
    logits.float().square().mean().backward()
    dm = mesh.ranks[0]
    names = [fqn for fqn, w in bound.items() if w.requires_grad]
    hf = model(ids).logits.float().square().mean()
    hf_grads = torch.autograd.grad(hf, [model.get_parameter(fqn) for fqn in names])
    assert names
    for fqn, hf_grad in zip(names, hf_grads):
        grad = dm.local_weight(fqn).grad
        assert grad is not None and rel_err(grad, hf_grad) < 1e-5, (fqn, fresh_seed)


def test_no_grad_forward_reads_weights_given_new_data(fresh_seed):
    """``module.to()`` and ``param.data = ...`` keep the parameter object and replace its data:
    the next no-grad forward reads the new data, not a view of the old."""
    torch.manual_seed(fresh_seed)
    model = small_model("mamba")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=1))
    dm = mesh.ranks[0]
    fqn = "backbone.layers.0.mixer.out_proj.weight"
    with torch.no_grad():
        before = mesh(ids)
        dm.local_weight(fqn).data = torch.randn_like(dm.local_weight(fqn))
        after = mesh(ids)
        changed = copy.deepcopy(model)
        changed.get_parameter(fqn).copy_(dm.local_weight(fqn))
        expected = changed(ids).logits
    assert rel_err(after, before) > 1e-3
    assert rel_err(after, expected) < 1e-5, fresh_seed
