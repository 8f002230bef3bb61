"""The hand-over's write, planned while the next world waits: at the hand-over the ranks only write bytes.

DCP plans every save: each rank makes its local plan, rank 0 gathers them, deduplicates the replicated items,
makes the metadata and scatters the final plans; after the write it gathers every rank's storage results,
writes the metadata and broadcasts it, unpickled again by every rank. None of that depends on the state's
values, only on its structure (names, shapes, dtypes, placements), which is fixed for a world once its
optimizer state exists. At gpt3-small on 4 ranks (2-core machine) it was about 0.5 s of planning and 0.5 s of
finishing in a 1.9 s write to memory.

So a world that waits for its state (the warm start, `train/job.py`) plans its own hand-over's write while
the old world still trains (`prepare`, a collective): DCP's save run through a writer that writes nothing,
keeping each rank's final plan and, on rank 0, the metadata with the places of every tensor piece, which
follow from the plan alone (`raw.tensor_places`). At the hand-over (`write_files`, from `memory.write`) each
rank writes its plan's items with `raw.Writer` and sends rank 0 only the places of its non-tensor items
(`write`), with which rank 0 completes the metadata (`metadata`). Files and metadata are those DCP's save of
the same state makes on the spot, item for item (tests/unit/test_planned_write.py); on GPUs the tensors'
recorded properties (pinned or not) are the GPU state's, not those of its staged host copy.

A plan serves only the state it was made for: a rank whose state's keys differ from it, or any item's kind
(tensor or not), dtype, shape, global size or place in the global tensor (`raw.StalePlan`), makes every rank
write through DCP's full save instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from elastic_trainer.checkpoint import raw
from elastic_trainer.config import CheckpointError
from elastic_trainer.elastic.handover import host_name


@dataclass
class Prepared:
    """A world's planned hand-over write (each rank its own)."""

    plan: SavePlan
    """This rank's final plan: DCP's, deduplicated across the ranks, with its files' prefix."""
    keys: frozenset
    """The keys of the flattened state it was made for."""
    threads: int
    """Files (and writing threads) per rank."""
    metadata: Metadata | None = None
    """Rank 0: DCP's metadata with the place of every tensor piece; the non-tensor ones come with the write."""
    late: list[list[MetadataIndex]] | None = None
    """Rank 0: each rank's non-tensor items, in the order it writes them."""


def prepare(pg, state: dict, threads: int) -> Prepared:
    """Plan the hand-over's write of `state` (a collective of `pg`): DCP's save with a writer that writes
    nothing. `threads`: files per rank, as the write will use."""
    dry = _Dry(threads)
    dcp.save(state, storage_writer=dry, process_group=pg)
    return Prepared(dry.plan, dry.keys, threads, dry.metadata, dry.late)


def sizes(prepared: Prepared) -> dict[str, int]:
    """{file name: bytes} of this rank's planned files, as far as the plan knows (their tensors)."""
    files = raw.files_of(prepared.plan, prepared.threads)
    out = {name: 0 for name, _ in files}
    for info in raw.tensor_places(files).values():
        if info.length:
            out[info.relative_path] = max(out[info.relative_path], info.offset + info.length)
    return out


def write_files(
    pg,
    state: dict,
    threads: int,
    folder: Path,
    prepared: Prepared | None,
    say=print,
    spares: dict[str, Path] | None = None,
):
    """Each rank's files of `state` in `folder`: as `prepared` says when it fits every rank's state (then the
    places of the non-tensor items, which complete the metadata on rank 0), else through DCP's save (then
    None: DCP has written the metadata); and this rank's pieces. `spares`: files allocated for the planned
    ones ahead (spare.py)."""
    if prepared is not None:
        late, status = None, None
        try:
            late, pieces = write(prepared, state, folder, spares)
        except raw.StalePlan as e:
            status = ("stale", f"{host_name()}: {e}")
        except Exception as e:  # noqa: BLE001  (every rank hears it, none waits in a collective)
            status = ("failed", f"{host_name()}: {type(e).__name__}: {e}")
        statuses = [None] * dist.get_world_size(pg)
        dist.all_gather_object(statuses, status, group=pg)
        failed = [why for what, why in filter(None, statuses) if what == "failed"]
        if failed:
            raise CheckpointError(f"writing the state to memory failed ({failed[0]})")
        if not any(statuses):
            return late, pieces
        say(
            f"[checkpoint] the planned hand-over does not fit the state "
            f"({next(why for _, why in filter(None, statuses))}); planning it now",
            flush=True,
        )
        for stale in [*folder.glob(f"__{dist.get_rank()}_*{raw.SUFFIX}"), *(spares or {}).values()]:
            stale.unlink(missing_ok=True)  # before DCP writes the state again
    writer = raw.Writer(folder, thread_count=threads)
    dcp.save(state, storage_writer=writer, process_group=pg)
    return None, writer.pieces


def write(
    prepared: Prepared, state: dict, folder, spares: dict[str, Path] | None = None
) -> tuple[list[tuple[str, int, int]], dict]:
    """This rank's part of `state` into `folder` as `prepared` says: the (file, offset, length) of each of its
    non-tensor items in `prepared.late`'s order, and its pieces (`raw.Writer.pieces`). raw.StalePlan when the
    plan does not fit the state."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
    if frozenset(planner.state_dict) != prepared.keys:
        changed = sorted(frozenset(planner.state_dict) ^ prepared.keys)
        raise raw.StalePlan(f"the state's items changed since it was planned ({len(changed)}, e.g. {changed[0]})")
    writer = raw.Writer(folder, thread_count=prepared.threads, spares=spares)
    results = writer.write_data(prepared.plan, planner).value()
    late = [
        (r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length)
        for r in results
        if writer.pieces[r.index].is_bytes
    ]
    return late, writer.pieces


def metadata(prepared: Prepared, late: list[list[tuple[str, int, int]]], storage_meta) -> Metadata:
    """Rank 0: the state's metadata, with the non-tensor places every rank wrote (`late`, by rank)."""
    places = dict(prepared.metadata.storage_data)
    for indices, got in zip(prepared.late, late, strict=True):
        if len(indices) != len(got):
            raise raw.StalePlan(f"{len(got)} non-tensor items written where {len(indices)} were planned")
        places.update((index, _StorageInfo(*where)) for index, where in zip(indices, got))
    return dataclasses.replace(prepared.metadata, storage_data=places, storage_meta=storage_meta)


class _Dry(raw.Writer):
    """A writer that writes nothing: it keeps this rank's final plan, and on rank 0 (DCP's finish) the
    metadata with every tensor piece's place and every rank's non-tensor items."""

    def __init__(self, threads: int):
        super().__init__("unwritten", thread_count=threads)
        self.plan = self.keys = self.metadata = self.late = None

    def prepare_local_plan(self, plan):
        return plan  # no folder: nothing is written

    def storage_meta(self):
        return None  # set when written (`metadata`)

    def write_data(self, plan, planner):
        self.plan, self.keys = plan, frozenset(planner.state_dict)
        files = raw.files_of(plan, self.thread_count)
        places = raw.tensor_places(files)
        results = [
            WriteResult(
                index=item.index, size_in_bytes=0, storage_data=places.get(item.index, _StorageInfo(name, -1, -1))
            )
            for name, items in files
            for item in items
        ]
        return raw.done_future(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION  # what DCP's FileSystemWriter.finish records
        self.late = [[r.index for r in rank if r.storage_data.offset < 0] for rank in results]
        metadata.storage_data = {
            r.index: r.storage_data for rank in results for r in rank if r.storage_data.offset >= 0
        }
        self.metadata = metadata
