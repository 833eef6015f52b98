"""``comm.ring.ring_linear`` (``Plan(tsp=D, tsp_weights="ring")``: docs/tsp.md) on its own, in
real processes over gloo and on simulated ranks: the output and every gradient against a plain
linear of the whole weight, and the weight shards it holds at once, measured."""

import json

import pytest

import ssmshard
from ssmshard.comm import run_simulated
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
    received shards alive at once (exactly two from D = 3: the one in use and the one arriving)."""
    out = tmp_path / "ring.json"
    ssmshard.launch(tsp_worker.ring_linear_results, world, _cases(world), fresh_seed, str(out), backend="gloo")
    _check(world, json.loads(out.read_text()), fresh_seed)


def test_ring_linear_on_simulated_ranks(fresh_seed):
    """The same checks at D = 4 with every rank a thread of this process (``SimulatedGroup``, whose
    ``start_shifts`` completes each shift before returning: the ring's order without overlap)."""
    world = 4
    results = run_simulated(lambda rank, world: [tsp_worker.ring_linear_case(rank, world, *case, fresh_seed)
                                                 for case in _cases(world)], world, group=tsp_worker.RING_GROUP)
    _check(world, results, fresh_seed)


def _check(world, every_rank, seed):
    cases = _cases(world)
    for rank, results in enumerate(every_rank):
        assert [r["name"] for r in results] == [name for name, _, _ in cases]
        for r in results:
            where = f"{r['name']} D={world} rank {rank} (seed {seed}): {r}"
            for key in ("out_err", "grad_x_err", "grad_bias_err", "grad_shard_vs_gather"):
                assert r[key] < 1e-5, (key, where)
            if r["name"] != "packed":
                assert r["grad_shard_vs_whole"] < 1e-5, where
            assert 0 < r["peak_bytes"] <= 2 * r["shard_bytes"], where
            if world > 2:
                assert r["peak_bytes"] == 2 * r["shard_bytes"], where
