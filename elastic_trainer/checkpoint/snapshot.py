"""Redundant in-memory snapshots: the training state of every K-th step held in two hosts' memory, so that a lost
host costs the step in flight, not every step since the last durable save.

After a snapshot's step, each rank copies its shard of the whole training state (weights, optimizer moments and
step counts; the step, data position, LR schedule and RNG scheme in the record's meta) on the training thread:
a host copy the next step cannot change (`memory.stage`). A background thread then writes it into the host's
shared memory as an in-memory state (checkpoint.memory: the files and record of a planned hand-over, written as
planned at the first snapshot), and the lowest rank of each host fetches whole the files of its partner: the
host before it in the order of the world's hosts, a ring, so every file is held on the host that wrote it and
on the next one, and no single host's loss takes both copies (the record, state.json, goes on every host).
Once every host has its own and its partner's files, the snapshot is complete and the generations before it
go; until then the previous complete one is kept, so a failure while a snapshot is written leaves a whole one.

The background thread uses a gloo group of its own (beside the checkpointer's, which an asynchronous durable
save uses from its own thread), one snapshot at a time: the next one, a durable save and a hand-over first wait
for it (`wait`). A snapshot that fails (no shared memory, a partner that stopped answering) is said in one line
and training goes on; the previous complete one stays.

Every file's digest (xxh3-128, the durable checkpoints' own) is in the record, and every copy is checked before
a restart reads it; a damaged copy is said in one line and not read, so the other copy is (or, with none left,
an older state or the durable checkpoint). The files of a superseded generation are not removed but written over
by the next one (each rank's in its spare folder meanwhile): shared-memory pages written before take about a
third of the time of new ones to write again (spare.py).

A restart after a failure finds the newest snapshot whose every file survives whole on some host, its own or
its partner's (`memory.discover`), and loads it resharded into the new world's layout (`memory.load`): the steps
redone are those after it, at most the step in flight with a snapshot every step.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from elastic_trainer.checkpoint import host_folders, memory, spare, storage
from elastic_trainer.checkpoint import state as ckpt_state
from elastic_trainer.checkpoint.host_folders import available_bytes
from elastic_trainer.checkpoint.transfer import fetch_file
from elastic_trainer.config import CheckpointError
from elastic_trainer.elastic.handover import host_name


@dataclass
class SnapshotStats:
    step: int
    stall_s: float
    """On the training thread: the host copy."""
    total_s: float
    """From the copy to the snapshot complete on every host."""
    bytes: int
    """The state's bytes (each is held twice where the world has several hosts)."""
    replica_bytes: int = 0
    """Bytes this host fetched from its partner."""
    error: str | None = None
    removed: list[str] = field(default_factory=list)


def partner_of(hosts: list[str], host: str) -> str | None:
    """The host whose files `host` keeps a copy of: the one before it in the order the world's ranks name
    them (a ring), None alone."""
    ring = list(dict.fromkeys(hosts))
    if len(ring) < 2:
        return None
    return ring[ring.index(host) - 1]


GENERATIONS = 2
"""Complete snapshots a host may hold at once: the newest, and the one kept while the next is written."""


def _tensors(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, DTensor):
        yield state.to_local()
    elif isinstance(state, torch.Tensor):
        yield state


class Snapshots:
    """A checkpointer's snapshots every `every` steps (`take` after a step that is `due`)."""

    def __init__(self, pg, checkpoint_dir: str, run_id: str, every: int, log=print):
        self.pg, self.dir, self.run_id, self.every, self.log = pg, checkpoint_dir, run_id, every, log
        self.rank, self.host = dist.get_rank(), host_name()
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, self.host, group=pg)
        self.hosts = hosts
        self.local_ranks = hosts.count(self.host)
        self.serves = hosts.index(self.host) == self.rank  # the host's lowest rank: its server, its replica
        self.partner = partner_of(hosts, self.host)
        root = host_folders.host_root(checkpoint_dir, create=True)
        self.spares = root / f"{spare.PREFIX}{os.getpid()}-snapshot"
        """This rank's files of superseded snapshots, written over by the next one (`_recycle`)."""
        self._own = re.compile(rf"^__{self.rank}_\d+\.distcp$")
        self.history: list[SnapshotStats] = []
        self.last_complete: int | None = None
        self._prepared = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._pending: concurrent.futures.Future | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, trainer) -> None:
        """Copy `trainer`'s state now (a collective on the first call, which plans the write) and write it in
        the background."""
        self.wait()
        t0 = time.perf_counter()
        if self._prepared is None:
            if not self._fits(trainer):
                self.every = 0
                return
            self._prepared = memory.prepare(self.pg, trainer)
        try:
            staged = memory.stage(trainer, self.local_ranks, copy=True)
            error = None
        except (RuntimeError, ImportError) as e:  # pinned memory refused, a host short of memory
            staged, error = None, f"{self.host}: {str(e).splitlines()[0]}"
        errors = [None] * len(self.hosts)  # every rank alike: all write, or none
        dist.all_gather_object(errors, error, group=self.pg)
        stall = time.perf_counter() - t0
        if any(errors):
            self._failed(trainer.step, next(e for e in errors if e))
            return
        self._pending = self._executor.submit(self._write, staged, t0, stall)

    def _fits(self, trainer) -> bool:
        """Whether every host has the memory for its snapshots (a collective, at the first one): two generations
        of its ranks' files and its partner's, in its shared-memory folder, and the copies its ranks make. If
        not, snapshots are off, said in one line."""
        mine = sum(t.numel() * t.element_size() for t in _tensors(ckpt_state.tensor_state(trainer)))
        gathered = [None] * len(self.hosts)
        dist.all_gather_object(gathered, (mine, *available_bytes()), group=self.pg)
        state = {h: 0 for h in self.hosts}
        for h, (bytes_, _, _) in zip(self.hosts, gathered):
            state[h] += bytes_
        for h in dict.fromkeys(self.hosts):
            _, available, shm_free = gathered[self.hosts.index(h)]
            partner = partner_of(self.hosts, h)
            files = GENERATIONS * (state[h] + (state[partner] if partner else 0))
            if files > shm_free or files + state[h] > available:
                gib = 1 << 30
                self.log(
                    f"[checkpoint] --memory-snapshot-every {self.every}: no snapshots in memory: {h} would hold "
                    f"~{files / gib:.2f} GiB of them ({GENERATIONS} generations of its own and its partner's "
                    f"state) and copy ~{state[h] / gib:.2f} GiB for each, with {available / gib:.2f} GiB "
                    f"available and {shm_free / gib:.2f} GiB free in its shared-memory folder",
                    flush=True,
                )
                return False
        return True

    def _write(self, staged: memory.Staged, t0: float, stall: float) -> SnapshotStats:
        step = staged.step
        stats = SnapshotStats(step, stall, 0.0, 0)
        spares = {p.name: p for p in host_folders.entries(self.spares) if self._own.match(p.name)}
        try:
            written = memory.write(
                self.pg,
                None,
                self.dir,
                self.run_id,
                self._prepared,
                say=self.log,
                spares=spares,
                staged=staged,
                checksums=True,
            )
        except (CheckpointError, CheckpointException) as e:  # on every rank alike
            return self._failed(step, str(e).splitlines()[0], stats)
        del staged
        stats.bytes = written.bytes
        try:
            error = self._keep_partner(written, stats) if self.serves and self.partner else None
            errors = [None] * len(self.hosts)
            dist.all_gather_object(errors, error, group=self.pg)  # every host holds both copies, or it is said
        finally:
            if written.server is not None:
                written.server.stop()
        if any(errors):
            return self._failed(step, next(e for e in errors if e), stats)
        self._recycle(step, written.record)  # the older generations: this one is whole on every host
        dist.barrier(group=self.pg)  # every rank has taken its files before the host's folders go
        if self.serves:
            stats.removed = memory.drop(self.dir, step - 1)
        self.last_complete = step
        stats.total_s = time.perf_counter() - t0
        self.history.append(stats)
        return stats

    def _recycle(self, step: int, record: dict) -> None:
        """Move this rank's files of the generations before `step` (and, on the host's lowest rank, its
        partner's copies) into the rank's spare folder, where the next snapshot writes over them: pages of
        shared memory written before take a third of the time of new ones to write again (spare.py)."""
        root = host_folders.host_root(self.dir)
        if root is None:
            return
        partners = {n for n, info in record["files"].items() if info["host"] == self.partner and n != ".metadata"}
        for folder in host_folders.entries(root):
            m = memory.NAME.match(folder.name)
            if not m or int(m.group(1)) >= step:
                continue
            for f in host_folders.entries(folder):
                if self._own.match(f.name) or (self.serves and f.name in partners):
                    try:
                        self.spares.mkdir(mode=0o700, exist_ok=True)
                        os.replace(f, self.spares / f.name)
                    except OSError:  # removed meanwhile: the next write makes a new file
                        pass

    def _spare(self, name: str) -> Path | None:
        path = self.spares / name
        return path if path.exists() else None

    def _keep_partner(self, written: memory.Written, stats: SnapshotStats) -> str | None:
        """This host's copy of its partner's files of the snapshot (each fetched whole under a temporary name,
        written over a spare file when there is one, then renamed: a file present is complete). The error, if
        any, in one line."""
        record = written.record
        address = record["servers"].get(self.partner)
        theirs = [name for name, info in record["files"].items() if info["host"] == self.partner]
        try:
            if address is None:
                raise CheckpointError(f"no server for the files of {self.partner}")
            for name in theirs:
                part = written.folder / f".part-{name}"
                spare = self._spare(name)
                if spare is not None:
                    os.replace(spare, part)
                fetch_file(address, record, name, part, truncate=spare is None)
                os.replace(part, written.folder / name)
                stats.replica_bytes += record["files"][name]["bytes"]
            if not (written.folder / memory.STATE_FILE).exists():  # the record too: rank 0's host may be the one lost
                storage.write_json_atomic(written.folder / memory.STATE_FILE, record)
        except (CheckpointError, OSError) as e:
            return f"{self.host}: keeping {self.partner}'s copy: {e}"
        return None

    def _failed(self, step: int, why: str, stats: SnapshotStats | None = None) -> SnapshotStats:
        kept = f"step {self.last_complete}'s stays the newest" if self.last_complete else "none is complete yet"
        self.log(f"[checkpoint] the snapshot of step {step} in memory failed ({why}); {kept}", flush=True)
        stats = stats or SnapshotStats(step, 0.0, 0.0, 0)
        stats.error = why
        self.history.append(stats)
        return stats

    def wait(self) -> SnapshotStats | None:
        """Join the snapshot being written (its stats; None when none was)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown()
            shutil.rmtree(self.spares, ignore_errors=True)
