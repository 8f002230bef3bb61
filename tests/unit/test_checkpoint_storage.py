"""Checkpoint files: atomic commit, discovery, retention, integrity, and loading that never runs code."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import storage
from elastic_trainer.config import CheckpointError


def fake_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    tmp = storage.new_tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / "meta.json").write_text(json.dumps({"step": step}))
    return storage.commit(tmp, step, storage.describe_files(tmp, ["__0_0.distcp"]))


def test_commit_makes_checkpoint_visible_with_manifest_and_latest(tmp_path):
    final = fake_checkpoint(tmp_path, 7)
    assert final.name == "step-00000007"
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    manifest = json.loads((final / "manifest.json").read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", "meta.json"} and manifest["hash"] == "xxh3_128"
    assert manifest["files"]["__0_0.distcp"]["bytes"] == len(b"weights")
    storage.verify(final)
    assert not any(p.name.startswith(storage.TMP_PREFIX) for p in tmp_path.iterdir())


def test_uncommitted_and_foreign_folders_are_invisible(tmp_path):
    fake_checkpoint(tmp_path, 2)
    (storage.new_tmp_dir(tmp_path, 4)).mkdir()  # a save that crashed
    (tmp_path / "step-12").mkdir()  # not our naming
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in storage.complete_checkpoints(tmp_path)] == ["step-00000002"]
    storage.remove_abandoned(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.txt", "step-00000002", "step-12"]


def test_retention_keeps_newest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        fake_checkpoint(tmp_path, step)
    removed = storage.remove_old(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step-00000003", "step-00000002", "step-00000001"]
    assert [p.name for p in storage.complete_checkpoints(tmp_path)] == ["step-00000005", "step-00000004"]
    assert storage.remove_old(tmp_path, keep=0) == []


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(b"weightz"), "fails its xxh3_128 checksum (corrupted)"),
    (lambda f: f.write_bytes(b"weig"), "has 4 bytes, expected 7 (truncated?)"),
    (lambda f: f.unlink(), "is missing"),
])
def test_verify_reports_damage_in_one_line(tmp_path, damage, message):
    final = fake_checkpoint(tmp_path, 3)
    damage(final / "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        storage.verify(final)
    assert message in str(err.value) and "\n" not in str(err.value)


class Evil:
    """Unpickling this runs code: it creates the file named `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_without_running_code(tmp_path):
    dcp.save({"t": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil(str(marker))))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        storage.read_dcp_metadata(tmp_path / ".metadata")
    with pytest.raises(BaseException) as err:  # DCP wraps our error in a BaseException subclass
        dcp.load({"t": torch.zeros(3)}, storage_reader=storage.SafeReader(str(tmp_path)),
                 planner=storage.SafeLoadPlanner(), no_dist=True)
    assert "refusing to load posix.system" in str(err.value) + "".join(map(str, err.value.args))
    assert not marker.exists()
    # DCP's own reader would have run it: the test would catch a regression to it
    with pytest.raises(BaseException):
        dcp.load({"t": torch.zeros(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert marker.exists()


def test_crafted_non_tensor_item_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    dcp.save({"t": torch.ones(3), "lr": Evil(str(marker))}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert not marker.exists()
    state = {"t": torch.zeros(3), "lr": 0.1}
    with pytest.raises(BaseException) as err:
        dcp.load(state, storage_reader=storage.SafeReader(str(tmp_path / "ck")),
                 planner=storage.SafeLoadPlanner(), no_dist=True)
    assert "refusing unsafe item 'lr'" in str(err.value) + "".join(map(str, err.value.args))
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # DCP's default planner runs it
    assert marker.exists()


def test_safe_loading_still_reads_plain_values(tmp_path):
    dcp.save({"t": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"t": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(state, storage_reader=storage.SafeReader(str(tmp_path)), planner=storage.SafeLoadPlanner(),
             no_dist=True)
    assert torch.equal(state["t"], torch.arange(4.0)) and state["lr"] == 0.5 and tuple(state["betas"]) == (0.9, 0.95)
