"""``comm.ring.ring_linear`` (``Plan(tsp=D, tsp_weights="ring")``: docs/tsp.md) on its own, in
real processes over gloo: the output and every gradient against a plain linear of the whole
weight, and the weight shards it holds at once, measured."""

import json

import pytest

import ssmshard
from ssmshard.placement import Segment, Shard

import tsp_worker


def _cases(world):
    """Column-parallel (rows split), row-parallel (columns split), and a packed weight laid out as
    Mamba-2's in_proj with one group: ``[z | x | B | C | dt]``, B and C held whole by every rank."""
    packed = (Segment(8 * world, world), Segment(8 * world, world), Segment(4, 1, world), Segment(4, 1, world),
              Segment(world, world))
    return [("column", Shard(0, (Segment(6 * world, world),)), (6 * world, 10)),
            ("row", Shard(1, (Segment(4 * world, world),)), (7, 4 * world)),
            ("packed", Shard(0, packed), (17 * world + 8, 6))]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_linear_equals_whole_linear(world, tmp_path, fresh_seed):
    """Output and the gradients of the tokens and the bias within 1e-5 of ``F.linear`` with the
    whole weight; each rank's weight-shard gradient within 1e-5 of the all-gather schedule's and
    (even splits) of its slice of the whole weight's gradient over every rank's tokens. At most two
    received shards alive at once (exactly two at D = 3: the one in use and the one arriving)."""
    out = tmp_path / "ring.json"
    cases = _cases(world)
    ssmshard.launch(tsp_worker.ring_linear_results, world, cases, fresh_seed, str(out))
    for rank, results in enumerate(json.loads(out.read_text())):
        assert [r["name"] for r in results] == [name for name, _, _ in cases]
        for r in results:
            where = f"{r['name']} D={world} rank {rank} (seed {fresh_seed}): {r}"
            for key in ("out_err", "grad_x_err", "grad_bias_err", "grad_shard_vs_gather"):
                assert r[key] < 1e-5, (key, where)
            if r["name"] != "packed":
                assert r["grad_shard_vs_whole"] < 1e-5, where
            assert 0 < r["peak_bytes"] <= 2 * r["shard_bytes"], where
            if world == 3:
                assert r["peak_bytes"] == 2 * r["shard_bytes"], where
