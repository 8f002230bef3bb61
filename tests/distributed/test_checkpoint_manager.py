"""The checkpoint manager on two forked gloo ranks: who logs, who verifies, and a failed commit heard by every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, storage
from elastic_trainer.config import CheckpointError
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import Trainer
from tests.unit.test_checkpoint_manager_unit import CFG, CPU, MODEL, TOKENS, B, Log


def _two_ranks(rank, world, root: str, folder: str) -> dict:
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=root), log=log)
    hashed = []
    digest = storage.file_digest

    def watched_digest(path, *args, **kwargs):
        hashed.append(Path(path).name)
        return digest(path, *args, **kwargs)

    storage.file_digest = watched_digest
    try:
        verdict = ck.verify(Path(folder))
    finally:
        storage.file_digest = digest
    try:
        ck.load_first(None, [Path(root) / "missing"])
        error = None
    except CheckpointError as e:
        error = str(e)
    calls = [
        (args, {k: "sys.stderr" if v is sys.stderr else v for k, v in kwargs.items()}) for args, kwargs in log.calls
    ]
    out = {
        "run_id": ck.run_id,
        "log": calls,
        "hashed": hashed,
        "verdict": verdict,
        "error": error,
        "candidates": ck.candidates(),
    }
    ck.close()
    return out


def test_on_two_ranks_rank_zero_logs_and_each_rank_verifies_its_share(tmp_path):
    """A hand-made committed folder of 5 files; rank r hashes every 2nd file in name order from the r-th."""
    tmp = tmp_path / "made"
    dcp.save({"x": torch.arange(6)}, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp / name).write_text(name)
    folder = storage.commit(tmp, 4, {})
    files = sorted(storage.read_manifest(folder))
    assert files == [".metadata", "__0_0.distcp", "a.txt", "b.txt", "c.txt"]
    r0, r1 = run_ranks(_two_ranks, 2, str(tmp_path), str(folder))
    assert r0["run_id"] == r1["run_id"]
    assert sorted(r0["hashed"]) == [".metadata", "a.txt", "c.txt"] and sorted(r1["hashed"]) == ["__0_0.distcp", "b.txt"]
    assert r0["verdict"] is None and r1["verdict"] is None
    missing = tmp_path / "missing"
    skipped = f"{missing} is not a checkpoint folder"
    assert r0["log"] == [((f"[checkpoint] skipping missing: {skipped}",), {"file": "sys.stderr", "flush": True})]
    assert r1["log"] == []
    assert r0["error"] == r1["error"] == str(storage.none_resumable(tmp_path, [skipped]))
    assert r0["candidates"] == r1["candidates"] == [folder]


def _rank_zero_commit_fails(rank, world, root: str) -> str:
    """Each rank saves; rank 0's pruning (after its commit) raises something that is not an OSError."""
    if rank == 0:

        def broken(*args, **kwargs):
            raise ValueError("keep must be a number")

        storage.remove_old = broken  # this forked rank only
    layout = Layout(2, 1, 1, B // 2, 1)
    t = Trainer(MODEL, CFG, layout, build_mesh(layout, "cpu"), CPU, tokens=TOKENS)
    ck = Checkpointer(CheckpointConfig(dir=root), log=Log())
    try:
        ck.save(t)
        return "saved"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ck.close()


def test_any_failure_of_rank_zero_s_commit_reaches_every_rank(tmp_path):
    """The other ranks wait for rank 0's verdict: an error of any kind must reach them, not leave them waiting."""
    got = run_ranks(_rank_zero_commit_fails, 2, str(tmp_path), timeout=60)
    assert got == ["CheckpointError: committing step 0 failed: ValueError: keep must be a number"] * 2
