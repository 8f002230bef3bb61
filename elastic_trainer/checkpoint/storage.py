"""Checkpoint files on disk: safe reading, integrity manifest, atomic commit, discovery and retention.

A checkpoint directory DIR holds complete checkpoints and nothing half-written is ever visible:

    DIR/step-00000030/     a complete checkpoint: DCP files (.metadata, __R_I.distcp), meta.json, manifest.json
    DIR/.tmp-step-00000040-<id>/   a save in progress (or abandoned by a crash); never read
    DIR/latest             "step-00000030", replaced atomically after each commit

A save writes into a temporary folder; the commit records every file's size and xxh3-128 checksum in
manifest.json, then renames the folder to its final name (atomic on POSIX), fsyncs, and replaces `latest`.
Readers list `step-*` folders, so a crash at any point leaves at most an ignored temporary folder. Tests kill
the commit at chosen points through `checkpoint.faults`.

Security: loading never unpickles arbitrary objects. DCP's own reader unpickles `.metadata` without
restriction (pytorch issue 189308) and its load planner reads non-tensor items with
`torch.load(weights_only=False)`; `SafeReader` and `SafeLoadPlanner` replace both with allowlisted loading.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from elastic_trainer.checkpoint import faults
from elastic_trainer.checkpoint.hashing import HASH
from elastic_trainer.config import CheckpointError, ConfigError

STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
META = "meta.json"
LATEST = "latest"


# -- safe loading ---------------------------------------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside a fixed allowlist."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint metadata {str(path)!r} cannot be read ({e.strerror or e})") from None
    return parse_dcp_metadata(data, repr(str(path)))


def parse_dcp_metadata(data: bytes, where: str) -> Metadata:
    """DCP metadata from its bytes through the allowlisted unpickler (`where` names it in errors)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ValueError,
        ImportError,
        IndexError,
        TypeError,
        KeyError,
    ) as e:
        raise CheckpointError(f"unsafe or corrupted checkpoint metadata {where}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} does not hold DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read through the allowlisted unpickler.

    DCP swallows a failing read and retries with rank-local metadata, wrapping both errors; callers that
    want the one-line reason call `read_dcp_metadata` first (Checkpointer does) and may pass what it returned
    as `metadata`, so that the file is not unpickled twice (a quarter of a second at gpt3-medium)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._known_metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # we never write rank-local metadata
            raise CheckpointError("rank-local checkpoint metadata is not supported")
        metadata = self._known_metadata or read_dcp_metadata(self._get_metadata_path())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyper-parameters) are read with torch.load(weights_only=True), each distinct
    payload once: the flattened optimizer state repeats a few values in thousands of items (gpt3-medium: 3,212
    items a rank, 0.3 s of torch.load), and every item gets its own copy of the object."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        payload = value.getvalue()
        seen = self.__dict__.setdefault("_loaded", {})
        if payload not in seen:
            try:
                seen[payload] = torch.load(io.BytesIO(payload), weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"refusing unsafe item {read_item.dest_index.fqn!r} in checkpoint: {_refusal_reason(e)}"
                ) from None
        obj = copy.deepcopy(seen[payload])
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _refusal_reason(error: Exception) -> str:
    """The line of torch's weights-only refusal that names the global (its first line is generic advice),
    without terminal colour codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or [type(error).__name__])[0]


# -- integrity ------------------------------------------------------------------------------------


def file_digest(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(folder: Path, names: list[str], known: dict[str, dict] | None = None) -> dict[str, dict]:
    """{name: {"bytes", HASH}} for files in folder; a name in `known` (digests taken while writing, see
    HashingWriter) is taken from it when its size still matches, the others are read and hashed."""
    known = known or {}
    out = {}
    for n in names:
        size = (folder / n).stat().st_size
        seen = known.get(n)
        out[n] = seen if seen and seen["bytes"] == size else {"bytes": size, HASH: file_digest(folder / n)}
    return out


def read_manifest(folder: Path) -> dict[str, dict]:
    """{file name: {"bytes", HASH}} recorded at commit; CheckpointError when unreadable."""
    try:
        return json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{folder.name}: unreadable manifest ({e})") from None


def verify(folder: Path, rank: int = 0, world: int = 1) -> None:
    """Check sizes and checksums against manifest.json; raise CheckpointError.

    All files, or with `world` > 1 this rank's share (every world-th file in name order), so that ranks
    verify a checkpoint in parallel."""
    manifest = read_manifest(folder)
    for name in sorted(manifest)[rank::world]:
        expected = manifest[name]
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{folder.name}: file {name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{folder.name}: file {name} has {size} bytes, expected {expected['bytes']} (truncated?)"
            )
        if file_digest(path) != expected[HASH]:
            raise CheckpointError(f"{folder.name}: file {name} fails its {HASH} checksum (corrupted)")


# -- atomic commit, discovery, retention ----------------------------------------------------------


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def new_tmp_dir(root: Path, step: int, run_id: str | None = None) -> Path:
    """Where a save of `step` writes before its commit; `run_id` (the same on every rank) or a random one."""
    return root / f"{TMP_PREFIX}{step_dirname(step)}-{run_id or uuid.uuid4().hex[:8]}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(tmp: Path, step: int, file_info: dict[str, dict]) -> Path:
    """Write the manifest, make the checkpoint visible under its final name, point `latest` at it."""
    root = tmp.parent
    info = dict(file_info)
    for name in sorted(p.name for p in tmp.iterdir()):
        if name not in info and name != MANIFEST:
            info.update(describe_files(tmp, [name]))
    write_json_atomic(tmp / MANIFEST, {"hash": HASH, "files": info, "committed": time.time()})
    _fsync_dir(tmp)
    faults.fault("written", step)
    final = root / step_dirname(step)
    if final.exists():
        # The same step saved again (a resumed run stopping at once): the same state of the same trajectory
        # (resuming checks it). Keep the committed copy: deleting it first and renaming would leave a moment
        # with no step-N at all, and a crash then would lose both (the new one is still a temporary folder).
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, final)
        _fsync_dir(root)
    faults.fault("renamed", step)
    latest = root / f".{LATEST}.{uuid.uuid4().hex[:8]}"
    latest.write_text(final.name + "\n")
    os.replace(latest, root / LATEST)
    _fsync_dir(root)
    return final


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoints in root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def none_resumable(root: str | os.PathLike, errors: list[str]) -> CheckpointError:
    """The error for a folder whose every checkpoint is damaged (`errors`, newest first): starting over would
    bury them under new saves, and --keep would delete them."""
    return CheckpointError(
        f"no checkpoint in --checkpoint-dir {root} can be resumed ({len(errors)} damaged; "
        f"newest: {errors[0]}); repair them, move them away or pass another --checkpoint-dir "
        "to start over"
    )


def require_no_checkpoints(root: str | os.PathLike) -> None:
    """For `--resume never`: ConfigError when root already holds complete checkpoints."""
    existing = complete_checkpoints(root)
    if existing:
        raise ConfigError(
            f"--checkpoint-dir {root} already holds checkpoints ({existing[0].name}, ...); "
            "resume them (--resume auto) or use an empty folder"
        )


def remove_old(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (keep <= 0 keeps all); return what was removed."""
    if keep <= 0:
        return []
    removed = complete_checkpoints(root)[keep:]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def remove_abandoned(root: Path) -> None:
    """Temporary folders of saves that never committed (a crash); called before a run saves anything."""
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(TMP_PREFIX) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


META_FIELDS = {"format": int, "step": int, "model": dict, "train": dict, "layout": dict}


def read_meta(folder: Path) -> dict:
    """meta.json of a checkpoint folder, its structure checked (the keys and types every reader relies on)."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is unreadable ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object")
    for key, kind in META_FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise CheckpointError(
                f"{str(path)!r}: {key!r} is missing or not {'an integer' if kind is int else 'an object'}"
                " (a damaged or foreign meta.json)"
            )
    if meta["step"] < 0:
        raise CheckpointError(f"{str(path)!r}: step {meta['step']} is negative")
    for key in ("dp", "tp", "pp"):
        if not isinstance(meta["layout"].get(key), int):
            raise CheckpointError(f"{str(path)!r}: layout.{key} is missing or not an integer")
    for key in ("schedule_steps", "data"):
        if key not in meta["train"]:
            raise CheckpointError(f"{str(path)!r}: train.{key} is missing")
    try:
        from elastic_trainer.config import ModelConfig

        ModelConfig(**meta["model"])
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{str(path)!r}: its model is not valid ({' '.join(str(e).split())})") from None
    return meta


def first_failure(error) -> str:
    """The first rank's exception of a DCP CheckpointException (every rank's tracebacks), on one line."""
    for failure in error.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        text = str(exc).strip().splitlines()
        return text[-1].strip() if text else type(exc).__name__
    return str(error).splitlines()[0]
