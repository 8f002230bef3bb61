"""In-memory training states: how a planned hand-over passes the state from the stopping world to the next.

The stopping ranks write the state with DCP's plan and metadata, each piece as its bare bytes (`raw`; the plan
made ahead, while the world waited to start, when it still fits: `planned`), into their own host's shared
memory (tmpfs), one folder per state, each host holding only its own ranks' files:

    SHM/elastic-trainer-UID/JOB/HOST/step-NNNNNNNN-ID/
        __R_0.distcp       the files of the ranks that ran on HOST
        .metadata          on the host of rank 0: DCP's metadata
        state.json         on the host of rank 0, written last: the state is complete. The checkpoint's meta,
                           each file's host and size, the hosts' servers and the token they ask for

SHM is $ELASTIC_TRAINER_SHM_DIR, else /dev/shm; JOB is the checkpoint folder's random id (its `.memory-id`,
host_folders.py), so a resumed job finds its states and a folder made again never does; HOST is the host's name in
the hosts file, so two "hosts" on one machine (loopback tests) never read each other's memory. The lowest rank of
each host serves its host's files (`transfer.Server`).

The next world reads the state resharded into its own layout: DCP's load plan names the byte range of every
stored piece a rank needs; pieces on the rank's own host are read in place, the others are fetched from
their host's server into a private folder on the rank's host (`load`). Each rank reads with its own plan,
without DCP's collectives (its global load plan changes nothing); a failure on any rank fails every rank. A
state in memory is a checkpoint like the durable ones: any start (a restart after a failure, a resumed job)
takes it when it is complete and at least as new as the newest durable checkpoint, and every durable commit
removes the states it covers. The durable checkpoint made from a state in memory is in DCP's own format
(`raw.to_durable`).
"""

from __future__ import annotations

import json
import pickle
import re
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_trainer.checkpoint import faults, host_folders, planned, raw, spare, staging, storage
from elastic_trainer.checkpoint import state as ckpt_state
from elastic_trainer.checkpoint.host_folders import SHM_ENV, host_root  # noqa: F401 (SHM_ENV: for callers of memory)
from elastic_trainer.checkpoint.transfer import Server, fetch_file, gather_pieces
from elastic_trainer.config import CheckpointError
from elastic_trainer.elastic.handover import host_name

STATE_FILE = "state.json"
HASH = storage.HASH
"""The digest a snapshot's record carries for each file (the durable checkpoints' own)."""
FORMAT = 2
"""state.json's format: 2, each piece stored as its bytes (`raw`); 1 (before), DCP's torch.save framing."""
READERS = {1: storage.SafeReader, FORMAT: raw.Reader}
"""The formats this version reads, and their readers (1: DCP's own files)."""
NAME = re.compile(r"^step-(\d{8})-([0-9a-z]+)$")
LOAD_PREFIX = ".load-"
LOAD_NAME = re.compile(r"^\.load-step-(\d{8})-[0-9a-z]+-[0-9a-z]+$")


def step_of(name: str) -> int:
    return int(NAME.match(name).group(1))


@dataclass
class Written:
    """A state written to memory by the stopping world (the same on every rank)."""

    record: dict
    """state.json's content."""
    folder: Path
    """This host's folder of the state."""
    bytes: int
    seconds: float
    server: Server | None = None
    """The server of this host's files (on the host's lowest rank), until the next world has loaded."""
    pieces: dict = field(default_factory=dict)
    """This rank's stored pieces (`raw.Writer.pieces`): what the durable copy is made from."""
    planned: bool = False
    """Written as planned ahead (planned.py), not planned by DCP's save on the spot."""
    ahead: dict = field(default_factory=dict)  # files allocated ahead (spare.py): bytes, allocate_s, waited_s

    @property
    def step(self) -> int:
        return self.record["step"]


@dataclass
class Staged:
    """A rank's state taken at a step, ready to be written (`write`)."""

    step: int
    meta: dict
    state: dict
    threads: int
    """The writer's threads (and files) for it."""


def stage(trainer, local_ranks: int, copy: bool = False) -> Staged:
    """`trainer`'s state now: a GPU state staged in host memory (staging.for_writing); with `copy` a CPU
    state is copied too, so that training on while it is written (snapshot.py) changes nothing in it."""
    state = ckpt_state.tensor_state(trainer)
    if copy:  # a failure to copy is raised: writing the live tensors while they train would tear them
        on_gpu = staging.is_on_gpu(state)
        staged = staging.to_host(state) if on_gpu else staging.cloned(state)
        threads = staging.writer_threads(local_ranks) if on_gpu else 1
    else:
        staged, threads = staging.for_writing(state, local_ranks)
    return Staged(trainer.step, ckpt_state.build_meta(trainer), staged, threads)


def write(
    pg,
    trainer,
    checkpoint_dir: str,
    run_id: str,
    prepared: planned.Prepared | None = None,
    say=print,
    spares: dict[str, Path] | None = None,
    staged: Staged | None = None,
    checksums: bool = False,
) -> Written:
    """Write `trainer`'s state (or the one `staged` earlier) into each rank's host memory (a collective of
    `pg`); rank 0 records it. `prepared`: the write planned ahead (`prepare`), used when it still fits the
    state; `spares`: its files, allocated ahead (spare.py); `checksums`: each file's digest in the record,
    checked by every later reader of the file (a snapshot's copies, snapshot.py)."""
    t0 = time.perf_counter()
    rank, world, host = dist.get_rank(), dist.get_world_size(), host_name()
    step = trainer.step if staged is None else staged.step
    name = f"step-{step:08d}-{run_id}"
    error = None
    try:
        folder = host_folders.state_folder(checkpoint_dir, name)
    except OSError as e:
        error = f"{host}: {e}"
    first = [None] * world
    dist.all_gather_object(first, (host, secrets.token_hex(16), error), group=pg)
    if any(e for _, _, e in first):  # every rank alike, before any collective of the save
        raise CheckpointError(f"no folder for the state in shared memory ({next(e for _, _, e in first if e)})")
    hosts, token = [h for h, _, _ in first], first[0][1]
    server = Server(folder.parent, host, {name: token}) if hosts.index(host) == rank else None
    address = server.start() if server else None
    try:
        if staged is None:
            staged = stage(trainer, hosts.count(host))
        late, pieces = planned.write_files(pg, staged.state, staged.threads, folder, prepared, say, spares)
    except BaseException:
        if server:
            server.stop()
        raise
    meta, staged = staged.meta, None  # a staged copy: host memory the size of the rank's state
    faults.fault("in_memory", step)
    mine = {p.name: p.stat().st_size for p in folder.glob(f"__{rank}_*.distcp")}
    sums = {n: storage.file_digest(folder / n) for n in mine} if checksums else {}
    second = [None] * world if rank == 0 else None
    dist.gather_object((mine, address, late, sums), second, dst=0, group=pg)
    outcome = [None]
    if rank == 0:  # the record, made and written here, reaches every rank through the broadcast
        files = {
            f: {"bytes": size, "host": hosts[r], **({HASH: got_sums[f]} if f in got_sums else {})}
            for r, (got, _, _, got_sums) in enumerate(second)
            for f, size in got.items()
        }
        outcome = [
            {
                "format": FORMAT,
                "name": name,
                "step": step,
                "token": token,
                "meta": meta,
                "files": files,
                "servers": {hosts[r]: a for r, (_, a, _, _) in enumerate(second) if a},
                "written": time.time(),
            }
        ]
        try:
            if late is not None:  # planned: the metadata is completed and written here
                done = planned.metadata(prepared, [got for _, _, got, _ in second], raw.Writer(folder).storage_meta())
                with open(folder / ".metadata", "wb") as f:
                    pickle.dump(done, f)
            files[".metadata"] = {"bytes": (folder / ".metadata").stat().st_size, "host": host}
            if checksums:
                files[".metadata"][HASH] = storage.file_digest(folder / ".metadata")
            storage.write_json_atomic(folder / STATE_FILE, outcome[0])
        except (OSError, CheckpointError) as e:
            outcome = [f"writing the state to memory failed: {e}"]
    dist.broadcast_object_list(outcome, src=0, group=pg)
    if isinstance(outcome[0], str):
        if server:
            server.stop()
        raise CheckpointError(outcome[0])
    record = outcome[0]
    total = sum(f["bytes"] for f in record["files"].values())
    return Written(record, folder, total, time.perf_counter() - t0, server, pieces, late is not None)


def prepare(pg, trainer) -> planned.Prepared:
    """Plan the hand-over's write of `trainer`'s state ahead of it (a collective of `pg`; see planned.py)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_name(), group=pg)
    state = ckpt_state.tensor_state(trainer)
    threads = staging.writer_threads(hosts.count(host_name())) if staging.is_on_gpu(state) else 1
    return planned.prepare(pg, state, threads)


# -- the next world: find and load -----------------------------------------------------------------------


@dataclass
class Found:
    """A complete state the ranks of this world can read."""

    record: dict
    hosts: list[str]
    """Each rank's host in this world (by rank)."""
    holders: dict[str, str]
    """{file: host} that each file is read from: the host that wrote it, else a host holding its replica
    (snapshot.py); the host that wrote it when it is served by the stopping world."""
    servers: dict[str, str] = field(default_factory=dict)
    """{host: address} of the servers its files come from."""

    @property
    def step(self) -> int:
        return self.record["step"]

    @property
    def name(self) -> str:
        return self.record["name"]


def _listing(root: Path, verify: bool) -> dict:
    """{state: {"files": {name: bytes}, "record", "damaged": [names]}} of this host's folders. With `verify`,
    a file whose record carries its digest is checked: one that does not match is left out (damaged)."""
    out = {}
    for folder in host_folders.entries(root):
        if not NAME.match(folder.name) or not folder.is_dir():
            continue
        try:
            record = json.loads((folder / STATE_FILE).read_text())
        except (OSError, ValueError):
            record = None
        try:
            files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
        except FileNotFoundError:  # dropped meanwhile by the world that wrote it
            continue
        damaged = []
        for name, info in (record or {}).get("files", {}).items() if verify else ():
            if HASH in info and files.get(name) == info["bytes"] and _digest(folder / name) != info[HASH]:
                damaged.append(name)
                del files[name]
        out[folder.name] = {"files": files, "record": record, "damaged": damaged}
    return out


def _digest(path: Path) -> str | None:
    try:
        return storage.file_digest(path)
    except OSError:
        return None


def discover(pg, checkpoint_dir: str, live: dict | None = None, say=None) -> list[Found]:
    """The complete in-memory states this world can read, newest first (a collective).
    `live`: the stopping world's record of the state it has just written (its servers are still up), which
    may hold files of hosts this world has no rank on. Folders of states that can never complete here (no
    record anywhere) are removed. `say`: told in one line when the newest state recorded has files no host
    of this world holds (their host and its partner lost together)."""
    root, host = host_root(checkpoint_dir), host_name()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host, group=pg)
    lowest = hosts.index(host) == dist.get_rank()  # lists and checks the host's folders for all its ranks
    mine = _listing(root, verify=True) if root and lowest else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=pg)
    records, present = {}, {}
    for h, listing in zip(hosts, gathered):
        for name, entry in listing.items():
            if entry["record"]:
                records[name] = entry["record"]
            for f, size in entry["files"].items():
                present.setdefault(name, {}).setdefault(f, {})[h] = size
            for f in entry["damaged"] if say is not None else ():
                step = step_of(name)
                say(
                    f"[checkpoint] {h}'s copy of {f} of the state of step {step} in memory does not match its "
                    "checksum; it is not read",
                    flush=True,
                )
    if live:
        records[live["name"]] = live
    found, lacking = [], {}
    for name, record in records.items():
        if record.get("format") not in READERS:  # written by a version whose files this one cannot read
            continue
        serving = record["servers"] if live and name == live["name"] else {}  # the stopping world's, still up
        holders = {f: _holder(info, present.get(name, {}).get(f, {}), serving) for f, info in record["files"].items()}
        if all(holders.values()):
            # this world's hosts serve their own files and the replicas they hold (load starts their servers);
            # the stopping world's servers are asked only for the files of hosts this world has no rank on
            found.append(Found(record, hosts, holders, {h: a for h, a in serving.items() if h not in hosts}))
        else:
            lacking[record["step"]] = sorted({record["files"][f]["host"] for f, h in holders.items() if h is None})
    newest = max((s.step for s in found), default=-1)
    if say is not None and lacking and max(lacking) > newest:
        step = max(lacking)
        say(
            f"[checkpoint] the state of step {step} in memory cannot be read: no host of this world holds the "
            f"files of {', '.join(lacking[step])} (a host and its partner lost together); "
            + (f"reading step {newest} instead" if found else "reading the newest durable checkpoint instead"),
            flush=True,
        )
    if root and lowest:
        for name in set(mine) - set(records):
            shutil.rmtree(root / name, ignore_errors=True)
    return sorted(found, key=lambda s: s.step, reverse=True)


def _holder(info: dict, sizes: dict[str, int], serving: dict) -> str | None:
    """The host a file of a state is read from: the one that wrote it when that host has it whole (or serves
    it from the stopping world), else any host holding a whole replica; None when no host has it."""
    if sizes.get(info["host"]) == info["bytes"] or info["host"] in serving:
        return info["host"]
    return next((h for h, size in sorted(sizes.items()) if size == info["bytes"]), None)


@dataclass
class HandoverStats:
    step: int
    state: str
    bytes_total: int
    """Bytes of the whole state."""
    bytes_read: int
    """Bytes all ranks read (pieces several ranks need counted once per reading host)."""
    bytes_fetched: int
    """Of those, bytes fetched from another host's server."""
    fetch_s: float
    read_s: float
    total_s: float
    hosts: int

    @property
    def fetch_gbs(self) -> float:
        return self.bytes_fetched / self.fetch_s / 1e9 if self.fetch_s > 0 else 0.0


def load(pg, trainer, found: Found, checkpoint_dir: str, run_id: str) -> HandoverStats:
    """Read `found` resharded into `trainer` (a collective of `pg`), then continue at its step."""
    t0 = time.perf_counter()
    rank, host, record, hosts = dist.get_rank(), host_name(), found.record, found.hosts
    root = host_root(checkpoint_dir)
    servers = dict(found.servers)
    serving = None
    holders = found.holders
    needs = set(holders.values()) - set(servers)
    if hosts.index(host) == rank and host in needs:  # this host's files, for the ranks of other hosts
        serving = Server(root, host, {found.name: record["token"]})
    addresses = [None] * len(hosts)
    dist.all_gather_object(addresses, serving.start() if serving else None, group=pg)
    servers.update({hosts[r]: a for r, a in enumerate(addresses) if a})
    metadata = _metadata(pg, found, hosts, root)
    state = ckpt_state.tensor_state(trainer)
    planner = _PlannedOnce()
    planner.set_up_planner(state, metadata, rank == 0)
    ranges = sorted(
        {
            (i.relative_path, i.offset, i.length)
            for i in (metadata.storage_data[item.storage_index] for item in planner.create_local_plan().items)
        }
    )
    folder = root / f"{LOAD_PREFIX}{found.name}-{run_id}"
    folder.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    fetched = gather_pieces(pg, record, ranges, hosts, servers, root / found.name, folder, holders)
    t2 = time.perf_counter()
    error = None
    try:  # each rank's plan is its own (DCP's global load plan changes nothing): no collective of DCP's
        reader = READERS[record["format"]](str(folder), metadata=metadata)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist: each rank on its own
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (every rank hears it below, none waits)
        error = f"{host}: {storage.first_failure(e) if isinstance(e, CheckpointException) else repr(e)}"
    totals = [None] * len(hosts)
    dist.all_gather_object(totals, (sum(n for _, _, n in ranges), fetched, error), group=pg)
    shutil.rmtree(folder, ignore_errors=True)  # every rank of the host has read from it
    if serving:
        serving.stop()
    failed = [why for _, _, why in totals if why]
    if failed:
        raise CheckpointError(f"reading the in-memory state {found.name} failed ({failed[0]})")
    ckpt_state.apply_tensor_state(trainer, state)
    trainer.restore(record["step"], ckpt_state.resumed_config(record["meta"], trainer.cfg))
    t3 = time.perf_counter()
    return HandoverStats(
        record["step"],
        found.name,
        sum(f["bytes"] for f in record["files"].values()),
        sum(t[0] for t in totals),
        sum(t[1] for t in totals),
        t2 - t1,
        t3 - t2,
        t3 - t0,
        len(set(hosts)),
    )


class _PlannedOnce(storage.SafeLoadPlanner):
    """The load's planner, whose local plan (which pieces this rank reads: the fetch needs it before the load)
    is made once for the same state and metadata (gpt3-small, 2 ranks: 0.24 s a plan)."""

    _plan = None

    def create_local_plan(self):
        if self._plan is None:
            self._plan = super().create_local_plan()
        return self._plan


def _metadata(pg, found: Found, hosts: list[str], root: Path):
    """DCP's metadata, read by a rank on its host (or fetched from its server) and sent to every rank."""
    owner = found.holders[".metadata"]
    src = hosts.index(owner) if owner in hosts else 0
    box = [None]
    if dist.get_rank() == src:
        path = root / found.name / ".metadata"
        try:
            if owner not in hosts:
                path = root / f".metadata-{found.name}"
                fetch_file(found.servers[owner], found.record, ".metadata", path)
            box = [path.read_bytes()]
        except (OSError, CheckpointError, KeyError) as e:
            box = [f"the metadata of the in-memory state {found.name} cannot be read: {e}"]
        finally:
            if owner not in hosts:
                path.unlink(missing_ok=True)
    dist.broadcast_object_list(box, src=src, group=pg)
    if isinstance(box[0], str):
        raise CheckpointError(box[0])
    return storage.parse_dcp_metadata(box[0], f"the in-memory state {found.name}")


# -- removal ---------------------------------------------------------------------------------------------


def drop(checkpoint_dir: str, up_to_step: int, keep: str | None = None) -> list[str]:
    """Remove this host's in-memory states of steps <= `up_to_step` (a durable checkpoint holds them) and the
    folders of their loads that never finished, except `keep` (a state the next world may still be reading);
    the names removed."""
    root, removed = host_root(checkpoint_dir), []
    if root is None:
        return removed
    for folder in host_folders.entries(root):  # nothing when the next world has just removed the emptied folder
        m = LOAD_NAME.match(folder.name) or NAME.match(folder.name)
        if m and int(m.group(1)) <= up_to_step and not (keep and folder.name.startswith((keep, LOAD_PREFIX + keep))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    removed += spare.sweep(root)  # a dead process's files allocated for a hand-over
    host_folders.remove_empty(root)
    return removed
