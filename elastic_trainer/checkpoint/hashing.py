"""Checksums taken while a checkpoint's files are written, so that the commit need not read them back.

A save's data files pass through `HashingStream` (DCP's writer through `HashingWriter`, the durable copy of a
state in memory directly); the commit records each file's size and digest in the manifest (`storage.commit`).
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

HASH = "xxh3_128"


class HashingStream(io.BufferedIOBase):
    """A file opened for writing that hashes what passes through it (HashingWriter's files, and the durable
    copies of states in memory). Any seek makes the digest unusable (then the file is read back and hashed at
    commit, as without this stream)."""

    def __init__(self, raw, on_close):
        import xxhash

        self._raw, self._on_close = raw, on_close
        self._hash, self._bytes = xxhash.xxh3_128(), 0

    @property
    def name(self):
        return self._raw.name

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = self._raw.write(data)  # a buffered file in blocking mode: all of it, or an exception
        if self._hash is not None:
            self._hash.update(data)
        self._bytes += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._hash = None  # bytes may be rewritten: no digest of this file from here
        return self._raw.seek(offset, whence)

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
            if self._hash is not None:
                self._on_close(self._bytes, self._hash.hexdigest())
        super().close()


class _HashingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, dict]):
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name

        def record(nbytes: int, digest: str) -> None:
            self.digests[name] = {"bytes": nbytes, HASH: digest}

        stream = HashingStream(open(path, mode), record)
        try:
            yield stream
        finally:
            stream.close()


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that takes each data file's checksum while writing it (`digests`, by file name),
    so that the commit need not read the files back (one pass over the bytes instead of two)."""

    def __init__(self, path: str | os.PathLike, **kwargs):
        super().__init__(path, **kwargs)
        self.digests: dict[str, dict] = {}
        self.fs = _HashingFileSystem(self.digests)
