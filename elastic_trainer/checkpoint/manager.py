"""Save and load the whole training state, collectively, on every rank.

Checkpoint collectives use their own gloo process group, so an asynchronous save (DCP `async_save`,
writing in a background thread) never interleaves with the training step's collectives.

Save: every rank writes its shards into a temporary folder with DCP, hashes the files it wrote, and sends
the digests to rank 0, which writes meta.json and commits (storage.commit: manifest, atomic rename,
`latest`, retention). Synchronous saves return once the checkpoint is visible; asynchronous ones return
after the state is copied (staged) and finish in the background; `wait()` joins them.

Load: the newest complete checkpoint whose files pass their checksums (each rank verifies a share) is
resharded into this run's layout; a corrupted or truncated one is reported in one line and the previous
complete one is used.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_trainer.checkpoint import hashing, memory, planned, raw, snapshot, spare, storage
from elastic_trainer.checkpoint import state as ckpt_state
from elastic_trainer.checkpoint.storage import first_failure as _first_failure
from elastic_trainer.config import CheckpointConfig
from elastic_trainer.test_hooks import count


@dataclass
class SaveStats:
    step: int
    stall_s: float
    """Time the training loop was blocked by the save."""
    total_s: float | None = None
    """Time until the checkpoint was committed (known once it is)."""
    path: str | None = None


@dataclass
class LoadStats:
    """What a load read, from where, and where its time went (seconds)."""

    step: int
    path: str
    saved_layout: dict
    """The layout that wrote the checkpoint (the one this run resharded from)."""
    verify_s: float
    """Checksums (each rank a share) and the metadata check."""
    read_s: float
    """DCP's resharding read into this run's tensors."""
    apply_s: float
    """Putting the read state into the model and optimizer."""
    total_s: float
    meta: dict = field(repr=False, default_factory=dict)


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, log=print):
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.pg = dist.new_group(backend="gloo")  # checkpoint collectives only
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        run_id = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(run_id, src=0, group=self.pg)
        self.run_id = run_id[0]
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self.history: list[SaveStats] = []
        self._metadata = None  # (folder, its DCP metadata) as the last verify read it
        self.last_saved_step: int | None = None
        self._prepared = None  # the hand-over's write, planned ahead (prepare_memory)
        self._spares: spare.Spares | None = None  # its files, allocated ahead (allocate_memory)
        self._last_save_time = time.monotonic()
        self.snapshots: snapshot.Snapshots | None = None
        """The state of every K-th step in memory (cfg.memory_snapshot_every), on a gloo group of its own."""
        if cfg.memory_snapshot_every:
            group = dist.new_group(backend="gloo")
            self.snapshots = snapshot.Snapshots(group, cfg.dir, self.run_id, cfg.memory_snapshot_every, self.log)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # -- save -------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether a periodic save is due after `step` (identical on every rank for step-based saves)."""
        if self.cfg.save_every and step % self.cfg.save_every == 0:
            return True
        return bool(self.cfg.save_interval_s) and time.monotonic() - self._last_save_time >= self.cfg.save_interval_s

    def snapshot_due(self, step: int) -> bool:
        """Whether the state after `step` is kept in memory (cfg.memory_snapshot_every; the same on every rank)."""
        return self.snapshots is not None and self.snapshots.due(step)

    def save(self, trainer, *, blocking: bool | None = None) -> SaveStats:
        """Checkpoint `trainer` at its current step (a collective: every rank calls it)."""
        self.wait()
        t0 = time.perf_counter()
        step = trainer.step
        tmp = storage.new_tmp_dir(self.root, step, self.run_id)
        os.makedirs(tmp, exist_ok=True)
        state = ckpt_state.tensor_state(trainer)
        meta = ckpt_state.build_meta(trainer)
        writer = hashing.HashingWriter(str(tmp))
        stats = SaveStats(step=step, stall_s=0.0)
        if blocking is False or (blocking is None and self.cfg.async_save):
            upload = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            stats.stall_s = time.perf_counter() - t0
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            self._pending = self._executor.submit(self._finish, upload, tmp, meta, stats, t0, writer.digests)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.pg)
            self._finish(None, tmp, meta, stats, t0, writer.digests)
            stats.stall_s = stats.total_s  # a synchronous save blocks until it is committed
        self.history.append(stats)
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        return stats

    def _finish(
        self,
        upload,
        tmp: Path,
        meta: dict,
        stats: SaveStats,
        t0: float,
        written: dict[str, dict] | None = None,
        keep: str | None = None,
    ) -> None:
        if upload is not None:
            upload.result()  # this rank's files are written
        mine = sorted(p.name for p in tmp.glob(f"__{self.rank}_*.distcp"))
        digests = storage.describe_files(tmp, mine, written)  # hashed while written; any other file read now
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(digests, gathered, dst=0, group=self.pg)
        outcome = [None]
        if self.rank == 0:
            try:
                storage.write_json_atomic(tmp / storage.META, meta)
                files = {k: v for d in gathered for k, v in d.items()}
                final = storage.commit(tmp, meta["step"], files)
                removed = storage.remove_old(self.root, self.cfg.keep)
                outcome = [str(final)]
                note = f", removed {', '.join(p.name for p in removed)}" if removed else ""
                self.log(
                    f"[checkpoint] step {meta['step']} saved to {final} in {time.perf_counter() - t0:.2f} s{note}",
                    flush=True,
                )
            except Exception as e:  # whatever it is, every rank must hear it: they wait in the broadcast below
                outcome = [f"error: {e}" if isinstance(e, OSError) else f"error: {type(e).__name__}: {e}"]
        dist.broadcast_object_list(outcome, src=0, group=self.pg)
        if outcome[0].startswith("error: "):
            raise storage.CheckpointError(f"committing step {meta['step']} failed: {outcome[0][7:]}")
        stats.total_s = time.perf_counter() - t0
        stats.path = outcome[0]
        memory.drop(self.cfg.dir, meta["step"], keep)  # this host's in-memory states the commit covers

    # -- in memory (a planned hand-over) ----------------------------------------------------------------

    def prepare_memory(self, trainer) -> None:
        """Plan the hand-over's write of `trainer`'s state now, while nothing waits for it (a collective; see
        checkpoint/planned.py): `write_memory` then only writes bytes."""
        try:
            self._prepared = memory.prepare(self.pg, trainer)
        except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP raises on every rank alike)
            self._prepared = None
            why = _first_failure(e) if isinstance(e, CheckpointException) else repr(e)
            self.log(f"[checkpoint] planning the hand-over's write failed ({why}); DCP will plan it then", flush=True)

    def allocate_memory(self, wait: bool = False) -> bool:
        """Start allocating the planned hand-over's files in this host's memory (a thread; checkpoint/spare.py),
        once the next world is on its way (`wait`: until done). False: nothing planned, or already started."""
        if self._prepared is None or self._spares is not None:
            return False
        try:
            root = memory.host_root(self.cfg.dir, create=True)  # made this user's, as the write makes it
            why = "the job's memory id could not be read"
        except OSError as e:
            root, why = None, str(e)
        if root is None:
            self.log(f"[checkpoint] no shared memory for the hand-over's files ({why}); they are made when written")
            return False
        self._spares = spare.Spares(root, planned.sizes(self._prepared)).start()
        if wait:
            self._spares.wait()
        return True

    def write_memory(self, trainer) -> memory.Written:
        """The state of `trainer` into each host's memory, for the next world (checkpoint.memory)."""
        self.wait()
        prepared, self._prepared = self._prepared, None
        spares, self._spares = self._spares, None
        files, waited = spares.take() if spares is not None else ({}, 0.0)
        try:
            written = memory.write(self.pg, trainer, self.cfg.dir, self.run_id, prepared, say=self.log, spares=files)
        finally:
            if spares is not None:
                spares.remove()  # what the write did not take (a plan gone stale, a failure)
        if files:
            written.ahead = {"bytes": spares.bytes, "allocate_s": spares.seconds, "waited_s": waited}
        return written

    def persist(self, written: memory.Written, release: bool = False) -> SaveStats:
        """The durable checkpoint of a state in memory: each rank writes the pieces it wrote there into DCP's
        own format (hashing the files on the way) and rank 0 commits, as a save does. The state in memory is
        then removed with `release` (the next world has it), else kept (a restart may still need it)."""
        t0 = time.perf_counter()
        step = written.step
        tmp = storage.new_tmp_dir(self.root, step, self.run_id)
        os.makedirs(tmp, exist_ok=True)
        digests = raw.to_durable(self.pg, written.folder, written.pieces, tmp)
        stats = SaveStats(step=step, stall_s=0.0)
        self._finish(
            None, tmp, written.record["meta"], stats, t0, digests, keep=None if release else written.record["name"]
        )
        self.history.append(stats)
        self.last_saved_step = step
        return stats

    def release(self, written: memory.Written) -> None:
        """Remove a state in memory that a durable checkpoint already holds (each rank, its host's copy)."""
        memory.drop(self.cfg.dir, written.step)

    def in_memory(self, live: dict | None = None) -> list[memory.Found]:
        """Complete in-memory states this world can read, newest first (a collective)."""
        return memory.discover(self.pg, self.cfg.dir, live, say=self.log)

    def load_memory(self, trainer, found: memory.Found) -> tuple[LoadStats, memory.HandoverStats]:
        """Reshard an in-memory state into `trainer` (a collective)."""
        meta = found.record["meta"]
        where = f"the in-memory state {found.name}"
        ckpt_state.check_compatible(meta, trainer.model_cfg, trainer.cfg, where, ckpt_state.data_id_of(trainer))
        stats = memory.load(self.pg, trainer, found, self.cfg.dir, self.run_id)
        self.last_saved_step = found.step
        self.log(
            f"[checkpoint] resumed step {found.step} from memory ({stats.bytes_read / 1e6:.1f} MB read, "
            f"{stats.bytes_fetched / 1e6:.1f} MB of it from other hosts; saved with dp={meta['layout']['dp']} "
            f"tp={meta['layout']['tp']} pp={meta['layout']['pp']}) in {stats.total_s:.2f} s",
            flush=True,
        )
        return LoadStats(
            found.step,
            f"memory:{found.name}",
            meta["layout"],
            0.0,
            stats.fetch_s + stats.read_s,
            0.0,
            stats.total_s,
            meta,
        ), stats

    def wait(self) -> None:
        """Join an in-flight asynchronous save (re-raising its error) and snapshot."""
        if self.snapshots is not None:
            self.snapshots.wait()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._spares is not None:  # allocated for a hand-over that did not come
                self._spares.remove()
        if self._executor is not None:
            self._executor.shutdown()
        if self.snapshots is not None:
            self.snapshots.close()
            dist.destroy_process_group(self.snapshots.pg)
        dist.destroy_process_group(self.pg)

    # -- load -------------------------------------------------------------------------------------

    def candidates(self, source: str = "auto") -> list[Path]:
        """Checkpoints to try, newest first: all complete ones ("auto") or one given folder."""
        paths = [Path(source)] if source != "auto" else None
        listing = [[str(p) for p in (paths or storage.complete_checkpoints(self.root))] if self.rank == 0 else None]
        dist.broadcast_object_list(listing, src=0, group=self.pg)
        return [Path(p) for p in listing[0]]

    def verify(self, folder: Path, checksums: bool = True) -> str | None:
        """None if every file passes its checksum, else the one-line reason (checked in parallel)."""
        try:
            if checksums:
                storage.verify(folder, self.rank, self.world)
            else:
                storage.read_manifest(folder)
            # refuses unsafe metadata in one line; kept for the load that follows (not unpickled twice)
            self._metadata = (folder, storage.read_dcp_metadata(folder / ".metadata"))
            error = None
        except storage.CheckpointError as e:
            error = str(e)
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.pg)
        return next((e for e in errors if e), None)

    def load(self, trainer, source: str = "auto", verify: bool | None = None) -> LoadStats | None:
        """Reshard the newest good checkpoint of `source` into `trainer` (None if there is none)."""
        return self.load_first(trainer, self.candidates(source), strict=source != "auto", verify=verify)

    def load_first(
        self, trainer, folders: list[Path], strict: bool = False, verify: bool | None = None
    ) -> LoadStats | None:
        """Load the first of `folders` that passes verification; with `strict` a failing one is an error
        instead of being skipped. `verify` overrides the config's checksum verification."""
        checksums = self.cfg.verify if verify is None else verify
        skipped = []
        for folder in folders:
            t0 = time.perf_counter()
            count("read_checkpoint")
            error = self.verify(folder, checksums) if folder.is_dir() else f"{folder} is not a checkpoint folder"
            if error:
                if strict:
                    raise storage.CheckpointError(error)
                self.log(f"[checkpoint] skipping {folder.name}: {error}", file=sys.stderr, flush=True)
                skipped.append(error)
                continue
            meta = storage.read_meta(folder)
            ckpt_state.check_compatible(
                meta, trainer.model_cfg, trainer.cfg, str(folder), ckpt_state.data_id_of(trainer)
            )
            t1 = time.perf_counter()
            state = ckpt_state.tensor_state(trainer)
            try:
                known = self._metadata[1] if self._metadata and self._metadata[0] == folder else None
                dcp.load(
                    state,
                    storage_reader=storage.SafeReader(str(folder), metadata=known),
                    planner=storage.SafeLoadPlanner(),
                    process_group=self.pg,
                )
            except CheckpointException as e:  # a BaseException carrying every rank's error
                raise storage.CheckpointError(f"loading {folder.name} failed: {_first_failure(e)}") from None
            t2 = time.perf_counter()
            ckpt_state.apply_tensor_state(trainer, state)
            trainer.restore(meta["step"], ckpt_state.resumed_config(meta, trainer.cfg))
            self.last_saved_step = meta["step"]
            t3 = time.perf_counter()
            stats = LoadStats(meta["step"], str(folder), meta["layout"], t1 - t0, t2 - t1, t3 - t2, t3 - t0, meta)
            saved = meta["layout"]
            self.log(
                f"[checkpoint] resumed step {meta['step']} from {folder} (saved with dp={saved['dp']} "
                f"tp={saved['tp']} pp={saved['pp']}) in {stats.total_s:.2f} s",
                flush=True,
            )
            return stats
        if skipped:
            raise storage.none_resumable(folders[0].parent, skipped)
        return None

    def prepare_fresh_run(self, resume: str) -> None:
        """Before the first save: drop abandoned temporary folders; refuse to mix with another run."""
        if resume == "never":
            storage.require_no_checkpoints(self.root)
        if self.rank == 0:
            storage.remove_abandoned(self.root)
        dist.barrier(group=self.pg)
