"""The spare-memory sweep against real dead processes (forked, then gone)."""

from __future__ import annotations

import os

from elastic_trainer.checkpoint import memory, spare


def test_the_sweep_removes_only_dead_processes_folders(tmp_path):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: the pid names no process now
    dead, mine = tmp_path / f".spare-{pid}", tmp_path / f".spare-{os.getpid()}"
    for folder in (dead, mine):
        folder.mkdir()
        (folder / "__3_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / "step-00000007-abc").mkdir()  # a state: not the sweep's
    assert spare.sweep(tmp_path) == [dead.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "step-00000007-abc"])


def test_a_durable_commit_on_the_host_sweeps_dead_processes_files(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.SHM_ENV, str(tmp_path / "shm"))
    root = memory.host_root(str(tmp_path / "ckpt"), create=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    (root / f".spare-{pid}").mkdir(parents=True)
    (root / f".spare-{pid}" / "__0_0.distcp").write_bytes(b"x")
    assert memory.drop(str(tmp_path / "ckpt"), 10) == [f".spare-{pid}"]
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").rglob("*.distcp"))
