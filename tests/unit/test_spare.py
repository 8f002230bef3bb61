"""Files allocated ahead for a hand-over (checkpoint/spare.py): their sizes and pages, a failed allocation
that leaves the write to new files, what is removed and what is kept, and the sweep of a dead process's
folder (what `memory.drop` does at every durable commit on a host)."""

from __future__ import annotations

import os

from elastic_trainer.checkpoint import memory, spare


def test_files_are_allocated_at_their_sizes_and_removed(tmp_path):
    sizes = {"__0_0.distcp": 3 << 20, "__0_1.distcp": 4096, "__0_2.distcp": 0}
    allocated = spare.Spares(tmp_path, sizes).start()
    files, waited = allocated.take()
    assert set(files) == set(sizes) and waited >= 0 and allocated.seconds is not None
    assert allocated.bytes == sum(sizes.values())
    for name, path in files.items():
        assert path.parent == tmp_path / f".spare-{os.getpid()}"
        assert path.stat().st_size == sizes[name]
        assert path.stat().st_blocks * 512 >= sizes[name]  # the pages are there, not a sparse file
    allocated.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_allocation_leaves_nothing_and_the_write_makes_new_files(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    allocated = spare.Spares(root, {"__0_0.distcp": 4096}).start()
    assert allocated.take()[0] == {}
    assert allocated.error is not None and "a-file" in allocated.error  # the folder could not be made
    allocated.remove()
    assert root.read_text() == "not a folder"


def test_a_link_left_in_the_folder_is_not_followed(tmp_path):
    """A folder of this pid made earlier (by another process, or someone else) is made anew: nothing in it
    is written through."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    old = tmp_path / "root" / f".spare-{os.getpid()}"
    old.mkdir(parents=True)
    (old / "__0_0.distcp").symlink_to(victim)
    allocated = spare.Spares(tmp_path / "root", {"__0_0.distcp": 8192}).start()
    files, _ = allocated.take()
    assert not files["__0_0.distcp"].is_symlink() and files["__0_0.distcp"].stat().st_size == 8192
    assert victim.read_bytes() == b"keep me"
    assert (old.stat().st_mode & 0o777) == 0o700
    allocated.remove()


def test_the_users_folder_is_made_this_users_only(tmp_path, monkeypatch):
    """What the write and the files prepared ahead both go through (`memory.host_root(create=True)`)."""
    monkeypatch.setenv(memory.SHM_ENV, str(tmp_path / "shm"))
    users = tmp_path / "shm" / f"elastic-trainer-{os.getuid()}"
    users.mkdir(parents=True, mode=0o755)
    root = memory.host_root(str(tmp_path / "ckpt"), create=True)
    assert root.is_dir() and root.parents[1] == users
    assert (users.stat().st_mode & 0o777) == 0o700


def test_a_commit_while_another_world_removes_the_emptied_host_folder(tmp_path, monkeypatch):
    """The stopping world commits its durable copy (`memory.drop`) just as the world that took its state
    removes the host's emptied folder: the folder is gone between its check and its listing (CI saw this
    kill the stopping world's rank 0, whose agent then restarted it beside the next world)."""
    import shutil
    from pathlib import Path

    monkeypatch.setenv(memory.SHM_ENV, str(tmp_path / "shm"))
    root = memory.host_root(str(tmp_path / "ckpt"), create=True)
    listing = Path.iterdir

    def removed_first(self):
        if self == root:
            shutil.rmtree(root)  # the other world's _remove_empty, at the worst moment
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", removed_first)
    assert memory.drop(str(tmp_path / "ckpt"), 10) == []
    assert memory._listing(root, verify=True) == {}


def test_a_file_is_read_from_its_writer_else_from_a_whole_replica():
    """memory._holder: the host that wrote a file when it holds it whole (or the stopping world serves it), else
    any host holding a copy of the recorded size (a snapshot's partner), else None."""
    info = {"bytes": 100, "host": "a"}
    assert memory._holder(info, {"a": 100, "b": 100}, {}) == "a"
    assert memory._holder(info, {"b": 100}, {}) == "b"
    assert memory._holder(info, {"a": 60, "b": 100}, {}) == "b"  # a's own copy cut short
    assert memory._holder(info, {"b": 99, "c": 100}, {}) == "c"
    assert memory._holder(info, {"b": 99}, {}) is None
    assert memory._holder(info, {}, {"a": "a:1234"}) == "a"
