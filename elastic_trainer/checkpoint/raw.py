"""The hand-over's files: DCP's plan and metadata, each stored piece as its bare bytes.

DCP's FileSystemWriter frames every tensor it stores with `torch.save` (a zip record with a checksum) and its
reader gets each one back through `torch.load` into a new tensor, which is then copied into the target: three
passes over the state on the write side and the read side together, and a fixed cost per piece. For a state
that lives a few seconds in host memory between two worlds of one job that is most of the hand-over's time:
0.74 GB of fp32 tensors into /dev/shm, one process, 2-core machine (benchmarks/rescale/file_format.py):
`dcp.save` 0.51 s, this module's writer 0.28 s (the bare `os.write` of the same bytes 0.25 s); `dcp.load`
0.47 s, this module's reader 0.10 s.

So the hand-over keeps everything of DCP that decides *what* goes where (the save plan with its deduplication,
the global metadata, the load plan that reshards into any layout) and changes only how a piece is stored:

- `Writer` (a FileSystemWriter) writes each piece's bytes at a 64-byte aligned offset of the rank's file(s),
  into files allocated ahead where it is given them (spare.py), and keeps, for this rank, what each piece is
  (dtype and shape), so that the durable copy can be made later;
- `Reader` maps each file and copies a piece's needed part straight into the target tensor (on the host or a
  GPU), with no intermediate tensor;
- `to_durable` (each rank's pieces through `to_dcp`, then the metadata) turns the files into DCP's own
  format, what any `dcp.load` reads, when the durable checkpoint is made from the copy in memory: checkpoints
  on disk stay plain DCP.

Non-tensor pieces (bytes) are stored as DCP stores them, so their reading is DCP's.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import mmap
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.futures import Future

from elastic_trainer.checkpoint import hashing, storage
from elastic_trainer.config import CheckpointError
from elastic_trainer.elastic.handover import host_name

ALIGN = 64
SUFFIX = ".distcp"


@dataclass(frozen=True)
class Piece:
    """One stored piece of this rank: where it is, and what it is (a tensor's dtype and shape, or bytes)."""

    info: _StorageInfo
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()

    @property
    def is_bytes(self) -> bool:
        return self.dtype is None


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class StalePlan(CheckpointError):
    """The plan a write was given does not fit the state it writes (a planned hand-over's; see planned.py)."""


def files_of(plan, threads: int) -> list[tuple[str, list]]:
    """The files a rank's `plan` is written into, one per thread (DCP's own split, of about equal bytes, none
    left empty), each with its items in the order they are written: tensors first, whose places follow from
    their sizes alone (`tensor_places`), then the non-tensor items, whose sizes are known once serialized."""
    groups = [g for g in _split_by_size_and_type(threads, list(plan.items)) if g]
    return [
        (f"{plan.storage_data.prefix}{n}{SUFFIX}", sorted(g, key=lambda i: i.type == WriteItemType.BYTE_IO))
        for n, g in enumerate(groups)
    ]


def tensor_places(files: list[tuple[str, list]]) -> dict[MetadataIndex, _StorageInfo]:
    """Where `Writer` puts each tensor item of `files` (`files_of`), known before anything is written."""
    out = {}
    for name, items in files:
        offset = 0
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                break
            data = item.tensor_data
            length = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
            out[item.index] = _StorageInfo(name, offset, length)
            offset = _aligned(offset + length)
    return out


def done_future(value) -> Future:
    """A Future already holding `value`: what DCP's storage interface returns for work done on the spot."""
    future: Future = Future()
    future.set_result(value)
    return future


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class Writer(FileSystemWriter):
    """DCP's writer with each piece stored as its bytes (see the module). `pieces`: this rank's, once written."""

    def __init__(self, path: str | os.PathLike, thread_count: int = 1, spares: dict[str, Path] | None = None):
        super().__init__(path, sync_files=False, thread_count=thread_count)
        self.pieces: dict[MetadataIndex, Piece] = {}
        self.spares = dict(spares or {})
        """{file name: a file allocated for it ahead (spare.py)}: moved into the folder and written into."""

    def write_data(self, plan, planner) -> Future:
        files = files_of(plan, self.thread_count)
        serialized = _Serialized(planner)
        if len(files) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
                done = list(pool.map(lambda f: self._write_file(*f, serialized), files))
        else:
            done = [self._write_file(*f, serialized) for f in files]
        results = []
        for pieces in done:
            for index, piece in pieces:
                self.pieces[index] = piece
                results.append(WriteResult(index=index, size_in_bytes=piece.info.length, storage_data=piece.info))
        return done_future(results)

    def _write_file(self, name: str, items: list, serialized: _Serialized) -> list[tuple[MetadataIndex, Piece]]:
        out, offset, end = [], 0, 0
        path, spare = os.path.join(self.path, name), self.spares.pop(name, None)
        try:
            if spare is not None:
                os.rename(spare, path)
        except OSError:  # gone (its process's folder swept): a new file
            spare = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if spare is not None else os.O_TRUNC), 0o600)
        try:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    raw, dtype, shape = serialized(item), None, ()
                else:
                    _check_tensor(item, serialized.planner.state_dict.get(item.index.fqn))
                    data = serialized.planner.resolve_data(item)
                    want = item.tensor_data
                    if data.dtype != want.properties.dtype or tuple(data.shape) != tuple(want.chunk.sizes):
                        raise StalePlan(
                            f"{item.index.fqn}: planned {want.properties.dtype} "
                            f"{tuple(want.chunk.sizes)}, the state holds {data.dtype} {tuple(data.shape)}"
                        )
                    raw, dtype, shape = _host_bytes(data), data.dtype, tuple(data.shape)
                _write_all(fd, raw, offset)
                out.append((item.index, Piece(_StorageInfo(name, offset, len(raw)), dtype, shape)))
                end = offset + len(raw) if len(raw) else end  # an empty piece writes nothing
                offset = _aligned(offset + len(raw))
            if spare is not None:
                os.ftruncate(fd, end)  # the size a new file would have
        finally:
            os.close(fd)
        return out


def _check_tensor(item, value) -> None:
    """StalePlan unless `value` is a tensor of the planned global size whose local part starts where the plan
    says (a DTensor of other placements can have a local part of the same shape elsewhere)."""
    want = item.tensor_data
    if not isinstance(value, torch.Tensor):
        raise StalePlan(f"{item.index.fqn}: planned a tensor, the state holds {type(value).__name__}")
    offsets = (0,) * value.dim()
    if isinstance(value, DTensor):
        offsets = tuple(compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)[1])
    if tuple(value.shape) != tuple(want.size) or offsets != tuple(want.chunk.offsets):
        raise StalePlan(
            f"{item.index.fqn}: planned {tuple(want.size)} from {tuple(want.chunk.offsets)}, the state "
            f"holds {tuple(value.shape)} from {offsets}"
        )


class _Serialized:
    """A non-tensor item's bytes as DCP stores them (`torch.save`), made once per distinct plain value: the
    flattened optimizer state repeats a few hyper-parameters in thousands of items."""

    PLAIN = (int, float, bool, str, type(None))

    def __init__(self, planner):
        self.planner, self.seen = planner, {}

    def __call__(self, item) -> memoryview:
        value = self.planner.lookup_object(item.index)
        if isinstance(value, torch.Tensor):  # planned as bytes (DCP would store it as a tensor now)
            raise StalePlan(f"{item.index.fqn}: planned a non-tensor item, the state holds a tensor")
        key = repr(value) if self._plain(value) else None  # repr tells 1, 1.0 and True apart; == does not
        if key is None or key not in self.seen:
            data = self.planner.transform_object(item, value).getbuffer()
            if key is None:
                return data
            self.seen[key] = data
        return self.seen[key]

    def _plain(self, value) -> bool:
        if isinstance(value, (tuple, list)):
            return all(self._plain(v) for v in value)
        return type(value) in self.PLAIN


class Reader(storage.SafeReader):
    """Reads the files `Writer` wrote (the metadata through the allowlisted unpickler, as SafeReader)."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, reqs in per_file.items():
            mapped = _map(os.path.join(self.path, name))
            try:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_one(req, planner, mapped)
            finally:
                _close(mapped)
        return done_future(None)

    def _read_one(self, req, planner, mapped) -> None:
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(mapped[info.offset : info.offset + info.length] if mapped else b""))
            return
        dtype, shape = self._chunks[(req.storage_index.fqn, tuple(req.storage_index.offset))]
        target = planner.resolve_tensor(req).detach()
        count = info.length // dtype.itemsize
        if count:
            part = narrow_tensor_by_index(
                _view(mapped, dtype, count, info.offset).view(shape), req.storage_offsets, req.lengths
            )
            if part.shape != target.shape:  # copy_ would broadcast a smaller piece without a word
                raise CheckpointError(
                    f"{req.storage_index.fqn}: a stored part of shape {tuple(part.shape)} "
                    f"for a target of shape {tuple(target.shape)}"
                )
            target.copy_(part)
            del part  # the mapping closes only once no tensor views it
        planner.commit_tensor(req, target)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = _chunk_shapes(metadata)


def _chunk_shapes(metadata: Metadata) -> dict:
    """{(fqn, chunk offsets): (dtype, chunk shape)} of every stored tensor piece."""
    out = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                out[(fqn, tuple(chunk.offsets))] = (entry.properties.dtype, tuple(chunk.sizes))
    return out


# -- the durable copy ---------------------------------------------------------------------------------------


def to_dcp(
    source: str | os.PathLike, target: str | os.PathLike, pieces: dict[MetadataIndex, Piece], on_file
) -> dict[MetadataIndex, _StorageInfo]:
    """Write this rank's pieces (`pieces`, from its Writer) from the files in `source` into files of the same
    names in `target` as DCP stores them (`torch.save` per tensor), each file fsynced and its digest reported
    through `on_file(name, nbytes, digest)`; the pieces' places in the new files (for the metadata)."""
    by_file: dict[str, list] = {}
    for index, piece in pieces.items():
        by_file.setdefault(piece.info.relative_path, []).append((index, piece))
    placed: dict[MetadataIndex, _StorageInfo] = {}
    for name, entries in sorted(by_file.items()):
        entries.sort(key=lambda e: e[1].info.offset)
        mapped = _map(os.path.join(source, name))
        try:
            with _synced(os.path.join(target, name), lambda n, h, name=name: on_file(name, n, h)) as stream:
                for index, piece in entries:
                    start = stream.tell()
                    _store(stream, mapped, piece)
                    placed[index] = _StorageInfo(name, start, stream.tell() - start)
        finally:
            _close(mapped)
    return placed


def _store(stream, mapped: mmap.mmap | None, piece: Piece) -> None:
    """One piece from the mapped file into `stream` as DCP stores it: bytes as they are, a tensor `torch.save`d."""
    info = piece.info
    if piece.is_bytes:
        stream.write(mapped[info.offset : info.offset + info.length] if mapped else b"")
        return
    count = info.length // piece.dtype.itemsize
    tensor = (_view(mapped, piece.dtype, count, info.offset) if count else torch.empty(0, dtype=piece.dtype)).view(
        piece.shape
    )
    torch.save(tensor, stream)


def to_durable(pg, folder: Path, pieces: dict[MetadataIndex, Piece], target: Path) -> dict[str, dict]:
    """Write this rank's `pieces` of the state in memory in `folder` into a durable checkpoint's folder `target`
    in DCP's own format, hashed on the way as a save's files are (a collective of `pg`: rank 0 also writes the
    metadata with every piece's new place). The {name: {"bytes", HASH}} the commit records."""
    out: dict[str, dict] = {}

    def record(name: str, nbytes: int, digest: str) -> None:
        out[name] = {"bytes": nbytes, hashing.HASH: digest}

    error = None
    try:
        placed = to_dcp(folder, target, pieces, record)
    except Exception as e:  # any failure (torch.save reports a full disk as a RuntimeError): every rank hears it
        placed, error = {}, f"{host_name()}: {type(e).__name__}: {e}"
    rank = dist.get_rank(pg)
    gathered = [None] * dist.get_world_size(pg) if rank == 0 else None
    dist.gather_object((placed, error), gathered, dst=0, group=pg)
    outcome = [None]
    if rank == 0:
        outcome = [next((e for _, e in gathered if e), None)]
        if outcome[0] is None:
            try:
                _write_metadata(folder, target, [got for got, _ in gathered], record)
            except Exception as e:  # every rank waits in the broadcast below
                outcome = [f"{host_name()}: {type(e).__name__}: {e}"]
    dist.broadcast_object_list(outcome, src=0, group=pg)  # every rank raises alike, or none does
    if outcome[0]:
        raise CheckpointError(f"the durable copy of the state in memory failed ({outcome[0]})")
    return out


def _write_metadata(folder: Path, target: Path, placed: list[dict], record) -> None:
    """The in-memory state's DCP metadata with every piece's place in the durable files."""
    metadata = storage.read_dcp_metadata(folder / ".metadata")
    moved = {index for got in placed for index in got}
    if moved != set(metadata.storage_data):  # a piece left where memory had it would fail only when loaded
        raise CheckpointError(f"{len(set(metadata.storage_data) - moved)} of the state's pieces were not copied")
    for got in placed:
        metadata.storage_data.update(got)
    with _synced(target / ".metadata", lambda nbytes, digest: record(".metadata", nbytes, digest)) as stream:
        pickle.dump(metadata, stream)


@contextmanager
def _synced(path: str | os.PathLike, on_close):
    """A new file written through a HashingStream (its digest to `on_close`), fsynced once fully written."""
    stream = hashing.HashingStream(open(path, "wb"), on_close)
    try:
        yield stream
        stream.flush()
        os.fsync(stream.fileno())
    finally:
        stream.close()


def _map(path: str | os.PathLike) -> mmap.mmap | None:
    """The file mapped copy-on-write (a private mapping: nothing written back), None when it is empty."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None


def _view(mapped: mmap.mmap, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """A tensor over bytes of the mapped file. Through a memoryview, so that the mapping refuses to close while
    a tensor views it (torch.frombuffer of the mmap itself lets it close under the tensor)."""
    return torch.frombuffer(memoryview(mapped), dtype=dtype, count=count, offset=offset)


def _close(mapped: mmap.mmap | None) -> None:
    """Unmap now, or (a tensor of a failed read still views it) once the last view is gone."""
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass
