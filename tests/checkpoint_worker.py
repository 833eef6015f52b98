"""Worker functions for the multi-process (gloo) checkpoint-loading tests.

Each rank loads its shards of a small model from a safetensors checkpoint onto a meta-device
model, while a wrapper around ``safe_open`` counts the elements of every tensor that comes out
of a file, and compares them (and the logits) bit for bit with the same program fed slices of
the model in memory, and the logits with Hugging Face eager. Results of all ranks are
gathered to rank 0, which writes them to a JSON file the test reads.
"""

import json
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ssmshard
import ssmshard.runtime.checkpoint as checkpoint_module
from ssmshard.placement import Shard, local_slice
from ssmshard.runtime import DistributedModule
from ssmshard.testing import rel_err

from conftest import small_model


class _CountingSlice:
    def __init__(self, lazy, key, reads):
        self._lazy, self._key, self._reads = lazy, key, reads

    def __getitem__(self, index):
        tensor = self._lazy[index]
        self._reads.append((self._key, tensor.numel()))
        return tensor

    def __getattr__(self, name):  # get_shape, get_dtype: metadata only
        return getattr(self._lazy, name)


class _CountingHandle:
    def __init__(self, handle, reads):
        self._handle, self._reads = handle, reads

    def get_slice(self, key):
        return _CountingSlice(self._handle.get_slice(key), key, self._reads)

    def get_tensor(self, key):
        tensor = self._handle.get_tensor(key)
        self._reads.append((key, tensor.numel()))
        return tensor

    def __getattr__(self, name):  # keys, metadata
        return getattr(self._handle, name)


def _counting_safe_open(reads):
    real = checkpoint_module.safe_open

    def opener(*args, **kwargs):
        return _CountingHandle(real(*args, **kwargs), reads)

    return real, opener


def _ids(vocab, seed):
    return torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(seed))


def _same_program_with_slices_of(loaded, model, plan, rank):
    """What ``parallelize(model, plan)`` builds from the model in memory, on the program the
    checkpoint path captured (its code is the same either way; sharing it saves a capture)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    # requires_grad as parallelize sets it: at::matmul folds a 3-D input into one mm only when
    # the weight needs no grad, which rounds differently even under no_grad.
    weights = {fqn: local_slice(named[fqn].detach(), spec.placement, rank).clone()
               .requires_grad_(spec.kind == "parameter" and named[fqn].requires_grad)
               for fqn, spec in loaded.program.param_specs.items()}
    return DistributedModule(loaded.program, weights, plan, rank)


def _compare(loaded, in_memory, model, seed):
    """Local weights and logits bit for bit, and the logits' error against HF eager."""
    mismatched = [fqn for fqn in loaded.program.param_specs
                  if not torch.equal(loaded.local_weight(fqn), in_memory.local_weight(fqn))
                  or loaded.local_weight(fqn).dtype != in_memory.local_weight(fqn).dtype]
    ids = _ids(model.config.vocab_size, seed)
    with torch.no_grad():
        logits = loaded(ids)
        return {"mismatched_weights": mismatched, "same_logits": torch.equal(logits, in_memory(ids)),
                "err_vs_hf": rel_err(logits, model(ids).logits)}


def _load(case, plan, mesh):
    directory, dtype = case["dir"], getattr(torch, case["dtype"]) if case["dtype"] else None
    if case["how"] == "from_pretrained":
        return ssmshard.parallelize_from_pretrained(directory, plan, dtype=dtype, device_mesh=mesh, progress=False)
    # A meta model built from the in-memory model's config, not from the checkpoint's.
    saved = small_model(case["family"], **case["overrides"])
    with torch.device("meta"):
        meta = type(saved)(saved.config).eval()
    loaded = ssmshard.parallelize(meta, plan, checkpoint=directory, device_mesh=mesh, progress=False)
    assert all(p.device.type == "meta" for p in meta.parameters())
    return loaded


def _load_case(rank, world, case, seed):
    """One checkpoint loaded while a wrapper around safe_open counts every element read.

    The in-memory reference is the model that was saved, or for a ``dtype`` case Hugging
    Face's own ``from_pretrained(dir, dtype=...)`` of the checkpoint.
    """
    plan = ssmshard.Plan(tp=world)
    mesh = init_device_mesh("cpu", (world,)) if case["mesh"] else None
    if case["dtype"]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(case["dir"], dtype=getattr(torch, case["dtype"])).eval()
    else:
        model = small_model(case["family"], **case["overrides"])
    reads = []
    real, opener = _counting_safe_open(reads)
    checkpoint_module.safe_open = opener
    try:
        loaded = _load(case, plan, mesh)
    finally:
        checkpoint_module.safe_open = real
    persistent = set(model.state_dict())  # non-persistent buffers are computed, not read
    weights = {fqn: {"local": loaded.local_weight(fqn).numel(), "full": math.prod(spec.shape),
                     "sharded": isinstance(spec.placement, Shard), "from_file": fqn in persistent,
                     "dtype": str(loaded.local_weight(fqn).dtype)}
               for fqn, spec in loaded.program.param_specs.items()}
    # By the program's names: a tied embedding is read under lm_head.weight.
    largest = max(weights, key=lambda fqn: weights[fqn]["full"])
    in_memory = _same_program_with_slices_of(loaded, model, plan, rank)
    generated = {}
    if not case["dtype"]:
        # Generation from the checkpoint-loaded module (its model only ever on meta): the
        # prefill/decode programs are captured from the meta model too, so their factory ops
        # and lifted constants must land on the weights' device.
        ids = _ids(model.config.vocab_size, seed)
        eos = model.generation_config.eos_token_id
        ours = loaded.generate(ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
        generated = {"generate_equal_hf": torch.equal(ours, hf), "generated": ours.tolist(), "hf_generated": hf.tolist()}
    return {"case": case, "rank": rank, **_compare(loaded, in_memory, model, seed), **generated, "reads": reads,
            "weights": weights, "largest_param": [largest, weights[largest]["full"]],
            "group_size": dist.get_world_size(mesh.get_group()) if mesh else None,
            "collectives": len(loaded.program.collectives)}


def run_all(rank, world, cases, seed, out_path):
    """All cases in one launch: starting processes costs more here than the work in them."""
    results = [_load_case(rank, world, case, seed) for case in cases]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([r for part in gathered for r in part], f)
