"""``ssmshard.launch``: arguments checked before anything starts, and no run that hangs.

The hang tests run a small script calling ``ssmshard.launch`` in a real subprocess (the
launcher) with short collective timeouts, and watch the ranks' own process ids.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ssmshard
from ssmshard.runtime.launch import collective_timeout

REPO = pathlib.Path(ssmshard.__file__).resolve().parents[1]


def _rank_fn(rank, world):
    pass


@pytest.mark.parametrize("nprocs", [0, -2, 2.0, True, "2", None])
def test_launch_rejects_a_bad_rank_count(nprocs):
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        ssmshard.launch(_rank_fn, nprocs)


def test_launch_rejects_what_cannot_reach_the_ranks():
    with pytest.raises(TypeError, match="fn must be callable"):
        ssmshard.launch("not a function", 2)
    with pytest.raises(TypeError, match="pickling"):
        ssmshard.launch(lambda rank, world: None, 2)
    with pytest.raises(TypeError, match="pickling"):
        ssmshard.launch(_rank_fn, 2, lambda: None)  # an argument that cannot be pickled


def test_launch_rejects_a_bad_backend_and_timeout(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        ssmshard.launch(_rank_fn, 2, backend="mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs one CUDA device per rank: nprocs=64"):
            ssmshard.launch(_rank_fn, 64, backend="nccl")
    for bad in (0, -1, float("inf"), "soon"):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            ssmshard.launch(_rank_fn, 2, timeout=bad)
    monkeypatch.setenv("SSMSHARD_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="SSMSHARD_TIMEOUT must be a positive number"):
        ssmshard.launch(_rank_fn, 2)
    monkeypatch.setenv("SSMSHARD_TIMEOUT", "12.5")
    assert collective_timeout(None, "gloo") == 12.5 and collective_timeout(7, "gloo") == 7.0
    monkeypatch.delenv("SSMSHARD_TIMEOUT")
    assert collective_timeout(None, "gloo") == 300.0


def test_a_nccl_group_for_weights_off_the_gpu_is_a_clear_error(monkeypatch):
    """parallelize's check before any collective: NCCL carries CUDA tensors only (torch's own error,
    from inside the first collective, names neither NCCL nor the weights' device). The check reads
    torch's backend config: a group started without a backend on a machine with a GPU reports
    'undefined' to dist.get_backend and has NCCL only ('cuda:nccl')."""
    from ssmshard.runtime import distributed

    monkeypatch.setattr(distributed.dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ValueError, match=r"backends \(nccl for cuda\) carry no cpu tensors, but this rank's "
                                         r"weights are on cpu"):
        distributed.check_backend_carries(None, torch.device("cpu"))
    distributed.check_backend_carries(None, torch.device("cuda", 0))  # no device touched: only its type is read
    for config in ("cpu:gloo,cuda:gloo", "cpu:gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(distributed.dist, "get_backend_config", lambda group=None, c=config: c)
        distributed.check_backend_carries(None, torch.device("cpu"))


def test_backends_by_device_reads_a_real_group():
    """A real one-rank gloo group: torch's config names gloo for CPU tensors."""
    from ssmshard.comm.groups import backends_by_device

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert backends_by_device()["cpu"] == "gloo"
    finally:
        torch.distributed.destroy_process_group()


# A launcher script: rank 0 runs a collective; what rank 1 does instead is the scenario.
# Each rank writes its pid, so the test can check that no rank outlives the run.
SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch
    import torch.distributed as dist
    import ssmshard
    from ssmshard.comm import all_reduce, register_group

    def ready(rank, pid_dir):  # about to run (or skip) the collective: the test's clock starts
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def rank_fn(rank, world, scenario, pid_dir):
        if scenario == "skip_dm":  # rank 1 skips a sharded forward that rank 0 runs
            model = ssmshard.build_small_model("mamba2")
            dm = ssmshard.parallelize(model, ssmshard.Plan(tp=world))
            ready(rank, pid_dir)
            if rank == 0:
                dm(torch.zeros(1, 4, dtype=torch.long))
            return
        register_group("world", dist.group.WORLD)
        ready(rank, pid_dir)
        if rank == 0:
            all_reduce(torch.ones(3), "world")
        else:
            time.sleep(600)  # alive, but never calls the collective

    if __name__ == "__main__":
        scenario, pid_dir, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
        ssmshard.launch(rank_fn, 2, scenario, pid_dir, timeout=timeout, backend="gloo")
''')


@pytest.fixture
def start_launcher(tmp_path):
    """Start the launcher script; at the end, kill whatever it left running (a hang fails the test,
    it must not outlive it)."""
    started = []

    def start(scenario, timeout):
        script = tmp_path / "launcher.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        launcher = subprocess.Popen([sys.executable, str(script), scenario, str(tmp_path), str(timeout)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()
        launcher.communicate()
    for pid_file in tmp_path.glob("rank*.pid"):
        if pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _rank_pids(tmp_path, wait_s=300):  # start-up (imports, capture) on a loaded machine
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        files = sorted(tmp_path.glob("rank*.pid"))
        if len(files) == 2 and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError("the ranks did not start")


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("scenario", ["skip_dm", "skip_all_reduce"])
def test_a_rank_skipping_a_collective_ends_the_run_with_the_waiting_rank_named(tmp_path, start_launcher, scenario):
    timeout = 4.0
    launcher = start_launcher(scenario, timeout)
    pids = _rank_pids(tmp_path)
    started = time.monotonic()
    out, _ = launcher.communicate(timeout=timeout + 30)
    elapsed = time.monotonic() - started
    assert launcher.returncode != 0, out
    # The launcher's error starts with the waiting rank's, which names itself and the collective.
    assert re.search(r"LaunchError: rank 0 of 2 failed; the other ranks were stopped: CollectiveError: rank 0 "
                     r"waited in all_reduce over process group '\w+' \(2 ranks\) and it failed\.", out), out
    assert "a wait is bounded by the process group's timeout (4 s)" in out, out
    if scenario == "skip_all_reduce":
        assert "Timed out" in out, out
    else:  # rank 1 exited: gloo reports the closed socket as "closed" or "reset", by timing
        assert re.search(r"Connection (closed|reset) by peer", out), out
    if scenario == "skip_all_reduce":  # rank 1 is alive: the timeout ends the wait
        assert elapsed >= timeout - 1, (elapsed, out)
    assert not _wait_gone(pids, 5)


# SIGKILL: the launcher cannot stop its ranks; each rank sees the launcher's end of a pipe
# close and ends itself (a rank's parent is the fork server, not the launcher).
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, start_launcher, signum):
    launcher = start_launcher("skip_all_reduce", 300)
    pids = _rank_pids(tmp_path)
    time.sleep(0.5)  # rank 0 is in the all_reduce, rank 1 asleep
    sent = time.monotonic()
    launcher.send_signal(signum)
    # Generous bounds (ranks get STOP_GRACE_S before SIGKILL): on a loaded 2-core machine the
    # launcher's and the ranks' interpreter teardown alone took over 10 s.
    launcher.communicate(timeout=30)
    assert not _wait_gone(pids, 30 - (time.monotonic() - sent)), "a rank outlived its launcher"
    assert launcher.returncode != 0
