"""Shared memory for the hand-over's files, allocated while the next world starts.

A file written into fresh tmpfs pages pays for each page as it is written: the kernel allocates it, and on a
virtual machine the hypervisor backs it first (pages a guest frees are handed back to the host). The write
of gpt3-medium's state by 4 ranks at once (4.28 GB, 2-core machine, benchmarks/rescale/allocated_ahead.py):
2.91 s into new pages, 2.21 s into pages only reserved ahead (`os.posix_fallocate`), 1.33 s into pages
written once ahead (`fill`, 2.5 s of its own). What is written ahead does not depend on the values, only on
the files' sizes, which the planned write (planned.py) knows ahead.

So once the launcher has started the next world (which then imports, connects and builds for seconds), each
rank of the stopping world allocates and writes its hand-over's files in a thread (`Spares`), in a folder
of its own process on its host; the write (`raw.Writer`) moves each one into the state's folder and writes into it.
The memory is the hand-over's copy, held from the next world's start instead of from the write. A file that
is not ready or not there is written as before; leftovers are removed by the rank (`remove`), and those of a
process that died by the next durable commit on the host (`sweep`, from `memory.drop`).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

from elastic_trainer.checkpoint import host_folders

PREFIX = ".spare-"
CHUNK = 64 << 20
NAME = re.compile(r"^\.spare-(\d+)(?:-snapshot)?$")
"""A process's spare folder: of a hand-over (spare.Spares), or of its snapshots (snapshot.py)."""


class Spares:
    """This process's files of the given sizes ({file name: bytes}), allocated in a thread (`start`)."""

    def __init__(self, root: Path, sizes: dict[str, int]):
        self.folder = root / f"{PREFIX}{os.getpid()}"
        self.sizes = dict(sizes)
        self.bytes = sum(self.sizes.values())
        self.seconds: float | None = None
        """How long the allocation took (None: not finished or failed)."""
        self.error: str | None = None
        self._thread = threading.Thread(target=self._allocate, name="spare-memory", daemon=True)

    def start(self) -> Spares:
        self._thread.start()
        return self

    def _allocate(self) -> None:
        t0 = time.perf_counter()
        try:
            shutil.rmtree(self.folder, ignore_errors=True)  # an earlier process's of this pid
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            self.folder.mkdir(mode=0o700)  # new, this user's: nothing in it is followed
            for name, size in self.sizes.items():
                fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    fill(fd, size)
                finally:
                    os.close(fd)
            self.seconds = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001  (a full /dev/shm: the files are written as before, into new pages)
            self.error = f"{type(e).__name__}: {e}"
            shutil.rmtree(self.folder, ignore_errors=True)

    def wait(self) -> None:
        self._thread.join()

    def take(self) -> tuple[dict[str, Path], float]:
        """({file name: its allocated file} for the write, seconds waited for the allocation to finish)."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        if self.error is not None or self.seconds is None:
            return {}, waited
        return {name: self.folder / name for name in self.sizes}, waited

    def remove(self) -> None:
        """What the write did not use, and the folder (waits for the allocation to end first)."""
        self.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def fill(fd: int, size: int) -> None:
    """`size` bytes of zeros into `fd`: every page allocated and written once (`os.posix_fallocate` alone
    reserves tmpfs pages without writing them, and a virtual machine's host provides a page on its first
    write: see the module)."""
    zeros = memoryview(bytes(min(size, CHUNK)))
    done = 0
    while done < size:  # the GIL is released in each pwrite
        done += os.pwrite(fd, zeros[: min(len(zeros), size - done)], done)


def sweep(root: Path) -> list[str]:
    """Remove the spare folders in `root` (one host's) of processes that no longer run; their names."""
    removed = []
    for folder in host_folders.entries(root):
        m = NAME.match(folder.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
