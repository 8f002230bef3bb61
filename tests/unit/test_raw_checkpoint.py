"""The hand-over's file format (checkpoint/raw.py), in one process: DCP's plan with each piece as its bytes.

- a state of every kind a training state holds (fp32, bf16, int64, a 0-dim tensor, an empty one, a transposed
  view, a non-tensor item) written by `raw.Writer` on 1 and 3 threads reads back equal through `raw.Reader`,
  each tensor's bytes where the record says, at a 64-byte boundary;
- `raw.to_dcp` with the metadata's places replaced gives files that torch's own FileSystemReader (not ours)
  reads back equal: the durable copy of a state in memory is a plain DCP checkpoint;
- a piece larger than the reader needs is read in part (DCP's storage offsets and lengths are honoured): a
  bf16 matrix stored whole is read into two row halves; a target of another shape is refused;
- the mapping of a file is not closed under a tensor that still views it.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from elastic_trainer.checkpoint import raw, storage
from elastic_trainer.config import CheckpointError


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(33, 17, generator=g),
        "half": torch.randn(8, 5, generator=g).to(torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "t": torch.randn(6, 9, generator=g).t(),  # a view that is not contiguous
        "hyper": {"lr": 0.001, "betas": [0.9, 0.95]},  # stored as bytes
    }


def blank(like):
    """`like` with every tensor zeroed and every other leaf None (what the load must fill in)."""
    if isinstance(like, dict):
        return {k: blank(v) for k, v in like.items()}
    return torch.zeros_like(like) if isinstance(like, torch.Tensor) else None


def save(folder, threads: int) -> raw.Writer:
    writer = raw.Writer(folder, thread_count=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" warning
        dcp.save(state(), storage_writer=writer, no_dist=True)
    return writer


def load(state_dict: dict, reader, planner=None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, storage_reader=reader, planner=planner or storage.SafeLoadPlanner(), no_dist=True)


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("threads", [1, 3])
def test_each_piece_is_its_bytes_and_reads_back_equal(tmp_path, threads):
    writer = save(tmp_path, threads)
    assert len({p.info.relative_path for p in writer.pieces.values()}) == threads
    for index, piece in writer.pieces.items():
        assert piece.info.offset % raw.ALIGN == 0
        if piece.is_bytes:
            continue
        value = state()[index.fqn].contiguous()
        stored = (tmp_path / piece.info.relative_path).read_bytes()[piece.info.offset :][: piece.info.length]
        as_numpy = value.view(torch.int16) if value.dtype == torch.bfloat16 else value  # numpy has no bf16
        assert stored == as_numpy.numpy().tobytes(), index.fqn
    got = blank(state())
    load(got, raw.Reader(str(tmp_path)))
    assert_equal(got, state())


def test_the_durable_copy_is_read_by_torchs_own_reader(tmp_path):
    source, target = tmp_path / "memory", tmp_path / "durable"
    source.mkdir(), target.mkdir()
    writer = save(source, 2)
    digests = {}
    placed = raw.to_dcp(source, target, writer.pieces, lambda name, n, d: digests.update({name: (n, d)}))
    assert sorted(digests) == sorted(p.name for p in target.iterdir())
    assert all(digests[p.name][0] == p.stat().st_size for p in target.iterdir())
    metadata = storage.read_dcp_metadata(source / ".metadata")
    metadata.storage_data.update(placed)
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    got = blank(state())
    load(got, FileSystemReader(str(target)), DefaultLoadPlanner())
    assert_equal(got, state())


def test_a_stored_piece_is_read_in_part(tmp_path):
    """Two "ranks" of a new layout each want half the rows of a matrix one rank stored whole."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    save(tmp_path, 1)
    reader = raw.Reader(str(tmp_path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    whole = state()["half"]

    class Planner:
        def __init__(self, target):
            self.target = target

        def resolve_tensor(self, req):
            return self.target

        def commit_tensor(self, req, tensor):
            pass

    for start in (0, 4):
        target = torch.zeros(4, 5, dtype=torch.bfloat16)
        req = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("half", torch.Size([start, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex("half", torch.Size([0, 0])),
            storage_offsets=torch.Size([start, 0]),
            lengths=torch.Size([4, 5]),
        )
        assert isinstance(metadata.state_dict_metadata["half"].chunks[0], ChunkStorageMetadata)
        reader.read_data(type("Plan", (), {"items": [req]})(), Planner(target)).wait()
        assert torch.equal(target, whole[start : start + 4])
    # a plan whose target does not match the part (copy_ would broadcast it) is refused
    with pytest.raises(CheckpointError, match="shape"):
        reader.read_data(type("Plan", (), {"items": [req]})(), Planner(torch.zeros(1, 5, dtype=torch.bfloat16)))


def test_the_mapping_outlives_the_tensors_that_view_it(tmp_path):
    """A read that fails midway leaves a tensor over the mapped file in its traceback: closing the mapping
    then must wait for it (an unmapped view reads garbage or crashes), and close once it is gone."""
    import mmap

    path = tmp_path / "piece"
    path.write_bytes(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = raw._view(mapped, torch.float32, 16, 0)
    raw._close(mapped)
    assert not mapped.closed and float(view.sum()) == 120.0
    del view
    raw._close(mapped)
    assert mapped.closed
