"""Do greedy tokens of batch-64 bf16 decode depend on how they were computed, and where they
differ, is it a near-tie?

    PYTHONPATH=$PWD python benchmarks/greedy_agreement_gpu.py --out $OUT            # one GPU
    PYTHONPATH=$PWD python benchmarks/greedy_agreement_gpu.py --smoke --out DIR      # CPU, tiny, fp32

For each model (random bf16 weights, ``generate_gpu.build_random_model``), one left-unpadded
batch of prompts and ``--new-tokens`` greedy tokens from:
  graphed       ``dm.generate``: the decode step replayed as a CUDA graph, the loop on the device
  graphed_again the same call again on the same module (a replay of the same graph)
  host_loop     the same module and graph with ``output_logits=True`` (the host loop): its logits
                give the margins below
  eager         the same module with ``cuda_graph=False`` (the same kernels, launched one by one)
  second_build  a second ``parallelize`` of the same model and plan, graphed
  hf            Hugging Face ``model.generate`` on the same model object, ``HF_ROWS`` rows per call
                (its torch path for Mamba-2 at batch 64 would allocate 160 GiB)
Each row compares one of them with ``host_loop``: how many rows of the batch differ, and for each
differing row the first step where it does and the margin there: ``host_loop``'s top logit minus
its logit of the token the other run chose, against the size of one bf16 rounding step of that
top logit (``ulp``). A margin of a few ulps is a near-tie that any change of summation order may
flip; a large one would be a bug. Rows go to ``OUT/rows_rank0.jsonl``, with ``host_loop``'s tokens
(``kind: tokens``) for comparing two processes.
"""

from __future__ import annotations

import bench_common  # first: --smoke sets TRITON_INTERPRET before any kernel import

import argparse
import os
import sys

import torch
import torch.distributed as dist

import ssmshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import GPU_MODELS, PAD, SMOKE_MODELS as DECODE_SMOKE_MODELS, free_memory, prompt_ids  # noqa: E402
from generate_gpu import Clock, Recorder, build_random_model  # noqa: E402

HF_ROWS = 16
SMOKE_MODELS = {name: DECODE_SMOKE_MODELS[name] for name in ("tiny-mamba", "tiny-mamba2")}


def first_differences(reference, other, logits, prompt):
    """Per differing row: (row, step, margin, ulp) at the first step where ``other`` differs."""
    found = []
    for row in torch.nonzero((reference != other).any(dim=1)).flatten().tolist():
        step = int(torch.nonzero(reference[row, prompt:] != other[row, prompt:])[0])
        scores = logits[step][row].float()
        top = scores.max()
        margin = float(top - scores[other[row, prompt + step]])
        ulp = float(torch.finfo(torch.bfloat16).eps * top.abs().clamp_min(1e-30))
        found.append({"row": row, "step": step, "margin": margin, "ulp": ulp, "margin_ulps": margin / ulp})
    return found


def agreement(name, make_config, run, rec):
    model = build_random_model(make_config(), run["device"], run["dtype"])
    ids = prompt_ids(model.config.vocab_size, run["batch"], run["prompt"], run["device"], seed=0)
    options = dict(max_new_tokens=run["new_tokens"], pad_token_id=PAD)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
    runs = {"graphed": dm.generate(ids, **options), "graphed_again": dm.generate(ids, **options)}
    out = dm.generate(ids, return_dict_in_generate=True, output_logits=True, **options)
    reference, logits = out.sequences, out.logits
    runs["eager"] = dm.generate(ids, cuda_graph=False, **options)
    del dm
    second = ssmshard.parallelize(model, ssmshard.Plan(tp=1))
    runs["second_build"] = second.generate(ids, **options)
    del second
    with torch.no_grad():
        runs["hf"] = torch.cat([model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=False, **options)
                                for rows in ids.split(HF_ROWS)])
    # Two processes of this script (a fresh one, then one reading the on-disk tunings) compare these.
    rec.write("tokens", model=name, variant="host_loop", tokens=reference.tolist())
    for variant, tokens in runs.items():
        differences = first_differences(reference, tokens, logits, ids.shape[1])
        rec.write("agreement", model=name, variant=variant, against="host_loop", batch=ids.shape[0],
                  prompt=ids.shape[1], new_tokens=run["new_tokens"], rows_differing=len(differences),
                  largest_margin_ulps=max((d["margin_ulps"] for d in differences), default=0.0),
                  differences=differences)
    del model
    free_memory(run["device"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", help="default: Mamba-2.8B and Mamba2-2.7B configs")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny fp32 models: checks the flow only")
    args = parser.parse_args(argv)
    if args.smoke:
        run = dict(models=SMOKE_MODELS, device=torch.device("cpu"), dtype=torch.float32, batch=4, prompt=8,
                   new_tokens=4)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on a CPU")
        run = dict(models={m: GPU_MODELS[m] for m in ("mamba-2.8b", "mamba2-2.7b")}, device=torch.device("cuda", 0),
                   dtype=torch.bfloat16, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens)
        torch.cuda.set_device(run["device"])
    if args.models:
        every = SMOKE_MODELS if args.smoke else GPU_MODELS
        unknown = sorted(set(args.models) - set(every))
        if unknown:
            raise SystemExit(f"unknown models {unknown}; choose from {list(every)}")
        run["models"] = {m: every[m] for m in args.models}
    bench_common.init_single_process_group(run["device"])
    rec = Recorder(args.out, 0, Clock(None))
    for name, make_config in run["models"].items():
        agreement(name, make_config, run, rec)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
