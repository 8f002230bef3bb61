"""This host's folders of a job's in-memory states (memory.py says what they hold): where they are, making
them, listing them. Two worlds of one host (the stopping one and the one that took its state) make, list and
remove these folders at the same moments, each removing the folders it left empty: nothing here fails because
the other world made or removed a folder a moment before."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path

from elastic_trainer.elastic.handover import host_name

SHM_ENV = "ELASTIC_TRAINER_SHM_DIR"
ID_FILE = ".memory-id"


def shm_base() -> Path:
    """Where in-memory states live: $ELASTIC_TRAINER_SHM_DIR, else /dev/shm (host memory)."""
    return Path(os.environ.get(SHM_ENV) or "/dev/shm")


def available_bytes() -> tuple[int, int]:
    """(memory this machine can still give (MemAvailable), free space of the shared-memory folder)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        available = 1 << 62
    base = shm_base()
    while not base.exists() and base != base.parent:
        base = base.parent
    stat = os.statvfs(base)
    return available, stat.f_bavail * stat.f_frsize


def _identity(checkpoint_dir: str, create: bool) -> str | None:
    """The checkpoint folder's random id (ID_FILE), written by the first save to memory: a folder deleted and
    made again never finds the states in memory of the job that used it before. None: never written."""
    path = Path(checkpoint_dir) / ID_FILE
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(8) + "\n")
        except FileExistsError:
            pass
    for _ in range(50):  # another rank may have created it a moment ago and be writing it
        try:
            identity = path.read_text().strip()
        except FileNotFoundError:
            return None
        if identity:
            return identity
        time.sleep(0.01)
    return None


def host_root(checkpoint_dir: str | os.PathLike, create: bool = False) -> Path | None:
    """This host's folder of the job's in-memory states (None when the job never wrote one; `create`: made)."""
    identity = _identity(str(checkpoint_dir), create)
    if identity is None:
        return None
    key = hashlib.sha256(f"{Path(checkpoint_dir).resolve()}\0{identity}".encode()).hexdigest()[:16]
    root = shm_base() / f"elastic-trainer-{os.getuid()}" / key / host_name()
    if create:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root.parents[1], 0o700)  # elastic-trainer-UID: this user's states only
    return root


def state_folder(checkpoint_dir: str, name: str) -> Path:
    """This host's new folder `name` for a state in memory."""
    tries = 3
    while True:
        folder = host_root(checkpoint_dir, create=True) / name
        try:
            folder.mkdir(exist_ok=True)
            return folder
        except FileNotFoundError:  # another world of this host removed the emptied folders as they were made
            tries -= 1
            if not tries:
                raise


def entries(folder: Path) -> list[Path]:
    """What `folder` holds, or nothing when it is not there (the other world removed it)."""
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove_empty(root: Path) -> None:
    """The host's, the job's and the user's folders once nothing is left in them."""
    for folder in (root, root.parent, root.parent.parent):
        try:
            folder.rmdir()
        except OSError:
            return
