"""Prepare a corpus: text in, a tokenized dataset out, in bounded memory, resumable, with progress.

    elastic-trainer prepare-data corpus/ --out /shared/data/corpus-gpt2 [--workers 8] [--text-field body]

The output folder (a *prepared dataset*, which `--data` takes as it is):

    manifest.json          tokenizer, dtype, sources (path, size, digest, pieces), shards (tokens, documents,
                           digest), totals, and the dataset's digest (its identity, whatever its path)
    shards/NAME.bin/.idx   Megatron-LM indexed datasets (Megatron reads them with --data-path shards/NAME)
    shards/NAME.json       the shard's own record, written last: a shard without it is incomplete

Every source file is cut into pieces of about `chunk_bytes` (a large .txt at a newline GPT-2's pre-tokenizer
splits at anyway, a .jsonl at a line end, a Parquet file at row groups, a save_to_disk dataset at rows);
each piece is tokenized by one worker process into one shard, streaming: the memory of a worker is one batch
of documents and the shard's per-document lengths, never the corpus. A shard's name is a digest of its source
file's content digest, its byte (or row) range and the settings, so:
- a run that is interrupted (Ctrl-C, SIGKILL, a lost host) and started again skips the complete shards and
  writes the others, byte for byte as an uninterrupted run would;
- a changed or added source file re-tokenizes only its own shards; shards no source needs any more are
  removed once the new manifest is written.
The training stream is every shard's tokens in manifest order: sources sorted by path, pieces in file order;
every document is followed by <|endoftext|>.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from elastic_trainer.config import ConfigError
from elastic_trainer.data import indexed, read, tokenizer
from elastic_trainer.data import manifest as manifests
from elastic_trainer.data.pieces import CHUNK_BYTES, FORMAT, PROGRESS_EVERY_S, Settings, digest, plan, stat_source
from elastic_trainer.data.records import Bad, DataError, Piece

THREADS_BELOW_BYTES = 64 << 20
"""Below this much text to tokenize (and without --workers), the workers are threads of this process."""
BATCH_CHARS = 4 << 20
"""Characters of documents encoded and written at a time by a worker."""
# -- one piece -> one shard (in a worker) ---------------------------------------------------------------------

_COUNTERS = None
"""Shared progress counters of the worker processes (set in each worker by `_init_worker`)."""


class _ThreadCounters(list):
    """The progress counters of thread workers (a process-shared array would start a resource tracker)."""

    def __init__(self):
        super().__init__([0, 0, 0])
        self._lock = threading.Lock()

    def get_lock(self):
        return self._lock


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while tokenizing: what was kept, in one line."""


def _init_worker(counters) -> None:
    """A worker process's start: the shared counters; Ctrl-C is the parent's to handle; the worker dies with
    its parent (a SIGKILLed parent left its idle workers waiting forever). (Started by "spawn", a worker
    inherits no file descriptor: not the parent's lock, so a SIGKILLed parent leaves nothing locked.)"""
    from elastic_trainer.elastic.lifetime import die_with_parent

    global _COUNTERS
    _COUNTERS = counters
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def _count(docs: int, tokens: int, chars: int) -> None:
    if _COUNTERS is not None:
        with _COUNTERS.get_lock():
            _COUNTERS[0] += docs
            _COUNTERS[1] += tokens
            _COUNTERS[2] += chars


def tokenize_piece(task: tuple) -> dict:
    """Tokenize one piece into shards/NAME.{bin,idx,json}; the files appear only complete (renamed from
    temporary names, the .json last). Returns the shard's record."""
    piece_dict, folder, name, text_field, skip, dtype_name = task
    piece = Piece(**{k: piece_dict[k] for k in ("path", "kind", "start", "stop", "line", "ends_document")})
    dtype = np.dtype(dtype_name)
    folder = Path(folder)
    enc = tokenizer.gpt2_encoding()
    bad = Bad()
    lengths: list[int] = []
    h = digest()
    tokens = chars = 0
    unique = f"{os.getpid()}-{threading.get_ident()}"  # thread workers share the process id
    tmp = {ext: folder / f"{name}.{ext}.tmp{unique}" for ext in ("bin", "idx", "json")}
    try:
        with open(tmp["bin"], "wb") as out:
            batch: list[np.ndarray] = []
            pending_docs = pending_tokens = pending_chars = 0

            def flush():  # the shared progress counters too, once per batch (a lock; not per document)
                nonlocal pending_docs, pending_tokens, pending_chars
                if batch:
                    data = np.concatenate(batch).astype(dtype, copy=False).tobytes()
                    out.write(data)
                    h.update(data)
                    batch.clear()
                _count(pending_docs, pending_tokens, pending_chars)
                pending_docs = pending_tokens = pending_chars = 0

            for text in read.documents(piece, bad, skip, text_field):
                ids = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
                if piece.ends_document:
                    ids = np.append(ids, np.uint32(tokenizer.EOT_ID))
                lengths.append(len(ids))
                tokens += len(ids)
                batch.append(ids)
                pending_docs += 1
                pending_tokens += len(ids)
                pending_chars += len(text)
                chars += len(text)
                if pending_chars >= BATCH_CHARS:
                    flush()
            flush()
        indexed.write_index(
            tmp["idx"], dtype, np.asarray(lengths, dtype=np.int64), np.arange(len(lengths) + 1, dtype=np.int64)
        )
        record = {
            "name": name,
            "tokens": tokens,
            "sequences": len(lengths),
            "documents": len(lengths) if piece.ends_document else max(len(lengths) - 1, 0),
            "chars": chars,
            "digest": h.hexdigest(),
            "bad_records": bad.count,
            "first_bad_records": bad.first,
        }
        tmp["json"].write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp["bin"], folder / f"{name}.bin")
        os.replace(tmp["idx"], folder / f"{name}.idx")
        os.replace(tmp["json"], folder / f"{name}.json")  # complete from here on
        return record
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)


# -- the whole run -------------------------------------------------------------------------------------------


class Progress:
    """Progress lines on stderr at most every PROGRESS_EVERY_S seconds, and the summary at the end. The first
    lines are held back for PROGRESS_EVERY_S: a quick preparation, or one that fails on bad input, says only
    its summary (only when `announce`: a small corpus prepared on first use is described by its caller) or
    its one-line error; a longer one starts talking then, with what it held back."""

    def __init__(self, quiet: bool = False, announce: bool = False):
        self.quiet, self.announce = quiet, announce
        self.total_shards = self.total_bytes = 0
        self.counters = None
        """documents, tokens, characters done: a list for thread workers, a shared array for processes"""
        self.t0 = self.last = time.monotonic()
        self.done = 0
        self._held: list[str] = []

    def restart_clock(self) -> None:
        """Time the hold-back window and the rate from now (after a set-up that is not the preparation's work)."""
        self.t0 = self.last = time.monotonic()

    def say(self, message: str, summary: bool = False) -> None:
        if self.quiet:
            return
        if not (summary or time.monotonic() - self.t0 >= PROGRESS_EVERY_S):
            self._held.append(message)
            return
        if summary and not self.announce and time.monotonic() - self.t0 < PROGRESS_EVERY_S:
            return
        for line in [*self._held, message]:
            print(f"[prepare] {line}", file=sys.stderr, flush=True)
        self._held.clear()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        docs, toks, chars = (int(v) for v in self.counters[:3])
        rate = chars / max(now - self.t0, 1e-9)
        left = max(self.total_bytes - chars, 0)
        eta = f"{left / rate:,.0f} s" if rate > 0 else "?"
        self.say(
            f"{self.done}/{self.total_shards} shards | {docs:,} documents | {toks / 1e6:,.1f} M tokens | "
            f"{rate / 1e6:,.1f} MB/s | ETA {eta}"
        )


def _previous_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(
            f"{folder}/manifest.json cannot be read ({e}); delete the folder and prepare it again"
        ) from None


def _cleanup_tmp(shards: Path) -> None:
    for path in shards.glob("*.tmp*"):
        path.unlink(missing_ok=True)


def prepare(
    sources: list[Path],
    out: Path,
    *,
    text_field: str = "text",
    skip_bad: bool = False,
    workers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    quiet: bool = False,
    announce: bool = False,
    min_tokens: int = 1,
) -> dict:
    """Prepare `sources` (text files and save_to_disk folders, sorted) into the folder `out`; returns the
    manifest. Bad input (a bad record, fewer than `min_tokens` tokens) raises DataError (one line) and leaves no
    folder it created. Two callers on one folder prepare it once: the second waits on the lock, then finds it
    prepared. `announce`: a summary even when it was quick (prepare-data)."""
    out = Path(out)
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        return _prepare_locked(
            sources, out, Settings(text_field, chunk_bytes), skip_bad, workers, Progress(quiet, announce), min_tokens
        )
    except (DataError, ConfigError):
        for folder in created:  # nothing of a failed first build stays (shared parents only when empty)
            if folder == out:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                try:
                    folder.rmdir()
                except OSError:
                    break
        raise


def _prepare_locked(sources, out, settings, skip_bad, workers, progress, min_tokens) -> dict:
    previous = _previous_manifest(out) if out.is_dir() else None
    if _usable(previous, out, sources, settings, skip_bad, min_tokens):  # read without the lock (the manifest
        return previous  # appears whole), so a read-only copy works too
    shards = out / "shards"
    try:
        shards.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "w")
    except OSError as e:
        raise DataError(
            f"cannot write the prepared data {out} ({e.strerror or e}): put --data-cache (or "
            "prepare-data --out) on writable storage every host sees"
        ) from None
    with lock:
        _wait_for(lock, out, progress)
        previous = _previous_manifest(out)
        if _usable(previous, out, sources, settings, skip_bad, min_tokens):
            return previous
        _cleanup_tmp(shards)
        return _run(sources, out, shards, settings, skip_bad, workers, previous, progress, min_tokens)


def _wait_for(lock, out: Path, progress: Progress) -> None:
    """Take the folder's lock; while another process prepares it, say so (after PROGRESS_EVERY_S, then every
    minute), so a waiting rank or launcher is not silent."""
    start, said = time.monotonic(), 0.0
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited >= PROGRESS_EVERY_S and waited - said >= (60 if said else PROGRESS_EVERY_S):
                progress.say(f"waiting {waited:,.0f} s for another preparation of {out} to finish")
                said = waited
            time.sleep(0.2)


def _usable(
    previous: dict | None, out: Path, sources: list[Path], settings: Settings, skip_bad: bool, min_tokens: int
) -> bool:
    """The folder already holds these sources prepared (DataError when it does but they are bad input)."""
    if not (previous and _fresh(previous, out, sources, settings)):
        return False
    manifests.check_bad_records(previous, skip_bad)
    manifests.check_length(previous, min_tokens, sources)
    return True


def _fresh(manifest: dict, out: Path, sources: list[Path], settings: Settings) -> bool:
    """The manifest is of these sources as they are now (sizes and mtimes), with these settings, and every
    shard it lists is there, whole (a missing or truncated one is written again)."""
    if manifest.get("settings") != settings.key() or manifest.get("format") != FORMAT:
        return False
    listed = [(s["path"], s["size"], s["mtime_ns"]) for s in manifest.get("sources", [])]
    try:
        if listed != [(str(p), *stat_source(p)) for p in sources]:
            return False
    except DataError:
        return False
    itemsize, shards = np.dtype(manifest["dtype"]).itemsize, out / "shards"
    try:
        return all(
            (shards / f"{s['name']}.bin").stat().st_size == s["tokens"] * itemsize
            and (shards / f"{s['name']}.json").is_file()
            for s in manifest["shards"]
        )
    except OSError:
        return False


def _run(sources, out, shards, settings, skip_bad, workers, previous, progress, min_tokens) -> dict:
    progress.counters = _ThreadCounters()  # until the workers are known to be processes
    t0 = time.monotonic()
    planned = plan(sources, settings, previous, progress.say)
    dtype = np.dtype(indexed.token_dtype(tokenizer.VOCAB_SIZE))
    pieces = [(piece, src) for src in planned for piece in src["pieces"]]
    done = {}
    for piece, _ in pieces:
        record = _shard_record(shards, piece["shard"], dtype.itemsize)
        if record is not None and (skip_bad or not record["bad_records"]):
            done[piece["shard"]] = record
    pending = {p["shard"]: (p, src) for p, src in pieces if p["shard"] not in done}  # identical pieces once
    todo = [p for p, _ in pending.values()]
    todo_bytes = sum(_piece_bytes(p, src) for p, src in pending.values())
    progress.total_shards, progress.total_bytes = len(todo), todo_bytes
    reused = len(pieces) - len(todo)
    given_workers = workers
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    if todo:
        progress.say(
            f"{len(todo)} of {len(pieces)} shards to write ({todo_bytes / 1e6:,.1f} MB of text, "
            f"{reused} already prepared) with {workers} worker(s) -> {out}"
        )
    tasks = [(p, str(shards), p["shard"], settings.text_field, skip_bad, dtype.name) for p in todo]
    processes = given_workers is not None or todo_bytes >= THREADS_BELOW_BYTES
    if processes:
        import multiprocessing as mp

        progress.counters = mp.get_context("spawn").Array("q", 3)  # shared with the worker processes
    else:
        tokenizer.gpt2_encoding()  # built once here (about 1 s), shared by the thread workers
        progress.restart_clock()  # what is held back is judged by the work, not by this build
    try:
        for record in _map(tasks, workers, processes, progress.counters, progress):
            done[record["name"]] = record
    except KeyboardInterrupt:
        _cleanup_tmp(shards)
        raise Interrupted(
            f"interrupted; {len(done)} of {len(pieces)} shards of {out} are complete and kept, run "
            "the same command again to continue"
        ) from None
    manifest = manifests.build(planned, [done[p["shard"]] for p, _ in pieces], settings, dtype, skip_bad)
    manifests.check_length(manifest, min_tokens, sources)
    tmp = out / f"manifest.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    removed = manifests.remove_stale(shards, {p["shard"] for p, _ in pieces})
    seconds = time.monotonic() - t0
    written = {t[2] for t in tasks}
    rate = sum(r["chars"] for r in done.values() if r["name"] in written) / max(seconds, 1e-9)
    progress.say(
        summary=True,
        message=f"done: {manifest['tokens']:,} tokens, {manifest['documents']:,} documents in "
        f"{len(pieces)} shards ({len(todo)} written, {reused} reused, {removed} stale removed) in "
        f"{seconds:,.1f} s ({rate / 1e6:,.1f} MB/s) -> {out}",
    )
    return manifest


def _piece_bytes(piece: dict, src: dict) -> int:
    if piece["kind"] in ("txt", "jsonl"):
        return piece["stop"] - piece["start"]
    return src["size"] // max(len(src["pieces"]), 1)


def _shard_record(shards: Path, name: str, itemsize: int) -> dict | None:
    """The record of a complete shard (its .json, its .idx, and a .bin of the size the record says)."""
    try:
        record = json.loads((shards / f"{name}.json").read_text())
        whole = (shards / f"{name}.bin").stat().st_size == record["tokens"] * itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if whole and (shards / f"{name}.idx").is_file() else None


def _map(tasks, workers: int, processes: bool, counters, progress):
    """Shard records as the tasks finish (in any order), with progress lines in between. The workers are
    processes started fresh ("spawn": the caller may hold threads, which a fork would copy mid-lock), or for a
    small corpus threads of this process (tiktoken releases the GIL while it encodes; no start-up). Executors,
    not multiprocessing.Pool: a worker that dies there loses its task and the pool waits forever; here the
    executor breaks (BrokenProcessPool) and the run stops."""
    if not tasks:
        return
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait

    global _COUNTERS
    if processes:
        pool = ProcessPoolExecutor(
            workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(counters,)
        )
    else:
        _COUNTERS, pool = counters, ThreadPoolExecutor(workers)
    try:
        pending = {pool.submit(tokenize_piece, task) for task in tasks}
        while pending:
            finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in finished:
                progress.done += 1
                yield future.result()
            progress.tick()
    except BaseException:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # Ctrl-C, an error: stop now
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if not processes:
            _COUNTERS = None
