"""Worker for tests/test_tsp.py and tests/test_tsp_ring.py: each rank runs ``Plan(tsp=N)`` on the
six families and records logits errors against HF eager, gradient errors against the unsharded
model's gradient slices, weight counts and activation bytes; and ``comm.ring.ring_linear`` alone
against a linear of the whole weight."""

import copy
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ssmshard
from ssmshard.comm import registered
from ssmshard.comm.ring import record_shards_in_flight, ring_layout, ring_linear
from ssmshard.placement import SeqShard, Shard, local_slice
from ssmshard.comm.weights import gather_shards, gathered_ranges
from ssmshard.testing import peak_activation_bytes, rel_err

from conftest import small_model
from generate_hf_arguments import gathered
from sp_worker import logits_errors


def _write_on_rank0(rank, results, out_path):
    """Every rank's results, in rank order, written as JSON by rank 0."""
    every_rank = gathered(results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(every_rank, f)


def _within_fp32(got, want, want64, tol, perturbed=()) -> bool:
    """``got`` within ``tol`` of HF's fp32 gradient ``want``, or no further from HF's fp64 gradient
    than 3x HF's own fp32 one (a sum that cancels leaves fp32 rounding above ``tol``), or than 2x
    the farthest of HF's fp32 gradients ``perturbed`` (weights moved by rounding-sized amounts,
    ``rounding_perturbed_grads``): at an ill-conditioned input HF's own fp32 gradient can land
    close to the fp64 one by luck. The 2x: ``got`` is one more draw of the same rounding, and the
    farthest of three draws understates how far one can land (zamba2 at D = 2, ring weights, seed
    4168603329 of tests/test_tsp.py: ours 2.06e-5 from fp64 against 1.81e-5 for the farthest
    perturbed one, 1.14x)."""
    if rel_err(got, want) < tol:
        return True
    reach = max([3 * rel_err(want.double(), want64)] + [2 * rel_err(w.double(), want64) for w in perturbed])
    return rel_err(got.double(), want64) <= reach


def rounding_perturbed_grads(model, loss, trials: int = 3) -> list:
    """HF's fp32 gradients of ``loss(model)`` after each weight is multiplied by ``1 + 1e-7 z``
    (z standard normal, seeded; 1e-7 is about one float32 rounding), ``trials`` times, as each
    perturbed copy's parameters by name (their ``.grad``): how far
    fp32 rounding alone moves the gradient at this input. Measured with zamba2 (batch 2 x 13,
    seed 3769080726 of tests/test_tsp.py): HF's fp32 gradient 5.5e-6 from its fp64 one, the three
    perturbed ones 7.3e-6, 7.1e-5 and 9.0e-5 from it (seeds 1 and 2: 1.4e-5 at most); ours at D = 2
    zigzag 3.8e-5 from HF's fp32, 5.6e-6 with its attention run in fp64, and that attention alone,
    given the same inputs, within 6e-7 of fp64 (an ill-conditioned input, not a wrong op)."""
    generator = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(trials):
        perturbed = copy.deepcopy(model)
        perturbed.zero_grad()
        with torch.no_grad():
            for weight in perturbed.parameters():
                weight.mul_(1 + 1e-7 * torch.randn(weight.shape, generator=generator))
        loss(perturbed).backward()
        grads.append(dict(perturbed.named_parameters(remove_duplicate=False)))
    return grads


def tsp_results(rank, world, cases, lengths, seed, out_path, order="contiguous", weights="gather"):
    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tsp=world, tsp_order=order, tsp_weights=weights))
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        errors = logits_errors(dm, model, lengths, gen)
        # Gradients: one loss through the sharded and the unsharded model.
        ids = torch.randint(0, vocab, (2, lengths[-1]), generator=gen)
        probe = torch.randn(2, lengths[-1], vocab, generator=gen)
        (dm(ids) * probe).sum().backward()
        dm.sync_replicated_grads()
        model.zero_grad()
        loss = lambda m: (m(ids).logits * probe.to(m.dtype)).sum()  # noqa: E731
        loss(model).backward()
        # HF's gradient in fp64 too: how far HF's own fp32 gradient is from it bounds what fp32 can reach.
        exact = copy.deepcopy(model).double()
        loss(exact).backward()
        errors_of_grads = gradient_errors(dm, model, rank, exact, loss)
        model.zero_grad()
        rings = sum(n.target is ring_linear for n in dm.program.graph.nodes)
        results.append({"family": family, "logits_err": max(errors), "rings": rings, **errors_of_grads})
    _write_on_rank0(rank, results, out_path)


def gradient_errors(dm, model, rank, model64=None, loss=None) -> dict:
    """``dm``'s local weight gradients against the matching slices of ``model``'s: the relative
    error over rank ``rank``'s whole local gradient vector (``grad_err``) and the worst single
    tensor's. With ``model64`` (an fp64 copy of ``model`` after the same backward) also whether
    they are within fp32's reach (``_within_fp32``: 1e-5 over the vector, 1e-4 per tensor); where
    they are not and ``loss`` (model -> the loss both backwards took) is given, judged again
    against HF's gradients of rounding-perturbed weights (``rounding_perturbed_grads``)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named64 = dict(model64.named_parameters(remove_duplicate=False)) if model64 is not None else None
    slices = {}  # fqn -> (ours, HF's fp32 slice, HF's fp64 slice or None)
    for fqn, spec in dm.program.param_specs.items():
        if spec.kind != "parameter" or named[fqn].grad is None:
            continue
        slices[fqn] = (dm.local_weight(fqn).grad, local_slice(named[fqn].grad, spec.placement, rank),
                       local_slice(named64[fqn].grad, spec.placement, rank) if named64 is not None else None)
    whole = lambda i: torch.cat([s[i].flatten() for s in slices.values()])  # noqa: E731
    errors = {"grad_err": rel_err(whole(0), whole(1)),
              "worst_tensor_grad_err": max(rel_err(got, want) for got, want, _ in slices.values())}
    if named64 is None:
        return errors

    def verdicts(perturbed):
        """(whole vector within reach, tensors beyond it), against ``perturbed`` (fqn -> weight)."""
        near = {fqn: [local_slice(p[fqn].grad, dm.program.param_specs[fqn].placement, rank) for p in perturbed]
                for fqn in slices}  # fqn -> this rank's slice of each perturbed gradient
        beyond = [fqn for fqn, (got, want, want64) in slices.items()
                  if not _within_fp32(got, want, want64, 1e-4, near[fqn])]
        near_whole = [torch.cat([t.flatten() for t in ts]) for ts in zip(*near.values())]
        return _within_fp32(whole(0), whole(1), whole(2), 1e-5, near_whole), beyond

    within, beyond = verdicts([])
    if (not within or beyond) and loss is not None:
        within, beyond = verdicts(rounding_perturbed_grads(model, loss))
    return {**errors, "grad_within_fp32": within, "tensors_beyond_fp32": beyond}


def memory_results(rank, world, cases, lengths, out_path):
    """Per family: each sharded weight's local element count against its placement, whether
    every gathered weight is read by the very next op (one whole weight in flight), and the
    peak activation bytes of a TSP rank and of the unsharded program at each length."""
    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tsp=world))
        named = dict(model.named_parameters(remove_duplicate=False))
        local_fraction = {}
        for fqn, spec in dm.program.param_specs.items():
            if isinstance(spec.placement, Shard):
                whole = named[fqn].numel() if fqn in named else None
                local_fraction[fqn] = [dm.local_weight(fqn).numel(), whole,
                                       [[s.size, s.pieces] for s in spec.placement.segments]]
        nodes = list(dm.program.graph.nodes)
        # A gathered weight is read by one op, and nothing but the gathers of that op's other
        # weights runs between: only the whole weights of the op at hand are ever in flight.
        in_flight_ok = all(len(n.users) == 1 and all(m.target is gather_shards
                                                     for m in nodes[i + 1:nodes.index(next(iter(n.users)))])
                           for i, n in enumerate(nodes) if n.target is gather_shards)
        full = ssmshard.capture(model, mode="forward").bind(model)
        peaks, full_peaks = [], []
        for length in lengths:
            ids = torch.randint(0, model.config.vocab_size, (2, length))
            peaks.append(peak_activation_bytes(dm.program.for_shapes([ids]), ids))
            full_peaks.append(peak_activation_bytes(full.for_shapes([ids]), ids))
        results.append({"family": family, "local": local_fraction, "in_flight_ok": in_flight_ok,
                        "gathers": sum(n.target is gather_shards for n in nodes),
                        "seq_sharded": sum(isinstance(n.meta.get("placement"), SeqShard) for n in nodes),
                        "peaks": peaks, "full_peaks": full_peaks})
    _write_on_rank0(rank, results, out_path)


def generate_results(rank, world, cases, seed, out_path, order="contiguous", weights="gather"):
    """Greedy generation of a TSP DistributedModule against HF's: the prompt is prefilled with its
    tokens split over the ranks (the TSP prefill program), decoded by the TP decode program over
    the same weight shards. Prompts: a left-padded batch (lengths 5, 12, 9) and an unpadded batch
    of 3 tokens (shorter than D x the conv kernel: the prefill pads it so the last rank holds the
    whole conv window). Also the prefill's last-token logits against HF eager's."""
    from generate_hf_arguments import hf_reference
    from generate_worker import left_padded_prompts
    from ssmshard.runtime.tsp_prefill import SequenceShardedPrefill

    results = []
    for family, overrides in cases:
        model = small_model(family, **overrides)
        vocab = model.config.vocab_size
        # Generation only: the weights laid out from the (tensor-parallel) prefill program.
        dm = ssmshard.parallelize(model, ssmshard.Plan(tsp=world, tsp_order=order, tsp_weights=weights),
                                  lazy_forward=True)
        prefill, _ = dm.generation_programs()
        result = {"family": family, "sequence_sharded": isinstance(prefill, SequenceShardedPrefill)
                  and prefill.program.shard["policy"] == "tsp" and prefill.program.shard["order"] == order,
                  "equal": [], "prefill_err": [],
                  "rings": sum(n.target is ring_linear for n in prefill.program.graph.nodes)}
        padded = left_padded_prompts(vocab, (5, 12, 9), seed)
        short = (torch.randint(1, vocab, (2, 3), generator=torch.Generator().manual_seed(seed)), None)
        for ids, mask in (padded, short):
            ours = dm.generate(ids, mask, max_new_tokens=6)
            hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
            result["equal"].append(torch.equal(ours, hf))
            logits, _ = dm.prefill(ids, mask)
            with torch.no_grad():
                want = model(ids, attention_mask=mask).logits[:, -1:]
            result["prefill_err"].append(rel_err(logits, want))
        results.append(result)
    _write_on_rank0(rank, results, out_path)


def packed_results(rank, world, families, packings, seed, out_path):
    """A packed row (``ssmshard.pack``) through ``Plan(tsp=N)``: each sequence's logits against HF
    eager on that sequence alone, and every rank's gradients of one loss over the row against the
    matching slices of HF's gradients of the same loss summed over the sequences run alone."""
    results = []
    for family in families:
        model = small_model(family)
        dm = ssmshard.parallelize(model, ssmshard.Plan(tsp=world), packed=True)
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        for lengths in packings:
            sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
            batch = ssmshard.pack(sequences)
            probes = [torch.randn(1, n, vocab, generator=gen) for n in lengths]
            logits = dm(batch)
            (logits * torch.cat(probes, dim=1)).sum().backward()
            dm.sync_replicated_grads()
            model.zero_grad()
            errors = []
            for ids, got, probe in zip(sequences, batch.unpack(logits.detach()), probes):
                want = model(ids[None]).logits
                (want * probe).sum().backward()
                errors.append(rel_err(got, want.detach()))
            named = dict(model.named_parameters(remove_duplicate=False))
            got, want = [], []
            for fqn, spec in dm.program.param_specs.items():
                if spec.kind == "parameter" and named[fqn].grad is not None:
                    want.append(local_slice(named[fqn].grad, spec.placement, rank).flatten())
                    got.append(dm.local_weight(fqn).grad.flatten())
                    dm.local_weight(fqn).grad = None
            model.zero_grad()
            results.append({"family": family, "lengths": lengths, "logits_err": max(errors),
                            "grad_err": rel_err(torch.cat(got), torch.cat(want))})
    _write_on_rank0(rank, results, out_path)


def ring_linear_results(rank, world, cases, seed, out_path):
    """``comm.ring.ring_linear`` on this rank's tokens against ``F.linear`` with the whole weight,
    per ``(name, placement, shape)`` case (``ring_linear_case``), on the launched process group."""
    with registered(RING_GROUP, dist.group.WORLD):
        results = [ring_linear_case(rank, world, *case, seed) for case in cases]
    _write_on_rank0(rank, results, out_path)


RING_GROUP = "tsp_ring_test"


def ring_linear_case(rank, world, name, placement, shape, seed):
    """The output and the gradients of the tokens and of the bias against ``F.linear`` with the
    whole weight; the weight shard's gradient against the all-gather schedule's (``gather_shards``:
    its reduce-scatter sums each shard's rows over every rank's tokens) and, where every segment is
    cut ``world`` ways, against this rank's slice of the whole weight's gradient over every rank's
    tokens. Also the peak bytes of received weight shards alive at once over forward and backward
    (``record_shards_in_flight``)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    # Every rank draws every rank's tokens and probes, so each can compute the whole weight's gradient.
    tokens = [torch.randn(2, 5, shape[1], generator=gen) for _ in range(world)]
    probes = [torch.randn(2, 5, shape[0], generator=gen) for _ in range(world)]

    def run(read_weight):
        shard = local_slice(weight, placement, rank).clone().requires_grad_()
        x, b = tokens[rank].clone().requires_grad_(), bias.clone().requires_grad_()
        out = read_weight(x, shard, b)
        (out * probes[rank]).sum().backward()
        return out.detach(), x.grad, shard.grad, b.grad

    with record_shards_in_flight() as record:
        out, grad_x, grad_shard, grad_bias = run(lambda x, shard, b: ring_linear(
            x, shard, b, placement.dim, shape[placement.dim], ring_layout(placement, world), RING_GROUP))
    ranges = gathered_ranges(placement, world)
    _, _, gather_grad, _ = run(lambda x, shard, b: F.linear(x, gather_shards(shard, placement.dim, ranges,
                                                                             RING_GROUP), b))
    whole = weight.clone().requires_grad_()
    x, b = tokens[rank].clone().requires_grad_(), bias.clone().requires_grad_()
    want = F.linear(x, whole, b)
    (want * probes[rank]).sum().backward()
    whole_grad = sum(torch.autograd.grad((F.linear(t, whole) * p).sum(), whole)[0] for t, p in zip(tokens, probes))
    even = all(seg.pieces == world for seg in placement.segments)
    return {"name": name, "out_err": rel_err(out, want), "grad_x_err": rel_err(grad_x, x.grad),
            "grad_bias_err": rel_err(grad_bias, b.grad), "grad_shard_vs_gather": rel_err(grad_shard, gather_grad),
            "grad_shard_vs_whole": rel_err(grad_shard, local_slice(whole_grad, placement, rank)) if even else None,
            "peak_bytes": record["peak_bytes"], "shard_bytes": record["shard_bytes"]}
