"""Worker for the program cache's multi-process test: each launch is a fresh set of processes,
so a second launch over the same folder loads what the first stored. Rank 0 writes results."""

import json

import torch

import ssmshard

from conftest import small_model
from generate_hf_arguments import hf_reference
from generate_worker import PAD, _same_on_every_rank, left_padded_prompts

NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 9, 7)
CHUNK = 4  # prefill_chunk_size: the prompts of 7 and 9 tokens go through the chunk program


def graph_rows(program):
    """Every node of ``program``'s graphs as text: name, op, target, arguments, tags, placements (the
    process group's name, which is each module's own, as GROUP)."""
    group = program.shard["group"]
    graphs = [program.graph_module] + ([program.folded.graph_module] if program.folded is not None else [])
    rows = []
    for graph_module in graphs:
        for module in graph_module.modules():
            if isinstance(module, torch.fx.GraphModule):
                rows += [f"{n.name} {n.op} {n.target} {n.args} {n.kwargs} {n.meta.get('ssmshard')} "
                         f"{n.meta.get('placement')}".replace(group, "GROUP") for n in module.graph.nodes]
    return rows


def programs_of(dm, static):
    programs = {"prefill": dm.prefill_program(), "chunk": dm.chunk_program(), "decode": dm.decode_program()}
    if static:
        programs["static_decode"] = dm.static_decode_program()
    return programs


def cached_generation(rank, world, families, seed, cache, out_path, compare_with_fresh, checkpoints):
    """``checkpoints``: family -> a directory its small model was saved in, for the families whose
    module is built from the checkpoint over a meta model (``parallelize_from_pretrained``)."""
    results = []
    for family in families:
        model = small_model(family)
        static = ssmshard.family_of(model).has_attention

        def build(program_cache):
            if family in checkpoints:
                return ssmshard.parallelize_from_pretrained(checkpoints[family], ssmshard.Plan(tp=world), lazy_forward=True,
                                                            program_cache=program_cache, progress=False)
            return ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True, program_cache=program_cache)
        dm = build(cache)
        ids, mask = left_padded_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed)
        options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
        runs = {"growing": dm.generate(ids, mask, static_kv=False, **options),
                "chunked": dm.generate(ids, mask, static_kv=False, prefill_chunk_size=CHUNK, **options)}
        if static:
            runs["static"] = dm.generate(ids, mask, static_kv=True, **options)
        result = {"family": family, "hf": hf.tolist(), "runs": {k: v.tolist() for k, v in runs.items()},
                  "same_on_all_ranks": all(_same_on_every_rank(v) for v in runs.values()),
                  "loaded": sorted(dm.program_cache.loaded), "stored": sorted(dm.program_cache.stored),
                  "from_store": {k: p.from_store for k, p in programs_of(dm, static).items()}}
        if compare_with_fresh:  # the same programs built here without the cache, node for node
            fresh = build(None)
            ours, theirs = programs_of(dm, static), programs_of(fresh, static)
            result["differing_programs"] = [k for k in ours if graph_rows(ours[k]) != graph_rows(theirs[k])
                                            or ours[k].state_specs != theirs[k].state_specs
                                            or ours[k].states_in_place != theirs[k].states_in_place
                                            or [str(p) for p in ours[k].shard["outputs"]]
                                            != [str(p) for p in theirs[k].shard["outputs"]]]
            result["nodes"] = {k: len(graph_rows(p)) for k, p in ours.items()}
        results.append(result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def refusals_and_unreadable_entries(rank, world, cache, out_path):
    """One rank: a loaded prefill program refuses passes and a report of every op's shape; a
    truncated entry is built again (the warning it logs is recorded); tokens against HF's."""
    import logging
    import pathlib

    model = small_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    result = {}
    first = ssmshard.parallelize(model, ssmshard.Plan(tp=1), lazy_forward=True, program_cache=cache)
    result["first_stored"] = list(first.program_cache.stored)
    loaded = ssmshard.parallelize(model, ssmshard.Plan(tp=1), lazy_forward=True, program_cache=cache)
    prefill = loaded.prefill_program()
    result.update(loaded=list(loaded.program_cache.loaded), from_store=prefill.from_store)
    for what, call in (("passes", lambda: ssmshard.passes.run_pipeline(prefill, ["drop_tensor_asserts"])),
                       ("report", lambda: prefill.report(activations=True))):
        try:
            call()
            result[what] = None
        except ValueError as error:
            result[what] = str(error)
    result["loaded_tokens_equal_hf"] = torch.equal(loaded.generate(ids, max_new_tokens=4, static_kv=False), hf)
    for entry in pathlib.Path(cache).glob("*.pt"):
        entry.write_bytes(entry.read_bytes()[:100])  # truncated

    class Records(logging.Handler):
        messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())
    handler = Records(level=logging.WARNING)
    logging.getLogger("ssmshard.runtime.program_cache").addHandler(handler)
    rebuilt = ssmshard.parallelize(model, ssmshard.Plan(tp=1), lazy_forward=True, program_cache=cache)
    logging.getLogger("ssmshard.runtime.program_cache").removeHandler(handler)
    result.update(warnings=Records.messages, rebuilt_stored=list(rebuilt.program_cache.stored),
                  rebuilt_from_store=rebuilt.prefill_program().from_store,
                  rebuilt_tokens_equal_hf=torch.equal(rebuilt.generate(ids, max_new_tokens=4, static_kv=False), hf))
    with open(out_path, "w") as f:
        json.dump(result, f)


def compiled_generation(rank, world, family, seed, cache, out_path):
    """``Plan(compile=True)``: HF's greedy tokens from a module whose programs may come from the
    cache, and what it loaded and stored."""
    model = small_model(family)
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world, compile=True), lazy_forward=True, program_cache=cache)
    ids, mask = left_padded_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed)
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    hf = hf_reference(lambda: model.generate(ids, attention_mask=mask, do_sample=False, **options))
    ours = dm.generate(ids, mask, **options)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ours": ours.tolist(), "hf": hf.tolist(), "loaded": sorted(dm.program_cache.loaded),
                       "stored": sorted(dm.program_cache.stored),
                       "compilations": len(dm.decode_program().compilations)}, f)
