"""Tensor-parallel forward under torchrun, checked against the unsharded model.

Every process builds the same small model (or, with ``--checkpoint DIR``, reads only its own
slices of a safetensors checkpoint onto a meta-device model), shards it over a 1-D device
mesh of all the processes, runs one batch and compares the logits with the unsharded model's
(Hugging Face eager; for a checkpoint, ``from_pretrained`` of the same directory, which loads
the whole model in each process: fine for a check, not what you deploy).

Run:  torchrun --standalone --nproc_per_node 2 examples/torchrun_forward.py [--family mamba2]
                [--checkpoint DIR] [--tol 1e-5]
Gloo on CPU; NCCL with one GPU per process when GPUs are present. Exits 1 above the tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ssmshard
from ssmshard.runtime.launch import collective_timeout
from ssmshard.testing import randomize_weights, rel_err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mamba2", help="small default model of this family")
    parser.add_argument("--checkpoint", help="a safetensors checkpoint directory to load instead")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest relative error accepted (float32)")
    args = parser.parse_args()

    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    if use_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    # The backend named, not left to torch: a group started without one on a machine with a GPU
    # has NCCL only, which carries no CPU tensors. The timeout bounds every wait for another rank.
    backend = "nccl" if use_gpu else "gloo"
    timeout = datetime.timedelta(seconds=collective_timeout(None, backend))
    dist.init_process_group(backend, timeout=timeout)  # torchrun's environment: rank, world, store
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = ssmshard.Plan(tp=world)

    if args.checkpoint:
        from transformers import AutoModelForCausalLM

        dm = ssmshard.parallelize_from_pretrained(args.checkpoint, plan, device_mesh=mesh, device=device)
        reference = AutoModelForCausalLM.from_pretrained(args.checkpoint).to(device).eval()
    else:
        reference = randomize_weights(ssmshard.build_small_model(args.family), seed=0).to(device)
        dm = ssmshard.parallelize(reference, plan, device_mesh=mesh)

    generator = torch.Generator().manual_seed(1234)  # the same tokens on every rank
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=generator).to(device)
    with torch.no_grad():
        logits = dm(ids)
        expected = reference(ids).logits
    max_diff = (logits - expected).abs().max().item()
    error = rel_err(logits, expected)
    verdict = "ok" if error <= args.tol else "ABOVE the tolerance"
    print(f"rank {rank}/{world} {type(reference).__name__}: logits relative error {error:.2e} "
          f"(tolerance {args.tol:g}: {verdict}); max abs diff {max_diff:.2e}", flush=True)
    dist.destroy_process_group()
    return 0 if error <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
