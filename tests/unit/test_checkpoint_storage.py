"""Checkpoint files: atomic commit, discovery, retention, integrity, and loading that never runs code."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from elastic_trainer.checkpoint import hashing, storage
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


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.write_bytes(b"weightz"), "fails its xxh3_128 checksum (corrupted)"),
        (lambda f: f.write_bytes(b"weig"), "has 4 bytes, expected 7 (truncated?)"),
        (lambda f: f.unlink(), "is missing"),
    ],
)
def test_verify_reports_damage_in_one_line(tmp_path, damage, message):
    final = fake_checkpoint(tmp_path, 3)
    damage(final / "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        storage.verify(final)
    assert message in str(err.value) and "\n" not in str(err.value)


def checkpoint_of_files(root: Path, n_data: int) -> Path:
    """A committed checkpoint with the files a DCP save of `n_data` ranks has (.metadata, one __R_0.distcp
    per rank, meta.json), each with its own content."""
    tmp = storage.new_tmp_dir(root, 5)
    tmp.mkdir(parents=True)
    names = [".metadata", "meta.json"] + [f"__{r}_0.distcp" for r in range(n_data)]
    for i, name in enumerate(names):
        (tmp / name).write_bytes(f"{name} holds {i * 'x'}".encode())
    return storage.commit(tmp, 5, {})


def rank_errors(folder: Path, world: int) -> list[str | None]:
    """What storage.verify says on each rank of `world` sharing the check (None: its share passed)."""
    errors = []
    for rank in range(world):
        try:
            storage.verify(folder, rank, world)
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
    return errors


FLIP = (lambda raw: raw[:-1] + bytes([raw[-1] ^ 0xFF]), "fails its xxh3_128 checksum (corrupted)")
TRUNCATE = (lambda raw: raw[: len(raw) // 2], "has {cut} bytes, expected {size} (truncated?)")


@pytest.mark.parametrize("damage, message", [FLIP, TRUNCATE], ids=["flipped", "truncated"])
def test_verify_shares_check_every_file_exactly_once(tmp_path, damage, message):
    """For every world from 1 to one more than the number of files and every file of the checkpoint, a
    damaged file is reported by exactly one rank's share, in the one-line message naming it; an intact
    checkpoint passes on every rank."""
    folder = checkpoint_of_files(tmp_path, 4)
    files = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert len(files) == 6
    for world in range(1, len(files) + 2):
        assert rank_errors(folder, world) == [None] * world
        for name in files:
            raw = (folder / name).read_bytes()
            (folder / name).write_bytes(damage(raw))
            detail = message.format(cut=len(damage(raw)), size=len(raw))
            found = [e for e in rank_errors(folder, world) if e]
            (folder / name).write_bytes(raw)
            assert found == [f"{folder.name}: file {name} {detail}"], (world, name)


# -- a crash at every point of the commit ----------------------------------------------------------------


class Crash(Exception):
    """Stands for the process dying at one point of storage.commit."""


# (object, attribute, label): every file-system step commit takes, and the helpers it calls them through
COMMIT_STEPS = [
    (os, "rename", "os.rename"),
    (os, "replace", "os.replace"),
    (os, "fsync", "os.fsync"),
    (shutil, "rmtree", "shutil.rmtree"),
    (json, "dump", "json.dump"),
    (Path, "write_text", "Path.write_text"),
    (storage, "write_json_atomic", "write_json_atomic"),
    (storage, "_fsync_dir", "_fsync_dir"),
]


def commit_with_crash(monkeypatch, root: Path, step: int, crash_at: int | None) -> list[str]:
    """Stage `step` in a temporary folder and commit it, raising Crash instead of the `crash_at`-th
    file-system step (None: run to the end); return the steps taken, in order."""
    tmp = storage.new_tmp_dir(root, step)
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(f"weights of step {step}".encode())
    (tmp / "meta.json").write_text(json.dumps({"step": step}))
    taken: list[str] = []

    def wrap(original, label):
        def step_or_crash(*args, **kwargs):
            if len(taken) == crash_at:
                raise Crash(label)
            taken.append(label)
            return original(*args, **kwargs)

        return step_or_crash

    with monkeypatch.context() as m:
        for owner, attr, label in COMMIT_STEPS:
            m.setattr(owner, attr, wrap(getattr(owner, attr), label))
        try:
            storage.commit(tmp, step, storage.describe_files(tmp, ["__0_0.distcp"]))
        except Crash:
            pass
    return taken


def assert_no_broken_checkpoint(root: Path, allowed: set[str]) -> None:
    """Every visible step-* folder verifies; `latest`, if any, names one of them; the newest is allowed."""
    visible = storage.complete_checkpoints(root)
    for folder in visible:
        storage.verify(folder)
    assert visible and visible[0].name in allowed and {p.name for p in visible} <= allowed
    if (root / "latest").exists():
        assert (root / "latest").read_text().strip() in {p.name for p in visible}


@pytest.mark.parametrize(
    "resave",
    [
        pytest.param(False, id="new-step"),
        pytest.param(True, id="same-step-again"),  # the committed step-2 is kept, the new copy dropped
    ],
)
def test_a_crash_at_any_point_of_the_commit_leaves_no_broken_checkpoint(monkeypatch, tmp_path, resave):
    """Crash before each file-system step of storage.commit in turn (on top of a committed step 1, and for a
    re-save of step 2 on top of an existing step 2): whatever is visible is complete, `latest` names a
    complete checkpoint, and the newest is step 1 or step 2."""
    root = tmp_path / "dry"
    root.mkdir()
    fake_checkpoint(root, 1)
    if resave:
        fake_checkpoint(root, 2)
    steps = commit_with_crash(monkeypatch, root, 2, None)
    assert {"write_json_atomic", "os.replace"} | ({"os.rename"} if not resave else set()) <= set(steps)
    assert (root / "latest").read_text().strip() == "step-00000002"
    for k, label in enumerate(steps):
        root = tmp_path / f"crash-{k}"
        root.mkdir()
        fake_checkpoint(root, 1)
        if resave:
            fake_checkpoint(root, 2)
        assert commit_with_crash(monkeypatch, root, 2, k) == steps[:k]
        try:
            assert_no_broken_checkpoint(root, {"step-00000001", "step-00000002"})
        except (AssertionError, CheckpointError) as e:
            raise AssertionError(f"crash before step {k} ({label}) of {steps}: {e}") from None


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
        dcp.load(
            {"t": torch.zeros(3)},
            storage_reader=storage.SafeReader(str(tmp_path)),
            planner=storage.SafeLoadPlanner(),
            no_dist=True,
        )
    assert "refusing to load posix.system" in str(err.value) + "".join(map(str, err.value.args))
    assert not marker.exists()
    # DCP's own reader would have run it: the test would catch a regression to it
    with pytest.raises(BaseException):  # noqa: B017  (whatever the payload raises once it ran)
        dcp.load({"t": torch.zeros(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert marker.exists()


def test_crafted_non_tensor_item_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    dcp.save({"t": torch.ones(3), "lr": Evil(str(marker))}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert not marker.exists()
    state = {"t": torch.zeros(3), "lr": 0.1}
    with pytest.raises(BaseException) as err:
        dcp.load(
            state,
            storage_reader=storage.SafeReader(str(tmp_path / "ck")),
            planner=storage.SafeLoadPlanner(),
            no_dist=True,
        )
    assert "refusing unsafe item 'lr'" in str(err.value) + "".join(map(str, err.value.args))
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # DCP's default planner runs it
    assert marker.exists()


def test_safe_loading_still_reads_plain_values(tmp_path):
    dcp.save({"t": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"t": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(state, storage_reader=storage.SafeReader(str(tmp_path)), planner=storage.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(state["t"], torch.arange(4.0)) and state["lr"] == 0.5 and tuple(state["betas"]) == (0.9, 0.95)


# -- hand-built protocol-2 pickles that run code -------------------------------------------------------


def test_a_payload_repeated_in_many_items_is_unpickled_once_and_each_item_gets_its_own(tmp_path, monkeypatch):
    """The flattened optimizer state repeats each group's settings per parameter: one torch.load per distinct
    payload, and no two items share a mutable object (a change to one group's betas must not move another's)."""
    saved = {"t": torch.arange(4.0), **{f"g{i}.betas": [0.9, 0.95] for i in range(5)}, "lr": 0.5}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    calls = []
    real_load = torch.load
    # the non-tensor items' loads (from a BytesIO; DCP's reader loads the tensor from a view of the file)
    monkeypatch.setattr(torch, "load", lambda f, **k: calls.append(isinstance(f, io.BytesIO)) or real_load(f, **k))
    state = {"t": torch.zeros(4), **{f"g{i}.betas": None for i in range(5)}, "lr": 0.0}
    dcp.load(state, storage_reader=storage.SafeReader(str(tmp_path)), planner=storage.SafeLoadPlanner(), no_dist=True)
    assert sum(calls) == 2  # [0.9, 0.95] and 0.5
    assert all(state[f"g{i}.betas"] == [0.9, 0.95] for i in range(5)) and state["lr"] == 0.5
    state["g0.betas"].append(0.0)
    assert state["g1.betas"] == [0.9, 0.95]


# Each program would, if unpickled without restriction, create the file `plant.marker` (the control test
# below proves it for every live one); the loaders must refuse it by the first global it names.


def g(module: str, name: str) -> bytes:
    """GLOBAL: push module.name (an unrestricted unpickler imports `module` to find it)."""
    return b"c" + f"{module}\n{name}\n".encode()


def s(text: str) -> bytes:
    """BINUNICODE: push a str."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: push func(*args)."""
    return func + tup(*args) + b"R"


def memo(slot: int, value: bytes) -> bytes:
    """Evaluate `value` into memo slot `slot` and leave the stack as it was (BINPUT, POP)."""
    return value + b"q" + bytes([slot]) + b"0"


def get(slot: int) -> bytes:
    return b"h" + bytes([slot])


def program(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


NONE, FALSE, EMPTY_DICT = b"N", b"\x89", b"}"


def touch(p) -> bytes:
    return s(f"touch {p.marker}")


def create(p) -> bytes:
    return s(f"open({p.marker!r}, 'w').close()")


def getattr_call(holder: bytes, name: str, *args: bytes) -> bytes:
    """holder.name(*args) through builtins.getattr, `holder` evaluated first (so its global is named first)."""
    return memo(0, holder) + call(call(g("builtins", "getattr"), get(0), s(name)), *args)


def partial_call(func: bytes, args: bytes, **kwargs: bytes) -> bytes:
    """functools.partial(func, *args, **kwargs)() as partial pickles itself (REDUCE, then BUILD its state)."""
    kw = EMPTY_DICT + b"(" + b"".join(s(k) + v for k, v in kwargs.items()) + b"u"
    made = memo(0, func) + call(g("functools", "partial"), get(0)) + tup(get(0), args, kw, NONE) + b"b"
    return call(made)


# name refused first -> program(plant); NOT_LIVE: would be refused by name but cannot run code offline
PAYLOADS = {
    "os.system": lambda p: program(call(g("os", "system"), touch(p))),
    "posix.system": lambda p: program(call(g("posix", "system"), touch(p))),
    "subprocess.Popen": lambda p: program(call(g("subprocess", "Popen"), tup(s("touch"), s(p.marker)))),
    "builtins.eval": lambda p: program(call(g("builtins", "eval"), create(p))),
    "builtins.exec": lambda p: program(call(g("builtins", "exec"), create(p))),
    "__builtin__.eval": lambda p: program(call(g("__builtin__", "eval"), create(p))),  # Python 2's name
    "builtins.getattr": lambda p: program(
        call(call(g("builtins", "getattr"), call(g("builtins", "__import__"), s("os")), s("system")), touch(p))
    ),
    "importlib.import_module": lambda p: program(call(g("importlib", "import_module"), s(p.module))),
    "{module}.anything": lambda p: program(g(p.module, "anything")),  # importing the module runs it
    "functools.partial": lambda p: program(call(call(g("functools", "partial"), g("posix", "system"), touch(p)))),
    "torch.load": lambda p: program(
        call(g("torch", "load"), s(p.evil_pt), NONE, g("torch.serialization", "pickle"))
    ),  # a pickle_module: unsafe load
    "torch.serialization.load": lambda p: program(
        call(g("torch.serialization", "load"), s(p.evil_pt), NONE, g("torch.serialization", "pickle"))
    ),
    "torch.save": lambda p: program(call(g("torch", "save"), s("x"), s(p.marker))),
    "torch.hub.load": lambda p: program(
        partial_call(g("torch.hub", "load"), tup(s(p.hub), s("entry")), source=s("local"))
    ),
    "torch.hub._load_local": lambda p: program(call(g("torch.hub", "_load_local"), s(p.hub), s("entry"))),
    "torch.jit.load": lambda p: program(call(g("torch.jit", "load"), s(p.evil_pt))),
    "torch._C._save_parameters": lambda p: program(
        call(g("torch._C", "_save_parameters"), EMPTY_DICT, s(p.marker), FALSE)
    ),
    "torch.distributed.checkpoint.metadata.os": lambda p: program(
        getattr_call(g("torch.distributed.checkpoint.metadata", "os"), "system", touch(p))
    ),
    "torch.distributed.checkpoint.filesystem.os": lambda p: program(
        getattr_call(g("torch.distributed.checkpoint.filesystem", "os"), "system", touch(p))
    ),
    "pathlib.os": lambda p: program(getattr_call(g("pathlib", "os"), "system", touch(p))),
    "collections._sys": lambda p: program(getattr_call(g("collections", "_sys"), "exit", s("x"))),
}
NOT_LIVE = {"torch.jit.load": "TorchScript archives hold no Python", "collections._sys": "sys.exit raises"}


@pytest.fixture
def plant(tmp_path, monkeypatch):
    """What the payloads use: the marker path, an importable module, a hub folder and a torch.save file
    that each create the marker when run (the module name is fresh, so no earlier import is cached)."""
    marker = tmp_path / "pwned"
    create_marker = f"open({str(marker)!r}, 'w').close()\n"
    module = f"et_planted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(create_marker)
    monkeypatch.syspath_prepend(str(tmp_path))
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hubconf.py").write_text(f"def entry():\n    {create_marker}")
    torch.save(Evil(str(marker)), tmp_path / "evil.pt")
    yield SimpleNamespace(marker=str(marker), module=module, hub=str(hub), evil_pt=str(tmp_path / "evil.pt"))
    sys.modules.pop(module, None)


def refused_name(key: str, plant) -> str:
    return key.format(module=plant.module)


def assert_nothing_ran(plant) -> None:
    assert not Path(plant.marker).exists()


def as_item(raw: bytes) -> bytes:
    """A torch.save file (DCP's format for non-tensor items) whose pickle is `raw`."""
    buf = io.BytesIO()
    torch.save(0.5, buf)
    original = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in original.infolist():
            z.writestr(info.filename, raw if info.filename.endswith("/data.pkl") else original.read(info))
    return out.getvalue()


# payloads whose code starts a process: their control runs in tests/e2e/test_pickle_payloads_live.py
STARTS_A_PROCESS = ("subprocess.Popen",)


@pytest.mark.parametrize("key", [k for k in PAYLOADS if k not in NOT_LIVE and k not in STARTS_A_PROCESS])
def test_planted_pickles_run_code_when_loaded_without_restriction(key, plant):
    """Control: each payload is live, as metadata (plain pickle) and as an item (torch.load, weights_only
    False, as DCP's own planner reads it), so the refusal tests below would see it run."""
    assert_payload_runs(key, plant)


def assert_payload_runs(key, plant):
    raw = PAYLOADS[key](plant)
    for load in (lambda: pickle.loads(raw), lambda: torch.load(io.BytesIO(as_item(raw)), weights_only=False)):
        sys.modules.pop(plant.module, None)  # imported afresh each time
        try:
            result = load()
            if isinstance(result, subprocess.Popen):
                result.wait()
        except Exception:  # noqa: BLE001 - the code ran before whatever failed after it
            pass
        assert Path(plant.marker).exists()
        Path(plant.marker).unlink()


@pytest.mark.parametrize("key", list(PAYLOADS))
def test_planted_metadata_is_refused_by_name_in_one_line(key, plant, tmp_path):
    """An otherwise valid checkpoint whose .metadata is the payload: read_dcp_metadata refuses the first
    global in one line naming it, and DCP's load through SafeReader fails with that reason; nothing runs."""
    folder = tmp_path / "ck"
    dcp.save({"t": torch.ones(3)}, checkpoint_id=str(folder), no_dist=True)
    (folder / ".metadata").write_bytes(PAYLOADS[key](plant))
    name = refused_name(key, plant)
    with pytest.raises(CheckpointError) as err:
        storage.read_dcp_metadata(folder / ".metadata")
    assert str(err.value) == (
        f"unsafe or corrupted checkpoint metadata {str(folder / '.metadata')!r}: "
        f"refusing to load {name} from checkpoint metadata"
    )
    with pytest.raises(BaseException) as err:  # DCP wraps our error in a CheckpointException
        dcp.load(
            {"t": torch.zeros(3)},
            storage_reader=storage.SafeReader(str(folder)),
            planner=storage.SafeLoadPlanner(),
            no_dist=True,
        )
    assert f"refusing to load {name} from checkpoint metadata" in str(err.value)
    assert_nothing_ran(plant)


class PlantingPlanner(DefaultSavePlanner):
    """Saves `raw` bytes as the non-tensor item `fqn` (DCP records their offset and length as usual)."""

    def __init__(self, fqn: str, raw: bytes):
        super().__init__()
        self.fqn, self.raw = fqn, raw

    def resolve_data(self, write_item):
        if write_item.index.fqn == self.fqn:
            return io.BytesIO(self.raw)
        return super().resolve_data(write_item)


@pytest.mark.parametrize("key", list(PAYLOADS))
def test_planted_non_tensor_item_is_refused_in_one_line(key, plant, tmp_path):
    """A checkpoint whose item 'lr' is the payload (as torch.save writes items): SafeLoadPlanner refuses it
    with a one-line CheckpointError naming the item, through DCP's load and called directly; nothing runs."""
    item = as_item(PAYLOADS[key](plant))
    dcp.save(
        {"t": torch.ones(3), "lr": 0.5},
        checkpoint_id=str(tmp_path / "ck"),
        planner=PlantingPlanner("lr", item),
        no_dist=True,
    )
    with pytest.raises(BaseException) as err:
        dcp.load(
            {"t": torch.zeros(3), "lr": 0.1},
            storage_reader=storage.SafeReader(str(tmp_path / "ck")),
            planner=storage.SafeLoadPlanner(),
            no_dist=True,
        )
    failures = [f[0] if isinstance(f, tuple) else f for f in err.value.failures.values()]
    assert [type(f) for f in failures] == [CheckpointError]
    for error in failures + [refusal_of_item(item)]:
        assert str(error).startswith("refusing unsafe item 'lr' in checkpoint: ") and "\n" not in str(error)
        assert "Weights only load failed" not in str(error) and "\x1b" not in str(error)  # the specific line
    assert_nothing_ran(plant)


def refusal_of_item(item: bytes) -> CheckpointError:
    planner = storage.SafeLoadPlanner()
    read_item = SimpleNamespace(dest_index=SimpleNamespace(fqn="lr"))
    with pytest.raises(CheckpointError) as err:
        planner.load_bytes(read_item, io.BytesIO(item))
    return err.value


def test_a_failed_dcp_load_is_reported_by_its_first_ranks_last_line():
    """DCP wraps every rank's exception with its traceback; the one-line error takes the first rank's
    exception's last line (its message, not the traceback), or its type when it has no message."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from elastic_trainer.checkpoint.manager import _first_failure

    def wrapped(exc):
        try:
            raise exc
        except BaseException as e:
            return _wrap_exception(e)

    two = CheckpointException(
        "load", {3: wrapped(ValueError("size mismatch\n  for model.wte: 4 != 8  ")), 0: wrapped(KeyError("other rank"))}
    )
    assert _first_failure(two) == "for model.wte: 4 != 8"
    assert _first_failure(CheckpointException("load", {1: wrapped(RuntimeError())})) == "RuntimeError"
    assert _first_failure(CheckpointException("load", {1: OSError("bare, not wrapped")})) == "bare, not wrapped"
    assert _first_failure(CheckpointException("load", {})) == "CheckpointException ranks:dict_keys([])"


@pytest.mark.parametrize(
    "text, line",
    [
        # torch's refusal: generic advice first, the named global further down, in colour on a terminal
        (
            "\x1b[1mWeights only load failed.\x1b[0m Re-running may work.\n\n\x1b[31;1mPlease file an issue\x1b[0m\n"
            "  \x1b[1mWeightsUnpickler error: Unsupported global: GLOBAL os.system was not an allowed "
            "global\x1b[0m  \n",
            "WeightsUnpickler error: Unsupported global: GLOBAL os.system was not an allowed global",
        ),
        ("Weights only load failed\nUnsupported operand 82", "Unsupported operand 82"),  # no GLOBAL: 'Unsupported'
        ("\n  \x1b[0m\n first line \nsecond", "first line"),  # nothing named: the first non-empty line, stripped
        ("", "ValueError"),  # no text at all: the type
    ],
)
def test_an_unsafe_item_is_refused_by_the_line_that_names_it(text, line):
    assert storage._refusal_reason(ValueError(text)) == line


# -- exact messages: read_meta, none_resumable, require_no_checkpoints --------------------------------


def valid_meta() -> dict:
    """The smallest meta.json read_meta accepts (the keys and types every reader relies on)."""
    from elastic_trainer.config import load_model_config

    return {
        "format": 1,
        "step": 4,
        "model": dataclasses.asdict(load_model_config("gpt-tiny")),
        "train": {"schedule_steps": 10, "data": ["a.txt"]},
        "layout": {"dp": 1, "tp": 1, "pp": 1},
    }


def write_meta(folder: Path, meta) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "meta.json"


def test_read_meta_returns_a_valid_meta(tmp_path):
    write_meta(tmp_path, valid_meta())
    assert storage.read_meta(tmp_path) == valid_meta()


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p.mkdir(), "Is a directory"),  # an OSError: its strerror, not "[Errno 21] ...: 'path'"
        (lambda p: None, "No such file or directory"),
        (
            lambda p: p.write_text("{not json"),
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),  # a ValueError: its text
    ],
    ids=["directory", "absent", "invalid-json"],
)
def test_read_meta_names_why_it_cannot_read(tmp_path, make, reason):
    path = tmp_path / "meta.json"
    make(path)
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    assert str(err.value) == f"{str(path)!r} is unreadable ({reason})"


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None])
def test_read_meta_refuses_json_that_is_not_an_object(tmp_path, value):
    path = write_meta(tmp_path, value)
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    assert str(err.value) == f"{str(path)!r} is not a JSON object"


@pytest.mark.parametrize(
    "key, value",
    [
        *[(k, missing) for k in storage.META_FIELDS for missing in ("missing",)],
        ("format", "1"),
        ("step", 4.0),
        ("step", True),
        ("format", False),  # a bool is not an integer here
        ("model", []),
        ("train", "x"),
        ("layout", 1),
        ("model", True),
    ],
)
def test_read_meta_refuses_a_missing_or_mistyped_key(tmp_path, key, value):
    """Each required key missing or of the wrong type: one line naming it and the type it must have."""
    meta = valid_meta()
    if value == "missing":
        del meta[key]
    else:
        meta[key] = value
    path = write_meta(tmp_path, meta)
    kind = "an integer" if storage.META_FIELDS[key] is int else "an object"
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    assert str(err.value) == f"{str(path)!r}: {key!r} is missing or not {kind} (a damaged or foreign meta.json)"


def test_none_resumable_names_the_folder_the_count_and_the_newest_error():
    error = storage.none_resumable("ckpts", ["step-00000009: file a is missing", "step-00000003: unreadable"])
    assert isinstance(error, CheckpointError)
    assert str(error) == (
        "no checkpoint in --checkpoint-dir ckpts can be resumed (2 damaged; newest: "
        "step-00000009: file a is missing); repair them, move them away or pass another "
        "--checkpoint-dir to start over"
    )


def test_require_no_checkpoints_refuses_a_folder_with_checkpoints(tmp_path):
    from elastic_trainer.config import ConfigError

    storage.require_no_checkpoints(tmp_path / "absent")
    storage.require_no_checkpoints(tmp_path)  # empty
    fake_checkpoint(tmp_path, 3)
    fake_checkpoint(tmp_path, 12)
    with pytest.raises(ConfigError) as err:
        storage.require_no_checkpoints(tmp_path)
    assert str(err.value) == (
        f"--checkpoint-dir {tmp_path} already holds checkpoints (step-00000012, ...); "
        "resume them (--resume auto) or use an empty folder"
    )


# -- SafeReader.read_metadata and SafeLoadPlanner.load_bytes, called directly ---------------------------


def test_safe_reader_refuses_rank_local_metadata(tmp_path):
    dcp.save({"t": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    reader = storage.SafeReader(str(tmp_path))
    for rank in (0, 1):
        with pytest.raises(CheckpointError, match=r"^rank-local checkpoint metadata is not supported$"):
            reader.read_metadata(rank=rank)
    assert reader.read_metadata(rank=None).state_dict_metadata.keys() == {"t"}


def test_safe_reader_keeps_the_saved_storage_meta_and_sets_its_load_id(tmp_path):
    dcp.save({"t": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    saved = storage.read_dcp_metadata(tmp_path / ".metadata").storage_meta
    assert saved is not None and saved.save_id and saved.load_id is None
    reader = storage.SafeReader(str(tmp_path))
    got = reader.read_metadata().storage_meta
    assert reader.load_id and got.load_id == reader.load_id
    assert (got.save_id, str(got.checkpoint_id)) == (saved.save_id, str(saved.checkpoint_id))


@pytest.mark.parametrize("drop", ["none", "absent"])
def test_safe_reader_adds_storage_meta_when_the_checkpoint_has_none(tmp_path, drop):
    """Metadata saved with storage_meta None (or, from an older torch, without the attribute) gets a fresh
    StorageMeta carrying the reader's load_id, and loads."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    dcp.save({"t": torch.arange(3.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = storage.read_dcp_metadata(tmp_path / ".metadata")
    metadata.storage_meta = None
    if drop == "absent":
        del metadata.__dict__["storage_meta"]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    reader = storage.SafeReader(str(tmp_path))
    got = reader.read_metadata().storage_meta
    assert isinstance(got, StorageMeta) and got.load_id == reader.load_id and got.save_id is None
    state = {"t": torch.zeros(3)}
    dcp.load(state, storage_reader=storage.SafeReader(str(tmp_path)), planner=storage.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(state["t"], torch.arange(3.0))


def test_an_unsafe_item_is_refused_even_when_the_environment_makes_torch_load_unsafe(tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns torch.load's default to weights_only=False; the planner passes
    weights_only=True explicitly, which the variable cannot override. The refusal names the global."""
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Evil(str(marker)), buf)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError) as err:
        storage.SafeLoadPlanner().load_bytes(
            SimpleNamespace(dest_index=SimpleNamespace(fqn="opt.lr")), io.BytesIO(buf.getvalue())
        )
    assert not marker.exists()
    text = str(err.value)
    assert text.startswith("refusing unsafe item 'opt.lr' in checkpoint: ") and "GLOBAL posix.system" in text
    assert "\n" not in text and "Weights only load failed" not in text


def test_safe_loading_without_flattening_stores_plain_values(tmp_path):
    """A planner that flattens nothing stores each non-tensor item under its name in the caller's state dict
    (with flatten_sharded_tensors, DCP's planner works on a copy of it, and so does ours)."""
    dcp.save({"t": torch.arange(4.0), "lr": 0.5, "steps": 7}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"t": torch.zeros(4), "lr": 0.0, "steps": 0}
    dcp.load(
        state,
        storage_reader=storage.SafeReader(str(tmp_path)),
        planner=storage.SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        no_dist=True,
    )
    assert torch.equal(state["t"], torch.arange(4.0)) and state["lr"] == 0.5 and state["steps"] == 7


@pytest.mark.parametrize(
    "make, reason",
    [(lambda p: None, "No such file or directory"), (lambda p: p.mkdir(), "Is a directory")],
    ids=["absent", "directory"],
)
def test_unreadable_dcp_metadata_is_reported_with_its_path_and_reason(tmp_path, make, reason):
    path = tmp_path / ".metadata"
    make(path)
    with pytest.raises(CheckpointError) as err:
        storage.read_dcp_metadata(path)
    assert str(err.value) == f"checkpoint metadata {str(path)!r} cannot be read ({reason})"


# -- read_meta's later checks, the manifest, the temporary names, retention of one, failing removals ---------


def test_read_meta_accepts_step_zero_and_names_a_negative_step(tmp_path):
    meta = valid_meta() | {"step": 0}  # a checkpoint of the initial state (saved before any step) is valid
    write_meta(tmp_path, meta)
    assert storage.read_meta(tmp_path)["step"] == 0
    path = write_meta(tmp_path, valid_meta() | {"step": -1})
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    assert str(err.value) == f"{str(path)!r}: step -1 is negative"


@pytest.mark.parametrize(
    "part, key, message",
    [
        ("layout", "tp", "layout.tp is missing or not an integer"),
        ("layout", "pp", "layout.pp is missing or not an integer"),
        ("train", "schedule_steps", "train.schedule_steps is missing"),
        ("train", "data", "train.data is missing"),
    ],
)
def test_read_meta_names_a_missing_layout_or_train_entry(tmp_path, part, key, message):
    meta = valid_meta()
    del meta[part][key]
    path = write_meta(tmp_path, meta)
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    assert str(err.value) == f"{str(path)!r}: {message}"


def test_read_meta_names_an_invalid_model_on_one_line(tmp_path):
    meta = valid_meta()
    meta["model"]["no_such_field"] = 1
    path = write_meta(tmp_path, meta)
    with pytest.raises(CheckpointError) as err:
        storage.read_meta(tmp_path)
    text = str(err.value)
    prefix = f"{str(path)!r}: its model is not valid ("
    assert text.startswith(prefix) and text.endswith(")") and "\n" not in text
    # the dataclass's own complaint, its words kept and separated by single spaces
    assert "unexpected keyword argument 'no_such_field'" in text[len(prefix) : -1]
    assert "  " not in text


def test_dcp_metadata_must_be_a_metadata_object(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))  # a plain dict: no global to refuse
    with pytest.raises(CheckpointError) as err:
        storage.read_dcp_metadata(path)
    assert str(err.value) == f"{str(path)!r} does not hold DCP metadata"


def test_an_unreadable_manifest_is_named_with_its_folder(tmp_path):
    folder = tmp_path / "step-00000003"
    folder.mkdir()
    with pytest.raises(CheckpointError) as err:
        storage.read_manifest(folder)
    assert str(err.value).startswith("step-00000003: unreadable manifest ([Errno 2] No such file or directory")
    (folder / "manifest.json").write_text(json.dumps({"hash": "xxh3_128"}))  # no "files"
    with pytest.raises(CheckpointError) as err:
        storage.read_manifest(folder)
    assert str(err.value) == "step-00000003: unreadable manifest ('files')"


def test_commit_keeps_the_callers_descriptions_and_records_the_time(tmp_path):
    """Files the caller described (the ranks hash their own shards) are not hashed again; the rest are."""
    tmp = storage.new_tmp_dir(tmp_path, 3)
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"abc")
    (tmp / "meta.json").write_text("{}")
    given = {"__0_0.distcp": {"bytes": 3, "xxh3_128": "described-by-its-rank"}}
    t0 = time.time()
    final = storage.commit(tmp, 3, given)
    t1 = time.time()
    manifest = json.loads((final / "manifest.json").read_text())
    import xxhash

    assert manifest["files"] == {
        "__0_0.distcp": given["__0_0.distcp"],
        "meta.json": {"bytes": 2, "xxh3_128": xxhash.xxh3_128(b"{}").hexdigest()},
    }
    assert t0 <= manifest["committed"] <= t1


def test_temporary_names_carry_eight_hex_digits(tmp_path, monkeypatch):
    assert re.fullmatch(r"\.tmp-step-00000012-[0-9a-f]{8}", storage.new_tmp_dir(tmp_path, 12).name)
    assert storage.new_tmp_dir(tmp_path, 12, run_id="r1").name == ".tmp-step-00000012-r1"
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(
        storage.os, "replace", lambda a, b: replaced.append((Path(a).name, Path(b).name)) or real_replace(a, b)
    )
    storage.write_json_atomic(tmp_path / "x.json", {"a": [1, 2]})
    fake_checkpoint(tmp_path, 4)
    names = [src for src, _ in replaced]
    assert re.fullmatch(r"\.x\.json\.[0-9a-f]{8}", names[0])
    assert re.fullmatch(r"\.manifest\.json\.[0-9a-f]{8}", names[1])
    assert re.fullmatch(r"\.latest\.[0-9a-f]{8}", names[2]) and replaced[2][1] == "latest"


def test_json_files_are_written_one_item_a_line(tmp_path):
    """meta.json and manifest.json stay readable and diffable by a person: one indent step, a final newline."""
    storage.write_json_atomic(tmp_path / "x.json", {"a": [1, 2], "b": {"c": None}})
    assert (tmp_path / "x.json").read_text() == '{\n "a": [\n  1,\n  2\n ],\n "b": {\n  "c": null\n }\n}\n'


def test_retention_of_one_keeps_only_the_newest(tmp_path):
    for step in (1, 2):
        fake_checkpoint(tmp_path, step)
    assert [p.name for p in storage.remove_old(tmp_path, keep=1)] == ["step-00000001"]
    assert [p.name for p in storage.complete_checkpoints(tmp_path)] == ["step-00000002"]


def test_a_removal_that_fails_does_not_stop_the_run(tmp_path, monkeypatch):
    """Retention and the clean-up of crashed saves are best effort: a folder that cannot be removed (another
    process removing it too, a busy network file system) is left, and training goes on."""
    for step in (1, 2):
        fake_checkpoint(tmp_path, step)
    storage.new_tmp_dir(tmp_path, 3).mkdir()
    real_rmtree = shutil.rmtree

    def failing_rmtree(path, ignore_errors=False, **kwargs):
        if not ignore_errors:
            raise OSError(16, "Device or resource busy", str(path))

    monkeypatch.setattr(storage.shutil, "rmtree", failing_rmtree)
    assert [p.name for p in storage.remove_old(tmp_path, keep=1)] == ["step-00000001"]
    storage.remove_abandoned(tmp_path)
    monkeypatch.setattr(storage.shutil, "rmtree", real_rmtree)


# -- checksums taken while writing (HashingWriter) and metadata read once (SafeReader(metadata=...)) ---------


def _save_with_hashing(folder: Path, state: dict, **kwargs) -> hashing.HashingWriter:
    writer = hashing.HashingWriter(str(folder), **kwargs)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


@pytest.mark.parametrize("threads", [1, 3])
def test_checksums_taken_while_writing_equal_the_files_read_back(tmp_path, threads):
    """Every data file DCP writes (one per writer thread) gets the size and xxh3-128 of its bytes as they are
    on disk: the independent reference is the file read back and hashed (file_digest)."""
    state = {f"w{i}": torch.randn(64, 33 + i) for i in range(5)} | {"lr": 0.25, "step": torch.tensor(7)}
    tmp = storage.new_tmp_dir(tmp_path, 3)
    writer = _save_with_hashing(tmp, state, thread_count=threads)
    files = sorted(p.name for p in tmp.glob("*.distcp"))
    assert len(files) == threads and sorted(writer.digests.keys() & set(files)) == files
    for name in files:
        assert writer.digests[name] == {
            "bytes": (tmp / name).stat().st_size,
            storage.HASH: storage.file_digest(tmp / name),
        }
    # what commit records is what verify checks: the checkpoint verifies, and a flipped byte is still found
    final = storage.commit(tmp, 3, storage.describe_files(tmp, files, writer.digests))
    storage.verify(final)
    data = bytearray((final / files[0]).read_bytes())
    data[len(data) // 2] ^= 1
    (final / files[0]).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its xxh3_128 checksum"):
        storage.verify(final)


def test_a_digest_is_used_only_when_the_file_still_has_its_size(tmp_path):
    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "b").write_bytes(b"abc")
    known = {"a": {"bytes": 5, storage.HASH: "taken while writing"}, "b": {"bytes": 99, storage.HASH: "stale"}}
    got = storage.describe_files(tmp_path, ["a", "b"], known)
    assert got["a"] == known["a"]
    assert got["b"] == {"bytes": 3, storage.HASH: storage.file_digest(tmp_path / "b")}


def test_a_stream_that_seeks_records_no_digest(tmp_path):
    """Hashing in write order is right only for sequential writes: after a seek the stream records nothing,
    so the commit reads the file back."""
    fs = hashing._HashingFileSystem({})
    with fs.create_stream(tmp_path / "seq", "wb") as s:
        s.write(b"hello ")
        s.write(memoryview(b"world"))
        assert s.tell() == 11 and s.name == str(tmp_path / "seq")
    with fs.create_stream(tmp_path / "seeked", "wb") as s:
        assert s.writable() and not s.readable()
        assert s.write(b"hello world") == 11
        assert s.seek(6) == 6 and s.write(b"W") == 1
        assert s.seek(-2, io.SEEK_END) == 9 and s.write(b"LD") == 2
    assert (tmp_path / "seeked").read_bytes() == b"hello WorLD"
    assert fs.digests == {"seq": {"bytes": 11, storage.HASH: storage.file_digest(tmp_path / "seq")}}
    with fs.create_stream(tmp_path / "wide", "wb") as s:  # a buffer of 4-byte items: 12 bytes, all hashed
        assert s.write(memoryview(torch.arange(3, dtype=torch.int32).numpy())) == 12
    assert fs.digests["wide"] == {"bytes": 12, storage.HASH: storage.file_digest(tmp_path / "wide")}
    with fs.create_stream(tmp_path / "seq", "rb") as s:  # reading is plain reading
        assert s.read() == b"hello world"
    assert sorted(fs.digests) == ["seq", "wide"]


def test_the_safe_reader_uses_metadata_it_is_given(tmp_path):
    """The metadata verify has read (through the allowlist) is not unpickled a second time by the load."""
    dcp.save({"t": torch.arange(4.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = storage.read_dcp_metadata(tmp_path / ".metadata")
    (tmp_path / ".metadata").write_bytes(b"not a pickle")  # would fail if read again
    out = {"t": torch.zeros(4)}
    dcp.load(out, storage_reader=storage.SafeReader(str(tmp_path), metadata=metadata), no_dist=True)
    assert out["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises(CheckpointException, match="unsafe or corrupted checkpoint metadata"):
        dcp.load(out, storage_reader=storage.SafeReader(str(tmp_path)), no_dist=True)
