import os
import random

import torch as _torch

# Triton kernels run under Triton's CPU interpreter where no GPU is present. The variable
# must be set before any kernel module is imported: @triton.jit reads it at decoration time.
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import ssmshard
from ssmshard.families import build_small_model
from ssmshard.testing import randomize_weights

SIX_FAMILIES = ["mamba", "falcon_mamba", "mamba2", "zamba", "zamba2", "llama"]

# Tests that hand CPU tensors to the Triton kernels: they need the interpreter, which is on only
# where no GPU is present (above); on a GPU machine the GPU tests run those kernels on CUDA tensors.
interpreted_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set where no "
           "GPU is present)")


def real_tensor(t) -> bool:
    """Stands in for the kernel adapters' ``_on_gpu`` (passes/swap_kernels.py) where a test runs the
    Triton kernels under the interpreter: any real tensor, CPU ones included, goes to the kernel;
    the fake tensors of graph verification still take the reference ops."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)


@pytest.fixture
def fresh_seed(request):
    """A new seed every run (fresh random inputs), printed on failure for reproduction.

    Replay a failure with ``SSMSHARD_TEST_SEED=<seed> pytest <test id>``. Tests whose inputs must
    not depend on what ran before (model and capture caches draw from the global RNG when cold)
    draw from a ``torch.Generator`` seeded with this value instead of the global RNG.
    """
    pinned = os.environ.get("SSMSHARD_TEST_SEED")
    seed = int(pinned) if pinned else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


_MODELS = {}


def small_model(family: str, **overrides):
    """A tiny model of ``family`` with O(1)-effect random weights (cached per config)."""
    key = (family, repr(sorted(overrides.items())))  # repr: overrides may hold lists
    if key not in _MODELS:
        _MODELS[key] = randomize_weights(build_small_model(family, **overrides), seed=1)
    return _MODELS[key]


def gated_norm_has_groups(model) -> bool:
    """Whether the installed transformers' gated RMSNorm (Mamba-2, Zamba2) normalises each group of
    channels; transformers 5.17's spans all of them (no ``group_size``)."""
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNormGated"))
    return hasattr(norm, "group_size")


def pipeline_steps(plan, mode: str = "decode", kernels: str = "triton") -> list:
    """The names of the pass steps ``plan`` runs on one rank's program of ``mode``, in order."""
    return [s if isinstance(s, str) else s[0]
            for s in plan.pipeline(mode, placements={}, rank=0, group="g", kernels=kernels)]


def simulated_gpu_plan_generation(model, seed, monkeypatch, tp=2, max_new_tokens=4):
    """Greedy tokens of a ``SimulatedMesh`` at ``tp`` running the GPU plan's passes (the Triton
    kernel adapters, which run the reference ops on CPU tensors), HF's for the same prompts, and
    the mesh (its rank programs to inspect)."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=tp))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        tokens = mesh.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    return tokens, expected, mesh
