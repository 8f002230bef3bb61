"""checkpoint/manager.py's Checkpointer in this process, on a gloo process group of one (and a few checks on two
forked ranks): where and how a save is committed, what it reports and logs, keep-N pruning, asynchronous saves
and their errors, due() by step and by interval, the candidates, verification and the resume choices of a load.

The expectations come from the module's and the methods' docstrings and from storage.py's documented names
(step-NNNNNNNN folders, `latest`, manifest.json, the one-line reasons), written out by hand. The clock the
checkpointer reads (its module's `time`) is replaced by one that only moves when a test moves it, so the
durations it reports are known exactly; the torch.distributed collectives are watched to check that every
checkpoint collective runs on the checkpointer's own process group, as the module docstring says.
"""

from __future__ import annotations

import dataclasses
import fractions
import gc
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, LoadStats, SaveStats, manager, storage
from elastic_trainer.checkpoint import state as ckpt_state
from elastic_trainer.config import CheckpointError, ConfigError, ModelConfig, TrainConfig
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import Trainer

MODEL = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=16, name="micro")
B, T = 4, 8
CFG = TrainConfig(global_batch=B, seq_len=T, steps=5, seed=3, lr=1e-3, warmup_steps=2, data=("no-such-corpus.txt",))
LAYOUT = Layout(1, 1, 1, B, 1)
CPU = torch.device("cpu")
TOKENS = np.random.default_rng(1).integers(0, MODEL.vocab_size, 64 * T + 1).astype(np.uint16)
FILES = [".metadata", "__0_0.distcp", "manifest.json", "meta.json"]  # one rank's checkpoint (storage docstring)
HASH_FAIL = "fails its xxh3_128 checksum (corrupted)"
COLLECTIVES = (
    "broadcast_object_list",
    "gather_object",
    "all_gather_object",
    "scatter_object_list",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce",
)


class Clock:
    """Stands in for the manager module's `time`: reads `now` for both clocks; tests move it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(manager, "time", c)
    return c


class Log:
    """A print-like log that records its calls."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


class Collectives:
    """Records the `group` of every torch.distributed collective called while `on`."""

    def __init__(self):
        self.on = False
        self.groups: list[tuple[str, object]] = []

    def all_on(self, pg) -> bool:
        return bool(self.groups) and all(g is pg for _, g in self.groups)


@pytest.fixture
def collectives(monkeypatch) -> Collectives:
    spy = Collectives()
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            if spy.on:
                spy.groups.append((_name, kwargs.get("group", "positional or default")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)
    return spy


def trainer(cfg: TrainConfig = CFG, steps: int = 0) -> Trainer:
    t = Trainer(MODEL, cfg, LAYOUT, build_mesh(LAYOUT, "cpu"), CPU, tokens=TOKENS)
    for _ in range(steps):
        t.train_step()
    return t


def weights(t: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in t.engine.model.state_dict().items()}


def names(root) -> list[str]:
    return [p.name for p in storage.complete_checkpoints(root)]


def saved_line(step: int, folder: Path, seconds: str = "0.00", note: str = "") -> tuple[tuple, dict]:
    return (f"[checkpoint] step {step} saved to {folder} in {seconds} s{note}",), {"flush": True}


# -- two ranks ------------------------------------------------------------------------------------


# -- construction ---------------------------------------------------------------------------------


def test_construction_makes_the_root_and_starts_with_nothing_saved(group, tmp_path, collectives):
    root = tmp_path / "a" / "b" / "ck"  # parents are made too
    collectives.on = True
    ck = Checkpointer(CheckpointConfig(dir=str(root)), log=Log())
    collectives.on = False
    try:
        assert root.is_dir() and list(root.iterdir()) == []
        assert ck.root == root and ck.rank == 0 and ck.world == 1
        assert ck.last_saved_step is None and ck.history == []
        # the id in this run's temporary folder names: 8 hex digits like storage's own random one (new_tmp_dir)
        assert re.fullmatch(r"[0-9a-f]{8}", ck.run_id)
        assert dist.get_backend(ck.pg) == "gloo" and ck.pg is not dist.group.WORLD
        assert collectives.all_on(ck.pg)
    finally:
        ck.close()


def test_the_checkpoint_group_is_gloo_whatever_the_default_backend(tmp_path, monkeypatch):
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=Log())
        assert dist.get_backend(ck.pg) == "gloo" and dist.get_backend() == "fake"
        ck.close()
    finally:
        dist.destroy_process_group()
        gc.collect()


# -- due ------------------------------------------------------------------------------------------


def test_due_by_step_every_save_every_steps(group, tmp_path, clock):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), save_every=3), log=Log())
    try:
        assert [s for s in range(1, 13) if ck.due(s)] == [3, 6, 9, 12]
        clock.now += 1e6  # without an interval the clock plays no part
        assert [s for s in range(1, 13) if ck.due(s)] == [3, 6, 9, 12]
    finally:
        ck.close()


def test_due_by_interval_counts_from_construction_then_from_the_last_save(group, tmp_path, clock):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), save_interval_s=30.0), log=Log())
    try:
        clock.now = 1029.5
        assert not ck.due(1) and not ck.due(3)
        clock.now = 1030.0  # exactly the interval: due
        assert ck.due(1) and ck.due(2)
        t = trainer(steps=1)
        ck.save(t)  # at 1030
        clock.now = 1059.0
        assert not ck.due(2)
        clock.now = 1060.0
        assert ck.due(2)
    finally:
        ck.close()


def test_due_by_step_or_by_interval(group, tmp_path, clock):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), save_every=2, save_interval_s=10.0), log=Log())
    try:
        assert [s for s in range(1, 6) if ck.due(s)] == [2, 4]
        clock.now += 10.0
        assert [s for s in range(1, 6) if ck.due(s)] == [1, 2, 3, 4, 5]
    finally:
        ck.close()


def test_nothing_is_due_without_save_every_or_interval(group, tmp_path, clock):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=Log())
    try:
        clock.now += 1e9
        assert [s for s in range(0, 6) if ck.due(s)] == []
    finally:
        ck.close()


# -- save -----------------------------------------------------------------------------------------


def test_a_blocking_save_is_committed_before_it_returns(group, tmp_path, clock, collectives):
    root = tmp_path / "ck"
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(root)), log=log)
    t = trainer(steps=1)
    try:
        collectives.on = True
        stats = ck.save(t)
        collectives.on = False
        folder = root / "step-00000001"
        # the clock stood still: no time passed, and a synchronous save stalls for all of it
        assert stats == SaveStats(step=1, stall_s=0.0, total_s=0.0, path=str(folder))
        assert ck.history == [stats] and ck.history[0] is stats and ck.last_saved_step == 1
        assert names(root) == ["step-00000001"] and sorted(os.listdir(folder)) == FILES
        assert (root / "latest").read_text() == "step-00000001\n"
        storage.verify(folder)  # the manifest covers every file
        assert json.loads((folder / "meta.json").read_text())["step"] == 1
        assert log.calls == [saved_line(1, folder)]
        assert collectives.all_on(ck.pg)
    finally:
        ck.close()


def test_the_log_line_reports_the_time_until_commit(group, tmp_path, clock, monkeypatch):
    """With a clock that moves 0.25 s whenever the commit runs, the save took 0.25 s and stalled as long."""
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=log)
    commit = storage.commit

    def slow_commit(*args):
        clock.now += 0.25
        return commit(*args)

    monkeypatch.setattr(storage, "commit", slow_commit)
    t = trainer(steps=2)
    try:
        stats = ck.save(t)
        assert (stats.step, stats.stall_s, stats.total_s) == (2, 0.25, 0.25)
        assert log.calls == [saved_line(2, tmp_path / "step-00000002", "0.25")]
    finally:
        ck.close()


def test_keep_prunes_the_oldest_and_the_log_names_them(group, tmp_path, clock):
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=2), log=log)
    t = trainer()
    try:
        stats = []
        for _ in range(3):
            t.train_step()
            stats.append(ck.save(t))
        assert names(tmp_path) == ["step-00000003", "step-00000002"]
        assert [s.step for s in ck.history] == [1, 2, 3] and ck.history == stats and ck.last_saved_step == 3
        assert log.calls == [
            saved_line(1, tmp_path / "step-00000001"),
            saved_line(2, tmp_path / "step-00000002"),
            saved_line(3, tmp_path / "step-00000003", note=", removed step-00000001"),
        ]
        ck.cfg = dataclasses.replace(ck.cfg, keep=0)  # keep 0 keeps all
        for _ in range(2):
            t.train_step()
            ck.save(t)
        assert names(tmp_path) == ["step-00000005", "step-00000004", "step-00000003", "step-00000002"]
        assert log.calls[3:] == [saved_line(4, tmp_path / "step-00000004"), saved_line(5, tmp_path / "step-00000005")]
        ck.cfg = dataclasses.replace(ck.cfg, keep=1)
        log.calls.clear()
        ck.save(t)  # step 5 again: the committed copy stays, the three older ones go (newest first)
        assert names(tmp_path) == ["step-00000005"]
        assert log.calls == [
            saved_line(5, tmp_path / "step-00000005", note=", removed step-00000004, step-00000003, step-00000002")
        ]
    finally:
        ck.close()


def test_a_failed_commit_is_a_checkpoint_error(group, tmp_path, clock):
    (tmp_path / "latest").mkdir()  # `latest` cannot be replaced: the commit's last step fails
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=log)
    t = trainer(steps=1)
    try:
        with pytest.raises(CheckpointError) as e:
            ck.save(t)
        assert re.fullmatch(
            re.escape(f"committing step 1 failed: [Errno 21] Is a directory: '{tmp_path}/.latest.")
            + "[0-9a-f]{8}"
            + re.escape(f"' -> '{tmp_path}/latest'"),
            str(e.value),
        )
        assert log.calls == [] and ck.history == []
    finally:
        ck.close()


class SlowWriter(dcp.FileSystemWriter):
    """Writes its files a little late, so that a commit that did not wait for them would miss them."""

    def write_data(self, *args, **kwargs):
        time.sleep(0.2)
        return super().write_data(*args, **kwargs)


def test_an_asynchronous_save_returns_after_staging_and_wait_joins_it(group, tmp_path, clock, collectives, monkeypatch):
    """The commit runs in the background (held here until released); wait() joins it."""
    released, threads = threading.Event(), []
    commit = storage.commit

    def held_commit(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        if not threads[-1]:
            released.wait(30)
        return commit(*args)

    monkeypatch.setattr(storage, "commit", held_commit)
    monkeypatch.setattr(dcp, "FileSystemWriter", SlowWriter)
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), async_save=True), log=log)
    t = trainer(steps=2)
    try:
        collectives.on = True
        stats = ck.save(t)
        assert stats == SaveStats(step=2, stall_s=0.0, total_s=None, path=None)
        assert ck.history == [stats] and ck.last_saved_step == 2
        assert names(tmp_path) == [] and log.calls == []
        released.set()
        ck.wait()
        collectives.on = False
        folder = tmp_path / "step-00000002"
        assert threads == [False]  # committed once, in the background
        assert stats == SaveStats(step=2, stall_s=0.0, total_s=0.0, path=str(folder))
        assert names(tmp_path) == ["step-00000002"] and sorted(os.listdir(folder)) == FILES
        storage.verify(folder)
        assert log.calls == [saved_line(2, folder)]
        assert collectives.all_on(ck.pg)
        ck.wait()  # nothing in flight: returns at once
        t.train_step()
        second = ck.save(t)  # the same executor again
        ck.wait()
        assert second.path == str(tmp_path / "step-00000003") and threads == [False, False]
        assert [s.step for s in ck.history] == [2, 3]
    finally:
        released.set()
        ck.close()


def test_blocking_overrides_the_configured_mode(group, tmp_path, clock, monkeypatch):
    threads = []
    commit = storage.commit

    def watched_commit(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        return commit(*args)

    monkeypatch.setattr(storage, "commit", watched_commit)
    t = trainer(steps=1)
    for async_save, blocking, in_main in [
        (True, True, True),
        (True, None, False),
        (False, False, False),
        (False, None, True),
        (True, False, False),
        (False, True, True),
    ]:
        ck = Checkpointer(
            CheckpointConfig(dir=str(tmp_path / f"{async_save}-{blocking}"), async_save=async_save), log=Log()
        )
        try:
            stats = ck.save(t, blocking=blocking)
            ck.wait()
            assert stats.path == str(tmp_path / f"{async_save}-{blocking}" / "step-00000001")
            assert threads.pop() is in_main, (async_save, blocking)
        finally:
            ck.close()


def test_an_asynchronous_save_s_error_is_raised_by_wait_once(group, tmp_path, clock):
    (tmp_path / "latest").mkdir()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), async_save=True), log=Log())
    t = trainer(steps=1)
    try:
        stats = ck.save(t)
        assert stats.step == 1
        with pytest.raises(CheckpointError, match=r"^committing step 1 failed: \[Errno 21\] Is a directory: "):
            ck.wait()
        ck.wait()  # raised once
        assert ck.history == [stats] and stats.path is None
    finally:
        ck.close()


def test_the_next_save_raises_the_previous_one_s_error(group, tmp_path, clock, monkeypatch):
    released = threading.Event()
    commit = storage.commit

    def held_commit(*args):
        released.wait(30)
        return commit(*args)

    (tmp_path / "latest").mkdir()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), async_save=True), log=Log())
    monkeypatch.setattr(storage, "commit", held_commit)
    t = trainer(steps=1)
    try:
        ck.save(t)
        released.set()
        with pytest.raises(CheckpointError, match=r"^committing step 1 failed"):
            ck.save(t)
    finally:
        released.set()
        ck.close()


# -- candidates and verification ------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_three(tmp_path_factory):
    """Checkpoints saved after steps 1, 2 and 3 (once per module, by this module's own Checkpointer on a group of
    one) and the trainer's weights at each save."""
    root = tmp_path_factory.mktemp("three") / "ck"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        mp.setattr(manager, "time", Clock())
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        rng = torch.random.get_rng_state()
        try:
            ck = Checkpointer(CheckpointConfig(dir=str(root), keep=0), log=Log())
            t = trainer()
            saved = {}
            for _ in range(3):
                t.train_step()
                ck.save(t)
                saved[t.step] = weights(t)
            ck.close()
        finally:
            torch.random.set_rng_state(rng)
            dist.destroy_process_group()
            gc.collect()
    assert names(root) == ["step-00000003", "step-00000002", "step-00000001"]
    return root, saved


@pytest.fixture
def three(saved_three, group, tmp_path, clock):
    """A checkpointer (verifying, keeping all) on a copy of the three checkpoints, its recording log, and the
    weights at each save."""
    source, saved = saved_three
    shutil.copytree(source, tmp_path / "ck")
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep=0), log=log)
    try:
        yield ck, log, saved
    finally:
        ck.close()


def folder_of(ck, step: int) -> Path:
    return ck.root / f"step-{step:08d}"


def damage_meta(folder: Path) -> str:
    """Move a space in meta.json: still a valid meta.json of the same size, but not the committed file."""
    text = (folder / "meta.json").read_text()
    assert "\n " in text
    (folder / "meta.json").write_text(text.replace("\n ", " \n", 1))
    return f"{folder.name}: file meta.json {HASH_FAIL}"


def test_candidates_are_every_complete_checkpoint_newest_first_or_the_one_named(three, collectives):
    ck, _, _ = three
    (ck.root / ".tmp-step-00000004-0badcafe").mkdir()  # a save in progress is never a candidate
    newest_first = [folder_of(ck, 3), folder_of(ck, 2), folder_of(ck, 1)]
    collectives.on = True
    assert ck.candidates() == newest_first
    assert ck.candidates("auto") == newest_first
    assert ck.candidates(str(folder_of(ck, 2))) == [folder_of(ck, 2)]
    assert ck.candidates(str(ck.root / "nowhere")) == [ck.root / "nowhere"]
    collectives.on = False
    assert collectives.all_on(ck.pg)


def test_verify_reports_the_first_failure_in_one_line(three, collectives):
    ck, _, _ = three
    collectives.on = True
    assert ck.verify(folder_of(ck, 3)) is None
    assert ck.verify(folder_of(ck, 3), checksums=False) is None
    reason = damage_meta(folder_of(ck, 3))
    assert ck.verify(folder_of(ck, 3)) == reason
    assert ck.verify(folder_of(ck, 3), checksums=False) is None  # sizes and checksums skipped
    (folder_of(ck, 2) / "manifest.json").write_text("{}")
    assert ck.verify(folder_of(ck, 2), checksums=False) == "step-00000002: unreadable manifest ('files')"
    collectives.on = False
    assert collectives.all_on(ck.pg)


# -- load -----------------------------------------------------------------------------------------


def test_load_resumes_the_newest_checkpoint(three, collectives):
    ck, log, saved = three
    fresh = trainer()
    collectives.on = True
    stats = ck.load(fresh)
    collectives.on = False
    folder = folder_of(ck, 3)
    meta = json.loads((folder / "meta.json").read_text())
    assert stats == LoadStats(
        step=3,
        path=str(folder),
        saved_layout=LAYOUT.to_dict(),
        verify_s=0.0,
        read_s=0.0,
        apply_s=0.0,
        total_s=0.0,
        meta=meta,
    )
    assert stats.meta == meta and meta["step"] == 3
    assert fresh.step == 3 and ck.last_saved_step == 3
    assert fresh.cfg == dataclasses.replace(CFG, decay_steps=CFG.steps)  # the checkpoint's schedule length
    got = weights(fresh)
    assert all(torch.equal(got[k], saved[3][k]) for k in saved[3]) and not all(
        torch.equal(got[k], saved[2][k]) for k in saved[2]
    )
    assert log.calls == [
        ((f"[checkpoint] resumed step 3 from {folder} (saved with dp=1 tp=1 pp=1) in 0.00 s",), {"flush": True})
    ]
    assert collectives.all_on(ck.pg)


def test_load_of_a_named_folder_loads_that_one(three):
    ck, log, saved = three
    fresh = trainer()
    stats = ck.load(fresh, str(folder_of(ck, 1)))
    assert (stats.step, stats.path, fresh.step, ck.last_saved_step) == (1, str(folder_of(ck, 1)), 1, 1)
    got = weights(fresh)
    assert all(torch.equal(got[k], saved[1][k]) for k in saved[1])


def test_a_damaged_newest_checkpoint_is_skipped_with_one_line(three):
    ck, log, _ = three
    reason = damage_meta(folder_of(ck, 3))
    fresh = trainer()
    stats = ck.load(fresh)
    assert stats.step == 2 and stats.path == str(folder_of(ck, 2)) and fresh.step == 2
    assert log.calls[0] == ((f"[checkpoint] skipping step-00000003: {reason}",), {"file": sys.stderr, "flush": True})
    assert log.calls[1][0][0].startswith(f"[checkpoint] resumed step 2 from {folder_of(ck, 2)} ")
    assert len(log.calls) == 2


def test_verify_false_loads_a_checkpoint_whose_checksums_fail(three):
    ck, log, _ = three
    damage_meta(folder_of(ck, 3))
    fresh = trainer()
    assert ck.load(fresh, verify=False).step == 3 and fresh.step == 3
    fresh = trainer()
    assert ck.load(fresh, str(folder_of(ck, 3)), verify=False).step == 3
    assert ck.load_first(trainer(), [folder_of(ck, 3)], verify=False).step == 3
    assert [c[0][0].split(" from ")[0] for c in log.calls] == ["[checkpoint] resumed step 3"] * 3


def test_the_config_s_verify_is_the_default(three):
    ck, _, _ = three
    damage_meta(folder_of(ck, 3))
    ck.cfg = dataclasses.replace(ck.cfg, verify=False)
    assert ck.load(trainer()).step == 3
    assert ck.load(trainer(), verify=True).step == 2


def test_a_named_folder_that_fails_verification_is_the_error(three):
    ck, log, _ = three
    reason = damage_meta(folder_of(ck, 3))
    fresh = trainer()
    with pytest.raises(CheckpointError) as e:
        ck.load(fresh, str(folder_of(ck, 3)))
    assert str(e.value) == reason and fresh.step == 0 and log.calls == []
    with pytest.raises(CheckpointError) as e:
        ck.load_first(fresh, [folder_of(ck, 3), folder_of(ck, 2)], strict=True)
    assert str(e.value) == reason


def test_load_first_skips_what_is_not_a_folder_by_default(three):
    ck, log, _ = three
    missing = ck.root / "step-00000009"
    fresh = trainer()
    stats = ck.load_first(fresh, [missing, folder_of(ck, 1)])
    assert stats.step == 1 and fresh.step == 1
    assert log.calls[0] == (
        (f"[checkpoint] skipping step-00000009: {missing} is not a checkpoint folder",),
        {"file": sys.stderr, "flush": True},
    )
    with pytest.raises(CheckpointError) as e:
        ck.load_first(fresh, [missing], strict=True)
    assert str(e.value) == f"{missing} is not a checkpoint folder"


def test_when_every_checkpoint_is_damaged_the_load_is_the_error(three):
    ck, log, _ = three
    reasons = [damage_meta(folder_of(ck, s)) for s in (3, 2, 1)]
    fresh = trainer()
    with pytest.raises(CheckpointError) as e:
        ck.load(fresh)
    assert str(e.value) == (
        f"no checkpoint in --checkpoint-dir {ck.root} can be resumed (3 damaged; newest: "
        f"{reasons[0]}); repair them, move them away or pass another --checkpoint-dir to start over"
    )
    assert [c[0][0] for c in log.calls] == [
        f"[checkpoint] skipping step-0000000{s}: {r}" for s, r in zip((3, 2, 1), reasons)
    ]
    assert fresh.step == 0 and ck.last_saved_step is None  # nothing saved or loaded


def test_no_checkpoint_loads_nothing(group, tmp_path, clock):
    log = Log()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=log)
    try:
        assert ck.load(trainer()) is None and ck.last_saved_step is None and log.calls == []
    finally:
        ck.close()


def test_a_checkpoint_of_other_settings_is_refused_naming_it(three):
    ck, log, _ = three
    other = trainer(dataclasses.replace(CFG, lr=2e-3))
    with pytest.raises(ConfigError) as e:
        ck.load(other)
    assert str(e.value) == (
        f"{folder_of(ck, 3)} was trained with other settings: lr=0.002 (checkpoint: 0.001); "
        "resuming would change the loss trajectory (use the checkpoint's values or another "
        "--checkpoint-dir)"
    )
    assert other.step == 0


def test_an_unsafe_item_is_refused_with_the_folder_s_name(group, tmp_path, clock):
    """A hand-made checkpoint whose learning rate is pickled as a Fraction (a global outside the allowlist)."""
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=Log())
    t = trainer()
    try:
        state = ckpt_state.tensor_state(t)
        key = "param_groups.tok_emb.weight.lr"
        assert state["optim"][key] == CFG.lr
        state["optim"][key] = fractions.Fraction(1, 1000)
        tmp = tmp_path / ".tmp-step-00000000-handmade"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=ck.pg)
        storage.write_json_atomic(tmp / "meta.json", ckpt_state.build_meta(t))
        folder = storage.commit(tmp, 0, {})
        fresh = trainer()
        with pytest.raises(CheckpointError) as e:
            ck.load(fresh)
        assert str(e.value).startswith(
            f"loading step-00000000 failed: refusing unsafe item 'optim.{key}' in checkpoint: "
        )
        assert "fractions.Fraction" in str(e.value) and "\n" not in str(e.value)
        assert folder == tmp_path / "step-00000000"
    finally:
        ck.close()


# -- a fresh run ----------------------------------------------------------------------------------


def test_prepare_fresh_run_drops_abandoned_saves_and_refuses_to_mix(group, tmp_path, collectives):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path)), log=Log())
    try:
        (tmp_path / ".tmp-step-00000007-0badcafe").mkdir()
        (tmp_path / ".tmp-step-00000007-0badcafe" / "__0_0.distcp").write_bytes(b"half")
        collectives.on = True
        ck.prepare_fresh_run("never")  # empty of complete checkpoints: fine
        assert os.listdir(tmp_path) == []
        (tmp_path / "step-00000005").mkdir()
        (tmp_path / ".tmp-step-00000008-0badcafe").mkdir()
        ck.prepare_fresh_run("auto")
        assert os.listdir(tmp_path) == ["step-00000005"]
        ck.prepare_fresh_run(str(tmp_path / "step-00000005"))
        with pytest.raises(ConfigError) as e:
            ck.prepare_fresh_run("never")
        collectives.on = False
        assert str(e.value) == (
            f"--checkpoint-dir {tmp_path} already holds checkpoints (step-00000005, ...); "
            "resume them (--resume auto) or use an empty folder"
        )
        assert collectives.all_on(ck.pg)
    finally:
        ck.close()
