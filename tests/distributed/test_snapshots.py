"""In-memory snapshots with a copy on a partner host (checkpoint/snapshot.py), on forked gloo ranks that play
three hosts (each rank's ELASTIC_TRAINER_HOST names its host: its own shared-memory folder and server).

4 ranks on hosts a, a, b, c (dp2 x tp2) train 3 steps, a snapshot after each, a durable save after step 2;
then the world is gone without saving (as after a failure in step 4). Each host keeps its own files and those
of the host before it in the ring a -> b -> c -> a, and only the newest generation. Then:
- host b is lost (its memory gone) and a byte of c's own file flipped: 3 ranks on c, a, a (pp3) find step 3
  whole (b's files from c's copy, c's damaged file, said in one line, from a's copy, the record from any host),
  read it resharded, and train steps 4-6 on the trajectory of one uninterrupted single-process run (1e-5
  relative); no durable checkpoint is read;
- hosts b and c are lost together (b's files are on b and c only): the ranks on a say so in one line and
  resume from the durable checkpoint of step 2, also on the trajectory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig, memory, snapshot
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job
from elastic_trainer.train.metrics import MetricsLog
from tests.distributed.test_handover_memory import HOST_A, HOST_B, HOST_C, MODEL, close, config, reference

HOSTS = [HOST_A, HOST_A, HOST_B, HOST_C]


@pytest.fixture(scope="module")
def tokens(data_cache):
    from elastic_trainer.config import TrainConfig
    from elastic_trainer.data.corpus import load

    return load(TrainConfig(data_cache=data_cache), quiet=True).train


def snapshotting(rank, world, layout, ckpt, hosts, tokens, steps, durable_step):
    """Train `steps` steps with a snapshot after each (as `Job.fit` takes them) and a durable save after
    `durable_step`; leave without saving. The losses and each snapshot's stats."""
    os.environ["ELASTIC_TRAINER_HOST"] = hosts[rank]
    cfg = CheckpointConfig(dir=ckpt, memory_snapshot_every=1)
    with Job(MODEL, config(steps + 3), layout, torch.device("cpu"), ckpt=cfg, tokens=tokens) as job:
        losses = []
        for _ in range(steps):
            losses.append(job.trainer.train_step()["loss"])
            if job.trainer.step == durable_step:
                job.checkpointer.save(job.trainer, blocking=True)
            assert job.checkpointer.snapshot_due(job.trainer.step)
            job.checkpointer.snapshots.take(job.trainer)
        job.checkpointer.wait()
        return losses, job.checkpointer.snapshots.history


def resuming(rank, world, layout, ckpt, hosts, tokens, until, counts):
    os.environ["ELASTIC_TRAINER_HOST"] = hosts[rank]
    os.environ["ELASTIC_TRAINER_TEST_COUNTS"] = counts
    cfg = CheckpointConfig(dir=ckpt, memory_snapshot_every=1)
    log = MetricsLog(None, enabled=rank == 0)  # the checkpointer's lines on stdout
    with Job(MODEL, config(until), layout, torch.device("cpu"), ckpt=cfg, tokens=tokens, log=log) as job:
        loaded = str(job.loaded.path)
        losses = [job.trainer.train_step()["loss"] for _ in range(until - job.trainer.step)]
    return loaded, losses


def test_partner_of_is_the_host_before_in_a_ring():
    assert snapshot.partner_of(["a", "a", "b", "c"], "a") == "c"
    assert snapshot.partner_of(["a", "a", "b", "c"], "b") == "a"
    assert snapshot.partner_of(["a", "a", "b", "c"], "c") == "b"
    assert snapshot.partner_of(["b", "a"], "a") == "b" and snapshot.partner_of(["b", "a"], "b") == "a"
    assert snapshot.partner_of(["a", "a"], "a") is None


def test_a_lost_host_resumes_from_its_partners_copy_in_a_new_layout(tmp_path, monkeypatch, tokens, capfd):
    shm = tmp_path / "shm"
    monkeypatch.setenv(memory.SHM_ENV, str(shm))
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(snapshotting, 4, Layout(2, 2, 1, 4, 1), ckpt, HOSTS, tokens, 3, 2)
    losses, history = first[0]
    assert [s.step for s in history] == [1, 2, 3] and not any(s.error for s in history)
    root = memory.host_root(ckpt).parent
    held = {
        h: {p.name: sorted(f.name for f in p.iterdir()) for p in (root / h).iterdir()} for h in (HOST_A, HOST_B, HOST_C)
    }
    assert all(list(folders) == [next(iter(held[HOST_A]))] for folders in held.values()), held  # one generation
    assert next(iter(held[HOST_A])).startswith("step-00000003-"), held
    own_and_partner = {  # the ring a -> b -> c -> a: each host keeps the files of the one before it
        HOST_A: ["__0_0.distcp", "__1_0.distcp", "__3_0.distcp", ".metadata", "state.json"],
        HOST_B: ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata", "state.json"],
        HOST_C: ["__2_0.distcp", "__3_0.distcp", "state.json"],
    }
    assert {h: next(iter(v.values())) for h, v in held.items()} == {h: sorted(f) for h, f in own_and_partner.items()}
    kept = tmp_path / "kept"
    shutil.copytree(shm, kept, symlinks=True)
    want = reference(tokens, 6)

    shutil.rmtree(root / HOST_B)  # host b lost: 3 ranks on c, a, a in a pipeline of 3
    (state,) = (root / HOST_C).iterdir()
    with open(state / "__3_0.distcp", "r+b") as f:  # and a flipped byte in c's own file
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    counts = str(tmp_path / "counts.txt")
    capfd.readouterr()
    second = run_ranks(resuming, 3, Layout(1, 1, 3, 2, 4), ckpt, [HOST_C, HOST_A, HOST_A], tokens, 6, counts)
    assert all(loaded.startswith("memory:step-00000003-") for loaded, _ in second), second
    assert close(losses + second[0][1], want)
    assert not Path(counts).exists()  # no durable checkpoint was read
    out = capfd.readouterr().out
    assert (
        f"{HOST_C}'s copy of __3_0.distcp of the state of step 3 in memory does not match its checksum; it is not read"
    ) in out, out  # read from a's copy

    shutil.rmtree(shm)  # hosts b and c lost together: b's files are nowhere
    shutil.copytree(kept, shm, symlinks=True)
    shutil.rmtree(root / HOST_B)
    shutil.rmtree(root / HOST_C)
    capfd.readouterr()
    third = run_ranks(resuming, 2, Layout(1, 2, 1, 8, 1), ckpt, [HOST_A, HOST_A], tokens, 6, counts)
    assert all(Path(loaded).name == "step-00000002" for loaded, _ in third), third
    assert close(losses[:2] + third[0][1], want)
    out = capfd.readouterr().out
    assert (
        f"the state of step 3 in memory cannot be read: no host of this world holds the files of {HOST_B} "
        "(a host and its partner lost together); reading the newest durable checkpoint instead"
    ) in out, out


def short_of_memory(rank, world, ckpt, tokens):
    os.environ["ELASTIC_TRAINER_HOST"] = [HOST_A, HOST_B][rank]
    snapshot.available_bytes = lambda: (1 << 40, 1 << 20)  # 1 MiB free in the shared-memory folder
    cfg = CheckpointConfig(dir=ckpt, memory_snapshot_every=1)
    log = MetricsLog(None, enabled=rank == 0)
    with Job(MODEL, config(3), Layout(2, 1, 1, 4, 1), torch.device("cpu"), ckpt=cfg, tokens=tokens, log=log) as job:
        job.fit(until=2)
        return job.checkpointer.snapshot_due(2), job.checkpointer.snapshots.history


def test_snapshots_that_would_not_fit_in_memory_are_off_in_one_line(tmp_path, monkeypatch, tokens, capfd):
    monkeypatch.setenv(memory.SHM_ENV, str(tmp_path / "shm"))
    due, history = run_ranks(short_of_memory, 2, str(tmp_path / "ckpt"), tokens)[0]
    assert not due and history == []
    out = capfd.readouterr().out
    line = "[checkpoint] --memory-snapshot-every 1: no snapshots in memory: localhost would hold ~0.08 GiB of them"
    assert line in out, out
    assert "(2 generations of its own and its partner's state)" in out and "0.00 GiB free in its shared-memory" in out
