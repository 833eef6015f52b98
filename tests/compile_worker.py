"""Worker for the compiled-program tests (``Plan(compile=True)``): every rank runs the compiled
programs, rank 0 writes what they gave beside Hugging Face eager."""

import json

import torch

import ssmshard
from ssmshard.testing import joint_rel_err, rel_err

from conftest import small_model
from finishing_rows import finishing_rows
from generate_hf_arguments import hf_reference
from generate_worker import PAD, left_padded_prompts

ATTENTION = ("zamba", "zamba2", "llama")


def _gradient_error(model, dm, ids):
    """max |compiled - HF eager| over max |HF eager|, over every parameter's gradient of one loss
    (tp=1: the module's weights may be the model's tensors, so HF's are taken and cleared first);
    and the parameters no gradient reached."""
    weights = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    weights = weights.to(ids.device)
    model.zero_grad(set_to_none=True)
    (model(ids).logits * weights).sum().backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (dm(ids) * weights).sum().backward()
    grads = {fqn: dm.local_weight(fqn).grad for fqn, spec in dm.program.param_specs.items()
             if spec.kind == "parameter"}
    missing = [fqn for fqn, grad in grads.items() if grad is None]
    error = joint_rel_err((grad, expected[fqn]) for fqn, grad in grads.items() if grad is not None)
    model.zero_grad(set_to_none=True)
    return error, missing


def compiled_vs_hf(rank, world, family, seed, out_path, device="cpu"):
    model = small_model(family).to(device)
    try:
        dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, compile=True))
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, model.config.vocab_size, (2, 11), generator=generator).to(device)
        with torch.no_grad():
            logits_err = rel_err(dm(ids), model(ids).logits)
            longer = torch.randint(1, model.config.vocab_size, (2, 17), generator=generator).to(device)
            longer_err = rel_err(dm(longer), model(longer).logits)  # a second length: recompiled dynamic
        grad_err, no_grad = _gradient_error(model, dm, ids) if world == 1 else (None, [])
        prompts, mask = (t.to(device) for t in left_padded_prompts(model.config.vocab_size, (5, 12, 9), seed))
        options = dict(max_new_tokens=12, pad_token_id=PAD)
        ours = dm.generate(prompts, mask, **options)
        chunked = dm.generate(prompts, mask, prefill_chunk_size=4, **options)
        hf = hf_reference(lambda: model.generate(prompts, attention_mask=mask, do_sample=False, **options))
        finishing = finishing_rows(lambda i, m, **o: dm.generate(i, m, **o), model, prompts, mask, PAD,
                                   reference=hf_reference)
        prefill, decode = dm.generation_programs()
        compiled = {"forward": len(dm.program.compilations), "prefill": len(prefill.compilations),
                    "chunk": len(dm.chunk_program().compilations),
                    # On a GPU attention families decode over static key/value buffers.
                    "decode": len(decode.compilations) + (len(dm.static_decode_program().compilations)
                                                          if device == "cuda" and dm.program.family in ATTENTION
                                                          else 0)}
        report = dm.program.report()
        graphed = dm.decode_graph(prompts.shape[0]) is not None  # on a GPU: the compiled step as a CUDA graph
    finally:
        model.cpu()  # the model object is shared by the tests of this process
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"logits_err": logits_err, "longer_err": longer_err, "grad_err": grad_err, "no_grad": no_grad,
                       "ours": ours.tolist(), "chunked": chunked.tolist(), "hf": hf.tolist(),
                       "finishing": finishing, "compilations": compiled, "graphed": graphed,
                       "report": report}, f)
