"""At tp > 1 a decode program admits the local (sharded) state shapes it is called with.

Its ``ranges`` were recorded at capture on the global shapes; the shard pass must rewrite the
fixed range of every sharded input to the local size, else each decode step misses the
shape-bucket cache and captures a new sibling program (a whole-model capture per token).
"""

import json

import pytest
import torch
import torch.distributed as dist

import ssmshard
from ssmshard.placement import Shard

from conftest import small_model


def _siblings_after_generate(rank, world, seed, out_path):
    model = small_model("mamba")  # conv and SSM states, sharded by channel
    dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world), lazy_forward=True)  # generation only
    ids = torch.randint(1, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    dm.generate(ids, max_new_tokens=5)
    prefill, decode = dm.generation_programs()
    _, states = prefill(ids)
    sharded = [(i, p) for i, p in enumerate(dm.state_placements()) if isinstance(p, Shard)]
    report = {"rank": rank, "prefill_siblings": len(prefill.siblings), "decode_siblings": len(decode.siblings),
              "sharded_states": len(sharded),
              "state_ranges_local": all(decode.ranges[(3 + i, p.dim)] == (states[i].shape[p.dim],) * 2
                                        for i, p in sharded)}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(reports, f)


@pytest.mark.compat
def test_tp2_decode_reuses_its_program_for_local_state_shapes(tmp_path, fresh_seed):
    out = tmp_path / "siblings.json"
    ssmshard.launch(_siblings_after_generate, 2, fresh_seed, str(out), backend="gloo")
    for report in json.loads(out.read_text()):
        assert report["sharded_states"] > 0, report
        assert report["state_ranges_local"], report
        assert report["decode_siblings"] == 0 and report["prefill_siblings"] == 0, report
