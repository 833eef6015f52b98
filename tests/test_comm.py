"""Collective ops (ssmshard.comm): values and gradients on gloo against torch.distributed and
a plain-torch global computation, symbolic-shape propagation, and the simulated in-process
backend against gloo, including its failure handling."""

import json
import re
import time

import pytest
import torch

import ssmshard
from ssmshard import comm
from ssmshard.testing import rel_err

import comm_worker

TOL = 1e-6  # fp32: the only differences are the order of N additions


WORLDS = (2, 3, 4)


def test_collectives_on_gloo_and_simulated(tmp_path, fresh_seed):
    """Every op (uneven reduce_scatter / all_gather lengths 1, N-1, N+1, 2N+1 included) on real
    gloo groups of N = 2, 3, 4 (one launch: groups of the last N of 4 processes, so group ranks
    differ from global ranks) equals the direct torch.distributed computation and the global
    plain-torch computation (values and gradients); the simulated group equals the gloo run."""
    ssmshard.launch(comm_worker.gloo_ranks, max(WORLDS), fresh_seed, str(tmp_path), WORLDS, backend="gloo")
    for world in WORLDS:
        simulated = comm.run_simulated(comm_worker.exercise, world, "simulated", fresh_seed, group="simulated")
        names = {case.name for case in comm_worker.cases(world)}
        for rank in range(world):
            where = f"world {world} rank {rank} (seed {fresh_seed})"
            report = json.loads((tmp_path / f"world{world}_rank{rank}.json").read_text())
            assert {key.rsplit(".", 1)[0] for key in report["global"]} == names
            for oracle in ("global", "direct"):
                bad = {k: e for k, e in report[oracle].items() if not e <= TOL}
                assert not bad, f"{where} vs the {oracle} oracle: {bad}"
            on_gloo = torch.load(tmp_path / f"world{world}_rank{rank}.pt")
            assert on_gloo.keys() == simulated[rank].keys()
            for key, value in on_gloo.items():
                assert simulated[rank][key].shape == value.shape, key
                assert rel_err(simulated[rank][key], value) <= TOL, f"simulated {key} {where}"


OP_OUTPUTS = ["reduce_scatter", "all_gather", "all_gather_partial_grad", "all_gather_padded", "all_to_all",
              "all_reduce", "tp_copy", "broadcast", "reduce", "shift"]


class _EveryOp(torch.nn.Module):
    def forward(self, x, heads):  # x (B, L, H); heads (B, L, 2N, H); returns OP_OUTPUTS in order
        group = "symbolic_tp"
        scattered = comm.reduce_scatter(x, 1, group)  # (B, ceil(L/N), H)
        return (scattered, comm.all_gather(scattered, 1, group, x.shape[1]),
                comm.all_gather_partial_grad(scattered, 1, group, x.shape[1]), comm.all_gather(scattered, 1, group),
                comm.all_to_all(heads, 2, 1, group), comm.all_reduce(x, group), comm.tp_copy(x, group),
                comm.broadcast(x, 0, group), comm.reduce(x, 0, group), comm.shift(x, group, -1))


def test_fake_propagation_keeps_batch_and_sequence_symbolic():
    """torch.export with dynamic batch and sequence dims (Dim.AUTO, as capture uses), the group
    only declared (as passes see it): each op's output sizes are expressions of the input
    symbols, right for every size, and no dim is specialized."""
    n = 3
    comm.declare_group_size("symbolic_tp", n)
    dynamic = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    args = (torch.randn(2, 7, 4), torch.randn(2, 7, 2 * n, 4))
    program = torch.export.export(_EveryOp(), args, strict=False, dynamic_shapes=(dynamic, dynamic))
    placeholders = [node.meta["val"] for node in program.graph.nodes if node.op == "placeholder"]
    symbols = [[size.node.expr for size in val.shape[:2]] for val in placeholders]  # [[B, L] of x, of heads]
    assert all(sym.is_Symbol for pair in symbols for sym in pair), symbols
    assert all(vr.upper > 10 ** 9 for vr in program.range_constraints.values()), program.range_constraints
    out_nodes = next(node for node in program.graph.nodes if node.op == "output").args[0]
    assert len(out_nodes) == len(OP_OUTPUTS)

    def expected(name, b, length):
        c = -(-length // n)
        return {"reduce_scatter": (b, c, 4), "all_gather_padded": (b, n * c, 4),
                "all_to_all": (b, n * length, 2, 4)}.get(name, (b, length, 4))

    for name, node in zip(OP_OUTPUTS, out_nodes):
        shape = node.meta["val"].shape
        assert any(isinstance(size, torch.SymInt) for size in shape[:2]), (name, shape)
        for b, length in ((1, 1), (2, 2), (5, 3), (3, 4), (4, 100)):
            values = {sym: value for pair in symbols for sym, value in zip(pair, (b, length))}
            sizes = tuple(int(size.node.expr.subs(values)) if isinstance(size, torch.SymInt) else size
                          for size in shape)
            assert sizes == expected(name, b, length), (name, b, length, shape)


def test_unknown_group_size_is_an_error():
    with pytest.raises(RuntimeError, match="declare_group_size"):
        comm.world_of("never_declared_group")
    with pytest.raises(RuntimeError, match="not registered"):
        comm.all_reduce(torch.ones(2), "never_declared_group")


def _all_reduce_everywhere_but(bad_rank, misbehave):
    def rank_main(rank, world):
        if rank == bad_rank:
            return misbehave()
        return comm.all_reduce(torch.ones(3), "world")
    return rank_main


def _boom():
    raise ValueError("boom")


def _sleep():
    time.sleep(1.5)
    return comm.all_reduce(torch.ones(3), "world")


@pytest.mark.parametrize("misbehave, raised, cause", [
    (_boom, ValueError, "rank 1 raised ValueError: boom"),
    (lambda: None, comm.SimulatedGroupError, "rank\\(s\\) \\[1\\] returned from"),  # skips the collective
    (lambda: comm.broadcast(torch.ones(3), 0, "world"), comm.SimulatedGroupError, "different collectives"),
    (lambda: comm.all_reduce(torch.ones(4), "world"), comm.SimulatedGroupError, "different collectives"),
    (_sleep, comm.SimulatedGroupError, "timed out after 0.3 s: rank\\(s\\) \\[1\\] never arrived"),
])
def test_a_failing_rank_makes_the_others_raise_promptly(misbehave, raised, cause):
    started = time.monotonic()
    with pytest.raises(raised) as info:
        comm.run_simulated(_all_reduce_everywhere_but(1, misbehave), 3, timeout=0.3 if misbehave is _sleep else 60)
    waited = time.monotonic() - started
    assert waited < (3 if misbehave is _sleep else 1), waited
    messages = [str(info.value)] + list(getattr(info.value, "__notes__", []))
    others = [m for m in messages if "all_reduce" in m and "cannot complete" in m]
    assert len(others) >= 2 and all(re.search(cause, m) for m in others), messages


def test_rank_of_outside_a_rank_thread_is_an_error():
    group = comm.SimulatedGroup(2)
    with comm.registered("unbound_simulated", group):
        with pytest.raises(comm.SimulatedGroupError, match="not a rank"):
            comm.rank_of("unbound_simulated")
        assert comm.world_of("unbound_simulated") == 2
        with group.bind(1):
            assert comm.rank_of("unbound_simulated") == 1


def test_simulated_barrier_waits_for_every_rank_and_checks_its_label():
    arrived = []

    def meet(rank, world):
        time.sleep(0.05 * rank)  # the later ranks arrive last
        arrived.append(rank)
        comm.backend_of("world").barrier("here")
        return sorted(arrived)  # every rank's arrival is in before any leaves

    assert comm.run_simulated(meet, 3) == [[0, 1, 2]] * 3

    def disagree(rank, world):
        comm.backend_of("world").barrier("here" if rank else "there")

    with pytest.raises(comm.SimulatedGroupError, match="met at different points: there \\(rank 0\\), here"):
        comm.run_simulated(disagree, 2, timeout=60)
