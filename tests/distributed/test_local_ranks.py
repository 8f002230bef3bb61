"""Forked gloo ranks (parallel/local_ranks.py), which calibrate, the benchmarks and the distributed tests use:
results by rank, torchrun's variables, and a failure blamed on the right rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.parallel.local_ranks import _failure_report, run_ranks


def _report(rank, world, scale, *, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # daemonic: a rank dies with the process that forked it rather than keep it from exiting
    return (
        rank * scale + offset,
        t.item(),
        env,
        torch.get_num_threads(),
        dist.get_world_size(),
        world,
        mp.current_process().daemon,
    )


def test_results_come_back_by_rank_with_torchrun_s_variables():
    got = run_ranks(_report, 3, 10, offset=1)
    assert [g[0] for g in got] == [1, 11, 21] and {g[1] for g in got} == {3.0}
    assert [g[2] for g in got] == [
        {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3"} for r in range(3)
    ]
    assert {(g[3], g[4], g[5], g[6]) for g in got} == {(1, 3, 3, True)}


def _fail_on(rank, world, bad):
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    dist.barrier()  # the others wait in a collective, as a real job's would
    return rank


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError) as err:
        run_ranks(_fail_on, 3, 1)
    text = str(err.value)
    assert text.splitlines()[0] == "rank 1 of 3 failed with exit code 1"
    assert "--- rank 1:\nTraceback (most recent call last):" in text and "ValueError: boom on 1" in text


def _sleep(rank, world):
    time.sleep(30)


def test_ranks_that_do_not_finish_are_killed_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^2 ranks did not finish within 0.5 s$"):
        run_ranks(_sleep, 2, timeout=0.5)
    assert time.monotonic() - t0 < 20


def test_the_report_blames_a_signalled_rank_first_then_lists_every_error(tmp_path):
    for r, text in [(0, "zero's traceback\n"), (2, "two's traceback\n"), (3, "three's\n")]:
        (tmp_path / f"error{r}.txt").write_text(text)
    # rank 3 was killed by SIGKILL; ranks 0 and 2 then failed in a collective; rank 1 finished
    assert _failure_report(str(tmp_path), 4, {0: 1, 1: 0, 2: 1, 3: -signal.SIGKILL}) == (
        "rank 3 of 4 failed with exit code -9 (killed by signal 9)\n"
        "--- rank 3:\nthree's\n\n--- rank 0:\nzero's traceback\n\n--- rank 2:\ntwo's traceback\n"
    )
    # two signalled: the first; no signal: the first rank that failed, and a rank that exited 0 is no culprit
    assert _failure_report(str(tmp_path), 4, {0: 0, 1: -15, 3: -9}).splitlines()[0] == (
        "rank 1 of 4 failed with exit code -15 (killed by signal 15)"
    )
    (tmp_path / "error0.txt").unlink()  # a rank that exits 0 leaves no error
    assert _failure_report(str(tmp_path), 4, {0: 0, 1: 0, 2: 3, 3: 1}) == (
        "rank 2 of 4 failed with exit code 3\n--- rank 2:\ntwo's traceback\n\n--- rank 3:\nthree's\n"
    )


def _topology(rank, world):
    from elastic_trainer.parallel.agree import gather_topology

    return gather_topology(None).sizes  # started without torchrun's agent: one host


def test_without_group_rank_every_rank_is_on_one_host():
    assert run_ranks(_topology, 3) == [(3,), (3,), (3,)]


def _interface(rank, world):
    return os.environ.get("GLOO_SOCKET_IFNAME"), dist.get_backend()


def test_ranks_use_the_loopback_interface_unless_one_is_set(monkeypatch):
    """gloo on a machine whose hostname does not resolve to a local address needs an interface: the ranks
    default to loopback ("lo")."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert run_ranks(_interface, 2) == [("lo", "gloo"), ("lo", "gloo")]
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # the parent's environment is left alone
